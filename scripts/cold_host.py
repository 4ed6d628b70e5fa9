"""What a control-plane call costs inside a running engine against the same call in a tight loop: the acceptance
estimate ECHO reads at every drafted level (`OnlineAcceptance.estimate` of one confidence) and one small tensor add,
timed warm (500 calls back to back), right after a decode step of the target (its weights have just streamed
through the caches) and after a step and 50 ms idle; medians (about one step in four refits the estimates, and the
first estimate after it pays the refit). Qwen2.5-Coder-1.5B + its EAGLE-3 head, bfloat16, one request.

    python scripts/cold_host.py --model <target dir> --head <head dir> [--steps 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from echo_trtllm.bench.prompts import load_prompts
from echo_trtllm.bench.run import machine_info, make_engine
from echo_trtllm.core import EchoConfig
from echo_trtllm.models.eagle3 import load_eagle3
from echo_trtllm.models.loader import load_model
from echo_trtllm.runtime.request import SamplingParams


def _us(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e6, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    target, tok = load_model(args.model, dtype=torch.bfloat16)
    head = load_eagle3(args.head, target)
    llm = make_engine(target, head, tok, EchoConfig(policy="echo"), 1, 1024, fallback="off")
    llm.shutdown()
    ex = llm.executor
    ex.submit(ex.make_request(load_prompts("humaneval")[0],
                              SamplingParams(max_tokens=16 * (args.steps + 8), temperature=0, ignore_eos=True)))
    for _ in range(6):
        ex.step()
    acc, x = ex.policy.acceptance, torch.tensor([0.5])
    calls = {"estimate": lambda: acc.estimate(x, 2), "tensor add": lambda: x + 1}

    def once(f) -> float:
        t0 = time.perf_counter()
        f()
        return time.perf_counter() - t0

    out = {name: {"warm_us": _us([once(f) for _ in range(500)])} for name, f in calls.items()}
    after_step = {name: [] for name in calls}
    after_idle = {name: [] for name in calls}
    for _ in range(args.steps):
        ex.step()
        for name, f in calls.items():
            after_step[name].append(once(f))
        time.sleep(0.05)
        for name, f in calls.items():
            after_idle[name].append(once(f))
    for name in calls:
        out[name]["after_a_step_us"] = _us(after_step[name])
        out[name]["after_a_step_and_50_ms_idle_us"] = _us(after_idle[name])
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"calls": out, "steps": args.steps, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"), "machine": machine_info(), "date": time.strftime("%Y-%m-%d"),
                       "command": f"python scripts/cold_host.py --model {os.path.basename(args.model.rstrip('/'))} "
                                  f"--head {os.path.basename(args.head.rstrip('/'))} --steps {args.steps}"}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
