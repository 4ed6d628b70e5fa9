"""echo-trtllm bench-serve: load an OpenAI-compatible server with streaming requests; throughput, TTFT, ITL p50/p99.

    echo-trtllm bench-serve --base-url http://127.0.0.1:8000 --concurrency 1,16,64 --num-prompts 64
    echo-trtllm bench-serve --methods ar,echo --concurrency 1,16,64 [--model ... --draft-model ...] --json out.json
    echo-trtllm bench-serve --methods ar,echo,chain:num_draft_tokens=2 --duration 180 --concurrency 16,64 \
        --rounds 3 --json out.json                           # sustained serving: 3 minutes of load per cell

With --methods each method's server is launched here (`echo-trtllm serve` with the method's policy and shape
options, `policy[:option=value]...` as `echo-trtllm bench --methods` takes them, plus the model and runtime flags
given), measured at every concurrency (and every --request-rate), and stopped before the next; rounds alternate
the methods' order. With --duration each cell keeps its load up for that many seconds after --warmup-seconds and
counts the tokens streamed inside that window; each cell also reports what the engine did in it, from /metrics
(bench/serve.py). docs/serving.md.
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
    g.add_argument("--methods", help="comma-separated methods to launch and compare, each policy[:option=value]... "
                                      "as bench takes them (e.g. ar,echo,chain:num_draft_tokens=2,echo:fallback=off)")
    options.add_model_options(ap)
    g = ap.add_argument_group("launched servers")
    options.add_max_batch_size_option(g, " of each launched server")
    options.add_max_seq_len_option(g)
    options.add_threads_option(g, " of each launched server")
    g.add_argument("--serve-arg", action="append", default=[],
                   help="one more flag for every launched server (repeat), e.g. --serve-arg=--fallback=off")
    g = ap.add_argument_group("load")
    g.add_argument("--concurrency", default="1,16,64", help="comma-separated maximum concurrencies (default: 1,16,64)")
    g.add_argument("--request-rate", help="Poisson arrivals per second, comma-separated for several cells (with "
                                           "--concurrency also a cap on requests in flight; default: all at once)")
    g.add_argument("--num-prompts", type=int, default=64, help="requests per cell (default: 64; not with --duration)")
    g.add_argument("--duration", type=float, help="sustained serving: seconds of load measured per cell (instead of "
                                                   "--num-prompts)")
    g.add_argument("--warmup-seconds", type=float, default=10.0,
                   help="with --duration: seconds of load before the measured window (default: 10)")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens per request (ignore_eos; default: 64)")
    g.add_argument("--max-tokens-range-ratio", type=float, default=0.0,
                   help="each request asks for its own max_tokens, uniform in [max_tokens (1 - r), max_tokens (1 + r)] "
                        "by its index (and with --duration the round), the same for every method (as vLLM's --random-range-ratio; "
                        "default: 0, one length for all)")
    g.add_argument("--prompts", default="mixed", help="prompt set (bench/prompts.py; default: mixed)")
    g.add_argument("--rounds", type=int, default=1,
                   help="repeat the whole comparison; methods alternate order each round (ABBA), medians and spreads "
                        "are reported (default: 1)")
    g.add_argument("--json", help="write every cell here")
    return ap


def _table(cells: list[dict]) -> str:
    head = (f"{'method':>24} {'conc':>5} {'rate':>5} {'req':>4} {'fail':>4} {'out tok/s':>9} {'TTFT p50':>9} "
            f"{'ITL p50':>8} {'ITL p99':>8} {'spec':>5} {'MAT':>5} {'explore':>7} {'pred/meas':>9}")
    rows = [head]
    for c in cells:
        e = c.get("engine") or {}
        rows.append(f"{c['method']:>24} {c['concurrency'] or '-':>5} {c['request_rate'] or '-':>5} {c['requests']:>4} "
                    f"{c['failed']:>4} {c['output_tokens_per_s']:>9.1f} {c['ttft_ms']['p50']:>9.1f} "
                    f"{c['itl_ms']['p50']:>8.1f} {c['itl_ms']['p99']:>8.1f} {e.get('speculative_share', 0):>5.0%} "
                    f"{e.get('mat', 0):>5.2f} {e.get('exploration_share', 0):>7.2%} "
                    f"{e.get('predicted_over_measured', float('nan')):>9.2f}")
    return "\n".join(rows) + "\n(times in ms; spec: speculative steps; explore: the controller's net exploration loss " \
                             "/ tokens; pred/meas: the online prices' predicted / measured step seconds)"


def _served_model(base_url: str) -> str:
    """The first model a running server lists (GET /v1/models)."""
    import urllib.request

    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/v1/models", timeout=30) as r:
            return json.loads(r.read())["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise ValueError(f"--base-url {base_url}: cannot read its model from /v1/models ({e}); "
                         "give --served-model-name") from None


# bench's shape options as the serve flags that set them
SERVE_FLAGS = {"max_depth": "--max-depth", "top_k": "--tree-top-k", "beam_width": "--beam-width",
               "total_tokens": "--total-tokens", "num_draft_tokens": "--num-draft-tokens",
               "max_nodes_per_request": "--max-nodes-per-request", "k_max": "--k-max", "static_nodes": "--static-nodes"}


def method_flags(spec: str) -> list[str]:
    """A --methods entry as `echo-trtllm serve` flags (ValueError naming the entry when serve cannot run it)."""
    from echo_trtllm.bench.run import SHAPE_OPTIONS, split_fallback

    rest, fallback = split_fallback(spec)
    policy, *opts = rest.split(":")
    from echo_trtllm.bench.run import parse_method

    parse_method(spec)  # validates the policy and each option's value
    flags = ["--policy", policy]
    for opt in opts:
        key, _, value = opt.partition("=")
        if key not in SERVE_FLAGS:
            raise ValueError(f"--methods: {spec!r}: serve has no flag for {key}; bench-serve takes "
                             f"{', '.join(k for k in SHAPE_OPTIONS if k in SERVE_FLAGS)}")
        flags += [SERVE_FLAGS[key], value]
    if fallback is not None:
        flags += ["--fallback", fallback]
    return flags


def _cells(args, concurrency, rates):
    """(concurrency, request rate) of every cell."""
    return [(c, r) for r in rates for c in concurrency] if rates != [None] else [(c, None) for c in concurrency]


def _measure(args, method, rnd, concurrency, prompts, launch_server, run_load, summarise) -> list[dict]:
    """One method at every concurrency and rate (its server launched for it when --methods)."""
    from echo_trtllm.bench.serve import engine_stats, run_sustained, scrape_metrics

    cells = []
    proc, url = None, args.base_url
    if args.methods:
        serve = [*method_flags(method), "--served-model-name", args.served_model_name, "--log-level", "warning",
                 *(["--max-batch-size", str(args.max_batch_size)] if args.max_batch_size else []),
                 "--max-seq-len", str(args.max_seq_len),
                 *(["--model", args.model] if args.model else []),
                 # the benchmarks' default draft is the separate tiny draft (a server's own default is the head:
                 # models.default_drafter)
                 *(["--draft-model", str(args.draft_model or DEFAULT_DRAFT)]
                   if args.draft_model or not (args.model or getattr(args, "engine_dir", None)) else []),
                 *(["--engine-dir", args.engine_dir] if getattr(args, "engine_dir", None) else []),
                 *(["--threads", str(args.threads)] if args.threads else []), *args.serve_arg]
        proc, url = launch_server(serve)
    try:
        for c, rate in _cells(args, concurrency, args.rates):
            if args.duration:
                timings, tokens, wall, before, after = asyncio.run(run_sustained(
                    url, args.served_model_name, prompts, args.duration, args.warmup_seconds, args.max_tokens, c,
                    rate, seed=rnd, range_ratio=args.max_tokens_range_ratio))
                cell = summarise(method, timings, wall, c, rate).as_dict()
                cell["output_tokens"], cell["output_tokens_per_s"] = tokens, tokens / wall
                cell["engine"] = engine_stats(before, after)
            else:
                before = scrape_metrics(url)
                timings, wall = asyncio.run(run_load(url, args.served_model_name, prompts, args.num_prompts,
                                                     args.max_tokens, c, rate,
                                                     range_ratio=args.max_tokens_range_ratio))
                cell = summarise(method, timings, wall, c, rate).as_dict()
                cell["engine"] = engine_stats(before, scrape_metrics(url))
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


def _summary(cells: list[dict], methods: list[str]) -> list[dict]:
    """Per method and cell (concurrency, rate) over rounds: median / min / max output tok/s, median TTFT / ITL p50 and
    p99, the median tok/s relative to the first method's in the same cell (and every round's ratio, each against the
    first method's cell of that round), and the engine's medians (speculative share, MAT, exploration share,
    predicted / measured step seconds)."""
    import statistics

    out = []
    keys = sorted({(x["concurrency"] or 0, x["request_rate"] or 0.0) for x in cells})
    for c, rate in keys:
        first = {x["round"]: x["output_tokens_per_s"] for x in cells
                 if x["method"] == methods[0] and (x["concurrency"] or 0) == c and (x["request_rate"] or 0.0) == rate}
        base = None
        for m in methods:
            got = [x for x in cells if x["method"] == m and (x["concurrency"] or 0) == c
                   and (x["request_rate"] or 0.0) == rate]
            if not got:
                continue
            tps = [x["output_tokens_per_s"] for x in got]
            med = lambda key, q: statistics.median(x[key][q] for x in got)  # noqa: E731

            def eng(key):
                vals = [x["engine"][key] for x in got if x.get("engine") and x["engine"].get(key) == x["engine"].get(key)]
                return statistics.median(vals) if vals else None

            row = {"method": m, "concurrency": c or None, "request_rate": rate or None, "rounds": len(got),
                   "tok_s_median": statistics.median(tps), "tok_s_min": min(tps), "tok_s_max": max(tps),
                   "ttft_p50_ms": med("ttft_ms", "p50"), "ttft_p99_ms": med("ttft_ms", "p99"),
                   "itl_p50_ms": med("itl_ms", "p50"), "itl_p99_ms": med("itl_ms", "p99"),
                   "vs_first_by_round": [x["output_tokens_per_s"] / first[x["round"]] for x in got
                                         if first.get(x["round"])],
                   **{k: eng(k) for k in ("speculative_share", "mat", "exploration_share", "predicted_over_measured",
                                          "prediction_abs_error", "expected_over_emitted")}}
            base = base or row["tok_s_median"]
            row["vs_first_method"] = row["tok_s_median"] / base if base else 0.0
            out.append(row)
    return out


def _summary_table(summary: list[dict]) -> str:
    rows = [f"{'method':>24} {'conc':>5} {'rate':>5} {'tok/s median [min-max]':>26} {'x first':>7} "
            f"{'x first by round':>22} {'TTFT p50/p99':>14} {'ITL p50/p99':>12} {'spec':>5} {'MAT':>5}"]
    for r in summary:
        spread = f"{r['tok_s_median']:.1f} [{r['tok_s_min']:.1f}-{r['tok_s_max']:.1f}]"
        by_round = ",".join(f"{v:.2f}" for v in r["vs_first_by_round"])
        rows.append(f"{r['method']:>24} {r['concurrency'] or '-':>5} {r['request_rate'] or '-':>5} {spread:>26} "
                    f"{r['vs_first_method']:>7.3f} {by_round:>22} {r['ttft_p50_ms']:>6.1f}/{r['ttft_p99_ms']:<7.1f} "
                    f"{r['itl_p50_ms']:>5.1f}/{r['itl_p99_ms']:<6.1f} {r['speculative_share'] or 0:>5.0%} "
                    f"{r['mat'] or 0:>5.2f}")
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
        args.rates = [None] if args.request_rate is None else options.float_list(args.request_rate, "--request-rate")
        if any(r <= 0 for r in args.rates if r is not None):
            raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
        if args.duration is not None and not args.duration > 0:
            raise ValueError(f"--duration must be > 0 seconds, got {args.duration}")
        if not args.warmup_seconds >= 0:
            raise ValueError(f"--warmup-seconds must be >= 0, got {args.warmup_seconds}")
        if not 0.0 <= args.max_tokens_range_ratio < 1.0:
            raise ValueError(f"--max-tokens-range-ratio must lie in [0, 1), got {args.max_tokens_range_ratio}")
        prompts = load_prompts(args.prompts)
        methods = args.methods.split(",") if args.methods else ["server"]
        if args.methods:
            for m in methods:
                method_flags(m)
        if args.served_model_name is None:
            args.served_model_name = _served_model(args.base_url) if args.base_url else "echo-bench"
    except options.USAGE_ERRORS as e:
        return options.fail(PROG, e)
    cells = []
    for rnd in range(args.rounds):
        for method in (methods if rnd % 2 == 0 else methods[::-1]):
            cells += _measure(args, method, rnd, concurrency, prompts, launch_server, run_load, summarise)
    print(_table(cells))
    summary = _summary(cells, methods)
    print(_summary_table(summary))
    if args.json:
        meta = report_meta("echo_trtllm.cli bench-serve", argv)
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "cells": cells, "args": {k: v for k, v in vars(args).items()}, **meta},
                      f, indent=2)
    return 0 if all(c["failed"] == 0 for c in cells) else 1
