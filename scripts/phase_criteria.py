"""Issue 34's second target read off a `bench --profile-phases` JSON: per batch size, a speculative step's time
outside the target's verification forward against 1.5 x AR's time outside its forward plus the head's forwards
(the measured draft forwards per step x ms each: every head forward the step ran, its KV catch-up included, is
allowed), and the head's share of the step.

    python scripts/phase_criteria.py PHASES_JSON [--method "echo pure"]

With several profile rounds (`bench --profile-phases --rounds N`) the criterion is also read per round, each
round's AR beside the same round's speculative steps, and the table gives the spread and how many rounds were
within the bound.

"Outside the forward" is the step's total less the target's forward (control, the draft's forwards, the tree's
inputs, acceptance, finishing, commit, the rest of the step call).
"""

from __future__ import annotations

import argparse
import json


def _one(a: dict, s: dict) -> dict:
    """The criterion for one AR summary and one speculative summary (one round, or a single-pass profile)."""
    ar_outside = a["total_ms"] - a["phases_ms"]["forward"]
    outside = s["total_ms"] - s["phases_ms"]["forward"]
    head = s.get("draft_forwards_per_step", 0.0) * s.get("draft_ms_per_forward", 0.0)
    bound = 1.5 * ar_outside + head
    return {"ar_step_ms": a["total_ms"], "ar_outside_ms": round(ar_outside, 2), "step_ms": s["total_ms"],
            "outside_ms": round(outside, 2), "head_ms": round(head, 2), "bound_ms": round(bound, 2),
            "within_bound": outside <= bound, "head_share": round(s["phases_ms"]["draft_model"] / s["total_ms"], 4),
            "emitted_per_step": s["emitted_per_step"], "verified_per_step": s["verified_per_step"],
            "tokens_per_s": s["tokens_per_s"], "ar_tokens_per_s": a["tokens_per_s"]}


def criteria(phases: list[dict], method: str) -> list[dict]:
    """Per batch size: the criterion from the medians, and with several profile rounds the criterion of each round
    (AR's round i beside the method's round i: the rounds alternate the two) under "rounds", with how many were
    within the bound."""
    ar = {r["batch_size"]: r["plain"] for r in phases if r["method"] == "ar" and r["plain"]["steps"]}
    out = []
    for r in phases:
        s = r["speculative"]
        if r["method"] != method or not s["steps"] or r["batch_size"] not in ar:
            continue
        a = ar[r["batch_size"]]
        row = {"batch_size": r["batch_size"], **_one(a, s)}
        if "rounds" in s and "rounds" in a:
            if len(a["rounds"]) != len(s["rounds"]):
                raise ValueError(f"B = {r['batch_size']}: AR has {len(a['rounds'])} profile rounds, {method!r} "
                                 f"{len(s['rounds'])}: the rounds are read in pairs")
            row["rounds"] = [_one(x, y) for x, y in zip(a["rounds"], s["rounds"]) if x["steps"] and y["steps"]]
            row["rounds_within"] = sum(c["within_bound"] for c in row["rounds"])
        out.append(row)
    return out


def _span(c: dict, key: str) -> str:
    values = [x[key] for x in c.get("rounds", [])]
    return f" ({min(values):.1f}-{max(values):.1f})" if len(values) > 1 else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("phases_json")
    ap.add_argument("--method", default="echo pure", help="the speculative method's label in the JSON")
    args = ap.parse_args(argv)
    with open(args.phases_json) as f:
        phases = json.load(f)["phases"]
    rows = criteria(phases, args.method)
    if not rows:
        methods = sorted({r["method"] for r in phases if r["speculative"]["steps"]})
        ap.error(f"--method {args.method!r}: no speculative steps of that method beside AR in {args.phases_json}; "
                 f"methods there: {methods}")
    print("| B | AR step | AR outside | step | outside | head forwards | bound | within | head share | tok/s (AR) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|---:|---|")
    for c in rows:
        within = "yes" if c["within_bound"] else "no"
        if "rounds" in c:
            within += f" ({c['rounds_within']} of {len(c['rounds'])} rounds)"
        print(f"| {c['batch_size']} | {c['ar_step_ms']:.1f} | {c['ar_outside_ms']:.1f}{_span(c, 'ar_outside_ms')} | "
              f"{c['step_ms']:.1f} | {c['outside_ms']:.1f}{_span(c, 'outside_ms')} | {c['head_ms']:.1f} | "
              f"{c['bound_ms']:.1f}{_span(c, 'bound_ms')} | {within} | {c['head_share']:.1%} | "
              f"{c['tokens_per_s']:.1f} ({c['ar_tokens_per_s']:.1f}) |")
    if any("rounds" in c for c in rows):
        print("\nmedians over the profile rounds; (min-max) over rounds, each round's AR beside its own ECHO")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
