"""echo-trtllm bench-online: how well the online prices predict real steps, and what the speculation controller
expected against what it got (the report is echo_trtllm/bench/online.py's; its docstring says what each figure is).
"""

from __future__ import annotations

import argparse
import json
import time

from echo_trtllm.api import FALLBACK_MODES, LLM
from echo_trtllm.bench.online import SKIP, prediction_report
from echo_trtllm.bench.prompts import load_prompts
from echo_trtllm.bench.run import report_meta
from echo_trtllm.cli import options
from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET
from echo_trtllm.runtime.request import SamplingParams

PROG = "echo-trtllm bench-online"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    options.add_model_options(ap, engine_dir=False)  # default: the embedded target and its separate draft model
    options.add_dtype_option(ap)
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--steps", type=int, default=150, help="full-batch steps per batch size at least (default: 150)")
    options.add_fallback_option(ap)
    options.add_prompt_set_option(ap)
    ap.add_argument("--max-tokens", type=int, default=64)
    options.add_max_seq_len_option(ap)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.model is None:
        args.model, args.draft_model = DEFAULT_TARGET, args.draft_model or DEFAULT_DRAFT
    try:
        batch_sizes = options.int_list(args.batch_sizes, "--batch-sizes")
        fallback = options.fallback_modes(args.fallback)[0]
        if args.steps <= SKIP:
            raise ValueError(f"--steps must exceed the {SKIP} steps the prices get before they are judged")
    except options.USAGE_ERRORS as e:
        return options.fail(PROG, e)

    try:
        rows = _run(args, batch_sizes, fallback)
    except options.USAGE_ERRORS as e:  # e.g. a draft that does not fit the target
        return options.fail(PROG, e)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, **report_meta("echo_trtllm.cli bench-online", argv)}, f, indent=2)
    return 0


def _run(args, batch_sizes: list[int], fallback: str) -> list[dict]:
    """One engine per batch size, kept full for --steps steps; a row of the prices' report each."""
    prompts = load_prompts(args.prompt_set, "eval") if args.prompt_set == "humaneval" else load_prompts(args.prompt_set)
    rows = []
    for b in batch_sizes:
        # enough requests that the batch stays full for args.steps steps even when every step emits several
        # tokens per request (at most max_depth + 1)
        n = b * max(2, -(-args.steps * 7 // args.max_tokens))
        with LLM(args.model, args.draft_model, max_batch_size=b, max_seq_len=args.max_seq_len, dtype=args.dtype,
                 iter_stats_max_iterations=1 << 20, fallback=FALLBACK_MODES[fallback]) as llm:
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
            handles = [llm.generate_async(prompts[i % len(prompts)], params) for i in range(n)]
            reports, full = [], 0
            while full < args.steps and not all(h.done for h in handles):
                for rep in llm.get_stats():
                    reports.append(rep)
                    full += rep.batch_size == b
                time.sleep(0.05)
            for h in handles:
                h.abort()
            reports += llm.get_stats()
            full_reports = [r for r in reports if r.batch_size == b]
            row = {"batch_size": b, "dtype": llm.dtype, **prediction_report(full_reports),
                   "speculation_stats": llm.speculation_stats()}
        rows.append(row)
        s = row["step"]
        print(f"B={b}: {row['steps']} judged steps, spec {row['speculative_share']:.0%}: whole step "
              f"{s['median_abs_rel_error']:.1%} (predicted/measured {s['predicted_over_measured']:.2f}); plain "
              f"{row['plain']['median_abs_rel_error']}, speculative {row['speculative']['median_abs_rel_error']}; "
              + ", ".join(f"{k} {v['steps']} steps expected/emitted {v['expected_over_emitted']}"
                          for k, v in row["decisions"].items()), flush=True)
    return rows
