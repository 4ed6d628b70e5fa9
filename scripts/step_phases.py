"""Served steps per phase: AR against ECHO under sustained load, in one process, rounds interleaved.

    .venv/bin/python scripts/step_phases.py --model TARGET --draft-model DRAFT [--batch-size 16] [--steps 90]
        [--rounds 2] [--dtype bfloat16] [--prompt-set humaneval] [--json out.json]

One `LLM` per method (AR shares ECHO's loaded target), each stepped directly: B * 40 requests of 64 greedy tokens
are queued so the batch stays full (a request that finishes is replaced at once, its prompt prefilled inside the
next step, as in serving). Per round and method, over the full-batch steps after the first 10, the means of the
step's wall time (admission and prefill included), its decode total, verification, the draft's forwards and the
host control, split into plain and speculative steps, and tokens/s. Wall-clock figures on a shared machine: the
rounds are interleaved so both methods see the same drift.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _means(rows) -> dict:
    def m(xs):
        return round(statistics.mean(xs) * 1e3, 2) if xs else None

    return {"steps": len(rows), "wall_ms": m([w for _, w in rows]), "total_ms": m([r.timings.total for r, _ in rows]),
            "verify_ms": m([r.timings.verify for r, _ in rows]),
            "draft_model_ms": m([r.timings.draft_model for r, _ in rows]),
            "control_ms": m([r.timings.control for r, _ in rows]),
            "emitted_per_step": round(statistics.mean(r.emitted_tokens for r, _ in rows), 2) if rows else None}


def run(ex, prompts, batch_size: int, steps: int) -> dict:
    from echo_trtllm.runtime.request import SamplingParams

    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    mine = [ex.make_request(prompts[i % len(prompts)], params) for i in range(batch_size * 40)]
    for q in mine:
        ex.submit(q)
    rows = []
    while ex.has_work and len(rows) < steps:
        t0 = time.perf_counter()
        r = ex.step()
        rows.append((r, time.perf_counter() - t0))
    for q in mine:
        ex.abort(q, "abort")
    full = [(r, w) for r, w in rows if r.batch_size == batch_size][10:]
    wall = sum(w for _, w in full)
    return {"plain": _means([x for x in full if not x[0].speculated]),
            "speculative": _means([x for x in full if x[0].speculated]),
            "tokens_per_s": round(sum(r.emitted_tokens for r, _ in full) / wall, 3) if wall else None}


def main(argv=None) -> int:
    from echo_trtllm.api import LLM
    from echo_trtllm.bench.prompts import load_prompts
    from echo_trtllm.bench.run import report_meta
    from echo_trtllm.core import EchoConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model", required=True)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=90)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-set", default="humaneval")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.batch_size < 1 or args.steps <= 10 or args.rounds < 1:
        ap.error("--batch-size must be >= 1, --steps > 10 (the first 10 full steps are left out), --rounds >= 1")
    prompts = (load_prompts(args.prompt_set, "eval") if args.prompt_set == "humaneval"
               else load_prompts(args.prompt_set))
    echo = LLM(args.model, args.draft_model, max_batch_size=args.batch_size, max_seq_len=512, dtype=args.dtype)
    ar = LLM(echo.executor.target, None, tokenizer=echo.tokenizer, max_batch_size=args.batch_size, max_seq_len=512,
             dtype=args.dtype, speculative_config=EchoConfig(policy="ar"))
    echo.shutdown()  # stepped directly below: the engine loops stay idle
    ar.shutdown()
    rounds = []
    for k in range(args.rounds):
        order = (("ar", ar), ("echo", echo)) if k % 2 == 0 else (("echo", echo), ("ar", ar))
        row = {name: run(llm.executor, prompts, args.batch_size, args.steps) for name, llm in order}
        rounds.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            meta = report_meta("scripts.step_phases", argv, runner=".venv/bin/python scripts/step_phases.py")
            json.dump({"batch_size": args.batch_size, "rounds": rounds, **meta}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
