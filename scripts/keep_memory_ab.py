"""glibc's thresholds kept or left (echo_trtllm.cpu.keep_freed_memory) on a closed AR batch: the prefill of B prompts
and the decode steps after it, each setting in its own fresh process (the thresholds are process-wide), the two
alternating over rounds.

    python scripts/keep_memory_ab.py --model <target> [--dtype bfloat16] [--batch-size 16] [--max-tokens 128]
        [--rounds 2] [--json out.json]

Each process builds the engine (AR, the prompts' batch as in scripts/bench_vllm.py's closed batches: greedy
HumanEval eval prompts, ignore_eos), runs one batch untimed, then times one batch of other prompts: the admission
(prefill of every prompt) and every decode step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from echo_trtllm.bench.run import child_result, print_result, write_report

ROOT = Path(__file__).resolve().parents[1]


def child(args) -> dict:
    import torch

    from echo_trtllm import LLM, EchoConfig, SamplingParams
    from echo_trtllm.bench.prompts import load_prompts
    from echo_trtllm.cpu import keep_freed_memory

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, None, speculative_config=EchoConfig(policy="ar"), max_batch_size=args.batch_size,
              max_seq_len=512, dtype=args.dtype)
    llm.shutdown()  # stepped directly
    ex, prompts = llm.executor, load_prompts("humaneval", "eval")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    out = {}
    for name, first in (("untimed", 1 + args.batch_size), ("timed", 1)):
        reqs = [ex.make_request(q, params) for q in prompts[first:first + args.batch_size]]
        for r in reqs:
            ex.submit(r)
        t0 = time.perf_counter()
        ex.admit()
        prefill = time.perf_counter() - t0
        steps = []
        while ex.has_work:
            t = time.perf_counter()
            ex.step()
            steps.append(time.perf_counter() - t)
        out = {"prefill_s": round(prefill, 3), "prompt_tokens": sum(len(r.prompt_token_ids) for r in reqs),
               "decode_steps": len(steps), "decode_step_ms_median": round(statistics.median(steps) * 1e3, 2),
               "total_s": round(prefill + sum(steps), 3),
               "tokens_per_s": round(args.batch_size * args.max_tokens / (prefill + sum(steps)), 2)}
    return {**out, "kept": keep_freed_memory()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.batch_size < 1 or args.max_tokens < 1 or args.rounds < 1 or args.threads < 1:
        ap.error("--batch-size, --max-tokens, --rounds and --threads must be >= 1")
    if args.child:
        print_result(child(args))
        return 0
    rows = []
    for k in range(args.rounds):
        for keep in (("1", "0") if k % 2 == 0 else ("0", "1")):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", args.model, "--dtype",
                   args.dtype, "--batch-size", str(args.batch_size), "--max-tokens", str(args.max_tokens),
                   "--threads", str(args.threads)]
            env = {**os.environ, "ECHO_KEEP_FREED_MEMORY": keep}
            rows.append({"round": k + 1, **child_result(cmd, env=env, cwd=ROOT)})
            print(json.dumps(rows[-1]), flush=True)
    summary = {}
    for kept in (True, False):
        mine = [r for r in rows if r["kept"] is kept]
        summary["kept" if kept else "glibc defaults"] = {
            key: round(statistics.median(r[key] for r in mine), 3)
            for key in ("prefill_s", "decode_step_ms_median", "tokens_per_s")}
    print(json.dumps(summary))
    if args.json:
        write_report(args.json, "keep_memory_ab", argv, rows=rows, medians=summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
