"""echo-trtllm bench-dtype: a model's forward time by tokens in each dtype on this machine, and what --dtype auto
picks (echo_trtllm.bench.dtype).

    echo-trtllm bench-dtype --model M [--draft-model D] [--dtypes float32,bfloat16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

from . import options

PROG = "echo-trtllm bench-dtype"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    options.add_model_options(ap, engine_dir=False)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated, timed in this order")
    ap.add_argument("--tokens", default="1,4,16,64,128", help="tokens per forward to time")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per point (fastest kept)")
    options.add_threads_option(ap)
    ap.add_argument("--json", help="write the curves (and the machine) here")
    return ap


def main(argv: list[str] | None = None) -> int:
    from echo_trtllm.bench.dtype import dtype_curves
    from echo_trtllm.bench.run import machine_info
    from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET
    from echo_trtllm.models.loader import DTYPES

    args = build_parser().parse_args(argv)
    try:
        options.apply_threads(args)
        tokens = tuple(options.int_list(args.tokens, "--tokens"))
        dtypes = [d for d in args.dtypes.split(",") if d]
        bad = [d for d in dtypes if d not in DTYPES]
        if bad or not dtypes:
            raise ValueError(f"--dtypes: unknown {bad or 'empty'}; choose from {', '.join(DTYPES)}")
        if args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
        models = {"target": args.model or DEFAULT_TARGET}
        if args.draft_model or not args.model:
            models["draft"] = args.draft_model or DEFAULT_DRAFT
        results = {role: dtype_curves(src, dtypes, tokens, args.repeats) for role, src in models.items()}
    except options.USAGE_ERRORS as e:
        return options.fail(PROG, e)
    for role, r in results.items():
        print(f"{role}: auto -> {r['auto']}  ({r['auto_rule']})")
        print("  tokens " + "".join(f"{t:>10}" for t in tokens))
        for name, curve in r["seconds"].items():
            print(f"  {name:<8}" + "".join(f"{curve[str(t)] * 1e3:>8.1f}ms" for t in tokens))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"models": {role: str(src).rsplit("/", 1)[-1] for role, src in models.items()},
                       "results": results, "machine": machine_info(), "date": time.strftime("%Y-%m-%d")}, f, indent=2)
    return 0
