"""echo-trtllm bench: every method side by side, by batch size, on real prompt sets.

    echo-trtllm bench --methods ar,chain,static,eagle2,ddd,echo,echo-dense,echo-fixed --batch-sizes 1,4,16 \
        --max-tokens 32 --prompt-set humaneval --json results.json --markdown results.md --plot results

For each batch size and round, every method runs the same requests (batch_size requests, one per slot, all
submitted at once) in the same process, AR first, so ratios are measured side by side; medians over rounds are
reported. The echo family uses a calibration (`--calibration FILE`, or measured in-process first unless
`--no-calibrate`): its gate thresholds and the cost curve from which each step's budget is chosen.

Metrics per (method, batch size, temperature):
  tokens_per_s        output tokens / decode seconds (steps only; prompt prefill excluded)
  e2e_tokens_per_s    output tokens / wall seconds from submission to the last finish (prefill included)
  mat                 mean accepted tokens per request-step (emitted per step, bonus included; AR = 1)
  verified_per_step   tokens the target verified per step (whole batch)
  acceptance_rate     accepted draft tokens / verified draft tokens
  latency_p50/p99_s   request latency from submission to finish
  control_share       ECHO control (gate + schedule + pack) as a share of decode step time
  draft_share         draft model forwards as a share of decode step time
  speculated_share    share of steps that speculated (the budget rule may choose plain AR)
  mat_vs_oracle       emitted tokens / the hindsight oracle's for the same drafts and per-step budget (T=0)
  speedup_vs_ar       tokens_per_s over AR's in the same rounds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from echo_trtllm.core.config import POLICY_NAMES, EchoConfig
from echo_trtllm.core.policies import make_policy
from echo_trtllm.runtime.executor import Executor
from echo_trtllm.runtime.request import SamplingParams

from .trace import TraceRecorder

__all__ = ["run_cell", "bench", "main", "markdown_table", "plot"]

METRICS = ("tokens_per_s", "e2e_tokens_per_s", "mat", "verified_per_step", "acceptance_rate", "latency_p50_s",
           "latency_p99_s", "control_share", "draft_share", "speculated_share", "mat_vs_oracle")


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def run_cell(ex: Executor, prompts: list[str], batch_size: int, max_tokens: int, temperature: float,
             seed: int = 0) -> dict:
    """One method at one batch size: batch_size requests submitted at once to `ex`, run to completion.

    The executor is reused across rounds (as a server's is): its budget rule keeps what it learnt."""
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=0.95 if temperature else 1.0,
                             seed=seed + i, ignore_eos=True) for i in range(batch_size)]
    reqs = [ex.make_request(prompts[(seed + i) % len(prompts)], params[i]) for i in range(batch_size)]
    recorder = TraceRecorder(reqs, ex.policy.max_tree_nodes - 1) if temperature == 0 else None
    t_submit = time.perf_counter()
    for r in reqs:
        ex.submit(r)
    finish: dict[int, float] = {}
    steps = verified = speculated = 0
    decode = control = draft_model = 0.0
    while ex.has_work:
        rep = ex.step()
        if not rep.batch_size:
            continue
        steps += 1
        verified += rep.verified_tokens
        speculated += rep.verified_tokens > rep.batch_size
        decode += rep.timings.total
        control += rep.timings.control
        draft_model += rep.timings.draft_model
        if recorder is not None:
            recorder.record(rep)
        now = time.perf_counter()
        for r in rep.finished:
            finish[id(r)] = now - t_submit
    wall = time.perf_counter() - t_submit
    tokens = sum(len(r.output_token_ids) for r in reqs)
    req_steps = sum(r.stats.steps for r in reqs)
    drafts_verified = sum(r.stats.verified_tokens for r in reqs) - req_steps
    latencies = [finish[id(r)] for r in reqs]
    row = {
        "tokens": tokens, "steps": steps, "decode_seconds": decode,
        "tokens_per_s": tokens / decode, "e2e_tokens_per_s": tokens / wall,
        "mat": tokens / req_steps, "verified_per_step": verified / steps,
        "acceptance_rate": (tokens - req_steps) / drafts_verified if drafts_verified else 0.0,
        "latency_p50_s": _percentile(latencies, 0.5), "latency_p99_s": _percentile(latencies, 0.99),
        "control_share": control / decode, "draft_share": draft_model / decode, "speculated_share": speculated / steps,
        "mat_vs_oracle": float("nan"), "trace": None,
    }
    if recorder is not None:
        ev = recorder.evaluate()
        row["mat_vs_oracle"] = ev["mat_vs_oracle"]
        row["trace"] = ev["records"]
    return row


