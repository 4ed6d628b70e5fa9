"""What a one-row draft level costs with the caches cold, as inside the engine, against warm: the level's batch
(`level_batch`, as `Drafter.expand_level` builds it) and the head's forward over it, one request, one token, timed
together.

Inside the engine a head forward runs right after the target's, which streams the target's weights (3 GB for the
Qwen pair) through every cache level: the head's weights, but also the interpreter's and the dispatcher's code and
data, are then read from memory again. A loop of head forwards alone keeps all of it cached and reads another cost.
Arms, alternated within each round (the order reversed every other round):

- warm: calls back to back;
- cold: a buffer of `--flush-mb` MB (default 256, eight times this machine's L3) written before each call;
- cold-no-products (with `--draft-quantization w8a16` only, where a one-row product is one int8 kernel call): as
  cold, with the kernel's calls answered from a cache of their first outputs, so what is left is everything around
  the products: the batch's construction, the norms, rotary values, KV write, mask, attention, the Python (a
  product the kernel does not take, an input width not a multiple of 16, still runs: none in the Qwen heads).

Beside the times, the dispatched PyTorch operations of one build and forward (`TorchDispatchMode`), by name.

    python scripts/cold_forward.py --model <target> --head <its EAGLE-3 head> [--draft-quantization w8a16]
        [--position 300] [--repeats 60] [--rounds 6] [--threads 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def count_operations(fn) -> dict[str, int]:
    """The PyTorch operations fn dispatches, by name (most first)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return dict(counts.most_common())


class CachedKernel:
    """torch._weight_int8pack_mm answered from a cache of its first output per shape (the cold-no-products arm)."""

    def __init__(self, real) -> None:
        self.real, self.outputs = real, {}

    def __call__(self, x, w, scale):
        key = (tuple(x.shape), tuple(w.shape), w.data_ptr())
        if key not in self.outputs:
            self.outputs[key] = self.real(x, w, scale)
        return self.outputs[key]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", required=True, help="the target's EAGLE-3 head")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--draft-quantization", default=None, choices=("w8a16",))
    ap.add_argument("--position", type=int, default=300, help="the token's cache position (its context)")
    ap.add_argument("--repeats", type=int, default=60, help="calls per arm and round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--flush-mb", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    for name in ("position", "repeats", "rounds", "flush_mb", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.draft_quantization and args.dtype != "bfloat16":
        ap.error("--draft-quantization w8a16 quantises a bfloat16 head's linears (--dtype bfloat16)")

    from echo_trtllm.bench.run import make_engine, write_report
    from echo_trtllm.core.config import EchoConfig
    from echo_trtllm.models.eagle3 import load_eagle3
    from echo_trtllm.models.loader import load_model
    from echo_trtllm.runtime.inputs import level_batch

    torch.set_num_threads(args.threads)
    target, tok = load_model(args.model, dtype=args.dtype)
    head = load_eagle3(args.head, target)
    llm = make_engine(target, head, tok, EchoConfig(), 1, args.position + 64, fallback="off",
                      draft_quantization=args.draft_quantization)
    llm.shutdown()
    drafter = llm.executor.drafter
    model, cache = drafter.model, drafter.cache
    p = args.position
    feature = torch.randn(1, model.config.layer.hidden_size, generator=torch.Generator().manual_seed(0)).to(model.dtype)
    flush = torch.zeros(args.flush_mb << 18, dtype=torch.float32)  # flush_mb MB

    def call():
        batch = level_batch(torch.tensor([[tok.encode("x")[0]]]), torch.tensor([[p - 1]]), torch.tensor([[p]]),
                            torch.tensor([0]), torch.tensor([p]), torch.tensor([[[p]]]), p + 1)
        return model(batch, cache, feature)

    real = torch._weight_int8pack_mm
    cached = CachedKernel(real)
    arms = ["warm", "cold"] + (["cold-no-products"] if args.draft_quantization else [])

    def sample(arm: str) -> float:
        torch._weight_int8pack_mm = cached if arm == "cold-no-products" else real
        try:
            if arm != "warm":
                flush.add_(1.0)
            t0 = time.perf_counter()
            call()
            return time.perf_counter() - t0
        finally:
            torch._weight_int8pack_mm = real

    with torch.inference_mode():
        operations = count_operations(call)
        for arm in arms:  # warm-up: the kernel cache filled, the first calls' allocations made
            for _ in range(10):
                sample(arm)
        rounds = {arm: [] for arm in arms}
        for rnd in range(args.rounds):
            for arm in (arms if rnd % 2 == 0 else arms[::-1]):
                ms = [sample(arm) * 1e3 for _ in range(args.repeats)]
                rounds[arm].append(round(statistics.median(ms), 4))
            print(f"round {rnd + 1}: " + ", ".join(f"{a} {rounds[a][-1]:.3f} ms" for a in arms), flush=True)
    combined = {a: {"median": round(statistics.median(v), 4), "min": min(v), "max": max(v)} for a, v in rounds.items()}
    for a, c in combined.items():
        print(f"{a}: {c['median']:.3f} ms ({c['min']:.3f}-{c['max']:.3f})")
    print(f"dispatched operations a build and forward: {sum(operations.values())}")
    if args.json:
        write_report(args.json, "cold_forward", argv, position=p, repeats=args.repeats, dtype=args.dtype,
                     draft_quantization=llm.draft_quantization, flush_mb=args.flush_mb, threads=args.threads,
                     rounds=rounds, combined=combined, operations=operations,
                     operations_total=sum(operations.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
