"""Do fresh large allocations cost a decode step? glibc serves allocations above its mmap threshold (at most 32 MB
by its own adjustment) with fresh pages, faulted in on first touch, every time: the target's float32 logits of 64
rows x 151,936 tokens are 39 MB, allocated every step. This times AR steps of 64 rows on a model (bfloat16,
prepacked), first with glibc's thresholds, then after mallopt keeps large allocations on the heap (it cannot be
undone cleanly in one process, so the order is fixed: the second half also has 15 more tokens of context).

    python scripts/large_alloc_probe.py --model DIR [--steps 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def main() -> None:
    from echo_trtllm.bench.prompts import load_prompts
    from echo_trtllm.bench.run import report_meta
    from echo_trtllm.core import EchoConfig
    from echo_trtllm.models.loader import load_model
    from echo_trtllm.models.packed import prepack_linears
    from echo_trtllm.runtime.executor import Executor
    from echo_trtllm.runtime.request import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json")
    args = ap.parse_args()
    target, tok = load_model(args.model, dtype="bfloat16")
    prepack_linears(target)
    ex = Executor(target, None, tok, EchoConfig(policy="ar"), max_batch_size=args.batch_size, max_seq_len=512)
    prompts = load_prompts("humaneval")
    for i in range(args.batch_size):
        ex.submit(ex.make_request(prompts[i % len(prompts)], SamplingParams(max_tokens=4 * args.steps + 16,
                                                                            temperature=0, ignore_eos=True)))
    ex.step()  # prefill

    def steps(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            ex.step()
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    steps(3)
    default = steps(args.steps)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1)
    steps(3)
    kept = steps(args.steps)
    for name, ms in (("glibc's thresholds", default), ("large allocations kept on the heap", kept)):
        print(f"{name}: median {statistics.median(ms):.1f} ms per step ({min(ms):.1f}-{max(ms):.1f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"default_ms": default, "heap_kept_ms": kept, "batch_size": args.batch_size,
                       **report_meta("scripts.large_alloc_probe", None)}, f, indent=1)


if __name__ == "__main__":
    main()
