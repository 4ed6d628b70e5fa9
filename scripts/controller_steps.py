"""ECHO as shipped (the speculation controller deciding each step) on one closed batch, read step by step: every
step's rows, whether it speculated, its wall time, tokens verified and emitted, and the controller's decision
(reason, estimated ratio of speculative to plain tokens a second and its bounds, credit). Then tokens a second over
the whole run, without the first step (it prefills the prompts), over the full-batch speculative and plain steps,
and over the drain (steps after the first request finished).

    python scripts/controller_steps.py --model <target> --head <its EAGLE-3 head> [--batch-size 16]
        [--max-tokens 128] [--dtype bfloat16] [--json out.json]

HumanEval prompts, greedy, ignore_eos: AR's closed batch ends all its requests at one step, ECHO's requests end at
different steps (each emits as many tokens a step as its drafts were accepted), so the drain is reported apart
(`bench`'s "x AR full batch" column is the full-batch part).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo_trtllm.bench.prompts import load_prompts  # noqa: E402
from echo_trtllm.bench.run import make_engine, write_report  # noqa: E402
from echo_trtllm.core import EchoConfig  # noqa: E402
from echo_trtllm.models.eagle3 import load_eagle3  # noqa: E402
from echo_trtllm.models.loader import load_model  # noqa: E402
from echo_trtllm.runtime.request import SamplingParams  # noqa: E402


def _round(x, n=3):
    return None if x is None else round(float(x), n)


def run_steps(executor, prompts: list[str], batch_size: int, max_tokens: int) -> list[dict]:
    """Step the batch to its end; one row per step."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i in range(batch_size):
        executor.submit(executor.make_request(prompts[i % len(prompts)], params))
    rows = []
    while executor.has_work:
        t = time.perf_counter()
        r = executor.step()
        ms = (time.perf_counter() - t) * 1e3
        d = r.decision
        rows.append({"rows": r.batch_size, "speculated": r.speculated, "ms": round(ms, 2),
                     "verified": r.verified_tokens, "emitted": r.emitted_tokens,
                     "reason": getattr(d, "reason", None), "ratio": _round(getattr(d, "ratio", None)),
                     "low": _round(getattr(d, "low", None)), "high": _round(getattr(d, "high", None)),
                     "credit": _round(executor.controller.credit if executor.controller else None, 2)})
    return rows


def summary(rows: list[dict], batch_size: int) -> dict:
    def rate(group):
        ms = sum(r["ms"] for r in group)
        return {"steps": len(group), "tokens": sum(r["emitted"] for r in group),
                "tokens_per_s": round(sum(r["emitted"] for r in group) / ms * 1e3, 2) if ms else None,
                "ms_per_step": round(ms / len(group), 2) if group else None}

    decode = rows[1:]
    full = [r for r in decode if r["rows"] == batch_size]
    return {"all": rate(rows), "without_first_step": rate(decode),
            "full_batch_speculative": rate([r for r in full if r["speculated"]]),
            "full_batch_plain": rate([r for r in full if not r["speculated"]]),
            "drain": rate([r for r in decode if r["rows"] < batch_size])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="target (HF directory or .gguf)")
    ap.add_argument("--head", required=True, help="its EAGLE-3 head directory")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.batch_size < 1 or args.max_tokens < 1:
        ap.error("--batch-size and --max-tokens must be >= 1")
    target, tok = load_model(args.model, dtype=args.dtype)
    head = load_eagle3(args.head, target)
    llm = make_engine(target, head, tok, EchoConfig(policy="echo"), args.batch_size, 1024, fallback="auto")
    llm.shutdown()  # the executor is stepped here directly
    with torch.no_grad():  # not inference mode: a bfloat16 model's prepacked weights track their tensors' versions
        rows = run_steps(llm.executor, load_prompts("humaneval"), args.batch_size, args.max_tokens)
    totals = summary(rows, args.batch_size)
    for k, v in totals.items():
        print(f"{k:24s} {v}")
    if args.json:
        write_report(args.json, "controller_steps", argv, summary=totals, steps=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
