"""Tensor parallelism on this machine: tp = N against tp = 1, side by side in one run (docs/scale-out.md).

    python -m echo_trtllm.bench.tp [--model M --draft-model D] [--tp-sizes 1,2] [--methods ar,echo]
                                   [--batch-size 8] [--max-tokens 32] [--rounds 3] [--threads 2] [--json out.json]

For every round, in alternating order of tp sizes, each (method, tp) engine is started (`LLM(...,
tensor_parallel_size=tp)`), warmed up on one prompt, then times one batch of `--batch-size` HumanEval evaluation
prompts, greedy, `--max-tokens` each (ignore_eos). The same `--threads` CPU cores are shared in every cell: a
tp = N engine gives each rank threads / N. Reported per cell: tokens/s (median, min-max over rounds) and its ratio to
tp = 1, each rank's weight bytes, and whether the greedy tokens equal tp = 1's. The methods run pure (no AR
fallback, no cost model: the fixed K_max) so both sides run the same steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from echo_trtllm.api import LLM
from echo_trtllm.bench.prompts import load_prompts
from echo_trtllm.bench.run import report_meta
from echo_trtllm.core.config import EchoConfig
from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET
from echo_trtllm.models.fp8 import weight_bytes
from echo_trtllm.runtime.request import SamplingParams


def run_cell(model, draft, method: str, tp: int, threads: int, prompts: list[str], max_tokens: int) -> dict:
    torch.set_num_threads(max(1, threads // tp))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t_load = time.perf_counter()
    with LLM(model, draft if method != "ar" else None, speculative_config=EchoConfig(policy=method),
             dtype="float32", cost_model=None, fallback=False, max_batch_size=len(prompts),
             tensor_parallel_size=tp) as llm:
        load_s = time.perf_counter() - t_load
        llm.generate(prompts[0], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        if tp > 1:
            ranks = [s["weight_bytes"] for s in llm.tensor_parallel_stats]
        else:
            ranks = [{"target": weight_bytes(llm.target), **({"draft": weight_bytes(llm.draft)} if llm.draft else {})}]
    tokens = [o.token_ids for o in outs]
    return {"tokens_per_s": sum(map(len, tokens)) / wall, "steps": sum(o.stats.steps for o in outs),
            "load_s": load_s, "rank_weight_bytes": ranks, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_TARGET))
    ap.add_argument("--draft-model", default=str(DEFAULT_DRAFT))
    ap.add_argument("--tp-sizes", default="1,2")
    ap.add_argument("--methods", default="ar,echo")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads shared by all ranks of a cell (default: 2)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.tp_sizes.split(",")]
    methods = args.methods.split(",")
    if 1 not in sizes:
        raise SystemExit("--tp-sizes must include 1 (the reference)")
    prompts = load_prompts("humaneval", split="eval")[: args.batch_size]
    cells: dict[tuple[str, int], list[dict]] = {}
    for rnd in range(args.rounds):
        order = sizes if rnd % 2 == 0 else sizes[::-1]
        for method in methods:
            for tp in order:
                cell = run_cell(args.model, args.draft_model, method, tp, args.threads, prompts, args.max_tokens)
                cells.setdefault((method, tp), []).append(cell)
                print(f"round {rnd} {method:>5} tp={tp}: {cell['tokens_per_s']:7.1f} tok/s  steps {cell['steps']}  "
                      f"load {cell['load_s']:.1f} s", flush=True)
    rows = []
    for method in methods:
        ref = cells[(method, 1)]
        ref_tps = statistics.median(c["tokens_per_s"] for c in ref)
        for tp in sizes:
            runs = cells[(method, tp)]
            tps = [c["tokens_per_s"] for c in runs]
            rows.append({"method": method, "tp": tp, "tokens_per_s_median": statistics.median(tps),
                         "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps),
                         "vs_tp1": statistics.median(tps) / ref_tps, "steps": runs[0]["steps"],
                         "rank_weight_bytes": runs[0]["rank_weight_bytes"],
                         "greedy_equal_tp1": all(c["tokens"] == ref[0]["tokens"] for c in runs),
                         "load_s_median": statistics.median(c["load_s"] for c in runs)})
    print("| method | tp | tok/s median (min-max) | × tp=1 | weights per rank (MiB) | greedy == tp=1 |")
    print("|---|---:|---|---:|---|---|")
    for r in rows:
        mib = " / ".join(f"{sum(w.values()) / 2**20:.2f}" for w in r["rank_weight_bytes"])
        print(f"| {r['method']} | {r['tp']} | {r['tokens_per_s_median']:.1f} ({r['tokens_per_s_min']:.1f}-"
              f"{r['tokens_per_s_max']:.1f}) | {r['vs_tp1']:.2f} | {mib} | {'yes' if r['greedy_equal_tp1'] else 'NO'} |")
    if args.json:
        meta = report_meta("echo_trtllm.bench.tp", argv)
        Path(args.json).write_text(json.dumps({"rows": rows, "model": Path(args.model).name,
                                               "draft_model": Path(args.draft_model).name,
                                               "batch_size": args.batch_size, "max_tokens": args.max_tokens,
                                               "rounds": args.rounds, "threads": args.threads, **meta},
                                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
