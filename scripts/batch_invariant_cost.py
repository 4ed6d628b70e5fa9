"""What the batch-invariant mode costs: the same closed batches through two engines in one process, one default and
one with `batch_invariant=True` (models/invariant.py), alternated in every round so both see the same machine;
tokens/s of each and the ratio per round (median, min-max), per policy and batch size. Also whether the mode's
greedy output equals the default's (it need not: the mode's bits differ from the default kernels'), and whether
every policy's greedy output in the mode equals the first policy's (AR's) at each batch size (it must).

    python scripts/batch_invariant_cost.py [--model DIR --draft-model DIR] [--dtype bfloat16] \
        [--batch-sizes 1,16] [--policies ar,echo] [--max-tokens 64] [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

from echo_trtllm.api import LLM
from echo_trtllm.bench.prompts import load_prompts
from echo_trtllm.bench.run import report_meta
from echo_trtllm.core import EchoConfig
from echo_trtllm.runtime.request import SamplingParams


def timed(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    ids = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, ids)) / wall, ids


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="target (default: the embedded pair)")
    ap.add_argument("--draft-model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--policies", default="ar,echo")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-set", default="humaneval")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    prompts = load_prompts(args.prompt_set)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rows, invariant_out = [], {}
    for policy in args.policies.split(","):
        engines = {mode: LLM(args.model, args.draft_model, dtype=args.dtype, batch_invariant=mode == "invariant",
                             speculative_config=EchoConfig(policy=policy), max_batch_size=max(sizes),
                             fallback=False if policy != "ar" else "auto")
                   for mode in ("default", "invariant")}
        try:
            for b in sizes:
                batch = [prompts[i % len(prompts)] for i in range(b)]
                for llm in engines.values():  # warm-up
                    timed(llm, batch[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
                rates = {m: [] for m in engines}
                same = None
                for r in range(args.rounds):
                    order = list(engines) if r % 2 == 0 else list(engines)[::-1]
                    outs = {}
                    for m in order:
                        rate, outs[m] = timed(engines[m], batch, params)
                        rates[m].append(rate)
                    same = outs["default"] == outs["invariant"] if same is None else same
                    invariant_out.setdefault(b, {})[policy] = outs["invariant"]
                ratio = [i / d for i, d in zip(rates["invariant"], rates["default"])]
                row = {"policy": policy, "batch_size": b, "default_tokens_per_s": rates["default"],
                       "invariant_tokens_per_s": rates["invariant"], "ratio_by_round": ratio,
                       "ratio_median": statistics.median(ratio), "greedy_equal_to_default": same}
                rows.append(row)
                print(f"{policy:5s} B={b:3d}: default {statistics.median(rates['default']):8.1f} tok/s, invariant "
                      f"{statistics.median(rates['invariant']):8.1f} tok/s, x{row['ratio_median']:.2f} "
                      f"({min(ratio):.2f}-{max(ratio):.2f}); same greedy text: {same}", flush=True)
        finally:
            for llm in engines.values():
                llm.shutdown()
            del engines, llm  # two engines of a 1.5B pair at a time: the next policy's must not meet these
            gc.collect()
    first = args.policies.split(",")[0]
    agree = {b: {p: out == by_policy[first] for p, out in by_policy.items()} for b, by_policy in invariant_out.items()}
    print(f"in the mode, greedy output equal to {first}'s: {agree}")
    if args.json:
        report = {"rows": rows, f"invariant_equal_to_{first}": agree, "dtype": args.dtype, "max_tokens": args.max_tokens, "rounds": args.rounds,
                  **report_meta("scripts.batch_invariant_cost", argv)}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