def load_hf_pair(model: str, draft: str, dtype: str):
    """The same target and draft as HF transformers models (for the assisted-generation baseline)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    def load(path: str):
        p = Path(path)
        kw = {"gguf_file": p.name} if p.suffix == ".gguf" else {}
        return AutoModelForCausalLM.from_pretrained(str(p.parent if kw else p), dtype=getattr(torch, dtype), **kw).eval()

    return load(model), load(draft)


@torch.inference_mode()
def hf_assisted_cell(hf_target, hf_draft, tokenizer, prompts: list[str], max_tokens: int, num_assistant_tokens,
                     seed: int = 0) -> dict:
    """HF transformers generate() at batch size 1, greedy, one prompt: plain (hf_draft None) or assisted with
    `num_assistant_tokens` draft tokens ('heuristic' = transformers' default adaptive schedule)."""
    ids = torch.tensor([tokenizer.encode(prompts[seed % len(prompts)])])
    kw = {}
    if hf_draft is not None:
        cfg = hf_draft.generation_config
        if num_assistant_tokens == "heuristic":
            cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = 20, "heuristic"
        else:
            cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = int(num_assistant_tokens), "constant"
        kw["assistant_model"] = hf_draft
    t0 = time.perf_counter()
    out = hf_target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, pad_token_id=tokenizer.eos_token_ids[0] if
                             tokenizer.eos_token_ids else 0, **kw)
    seconds = time.perf_counter() - t0
    tokens = out.shape[1] - ids.shape[1]
    # generate() reports no per-step statistics: only the timing metrics are known
    return {**dict.fromkeys(METRICS, float("nan")), "tokens": tokens, "steps": float("nan"), "decode_seconds": seconds,
            "tokens_per_s": tokens / seconds, "e2e_tokens_per_s": tokens / seconds, "latency_p50_s": seconds,
            "latency_p99_s": seconds, "trace": None}


def _config(method: str, args, batch_size: int) -> EchoConfig:
    return EchoConfig(policy=method, k_max=max(args.k_max, batch_size), max_depth=args.max_depth,
                      max_nodes_per_request=args.max_nodes_per_request, total_tokens=args.total_tokens,
                      top_k=args.top_k, beam_width=args.beam_width, num_draft_tokens=args.num_draft_tokens)


def bench(target, draft, tokenizer, methods: list[str], batch_sizes: list[int], temperatures: list[float],
          prompts: list[str], args, calibration=None, progress=None, hf=None) -> tuple[list[dict], dict]:
    """All cells; returns (result rows, traces keyed 'method/B'). hf: (target, draft) transformers models for
    the assisted-generation baseline at batch size 1, temperature 0."""
    rows, traces = [], {}
    order = ["ar"] + [m for m in methods if m != "ar"]  # AR runs first in every round: the ratios' base
    for b in batch_sizes:
        for temp in temperatures:
            samples: dict[str, list[dict]] = {m: [] for m in order}
            executors = {}
            for m in order:
                cfg, cost, gates = _config(m, args, b), None, None
                if calibration is not None and m.startswith("echo"):
                    cfg, cost, gates = calibration.apply(cfg), calibration.cost_model, calibration.gate_for
                room = b * make_policy(cfg).max_tree_nodes  # a step of full trees for every request
                executors[m] = Executor(target, draft if m != "ar" else None, tokenizer, cfg, max_batch_size=b,
                                        max_seq_len=args.max_seq_len, max_num_tokens=max(2048, room),
                                        cost_model=cost, gate_provider=gates)
            hf_methods = [f"hf-assisted-{n}" for n in args.hf_assisted] if hf is not None and b == 1 and temp == 0 else []
            if hf_methods:
                samples.update({m: [] for m in ["hf-ar", *hf_methods]})
            for rnd in range(args.warmup_rounds + args.rounds):
                for m in order:
                    cell = run_cell(executors[m], prompts, b, args.max_tokens, temp, seed=rnd * b)
                    if rnd >= args.warmup_rounds:
                        samples[m].append(cell)
                    if progress is not None:
                        progress(m, b, temp, cell)
                for m in (["hf-ar", *hf_methods] if hf_methods else []):
                    n = m.rsplit("-", 1)[1]
                    cell = hf_assisted_cell(hf[0], hf[1] if m != "hf-ar" else None, tokenizer, prompts,
                                            args.max_tokens, n, seed=rnd * b)
                    if rnd >= args.warmup_rounds:
                        samples[m].append(cell)
                    if progress is not None:
                        progress(m, b, temp, cell)
            order_out = order + (["hf-ar", *hf_methods] if hf_methods else [])
            ar = statistics.median(s["tokens_per_s"] for s in samples["ar"])
            for m in order_out:
                if m not in methods and not m.startswith("hf-"):
                    continue
                cells = samples[m]
                row = {"method": m, "batch_size": b, "temperature": temp, "rounds": len(cells)}
                for key in METRICS:
                    vals = [c[key] for c in cells if c[key] == c[key]]  # drop NaN
                    row[key] = statistics.median(vals) if vals else None
                row["speedup_vs_ar"] = row["tokens_per_s"] / ar
                rows.append(row)
                if temp == 0 and cells[-1]["trace"] is not None:
                    traces[f"{m}/{b}"] = cells[-1]["trace"]
    return rows, traces


