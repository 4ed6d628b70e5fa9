"""One ECHO control plane over a tensor-parallel group of ranks (torch.distributed: gloo on CPU, NCCL on CUDA).

Rank 0, the leader, runs the whole engine as one process would: scheduler, drafting loop, gate, budget,
selection, packing, acceptance. The model shards (models/tp.py) make every collective itself; what the other
ranks need is to run the *same* model calls at the same time. So the leader's shards carry a `Mirror`, which sends
each call before running it: a header (op, arguments, tensor shapes) over a gloo command group (the workers wait
there without a time limit, however idle the server; the leader waits there at most ECHO_TP_TIMEOUT_S, like on
every other collective), then the call's tensors (the packed Super-Tree's ids, positions, slots, write positions,
mask, logits rows; or a compaction's slots / source / destination) broadcast on the data group. The workers
replay them in order (`serve`), so every rank verifies the same tree and commits the same accepted path: ranks
cannot diverge, because only the leader decides anything.

Launch: `LLM(..., tensor_parallel_size=N)` spawns ranks 1..N-1 itself (`start`); under `torchrun` every rank
runs the same program and ranks > 0 become workers inside `LLM(...)` and leave the process when the leader shuts
down. A rank that fails ends the group: collectives fail with a `TensorParallelError` naming it (peer gone, or
after ECHO_TP_TIMEOUT_S seconds, default 300) and every later call fails at once. Loading waits for the slowest
rank's shard up to ECHO_TP_LOAD_TIMEOUT_S (default 3600). Rank 0 never waits without a limit; a worker waits for
rank 0's next command without one (an idle server), and leaves when rank 0's sockets close.
"""

from __future__ import annotations

import collections
import datetime
import os
import socket
import subprocess
import threading
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from echo_trtllm.models.llama import CausalLM, ForwardBatch, KVCache
from echo_trtllm.models.tp import TensorParallel, TensorParallelError, load_shard

__all__ = ["TensorParallelError", "TPGroup", "start", "TIMEOUT_S", "LOAD_TIMEOUT_S"]

TIMEOUT_S = float(os.environ.get("ECHO_TP_TIMEOUT_S", 300))
LOAD_TIMEOUT_S = float(os.environ.get("ECHO_TP_LOAD_TIMEOUT_S", 3600))  # a rank's shard may load later than rank 0's
IDLE_TIMEOUT = datetime.timedelta(days=365)  # workers wait for the next command here, however idle the server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class _Spec:
    shape: tuple[int, ...]
    dtype: torch.dtype


