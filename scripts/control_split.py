"""Where a speculative step's host time goes, function by function, and what acceptance costs beside the target's
LM head: wall time around the control plane's parts of real ECHO steps (pure, every step drafts) of the embedded
target with its EAGLE-3 head, and microbenchmarks of verification and of a fused LM-head argmax at the Qwen
target's shapes. Prints a table; writes JSON.

    python scripts/control_split.py [--batch-sizes 1,16,64] [--steps 40] [--json out.json] [--split-only | --micro-only]
        [--model <target> --head <its EAGLE-3 head> --dtype bfloat16] [--threads N]

Part 1 wraps, by monkeypatching, the functions a step calls (their own time plus what they call): the drafting
loop's device-side level work (`_level_on_device`, the head's forward included, and the head's forward alone), the
replay of drafted levels on the host (`_replay`, the policy's `observe` inside it), `select` (budget allocation,
acceptance estimates, the budget rule), `start`, building the tree (`from_levels`), packing, verification,
learning, finishing and commit, and inside them the acceptance estimates (the cost stop's and the selection's
reads), the acceptance counts (learning) and the gate's thresholds (start), with how often each is called a step.
--model / --head run it on another target and head (default: the embedded pair). Part 2 times, at 151,936 vocabulary entries, `verify` over 64 plain rows and over 64
requests with 22 extra tree nodes, the argmax alone and the tree walk alone; and the Qwen LM head (1536 -> 151,936,
bfloat16, prepacked) at 64 / 87 rows as one product then a float32 copy and argmax, against the same product in
vocabulary chunks of 8,192 with each chunk's row maxima kept (no float32 copy of every row); the head's
feature store's row write at the Qwen target's feature width (`store_copy`); and a drafter's top-k of a level's
distribution, torch.topk against `core.tree.row_topk`, over 8,192 and 151,936 entries (`draft_topk`).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

import echo_trtllm.core.acceptance as acceptance_mod
import echo_trtllm.core.controller as controller_mod
import echo_trtllm.core.prices as prices_mod
import echo_trtllm.core.policies as policies
import echo_trtllm.core.tree as tree_mod
import echo_trtllm.runtime.drafter as drafter_mod
import echo_trtllm.runtime.executor as executor_mod
from echo_trtllm.bench.prompts import load_prompts
from echo_trtllm.bench.run import make_engine
from echo_trtllm.core import EchoConfig, pack, verify
from echo_trtllm.core.tree import SuperTree, row_topk
from echo_trtllm.core.verify import _accept_predicted, verify_paths
from echo_trtllm.models import DEFAULT_EAGLE3, DEFAULT_TARGET
from echo_trtllm.models.eagle3 import load_eagle3
from echo_trtllm.models.loader import load_model
from echo_trtllm.runtime.request import SamplingParams

WRAPPED = ((policies, "_level_on_device", "level work on the device (head forward included)"),
           (drafter_mod.Eagle3Drafter, "_forward", "head forward"),
           (drafter_mod.Drafter, "expand_level", "drafter level (head forward included)"),
           (drafter_mod.Drafter, "expand_roots", "drafter roots (head forward included)"),
           (policies, "_keep_active", "rows kept (in drafting)"),
           (policies, "_replay", "replay of drafted levels"), (policies.EchoPolicy, "observe", "observe (in replay)"),
           (policies.EchoPolicy, "select", "select"), (policies.EchoPolicy, "start", "start"),
           (tree_mod.SuperTree, "from_levels", "tree from levels"), (executor_mod.Executor, "_pack", "pack"),
           (executor_mod.Executor, "_verify", "verify"), (executor_mod.Executor, "_learn", "learn"),
           (executor_mod.Executor, "_finish_step", "finish"), (executor_mod.Executor, "_commit_step", "commit"),
           (executor_mod.Executor, "_target_forward", "target forward"),
           (executor_mod.Executor, "_commit", "target KV commit (in commit)"),
           (executor_mod.Executor, "_observe", "the head's features observed (in commit)"),
           (drafter_mod.FeatureStore, "write", "feature store write (in commit and prefill)"),
           (acceptance_mod.OnlineAcceptance, "estimate", "acceptance estimates (in stop and select)"),
           (acceptance_mod.OnlineAcceptance, "observe", "acceptance counts (in learn)"),
           (acceptance_mod.OnlineAcceptance, "threshold", "gate thresholds (in start)"),
           (prices_mod.StepCostModel, "observe", "step prices (in learn)"),
           (controller_mod.SpeculationController, "observe", "controller (in learn)"),
           (policies.EchoPolicy, "learn", "acceptance (in learn)"),
           (drafter_mod.Eagle3Drafter, "begin", "draft begin (in control)"),
           (executor_mod.Executor, "_decide", "speculation decision (in control)"),
           (controller_mod.SpeculationController, "_estimate_now", "controller's estimate read anew (in decision)"),
           (tree_mod.SuperTree, "select", "tree select (in select and result)"))


def timed(seconds: dict, calls: dict):
    for owner, name, label in WRAPPED:
        f = getattr(owner, name)

        def g(*a, _f=f, _label=label, **k):
            t = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                seconds[_label] += time.perf_counter() - t
                calls[_label] += 1
        setattr(owner, name, g)


def pure_echo(target, head, tok, batch_size: int, max_tokens: int, prompts: list[str], warm: int = 4,
              fallback: str = "off"):
    """ECHO pure (every step drafts) on target and head with batch_size greedy requests of `max_tokens`, warmed by
    `warm` steps: the steps this script and `control_sampled.py` measure (fallback "on": ECHO as shipped, its
    speculation controller deciding each step). Returns (executor, submit), where submit(n) adds batch_size more
    requests, the i-th of prompt n + i."""
    llm = make_engine(target, head, tok, EchoConfig(policy="echo"), batch_size, 1024, fallback=fallback)
    llm.shutdown()
    ex = llm.executor
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    def submit(n: int) -> None:
        for i in range(batch_size):
            ex.submit(ex.make_request(prompts[(n + i) % len(prompts)], params))

    submit(0)
    for _ in range(warm):
        ex.step()
    return ex, submit


def control_split(batch_sizes: list[int], steps: int, model=None, head_dir=None, dtype="float32",
                  fallback: str = "off") -> list[dict]:
    seconds: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    timed(seconds, calls)
    target, tok = load_model(model or DEFAULT_TARGET, dtype=dtype)
    head = load_eagle3(head_dir or DEFAULT_EAGLE3, target)
    prompts = load_prompts("humaneval")
    out = []
    for b in batch_sizes:
        ex, _ = pure_echo(target, head, tok, b, steps * 8 + 64, prompts, fallback=fallback)
        seconds.clear()
        calls.clear()
        total = control = 0.0
        for _ in range(steps):
            r = ex.step()
            total += r.timings.total
            control += r.timings.control
        row = {"batch_size": b, "step_ms": round(total / steps * 1e3, 3), "control_ms": round(control / steps * 1e3, 3),
               "parts_ms": {k: round(v / steps * 1e3, 3) for k, v in sorted(seconds.items(), key=lambda x: -x[1])},
               "calls_per_step": {k: round(calls[k] / steps, 2) for k in seconds}}
        out.append(row)
    return out


def _median_ms(fn, n: int = 15) -> float:
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1e3, 3)


def accept_cost(vocab: int = 151_936) -> list[dict]:
    out = []
    for b, extra in ((64, 0), (64, 22)):
        parents = [torch.tensor([-1] + list(range(int(i < extra) + int(i < extra // 3))))
                   for i in range(b)]
        batch = pack(SuperTree.from_parents(parents), torch.full((b,), 100))
        logits = torch.randn(batch.total_nodes, vocab)
        pred = logits.argmax(-1)
        deepest = int(batch.node_depths.max())
        out.append({"rows": batch.total_nodes, "verify_ms": _median_ms(lambda: verify(batch, logits)),
                    "argmax_ms": _median_ms(lambda: logits.argmax(-1)),
                    "tree_walk_ms": _median_ms(lambda: _accept_predicted(batch, pred, deepest).flatten()),
                    "verify_paths_ms": _median_ms(lambda: verify_paths(batch, logits, max_depth=deepest).flatten())})
    return out


def lm_head_argmax(hidden: int = 1536, vocab: int = 151_936, chunk: int = 8192) -> list[dict]:
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return []
    w = (torch.randn(vocab, hidden) * 0.02).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
    chunks = [torch.ops.mkldnn._reorder_linear_weight(w[a:a + chunk].contiguous(), 1) for a in range(0, vocab, chunk)]

    def lin(x, p):
        return torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

    out = []
    for rows in (64, 87):
        x = torch.randn(rows, hidden).bfloat16()

        def fused():
            best_v, best_i = torch.full((rows,), -float("inf")), torch.zeros(rows, dtype=torch.long)
            for j, p in enumerate(chunks):
                v, i = lin(x, p).float().max(-1)
                better = v > best_v
                best_v, best_i = torch.where(better, v, best_v), torch.where(better, i + j * chunk, best_i)
            return best_i

        same = bool(torch.equal(lin(x, packed).float().argmax(-1), fused()))
        out.append({"rows": rows, "product_ms": _median_ms(lambda: lin(x, packed), 7),
                    "product_float_argmax_ms": _median_ms(lambda: lin(x, packed).float().argmax(-1), 7),
                    "chunked_fused_argmax_ms": _median_ms(fused, 7), "same_tokens": same})
    return out


def store_copy(rows: int = 64, width: int = 4608, ring: int = 512) -> dict:
    """The feature store's row write at the Qwen target's feature width (three layers of 1536, bfloat16): one row
    for each of `rows` slots into a store of rows x ring, as `index_copy_` (the store's write), `index_put_`, and
    `index_copy_` on an int64 view of the same bytes (bit-equal), beside `index_select` of the same rows and a
    contiguous copy of the same bytes."""
    store = torch.zeros(rows * ring, width, dtype=torch.bfloat16)
    feats = torch.randn(rows, width).bfloat16()
    idx = torch.arange(rows) * ring + 100
    wide, wide_feats = store.view(torch.int64), feats.view(torch.int64)
    check = store.clone()
    check.view(torch.int64).index_copy_(0, idx, wide_feats)
    return {"rows": rows, "width": width, "dtype": "bfloat16",
            "index_copy_ms": _median_ms(lambda: store.index_copy_(0, idx, feats), 101),
            "index_put_ms": _median_ms(lambda: store.index_put_((idx,), feats), 101),
            "index_copy_int64_view_ms": _median_ms(lambda: wide.index_copy_(0, idx, wide_feats), 101),
            "int64_view_equal": bool(torch.equal(check, store.index_copy_(0, idx, feats))),
            "index_select_ms": _median_ms(lambda: store.index_select(0, idx), 101),
            "contiguous_copy_ms": _median_ms(lambda: store[:rows].copy_(feats), 101)}


def draft_topk(k: int = EchoConfig().top_k) -> list[dict]:
    """A drafter's top-k of a level (`core.tree.DraftTopK.of`): the softmax of the level's rows, then torch.topk
    (before) or `row_topk` (after) of the distribution, over the Qwen head's draft vocabulary and the Qwen draft
    model's whole vocabulary, with whether both give the same values."""
    out = []
    for vocab in (8192, 151_936):
        for rows in (1, 4, 16, 64):
            probs = torch.softmax(torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)), -1)
            same = bool(torch.equal(torch.topk(probs, k, dim=-1).values, row_topk(probs, k)[0]))
            out.append({"vocab": vocab, "rows": rows, "k": k,
                        "softmax_ms": _median_ms(lambda: torch.softmax(probs, -1), 51),
                        "torch_topk_ms": _median_ms(lambda: torch.topk(probs, k, dim=-1), 51),
                        "row_topk_ms": _median_ms(lambda: row_topk(probs, k), 51), "same_values": same})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--split-only", action="store_true", help="the engine's split alone (no microbenchmarks)")
    ap.add_argument("--micro-only", action="store_true", help="the microbenchmarks alone (no engine split)")
    ap.add_argument("--model", default=None, help="target (HF directory or .gguf; default: the embedded target)")
    ap.add_argument("--head", default=None, help="its EAGLE-3 head directory (default: the embedded head)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--fallback", default="off", choices=["off", "on"],
                    help="off: ECHO pure, every step drafts; on: ECHO as shipped, its controller deciding each step")
    args = ap.parse_args(argv)
    if (args.model is None) != (args.head is None):
        ap.error("--model and --head go together (a head is trained for its target)")
    if args.split_only and args.micro_only:
        ap.error("--split-only and --micro-only exclude each other (neither: both parts)")
    torch.set_num_threads(args.threads)
    with torch.no_grad():  # not inference mode: a bfloat16 model's prepacked weights track their tensors' versions
        split = [] if args.micro_only else control_split([int(b) for b in args.batch_sizes.split(",")], args.steps,
                                                         args.model, args.head, args.dtype, args.fallback)
        result = {"control_split": split, **({} if args.split_only else {"accept_cost": accept_cost(),
                                                                          "lm_head_argmax": lm_head_argmax(),
                                                                          "store_copy": store_copy(),
                                                                          "draft_topk": draft_topk()}),
                  "threads": args.threads}
    for row in result["control_split"]:
        print(f"B={row['batch_size']}: step {row['step_ms']} ms, control {row['control_ms']} ms")
        for k, v in row["parts_ms"].items():
            print(f"   {k:52s} {v:8.3f}  ({row['calls_per_step'][k]} calls a step)")
    if not args.split_only:
        print("acceptance:", result["accept_cost"])
        print("LM head:", result["lm_head_argmax"])
        print("feature store rows:", result["store_copy"])
        for row in result["draft_topk"]:
            print(f"draft top-k, vocabulary {row['vocab']}, {row['rows']} rows: softmax {row['softmax_ms']} ms, "
                  f"torch.topk {row['torch_topk_ms']} ms, row_topk {row['row_topk_ms']} ms, "
                  f"same values {row['same_values']}")
    if args.json:  # beside the machine (its CPU and flags), the date and the command
        from echo_trtllm.bench.run import write_report

        write_report(args.json, "control_split", argv, **result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
