"""echo-trtllm bench-serve: load an OpenAI-compatible server with streaming requests; throughput, TTFT, ITL p50/p99.

    echo-trtllm bench-serve --base-url http://127.0.0.1:8000 --concurrency 1,16,64 --num-prompts 64
    echo-trtllm bench-serve --methods ar,echo --concurrency 1,16,64 [--model ... --draft-model ...] --json out.json

With --methods each method's server is launched here (`echo-trtllm serve --policy METHOD` plus the model and
runtime flags given), measured at every concurrency, and stopped before the next; docs/serving.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time

from echo_trtllm.models import DEFAULT_DRAFT

from . import options

PROG = "echo-trtllm bench-serve"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    g = ap.add_argument_group("target server")
    g.add_argument("--base-url", help="a running server (instead of --methods)")
    g.add_argument("--served-model-name", help="the model id to send (default: with --base-url the server's own, from "
                                               "GET /v1/models; with --methods echo-bench)")
    g.add_argument("--methods", help="comma-separated policies to launch and compare, e.g. ar,echo")
    options.add_model_options(ap)
    g = ap.add_argument_group("launched servers")
    g.add_argument("--max-batch-size", type=int, default=64, help="each launched server's batch (default: 64)")
    g.add_argument("--max-seq-len", type=int, default=1024)
    g.add_argument("--threads", type=int, help="torch threads of each launched server")
    g.add_argument("--serve-arg", action="append", default=[],
                   help="one more flag for every launched server (repeat), e.g. --serve-arg=--fallback=off")
    g = ap.add_argument_group("load")
    g.add_argument("--concurrency", default="1,16,64", help="comma-separated maximum concurrencies (default: 1,16,64)")
    g.add_argument("--request-rate", type=float, help="Poisson arrivals per second (default: all at once)")
    g.add_argument("--num-prompts", type=int, default=64, help="requests per cell (default: 64)")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens per request (ignore_eos; default: 64)")
    g.add_argument("--prompts", default="mixed", help="prompt set (bench/prompts.py; default: mixed)")
    g.add_argument("--rounds", type=int, default=1,
                   help="repeat the whole comparison; methods alternate order each round (ABBA), medians and spreads "
                        "are reported (default: 1)")
    g.add_argument("--json", help="write every cell here")
    return ap


def _table(cells: list[dict]) -> str:
    head = (f"{'method':>8} {'conc':>5} {'req':>4} {'fail':>4} {'out tok/s':>9} {'req/s':>6} {'TTFT p50':>9} "
            f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'TPOT p50':>9}")
    rows = [head]
    for c in cells:
        rows.append(f"{c['method']:>8} {c['concurrency'] or '-':>5} {c['requests']:>4} {c['failed']:>4} "
                    f"{c['output_tokens_per_s']:>9.1f} {c['requests_per_s']:>6.2f} {c['ttft_ms']['p50']:>9.1f} "
                    f"{c['ttft_ms']['p99']:>9.1f} {c['itl_ms']['p50']:>8.1f} {c['itl_ms']['p99']:>8.1f} "
                    f"{c['tpot_ms']['p50']:>9.1f}")
    return "\n".join(rows) + "\n(times in ms)"


def _served_model(base_url: str) -> str:
    """The first model a running server lists (GET /v1/models)."""
    import urllib.request

    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/v1/models", timeout=30) as r:
            return json.loads(r.read())["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise ValueError(f"--base-url {base_url}: cannot read its model from /v1/models ({e}); "
                         "give --served-model-name") from None


def _measure(args, method, rnd, concurrency, prompts, launch_server, run_load, summarise) -> list[dict]:
    """One method at every concurrency (its server launched for it when --methods)."""
    cells = []
    proc, url = None, args.base_url
    if args.methods:
        serve = ["--policy", method, "--served-model-name", args.served_model_name, "--log-level", "warning",
                 "--max-batch-size", str(args.max_batch_size), "--max-seq-len", str(args.max_seq_len),
                 *(["--model", args.model] if args.model else []),
                 # the benchmarks' default draft is the separate tiny draft (a server's own default is the head:
                 # models.default_drafter)
                 *(["--draft-model", str(args.draft_model or DEFAULT_DRAFT)]
                   if args.draft_model or not (args.model or getattr(args, "engine_dir", None)) else []),
                 *(["--engine-dir", args.engine_dir] if getattr(args, "engine_dir", None) else []),
                 *(["--threads", str(args.threads)] if args.threads else []), *args.serve_arg]
        proc, url = launch_server(serve)
    try:
        for c in concurrency:
            timings, wall = asyncio.run(run_load(url, args.served_model_name, prompts, args.num_prompts,
                                                 args.max_tokens, c, args.request_rate))
            cell = summarise(method, timings, wall, c, args.request_rate).as_dict()
            cell["round"] = rnd
            cell["errors"] = sorted({t.error for t in timings if t.error})[:5]
            cells.append(cell)
            print(_table([cell]).splitlines()[1], flush=True)
            if cell["errors"]:
                print(f"  first error: {cell['errors'][0]}", flush=True)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except Exception:  # noqa: BLE001
                proc.kill()
        time.sleep(0.5)
    return cells


def _summary(cells: list[dict], methods: list[str], concurrency: list[int]) -> list[dict]:
    """Per method and concurrency over rounds: median / min / max output tok/s, median TTFT / ITL p50 and p99,
    and the median tok/s relative to the first method's at the same concurrency."""
    import statistics

    out = []
    for c in concurrency:
        base = None
        for m in methods:
            got = [x for x in cells if x["method"] == m and x["concurrency"] == c]
            tps = [x["output_tokens_per_s"] for x in got]
            med = lambda key, q: statistics.median(x[key][q] for x in got)  # noqa: E731
            row = {"method": m, "concurrency": c, "rounds": len(got), "tok_s_median": statistics.median(tps),
                   "tok_s_min": min(tps), "tok_s_max": max(tps), "ttft_p50_ms": med("ttft_ms", "p50"),
                   "ttft_p99_ms": med("ttft_ms", "p99"), "itl_p50_ms": med("itl_ms", "p50"),
                   "itl_p99_ms": med("itl_ms", "p99")}
            base = base or row["tok_s_median"]
            row["vs_first_method"] = row["tok_s_median"] / base if base else 0.0
            out.append(row)
    return out