class TPGroup:
    """This process's rank in a tensor-parallel group: its TensorParallel (collectives, layout), the command
    channel, and on the leader the `Mirror` and the spawned worker processes."""

    def __init__(self, rank: int, world: int, device: str, processes=()) -> None:
        self.rank, self.world, self.device = rank, world, torch.device(device)
        # a worker waits for the next command however long the server idles; the leader never waits on it for longer
        # than a collective may take (a worker that died unseen must not hold the leader past TIMEOUT_S)
        self.cmd_group = dist.new_group(backend="gloo", timeout=(
            IDLE_TIMEOUT if rank > 0 else datetime.timedelta(seconds=TIMEOUT_S)))
        # loading: every rank reports its shard's outcome here, however much later than rank 0's it finishes
        self.load_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=LOAD_TIMEOUT_S))
        self.tp = TensorParallel(rank, world, group=None)
        self.processes = list(processes)
        self.models: dict[str, CausalLM] = {}
        self.mirror = Mirror(self) if rank == 0 else None
        self.tp.mirror = self.mirror
        self.tp.diagnose = self._diagnose
        self._closed = False
        self._close_lock = threading.Lock()

    def _diagnose(self) -> str:
        """Spawned ranks that have exited, with their status (torchrun reports its own)."""
        import time

        time.sleep(0.2)  # a rank killed mid-collective: let its exit be reaped
        gone = [f"rank {r} exited with status {p.poll()}" for r, p in enumerate(self.processes, 1)
                if p.poll() is not None]
        return ", ".join(gone)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def healthy(self) -> bool:
        """The group can still run a model call: no collective has failed and every spawned rank is running (a
        rank killed while the engine idles is seen here before the next call fails on it)."""
        return self.tp.failed is None and all(p.poll() is None for p in self.processes)

    # ---------------------------------------------------------------- loading

    def agree(self, value, group=None):
        """The leader's `value` on every rank (e.g. the dtype "auto" resolved to), on the command group unless
        `group` is given."""
        box = [value if self.is_leader else None]
        dist.broadcast_object_list(box, src=0, group=group or self.cmd_group)
        return box[0]

    def load(self, key: str, path, dtype: torch.dtype) -> CausalLM:
        """Every rank loads its shard of `path`; a rank that fails is reported by name on the leader."""
        error, model = None, None
        try:
            model = load_shard(path, self.tp, dtype, self.device)
        except Exception as e:  # noqa: BLE001 - gathered below, raised on every rank
            error = f"{type(e).__name__}: {e}"
        errors = [None] * self.world if self.is_leader else None
        self.tp.checked(lambda: dist.gather_object(error, errors, dst=0, group=self.load_group))
        failed = self.tp.checked(lambda: self.agree([f"rank {r}: {e}" for r, e in enumerate(errors) if e]
                                                    if self.is_leader else None, self.load_group))
        if failed:
            self.tp.fail(f"loading {key} failed")
            raise ValueError(f"loading {key} failed on {'; '.join(failed)}")
        self.models[key] = model
        return model

    # ---------------------------------------------------------------- workers

    def serve(self) -> None:
        """A worker's loop: replay the leader's calls until it says stop (or the group fails)."""
        caches: dict[int, KVCache] = {}
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=self.cmd_group)
            op, args, specs = box[0]
            tensors = [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in specs]
            for t in tensors:
                dist.broadcast(t, src=0)
            if op == "stop":
                return
            if op == "forward":
                key, cache_id, capture, has_rows, float_logits = args
                batch = ForwardBatch(*tensors[:7], tensors[7] if has_rows else None, float_logits)
                self.models[key](batch, caches[cache_id], capture)
            elif op == "compact":
                caches[args[0]].compact(*tensors)
            elif op == "alloc":
                key, cache_id, slots, capacity = args
                caches[cache_id] = self.models[key].allocate_cache(slots, capacity)
            elif op == "free":
                for cache_id in args:
                    caches.pop(cache_id, None)
            elif op == "stats":
                dist.gather_object(self.stats(), None, dst=0, group=self.cmd_group)
            else:  # pragma: no cover - the leader only sends the ops above
                raise RuntimeError(f"unknown tensor-parallel op {op!r}")

    def stats(self) -> dict:
        """This rank's weight bytes per model (what it holds of each)."""
        from echo_trtllm.models.fp8 import weight_bytes

        return {"rank": self.rank, "weight_bytes": {k: weight_bytes(m) for k, m in self.models.items()}}

    def all_stats(self) -> list[dict]:
        """Every rank's `stats()` (leader only; any thread: it waits its turn with the engine's calls)."""
        out = [None] * self.world
        self.mirror.run(lambda: self.mirror.send("stats", ()),
                        lambda: self.tp.checked(lambda: dist.gather_object(self.stats(), out, dst=0,
                                                                           group=self.cmd_group)))
        return out

    def abandon(self, why: str) -> None:
        """Leader, when the engine thread is still inside a call: end the group without touching it (the spawned
        ranks are killed, so whatever the engine waits on fails at once); the engine thread closes it on exit."""
        self.tp.fail(why)
        for p in self.processes:
            if p.poll() is None:
                p.kill()

    def close(self) -> None:
        """Leader: tell the workers to stop and wait for spawned ones; every rank: leave the group."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self.is_leader and self.tp.failed is None:
            try:
                self.mirror.send("stop", ())
            except TensorParallelError:
                pass
        if self.tp.failed is None:
            # every rank waits here for the others before the group goes: a rank that destroyed it while a peer's
            # last broadcast was still in flight aborted at interpreter exit now and then ("terminate called
            # without an active exception", 2 runs in 16 of two torchrun ranks, 0 in 12 with it); bounded by TIMEOUT_S
            try:
                dist.barrier()
            except Exception:  # noqa: BLE001 - a peer that is gone: leave anyway
                pass
        for p in self.processes:
            if self.tp.failed is not None:
                p.kill()  # a failed group's ranks may be waiting inside a collective that never completes
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:  # a stuck rank is ended
                p.kill()
                p.wait()
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a failed group may not tear down cleanly; the process is leaving anyway
            pass


class Mirror:
    """Leader side: each model call is sent to the workers before it runs here (see the module docstring)."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group
        self.lock = threading.RLock()
        self.sent = 0  # commands sent so far
        self._next_cache = 0
        self._freed: collections.deque[int] = collections.deque()  # ids of caches garbage-collected here

    def checked(self, fn):
        return self.group.tp.checked(fn)

    def run(self, send, local):
        """One mirrored call: `send()` the command, then `local()` this rank's part, with no other mirrored call in
        between (the engine thread, calibration and `all_stats` may call from different threads). Once the command
        is sent the workers are inside the call; if this rank's part then fails, the ranks are out of step, so the
        group is ended (every later call raises at once)."""
        with self.lock:
            sent = self.sent
            send()
            try:
                return local()
            except BaseException as e:
                if self.sent != sent:
                    self.group.tp.fail(f"the tensor-parallel group is out of step: rank 0 failed inside a call the "
                                       f"other ranks were running ({type(e).__name__}: {e})")
                raise

    def send(self, op: str, args: tuple, tensors: tuple[Tensor, ...] = ()) -> None:
        if self._freed and op != "stop":
            freed = []
            while self._freed:
                freed.append(self._freed.popleft())
            self.send("free", tuple(freed))
        tensors = tuple(t.to(self.group.device).contiguous() for t in tensors)
        header = (op, args, [_Spec(tuple(t.shape), t.dtype) for t in tensors])

        def broadcast():
            dist.broadcast_object_list([header], src=0, group=self.group.cmd_group)
            for t in tensors:
                dist.broadcast(t, src=0)

        self.sent += 1
        self.checked(broadcast)

    def key(self, model: CausalLM) -> str:
        for key, m in self.group.models.items():
            if m is model:
                return key
        raise ValueError("this model is not one of the tensor-parallel group's")

    def allocate(self, model: CausalLM, cache: KVCache, slots: int, capacity: int) -> None:
        cache_id, self._next_cache = self._next_cache, self._next_cache + 1
        self.send("alloc", (self.key(model), cache_id, slots, capacity))
        cache.mirror, cache.mirror_id = self, cache_id
        weakref.finalize(cache, self._freed.append, cache_id)

    def forward(self, model: CausalLM, batch: ForwardBatch, cache: KVCache, capture: tuple[int, ...]) -> None:
        if cache.mirror is not self:
            raise ValueError("a tensor-parallel model runs on caches from its own allocate_cache()")
        fields = (batch.input_ids, batch.position_ids, batch.slots, batch.token_request, batch.token_local,
                  batch.write_pos, batch.attn_mask)
        rows = () if batch.logits_index is None else (batch.logits_index,)
        self.send("forward", (self.key(model), cache.mirror_id, tuple(capture), bool(rows), batch.float_logits),
                  fields + rows)

    def compact(self, cache: KVCache, slots: Tensor, src: Tensor, dst: Tensor) -> None:
        self.send("compact", (cache.mirror_id,), (slots, src, dst))


