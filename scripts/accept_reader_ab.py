"""Greedy acceptance inside the engine with the host library's logits reader (a row's top-1 read only where the
accepted paths need it) against every verified row's argmax then the tree walk, on the same executor: its steps
alternate the two (the reader's arm, then the argmax's, then the reader's ...), so both arms see the same requests,
the same prices and the same trees. Per method and batch size: the acceptance phase's median milliseconds a step
(`StepTimings.accept`: acceptance and the accepted paths' read) and the rows verified, for each arm.

    python scripts/accept_reader_ab.py --model <target> [--head <its EAGLE-3 head>] [--dtype bfloat16]
        [--batch-sizes 1,16,64] [--methods ar,echo] [--steps 40] [--json out.json]

ECHO runs pure (every step drafts); `ar` steps verify their roots only. The runtime's own rule (which steps take the
reader: `executor.READER_PLAIN_ROWS`) is bypassed here: each arm is forced on every step it runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(target, head, tok, method: str, batch_size: int, steps: int, prompts: list[str]) -> dict:
    import echo_trtllm.runtime.executor as executor_mod
    from echo_trtllm.bench.run import make_engine
    from echo_trtllm.core import EchoConfig
    from echo_trtllm.runtime.request import SamplingParams

    llm = make_engine(target, head if method != "ar" else None, tok, EchoConfig(policy=method), batch_size, 1024,
                      fallback="off")
    llm.shutdown()
    ex = llm.executor
    reader = ex._logits_reader
    if reader is None:
        raise SystemExit("the host library's logits reader is not built (scripts/setup.sh builds it)")
    params = SamplingParams(max_tokens=8 * steps + 64, temperature=0, ignore_eos=True)
    for i in range(batch_size):
        ex.submit(ex.make_request(prompts[i % len(prompts)], params))
    saved_rows = executor_mod.READER_PLAIN_ROWS
    executor_mod.READER_PLAIN_ROWS = 1 << 30  # the rule bypassed: the reader's arm takes every step it runs
    arms = {"reader": {"accept_ms": [], "verified": []}, "argmax": {"accept_ms": [], "verified": []}}
    try:
        for i in range(steps + 4):
            arm = "reader" if i % 2 == 0 else "argmax"
            ex._logits_reader = reader if arm == "reader" else None
            r = ex.step()
            if i >= 4 and r.result is not None:
                arms[arm]["accept_ms"].append(r.timings.accept * 1e3)
                arms[arm]["verified"].append(r.verified_tokens)
    finally:
        executor_mod.READER_PLAIN_ROWS = saved_rows
    return {"method": method, "batch_size": batch_size,
            **{f"{arm}_{k}": (round(statistics.median(v), 3) if k == "accept_ms" else round(statistics.mean(v), 1))
               for arm, d in arms.items() for k, v in d.items() if v},
            "steps_per_arm": min(len(d["accept_ms"]) for d in arms.values())}


def main(argv=None) -> int:
    import torch

    from echo_trtllm.bench.prompts import load_prompts
    from echo_trtllm.bench.run import write_report
    from echo_trtllm.models import DEFAULT_EAGLE3, DEFAULT_TARGET
    from echo_trtllm.models.eagle3 import load_eagle3
    from echo_trtllm.models.loader import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_TARGET))
    ap.add_argument("--head", default=str(DEFAULT_EAGLE3))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--methods", default="ar,echo")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error(f"--steps must be >= 2 (one a step per arm), got {args.steps}")
    target, tok = load_model(args.model, dtype=args.dtype)
    head = load_eagle3(args.head, target) if "echo" in args.methods else None
    prompts = load_prompts("humaneval")
    rows = []
    for method in args.methods.split(","):
        for b in (int(x) for x in args.batch_sizes.split(",")):
            row = run(target, head, tok, method, b, args.steps, prompts)
            rows.append(row)
            print(json.dumps(row))
    if args.json:
        write_report(args.json, "accept_reader_ab", argv, rows=rows, threads=torch.get_num_threads())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