def _summary_table(summary: list[dict]) -> str:
    rows = [f"{'method':>8} {'conc':>5} {'tok/s median [min-max]':>26} {'x first':>7} {'TTFT p50/p99':>14} "
            f"{'ITL p50/p99':>12}"]
    for r in summary:
        spread = f"{r['tok_s_median']:.1f} [{r['tok_s_min']:.1f}-{r['tok_s_max']:.1f}]"
        rows.append(f"{r['method']:>8} {r['concurrency']:>5} {spread:>26} {r['vs_first_method']:>7.3f} "
                    f"{r['ttft_p50_ms']:>6.1f}/{r['ttft_p99_ms']:<7.1f} {r['itl_p50_ms']:>5.1f}/{r['itl_p99_ms']:<6.1f}")
    return "\n".join(rows) + "\n(medians over rounds; ms)"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from echo_trtllm.bench.prompts import load_prompts
        from echo_trtllm.bench.run import report_meta
        from echo_trtllm.bench.serve import launch_server, run_load, summarise
    except ImportError as e:
        return options.fail(PROG, f"{e.name} is missing: install the serve extra (pip install 'echo-trtllm[serve]')")
    try:
        if bool(args.base_url) == bool(args.methods):
            raise ValueError("give exactly one of --base-url (a running server) or --methods (launch each)")
        concurrency = options.int_list(args.concurrency, "--concurrency")
        if args.num_prompts < 1 or args.max_tokens < 1 or args.rounds < 1:
            raise ValueError("--num-prompts, --max-tokens and --rounds must be >= 1")
        if args.request_rate is not None and args.request_rate <= 0:
            raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
        prompts = load_prompts(args.prompts)
        methods = args.methods.split(",") if args.methods else ["server"]
        if args.served_model_name is None:
            args.served_model_name = _served_model(args.base_url) if args.base_url else "echo-bench"
        from echo_trtllm.core.config import POLICY_NAMES

        bad = [m for m in methods if args.methods and m not in POLICY_NAMES]
        if bad:
            raise ValueError(f"--methods: unknown policy {bad[0]!r}; choose from {', '.join(POLICY_NAMES)}")
    except options.USAGE_ERRORS as e:
        return options.fail(PROG, e)
    cells = []
    for rnd in range(args.rounds):
        for method in (methods if rnd % 2 == 0 else methods[::-1]):
            cells += _measure(args, method, rnd, concurrency, prompts, launch_server, run_load, summarise)
    print(_table(cells))
    summary = _summary(cells, methods, concurrency)
    print(_summary_table(summary))
    if args.json:
        meta = report_meta("echo_trtllm.cli bench-serve", argv)
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "cells": cells, "args": {k: v for k, v in vars(args).items()}, **meta},
                      f, indent=2)
    return 0 if all(c["failed"] == 0 for c in cells) else 1
