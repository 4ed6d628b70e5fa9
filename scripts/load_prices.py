"""The step prices an engine starts from, build after build: ECHO on a target with its draft (the engine's
defaults: the cost curve measured at load, its warm-up's steps teaching the speculative step's constants) built
`--builds` times on the same models, and after each build the prices its policy reads before serving a step: the
verification knots, the attention (context) coefficient, the per-request term, and what they price at
`--batch-size` rows and `--context` cached tokens: the plain step and one more verified token. A marginal token priced far from the measured one decides whether the
budget rule ever verifies a drafted token at that batch size, and steps that verify only their roots (as many
tokens as requests) cannot correct it: their token count never differs from their request count.

    python scripts/load_prices.py --model <target> --head <its EAGLE-3 head> [--dtype bfloat16] [--builds 3]
        [--batch-size 16] [--context 150] [--no-warm-up | --warm-up-learns-all] [--json OUT]

--no-warm-up builds the engines without their warm-up steps (the executor's `warm_up` replaced by a no-op in this
process, for the measurement only): the prices are then the curve measured at load alone. --warm-up-learns-all
lets the warm-up's steps move every coefficient (the forward curves and the per-request term too), as the engine
did before its warm-up learnt the constants only: the same run's before and after.
"""

from __future__ import annotations

import argparse
import json

import torch

from echo_trtllm.bench.run import make_engine
from echo_trtllm.core.config import EchoConfig
from echo_trtllm.core.cost import marginal_token_time
from echo_trtllm.core.prices import StepCostModel
from echo_trtllm.models.eagle3 import load_eagle3
from echo_trtllm.models.loader import load_model
from echo_trtllm.runtime.executor import Executor


def read_prices(prices, batch_size: int, context: float) -> dict:
    """What a `StepPrices` prices now (milliseconds)."""
    t = prices._tables()
    plain = float(prices.verify_time(batch_size, context, batch_size))
    return {"verify_knots_ms": [round(x * 1e3, 2) for x in t["verify"]],
            "attention_ms": round(t["verify_att"] * 1e3, 3), "per_request_ms": round(t["per_request"] * 1e3, 3),
            # the speculative step's constants the warm-up teaches: drafting's host work, the draft's commit + tree
            "speculative_host_ms": round((t["step"] + t["speculative"]) * 1e3, 3),
            "drafted_tree_ms": round((t["drafted"] + t["tree"]) * 1e3, 3),
            "plain_step_ms": round(plain * 1e3, 2),
            "one_more_token_ms": round(marginal_token_time(prices, batch_size, context) * 1e3, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--builds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--context", type=float, default=150.0)
    ap.add_argument("--threads", type=int, default=2)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--no-warm-up", action="store_true", help="build without the warm-up steps (module docstring)")
    mode.add_argument("--warm-up-learns-all", action="store_true",
                      help="the warm-up's steps move every coefficient (module docstring)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.builds < 1 or args.batch_size < 1 or args.threads < 1 or args.context < 0:
        ap.error("--builds, --batch-size and --threads must be at least 1 and --context at least 0")
    torch.set_num_threads(args.threads)
    target, tok = load_model(args.model, dtype=args.dtype)
    head = load_eagle3(args.head, target)
    builds = []
    real_warm_up, real_observe = Executor.warm_up, StepCostModel.observe
    if args.no_warm_up:
        Executor.warm_up = lambda self, *a, **k: 0
    if args.warm_up_learns_all:
        StepCostModel.observe = lambda self, sample, forwards=True: real_observe(self, sample)
    try:
        with torch.no_grad():
            for _ in range(args.builds):
                llm = make_engine(target, head, tok, EchoConfig(policy="echo"), args.batch_size, 1024)
                llm.shutdown()
                builds.append(read_prices(llm.executor.policy.cost_model, args.batch_size, args.context))
                del llm
    finally:
        Executor.warm_up, StepCostModel.observe = real_warm_up, real_observe
    out = {"batch_size": args.batch_size, "context": args.context, "dtype": args.dtype, "threads": args.threads,
           "warm_up": not args.no_warm_up,
           "warm_up_learns": None if args.no_warm_up else "all" if args.warm_up_learns_all else "constants",
           "builds": builds,
           "command": f"python scripts/load_prices.py --model <target> --head <head> --dtype {args.dtype} "
                      f"--builds {args.builds} --batch-size {args.batch_size} --context {args.context:g} "
                      f"--threads {args.threads}"
                      + (" --no-warm-up" if args.no_warm_up else "")
                      + (" --warm-up-learns-all" if args.warm_up_learns_all else "")}
    for i, b in enumerate(builds):
        print(f"build {i}: plain {b['plain_step_ms']} ms, one more token {b['one_more_token_ms']} ms, attention "
              f"{b['attention_ms']} ms, per request {b['per_request_ms']} ms, speculative host "
              f"{b['speculative_host_ms']} ms, draft commit + tree {b['drafted_tree_ms']} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