# ---------------------------------------------------------------------------------------------------------- launch


def _init(rank: int, world: int, backend: str, init_method: str | None) -> None:
    if backend == "nccl":  # NCCL collectives otherwise return before they finish: a dead rank would not raise
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    kwargs = {"init_method": init_method, "rank": rank, "world_size": world} if init_method else {}
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=TIMEOUT_S), **kwargs)


def _backend(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _rank_device(device: str, rank: int) -> str:
    return f"cuda:{rank % max(torch.cuda.device_count(), 1)}" if torch.device(device).type == "cuda" else "cpu"


def _worker_main(rank: int, world: int, device: str, init_method: str, specs: list, dtype: torch.dtype,
                 threads: int) -> None:
    ignore_stop_signals()
    torch.set_num_threads(threads)
    dev = _rank_device(device, rank)
    if torch.device(dev).type == "cuda":
        torch.cuda.set_device(dev)
    _init(rank, world, _backend(device), init_method)
    group = TPGroup(rank, world, dev)
    try:
        try:
            for key, path in specs:
                group.load(key, path, dtype)
        except ValueError:
            return  # a load failure: the leader raises it, naming this rank
        group.serve()
    finally:
        group.close()


def ignore_stop_signals() -> None:
    """A worker ignores SIGINT / SIGTERM: Ctrl-C in a terminal, a supervisor's group-wide SIGTERM or torchrun's
    forwarding reach every rank, but only the leader decides when to stop (after draining); a worker leaves when
    it says stop or when its sockets close."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _spawn(rank: int, world: int, device: str, init_method: str, specs: list, dtype: torch.dtype):
    """Rank `rank` as a child process running this module (`python -m`: nothing of the caller's __main__ is
    re-imported, so `LLM(tensor_parallel_size=N)` works from any script, REPL or notebook)."""
    import json
    import sys

    args = {"rank": rank, "world": world, "device": device, "init_method": init_method, "specs": specs,
            "dtype": str(dtype).removeprefix("torch."), "threads": max(1, torch.get_num_threads() // world)}
    return subprocess.Popen([sys.executable, "-m", "echo_trtllm.runtime.parallel", json.dumps(args)],
                            stdin=subprocess.DEVNULL, start_new_session=True)


def start(world: int, device: str, specs: list[tuple[str, str]], dtype: torch.dtype) -> TPGroup:
    """The group for `LLM(tensor_parallel_size=world)`: under torchrun (torch.distributed already initialised or
    its environment set) this process's rank of it; otherwise this process is rank 0 and spawns ranks 1..world-1,
    which load `specs` ((key, path) per model, in order) and serve. One group per process at a time: torch.distributed
    keeps one default group per process, and under torchrun the workers leave with the first LLM."""
    global _launched
    if _active is not None and not _active._closed:
        raise ValueError("a tensor-parallel LLM is already running in this process; shut it down first (one "
                         "tensor-parallel LLM per process at a time)")
    if _launched == "torchrun":
        raise ValueError("under torchrun a process runs one tensor-parallel LLM: its workers left with the first")
    if dist.is_initialized() or "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and
                                                                        "WORLD_SIZE" in os.environ):
        if not dist.is_initialized():
            rank = int(os.environ["RANK"])
            dev = _rank_device(device, int(os.environ.get("LOCAL_RANK", rank)))
            if torch.device(dev).type == "cuda":
                torch.cuda.set_device(dev)
            _init(rank, int(os.environ["WORLD_SIZE"]), _backend(device), None)
        if dist.get_world_size() != world:
            raise ValueError(f"tensor_parallel_size={world} but the launcher started {dist.get_world_size()} ranks")
        rank = dist.get_rank()
        _launched = "torchrun"
        return _track(TPGroup(rank, world, _rank_device(device, int(os.environ.get("LOCAL_RANK", rank)))))
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    procs = [_spawn(r, world, device, init_method, specs, dtype) for r in range(1, world)]
    try:
        _init(0, world, _backend(device), init_method)
    except Exception as e:
        status = ", ".join(f"rank {r} exited with status {p.poll()}" for r, p in enumerate(procs, 1)
                           if p.poll() is not None)
        for p in procs:
            p.kill()
        raise TensorParallelError(f"the tensor-parallel ranks did not start ({status or 'no rank exited'}): "
                                  f"{type(e).__name__}: {e}") from None
    return _track(TPGroup(0, world, _rank_device(device, 0), procs))


_active: TPGroup | None = None
_launched: str | None = None


def _track(group: TPGroup) -> TPGroup:
    global _active
    _active = group
    return group


if __name__ == "__main__":  # a spawned rank (see _spawn)
    import json
    import sys

    a = json.loads(sys.argv[1])
    _worker_main(a["rank"], a["world"], a["device"], a["init_method"], [tuple(s) for s in a["specs"]],
                 getattr(torch, a["dtype"]), a["threads"])
