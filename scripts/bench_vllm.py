"""Side by side on one machine: vLLM's plain decoding, vLLM's own draft-model speculation at fixed k, vLLM + ECHO
(vllm-echo-draft: ECHO around vLLM's own draft-model runner, echo_trtllm.backends.vllm_draft; vllm-echo: vLLM's
custom-class proposer drafting with this project's engine, echo_trtllm.backends.vllm) and this project's engine,
on one target/draft pair, closed batches of c greedy requests
(ignore_eos, max_tokens each: the batch holds c rows throughout). Every method gets the same prompts, tokens, dtype
and a warm-up; each (round, method) runs in a fresh process, the methods' order rotating between rounds; the
ratios to vLLM AR are taken within a round, then the median and spread over rounds are reported.

    python scripts/bench_vllm.py --target-hf T_HF --draft-hf D_HF --target T.gguf --draft D.gguf \\
        --rounds 3 --concurrency 1 4 16 64 --out docs/bench/vllm-qwen.json

Needs the vLLM environment (`scripts/setup_vllm.sh`, or --vllm-python). HF directories for vLLM come from
`echo-trtllm export --format hf`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VLLM_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_NUM_THREADS": "2"}
METHODS = ("vllm-ar", "vllm-draft-k2", "vllm-draft-k4", "vllm-draft-table", "vllm-echo-draft", "vllm-echo-draft-pure", "vllm-echo",
           "vllm-echo-pure", "engine-ar", "engine-echo")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target-hf", required=True, help="the target as an HF directory (vLLM's)")
    ap.add_argument("--draft-hf", required=True, help="the draft as an HF directory (vLLM's draft-model method, ECHO)")
    ap.add_argument("--target", help="the target for this project's engine (default: --target-hf)")
    ap.add_argument("--draft", help="the draft for this project's engine (default: --draft-hf)")
    ap.add_argument("--methods", nargs="+", default=["vllm-ar", "vllm-draft-k2", "vllm-draft-k4", "vllm-echo-draft"],
                    choices=METHODS)
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts", default="humaneval", help="prompt set (eval split); default humaneval")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--echo-k", type=int, default=4, help="ECHO's longest chain (num_speculative_tokens)")
    ap.add_argument("--table", default="1-4:2,5-1024:0", type=parse_table,
                    help="vllm-draft-table's schedule, vLLM's num_speculative_tokens_per_batch_size as "
                         "FIRST-LAST:K,... (inclusive batch-size ranges, sorted, the first starting at 1; K >= 0). "
                         "The default is tuned by hand from runs H and I on this pair: k = 2 ahead of vLLM AR up "
                         "to 4 rows, behind it from 16")
    ap.add_argument("--cell-warmup-tokens", type=int, default=8,
                    help="before each concurrency's timed batch, an untimed one of other prompts at the same "
                         "concurrency and this many tokens (0: none); every method alike")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--memory-share", type=float, default=0.35, help="vLLM's gpu_memory_utilization (on the CPU: the share of host memory for weights and KV)")
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per (round, method) process")
    ap.add_argument("--trace-dir", help="where ECHO's cells write their per-step traces (ECHO_VLLM_TRACE)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    for name in ("target_hf", "draft_hf"):
        if not Path(getattr(args, name)).is_dir():
            ap.error(f"--{name.replace('_', '-')} must be an HF model directory, got {getattr(args, name)!r}")
    if any(c < 1 for c in args.concurrency) or args.rounds < 1 or args.max_tokens < 1:
        ap.error("--concurrency, --rounds and --max-tokens must be >= 1")
    return args


def parse_table(text: str) -> list[list[int]]:
    """`1-4:2,5-1024:0` -> [[1, 4, 2], [5, 1024, 0]] (vLLM checks the ranges themselves when it starts)."""
    table = []
    for part in text.split(","):
        try:
            span, k = part.split(":")
            first, last = span.split("-")
            entry = [int(first), int(last), int(k)]
        except ValueError:
            raise argparse.ArgumentTypeError(f"--table entries are FIRST-LAST:K, got {part!r}") from None
        if entry[0] < 1 or entry[1] < entry[0] or entry[2] < 0:
            raise argparse.ArgumentTypeError(f"--table entry {part!r}: needs 1 <= FIRST <= LAST and K >= 0")
        table.append(entry)
    if max(k for _, _, k in table) < 1:
        raise argparse.ArgumentTypeError("--table needs at least one range with K >= 1")
    return table


def run_method(args, method: str, prompts: list[str], offset: int) -> dict:
    spec = {"method": method, "table": args.table, "target_hf": args.target_hf, "draft_hf": args.draft_hf,
            "target": args.target or args.target_hf, "draft": args.draft or args.draft_hf,
            "echo_draft": args.draft_hf, "echo_k": args.echo_k, "dtype": args.dtype, "prompts": prompts,
            "concurrency": args.concurrency, "max_tokens": args.max_tokens, "warmup_tokens": 8,
            "cell_warmup_tokens": args.cell_warmup_tokens,
            "max_model_len": args.max_model_len, "memory_share": args.memory_share, "offset": offset,
            "trace": str(Path(args.trace_dir).resolve() / f"{method}-{offset}.jsonl") if args.trace_dir else None}
    if args.trace_dir:
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
    python = args.vllm_python if method.startswith("vllm") else sys.executable
    env = dict(os.environ, PYTHONPATH=str(ROOT), **VLLM_ENV)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    # the cell's own process group: vLLM's engine processes outlive the cell's exit otherwise, holding its pipes
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([python, str(ROOT / "scripts" / "vllm_cell.py"), f.name], stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env, start_new_session=True)
        result = None
        try:
            timer = threading.Timer(args.timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
            timer.start()
            for line in proc.stdout:
                if line.startswith("RESULT "):
                    result = json.loads(line[len("RESULT "):])
                    break
        finally:
            timer.cancel()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            os.unlink(f.name)
        if result is not None:
            return result
        err.seek(0)
        return {"method": method, "error": err.read()[-3000:]}


def summarise(rounds: list[dict], methods: list[str], concurrency: list[int]) -> dict:
    out = {}
    for m in methods:
        per_c = {}
        for c in concurrency:
            rates, ratios = [], []
            for r in rounds:
                cell = next((x for x in r.get(m, {}).get("cells", []) if x["concurrency"] == c), None)
                base = next((x for x in r.get("vllm-ar", {}).get("cells", []) if x["concurrency"] == c), None)
                if cell:
                    rates.append(cell["tokens_per_s"])
                    if base:
                        ratios.append(cell["tokens_per_s"] / base["tokens_per_s"])
            if rates:
                per_c[str(c)] = {"tokens_per_s_median": statistics.median(rates), "tokens_per_s": rates,
                                 "vs_vllm_ar_median": statistics.median(ratios) if ratios else None,
                                 "vs_vllm_ar": ratios}
        out[m] = per_c
    return out


def vllm_report_meta(script: str, argv, vllm_python: str) -> dict:
    """What a vLLM report's JSON records beside its numbers: machine, date, the command, vLLM's version and the
    environment its processes ran with."""
    from echo_trtllm.bench.run import report_meta

    meta = report_meta(script, argv)
    meta["command"] = meta["command"].replace("python -m ", "python ", 1)
    version = subprocess.run([vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True, check=False).stdout.strip()
    return {**meta, "vllm_version": version, "env": VLLM_ENV}


def main(argv=None) -> int:
    args = parse(argv)
    from echo_trtllm.bench.prompts import load_prompts

    prompts = load_prompts(args.prompts, "eval")
    header = vllm_report_meta("scripts/bench_vllm.py", argv, args.vllm_python)
    rounds = []
    for r in range(args.rounds):
        order = args.methods[r % len(args.methods):] + args.methods[: r % len(args.methods)]
        results = {}
        for m in order:
            res = run_method(args, m, prompts, offset=r * max(args.concurrency))
            results[m] = res
            cells = " ".join(f"c={x['concurrency']}:{x['tokens_per_s']:.1f}" for x in res.get("cells", []))
            print(f"round {r + 1} {m}: {cells or res.get('error', '')[-400:]}", flush=True)
        rounds.append(results)
        report = {"meta": {**header, "dtype": args.dtype, "max_tokens": args.max_tokens, "prompts": f"{args.prompts} (eval)",
                           "echo_k": args.echo_k, "table": args.table,
                           "batch": "closed: c requests together, ignore_eos"},
                  "summary": summarise(rounds, args.methods, args.concurrency), "rounds": rounds}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    for m, per_c in report["summary"].items():
        print(m, {c: (round(v["tokens_per_s_median"], 2), v["vs_vllm_ar_median"] and round(v["vs_vllm_ar_median"], 3))
                  for c, v in per_c.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
