"""What ECHO did inside vLLM, from the per-step traces its proposer writes (ECHO_VLLM_TRACE; `scripts/bench_vllm.py
--trace-dir`): per batch size (live rows), the steps, the share that drafted, the tokens drafted, the controller's
decisions, the proposer's own seconds per call and vLLM's step between calls (median, plain and drafting apart), and
the drafting steps by their longest chain (measured seconds beside the controller's predictions).

    python scripts/echo_trace_summary.py TRACE.jsonl [...] --out summary.json
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def by_depth(steps: list[dict]) -> dict[int, list[dict]]:
    """Drafting steps grouped by their longest chain."""
    groups: dict[int, list[dict]] = collections.defaultdict(list)
    for s in steps:
        groups[max(s["lengths"])].append(s)
    return groups


def summarise(path: Path) -> dict:
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_rows: dict[int, list[dict]] = collections.defaultdict(list)
    for s in steps:
        # the custom-class proposer's traces count the rows it drafted for ("live"); the draft-runner's, every row
        by_rows[s["rows"] if "catch_up" in s else s["live"]].append(s)
    # a step's interval is recorded at the call after it: pair each call's decision with the next interval
    following = {id(a): b.get("step_seconds") for a, b in itertools.pairwise(steps)}
    out = {}
    for rows, group in sorted(by_rows.items()):
        drafting = [s for s in group if sum(s["lengths"]) > 0]
        plain = [s for s in group if sum(s["lengths"]) == 0]

        def median(xs):
            xs = [x for x in xs if x is not None]
            return statistics.median(xs) if xs else None

        out[str(rows)] = {
            "steps": len(group), "drafting_steps": len(drafting),
            "drafted_tokens": sum(sum(s["lengths"]) for s in group),
            "decisions": dict(collections.Counter(s.get("decision") for s in group)),
            "propose_ms_median": median([s.get("propose_seconds") and 1e3 * s["propose_seconds"] for s in group]),
            "propose_ms_median_drafting": median([1e3 * s["propose_seconds"] for s in drafting
                                                  if s.get("propose_seconds") is not None]),
            "vllm_step_ms_median_after_plain": median([following.get(id(s)) and 1e3 * following[id(s)]
                                                       for s in plain]),
            "vllm_step_ms_median_after_drafting": median([following.get(id(s)) and 1e3 * following[id(s)]
                                                          for s in drafting]),
            # drafting steps by their longest chain (the levels the policy kept): the proposer's seconds, vLLM's
            # step after, what the controller predicted for a steady speculative step, the catch-up read first
            "by_longest_chain": {
                str(depth): {"steps": len(g),
                             "propose_ms_median": median([1e3 * s["propose_seconds"] for s in g
                                                          if s.get("propose_seconds") is not None]),
                             "vllm_step_ms_median": median([following.get(id(s)) and 1e3 * following[id(s)]
                                                            for s in g]),
                             "predicted_spec_ms_median": median([1e3 * s["estimate"]["spec_seconds"] for s in g
                                                                 if (s.get("estimate") or {}).get("spec_seconds")]),
                             "catch_up_tokens_median": median([s.get("catch_up") for s in g])}
                for depth, g in sorted(by_depth(drafting).items())},
            "predicted_plain_ms_median": median([1e3 * s["estimate"]["plain_seconds"] for s in group
                                                 if (s.get("estimate") or {}).get("plain_seconds")]),
        }
    last = steps[-1]["stats"] if steps else {}
    return {"trace": path.name, "by_live_rows": out, "final_stats": last}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from echo_trtllm.bench.run import report_meta

    meta = report_meta("scripts/echo_trace_summary.py", argv)
    meta["command"] = meta["command"].replace("python -m ", "python ", 1)
    report = {"meta": meta,
              "traces": [summarise(Path(t)) for t in args.traces]}
    Path(args.out).write_text(json.dumps(report, indent=1))
    for t in report["traces"]:
        print(t["trace"])
        for rows, v in t["by_live_rows"].items():
            if v["steps"] >= 5:
                print(f"  rows {rows}: {v['steps']} steps, {v['drafting_steps']} drafting, propose "
                      f"{v['propose_ms_median']} ms, vLLM step after plain {v['vllm_step_ms_median_after_plain']} "
                      f"ms / after drafting {v['vllm_step_ms_median_after_drafting']} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