def markdown_table(rows: list[dict]) -> str:
    head = ("| method | B | T | tokens/s | ×AR | MAT | verified/step | accept | p50 s | p99 s | control | draft "
            "| spec steps | MAT/oracle |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def f(v, fmt):
        return "–" if v is None else format(v, fmt)

    for r in rows:
        lines.append(
            f"| {r['method']} | {r['batch_size']} | {r['temperature']:g} | {f(r['tokens_per_s'], '.1f')} | "
            f"{f(r['speedup_vs_ar'], '.2f')} | {f(r['mat'], '.2f')} | {f(r['verified_per_step'], '.1f')} | "
            f"{f(r['acceptance_rate'], '.2f')} | {f(r['latency_p50_s'], '.2f')} | {f(r['latency_p99_s'], '.2f')} | "
            f"{f(r['control_share'], '.1%')} | {f(r['draft_share'], '.1%')} | {f(r['speculated_share'], '.0%')} | "
            f"{f(r['mat_vs_oracle'], '.2f')} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], prefix: str, title: str = "") -> list[str]:
    """throughput vs batch size per method, and speedup over AR; one figure pair per temperature."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib (or pip install -e .[bench])") from None
    files = []
    for temp in sorted({r["temperature"] for r in rows}):
        sub = [r for r in rows if r["temperature"] == temp]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for m in dict.fromkeys(r["method"] for r in sub):
            pts = sorted((r["batch_size"], r["tokens_per_s"], r["speedup_vs_ar"]) for r in sub if r["method"] == m)
            xs = [p[0] for p in pts]
            axes[0].plot(xs, [p[1] for p in pts], marker="o", label=m)
            axes[1].plot(xs, [p[2] for p in pts], marker="o", label=m)
        for ax, ylabel in zip(axes, ("output tokens/s", "speedup over AR")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[1].axhline(1.0, color="black", lw=0.8)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{title} (temperature {temp:g})".strip())
        fig.tight_layout()
        name = f"{prefix}-t{temp:g}.png"
        fig.savefig(name, dpi=110)
        plt.close(fig)
        files.append(name)
    return files


def command_line(argv: list[str] | None) -> str:
    """The command as run, with paths cut to their file names (recorded results carry no machine paths)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return "echo-trtllm bench " + " ".join(os.path.basename(a) if os.sep in a else a for a in args)


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise ValueError(f"--{name} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--{name} must list integers >= 1, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    from .prompts import PROMPT_SETS

    ap = argparse.ArgumentParser(prog="echo-trtllm bench", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="target (default: the embedded tiny target)")
    ap.add_argument("--draft-model", help="draft (default: the embedded tiny draft)")
    ap.add_argument("--methods", default="ar,chain,static,eagle2,ddd,echo,echo-dense,echo-fixed")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--temperatures", default="0", help="comma-separated; 0 = greedy (e.g. 0,0.8)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-set", default="mixed", choices=list(PROMPT_SETS))
    ap.add_argument("--rounds", type=int, default=1, help="timed rounds (medians reported)")
    ap.add_argument("--warmup-rounds", type=int, default=1, help="untimed rounds first (same executors)")
    ap.add_argument("--k-max", type=int, default=512, help="upper bound of the echo family's per-step budget")
    ap.add_argument("--max-depth", type=int, default=6)
    ap.add_argument("--max-nodes-per-request", type=int, default=32)
    ap.add_argument("--total-tokens", type=int, default=16, help="eagle2/ddd nodes per request, root included")
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--num-draft-tokens", type=int, default=4, help="chain length")
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--calibration", help="calibration JSON from echo-trtllm calibrate")
    ap.add_argument("--no-calibrate", action="store_true",
                    help="without --calibration: run the echo family uncalibrated (default gate, fixed K_max)")
    ap.add_argument("--hf-assisted", type=lambda t: [x for x in t.split(",") if x], default=[],
                    help="at B=1, T=0 also run HF transformers generate(): plain and assisted by the same draft with "
                         "these num_assistant_tokens, e.g. heuristic,4,8")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write results (and the machine, the command) here")
    ap.add_argument("--trace", help="write per-step acceptance traces here (input of echo_trtllm.bench.simulate)")
    ap.add_argument("--markdown", help="write the markdown table here (it is printed either way)")
    ap.add_argument("--plot", help="write PNG plots PREFIX-t<temperature>.png")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from tqdm import tqdm

    from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET
    from echo_trtllm.models.loader import load_model
    from echo_trtllm.runtime.calibrate import Calibration, calibrate

    from .prompts import load_prompts

    def error(msg: str) -> int:
        print(f"echo-trtllm bench: error: {msg}", file=sys.stderr)
        return 2

    try:
        methods = [m for m in args.methods.split(",") if m]
        bad = [m for m in methods if m not in POLICY_NAMES]
        if bad or not methods:
            raise ValueError(f"--methods: unknown {bad or 'empty'}; choose from {', '.join(POLICY_NAMES)}")
        batch_sizes = _int_list(args.batch_sizes, "batch-sizes")
        try:
            temperatures = [float(t) for t in args.temperatures.split(",") if t]
        except ValueError:
            raise ValueError(f"--temperatures must be comma-separated numbers, got {args.temperatures!r}") from None
        bad_n = [n for n in args.hf_assisted if n != "heuristic" and not (n.isdigit() and int(n) >= 1)]
        if bad_n:
            raise ValueError(f"--hf-assisted takes 'heuristic' or integers >= 1, got {bad_n}")
        if not temperatures or any(t < 0 for t in temperatures):
            raise ValueError(f"--temperatures must list numbers >= 0, got {args.temperatures!r}")
        if args.warmup_rounds < 0:
            raise ValueError(f"--warmup-rounds must be >= 0, got {args.warmup_rounds}")
        for name in ("max_tokens", "rounds"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        for m in methods:
            _config(m, args, max(batch_sizes))  # validate the tree parameters before loading anything
        prompts = load_prompts(args.prompt_set)
        calibration = Calibration.load(args.calibration) if args.calibration else None
    except (ValueError, FileNotFoundError) as e:
        return error(str(e))
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    target, tok = load_model(args.model or DEFAULT_TARGET, dtype=args.dtype)
    draft, _ = load_model(args.draft_model or DEFAULT_DRAFT, dtype=args.dtype, with_tokenizer=False)
    print(f"loaded target + draft in {time.perf_counter() - t0:.0f} s", flush=True)
    if calibration is None and not args.no_calibrate and any(m.startswith("echo") for m in methods):
        # the gate is re-derived per batch size (Calibration.gate_for); the warm-up needs only a few requests
        calibration = calibrate(target, draft, tok, EchoConfig(max_depth=args.max_depth, top_k=args.top_k,
                                                               beam_width=args.beam_width), prompts[:8],
                                batch_size=8, max_tokens=min(args.max_tokens, 32))
        print(f"calibrated in-process: {calibration.warmup['samples']} gate samples; gate at B=1: depths "
              f"{calibration.gate_for(1).gate_depths}, at B={max(batch_sizes)}: "
              f"{calibration.gate_for(max(batch_sizes)).gate_depths}", flush=True)
    hf = None
    if args.hf_assisted and 1 in batch_sizes and 0.0 in temperatures:
        hf = load_hf_pair(args.model or str(DEFAULT_TARGET), args.draft_model or str(DEFAULT_DRAFT), args.dtype)
    cells = len(batch_sizes) * len(temperatures) * (args.warmup_rounds + args.rounds) * len(set(methods) | {"ar"})
    cells += (args.warmup_rounds + args.rounds) * (len(args.hf_assisted) + 1) * (hf is not None)
    with tqdm(total=cells, desc="bench", unit="cell", file=sys.stderr) as bar:
        def progress(m, b, temp, cell):
            bar.set_postfix_str(f"{m} B={b} T={temp:g} {cell['tokens_per_s']:.1f} tok/s MAT {cell['mat']:.2f}")
            bar.update()

        rows, traces = bench(target, draft, tok, methods, batch_sizes, temperatures, prompts, args, calibration,
                             progress, hf)
    table = markdown_table(rows)
    print(table)
    meta = {"machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                        "threads": torch.get_num_threads(), "torch": torch.__version__},
            "date": time.strftime("%Y-%m-%d"), "command": command_line(argv),
            "calibration": json.loads(calibration.to_json()) if calibration else None}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": rows, **meta}, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump({"traces": traces, **meta}, f)
    if args.plot:
        for name in plot(rows, args.plot, os.path.basename(args.model or "default pair")):
            print(name)
    return 0
