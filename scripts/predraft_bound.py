"""Whether a check before drafting could turn the speculative steps that verify their roots only into plain steps
without changing what they verify: ECHO (the engine's defaults: learnt prices, the AR fallback) on a target with its
EAGLE-3 head at one batch size, and after every step what such a check would read at the prices learnt so far.

The budget rule (`core.cost.choose_budget`) takes n drafted tokens where (B + their estimates) / (drafting spent +
control + t_verify(B + n)) beats B / (drafting spent + t_verify(B)). Before drafting, no estimate is known; the most
any drafted token can be worth is the fit's largest estimate (`best_estimate`: every table row read at path
probability 1), and drafting spent only makes verifying more attractive (it is sunk by then). So a step could skip
drafting, with the same tree verified, only where even `best_estimate` for every token at the largest drafting
spend (`max_depth` levels of B x beam width) leaves rate(n) <= rate(0) for every n up to what full trees hold. The
script prints, per step, that best-case ratio max_n rate(n) / rate(0) at one level's spend and at the largest (a
ratio above 1: the check cannot skip), the ratio at one drafted token and at B of them beside it, with the prices it
read.

    python scripts/predraft_bound.py --model <target> --head <its EAGLE-3 head> [--dtype bfloat16]
        [--batch-size 16] [--steps 40] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from echo_trtllm.api import SamplingParams
from echo_trtllm.bench.prompts import load_prompts
from echo_trtllm.bench.run import make_engine
from echo_trtllm.core.config import EchoConfig
from echo_trtllm.core.cost import budget_seconds, marginal_token_time
from echo_trtllm.models.eagle3 import load_eagle3
from echo_trtllm.models.loader import load_model


def best_case_ratios(cost, b: int, n: int, spent: float, estimate: float, context: float) -> tuple[float, ...]:
    """The budget rule's rate with every drafted token at `estimate`, over its rate at none: at 1 token, at b
    tokens (one a request) and the largest over 1..n (n < 1: nothing can be drafted, all 1.0)."""
    if n < 1:
        return 1.0, 1.0, 1.0
    seconds = budget_seconds(n, b, cost, spent, context)
    rate = (b + estimate * torch.arange(n + 1, dtype=torch.float64)) / seconds
    ratio = rate / rate[0]
    return float(ratio[1]), float(ratio[min(b, n)]), float(ratio[1:].max())


def read_step(executor, report) -> dict | None:
    """What the check would read after this step (None before the engine prices drafting)."""
    policy = executor.policy
    cost = policy.cost_model
    if cost is None or not cost.draft_tokens:
        return None
    acc = policy.acceptance
    one = torch.ones(1)
    depth1 = float(acc.estimate(one, 1, True))
    best = max(float(acc.estimate(one, d, g)) for g in (True, False) for d in range(1, acc.max_depth + 1))
    b, ctx = report.batch_size, report.context
    width = b * policy.expand_width
    one_level = cost.drafting_time([width], ctx)
    largest = cost.drafting_time([width] * policy.max_depth, ctx)
    # the most drafted tokens a step can verify: the budget beyond the roots, and no more than full trees hold
    n = min(executor._budget() - b, b * (policy.max_tree_nodes - 1))
    v0 = float(cost.verify_time(b, ctx, b))
    one = best_case_ratios(cost, b, n, one_level, best, ctx)
    most = best_case_ratios(cost, b, n, largest, best, ctx)
    return {"speculated": report.speculated, "verified": report.verified_tokens, "drafted": report.drafted_tokens,
            "decision": getattr(report.decision, "reason", None), "depth1_estimate_at_1": round(depth1, 4),
            "best_estimate": round(best, 4), "plain_ms": round(v0 * 1e3, 2),
            "token_ms": round(marginal_token_time(cost, b, ctx) * 1e3, 3),
            "control_ms": round(cost.control_seconds * 1e3, 2), "one_level_ms": round(one_level * 1e3, 2),
            "largest_drafting_ms": round(largest * 1e3, 2),
            "max_drafted": n, "ratio_one_level_1_token": round(one[0], 4),
            "ratio_one_level_b_tokens": round(one[1], 4), "ratio_one_level": round(one[2], 4),
            "ratio_largest": round(most[2], 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.batch_size < 1 or args.steps < 1:
        ap.error("--batch-size and --steps must be at least 1")
    torch.set_num_threads(args.threads)
    target, tok = load_model(args.model, dtype=args.dtype)
    head = load_eagle3(args.head, target)
    prompts = load_prompts("humaneval")
    steps = []
    with torch.no_grad():
        llm = make_engine(target, head, tok, EchoConfig(policy="echo"), args.batch_size, 1024)
        llm.shutdown()  # the executor is stepped here, one step at a time
        ex = llm.executor
        params = SamplingParams(max_tokens=args.steps * 8, temperature=0, ignore_eos=True)
        for i in range(args.batch_size):
            ex.submit(ex.make_request(prompts[i % len(prompts)], params))
        for _ in range(args.steps):
            row = read_step(ex, ex.step())
            if row is not None:
                steps.append(row)
    ratios = [s["ratio_one_level"] for s in steps]
    first = [s["ratio_one_level_1_token"] for s in steps]
    summary = {"steps_read": len(steps), "speculative_steps": sum(s["speculated"] for s in steps),
               "roots_only_speculative_steps": sum(s["speculated"] and s["verified"] == args.batch_size
                                                   for s in steps),
               "best_estimate_min": min((s["best_estimate"] for s in steps), default=None),
               "ratio_one_level": [min(ratios), statistics.median(ratios), max(ratios)] if ratios else None,
               "ratio_one_level_1_token": [min(first), statistics.median(first), max(first)] if first else None,
               "steps_a_check_could_skip": sum(s["ratio_largest"] <= 1.0 for s in steps)}
    out = {"batch_size": args.batch_size, "steps": args.steps, "dtype": args.dtype, "threads": args.threads,
           "summary": summary, "per_step": steps,
           "command": f"python scripts/predraft_bound.py --model <target> --head <head> --dtype {args.dtype} "
                      f"--batch-size {args.batch_size} --steps {args.steps}"}
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
