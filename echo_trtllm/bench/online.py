"""How well the online prices predict real steps, and what the speculation controller expected against what it got.

    echo-trtllm bench-online [--model T --draft-model D] [--batch-sizes 1,16,64] [--steps 150]
        [--fallback on|off] [--prompt-set humaneval] [--max-tokens 64] [--json out.json]

For each batch size B: one engine as a user gets it (`LLM()`: no calibration file, the cost curve measured at load,
the warm-up steps), kept full for at least `--steps` steps (B requests in flight, a new one admitted as one finishes:
sustained load, not a closed batch's drain). Every step report carries the online cost model's prediction made
before it learned from that step (`StepReport.prediction`) and the controller's decision (`StepReport.decision`).
Reported per B, over the steps after the first 50 (the issue's bar: within 10 % median absolute error after 50):

    step          median |predicted - measured| / measured of the whole step, and predicted / measured summed
    drafting, verification   the same per phase
    plain, speculative       the whole step's error over plain and over speculative steps apart
    decisions     per reason (exploit, probe, plain, plain-probe, forced): steps, the tokens the decision expected
                  (its expected rate x the step's measured seconds) and the tokens emitted

Wall-clock timings on a shared machine: medians say more than any single step.
"""

from __future__ import annotations

import statistics

__all__ = ["prediction_report"]

SKIP = 50  # steps the prices get before they are judged


def _errors(pairs: list[tuple[float, float]]) -> dict:
    rel = [abs(p - m) / m for p, m in pairs if m > 0]
    return {"steps": len(rel), "median_abs_rel_error": round(statistics.median(rel), 4) if rel else None,
            "predicted_over_measured": round(sum(p for p, _ in pairs) / sum(m for _, m in pairs), 4)
            if pairs and sum(m for _, m in pairs) > 0 else None}


def prediction_report(reports, skip: int = SKIP) -> dict:
    """The report's figures over step reports (module docstring), the first `skip` steps left out."""
    judged = [r for r in reports if r.batch_size and r.prediction is not None][skip:]
    out = {"steps": len(judged),
           "step": _errors([(r.prediction.seconds, r.prediction.measured) for r in judged]),
           "drafting": _errors([(r.prediction.drafting, r.prediction.measured_drafting) for r in judged]),
           "verification": _errors([(r.prediction.verification, r.prediction.measured_verification) for r in judged]),
           "plain": _errors([(r.prediction.seconds, r.prediction.measured) for r in judged if not r.speculated]),
           "speculative": _errors([(r.prediction.seconds, r.prediction.measured) for r in judged if r.speculated]),
           "speculative_share": round(sum(r.speculated for r in judged) / len(judged), 4) if judged else None,
           "mean_batch": round(statistics.mean(r.batch_size for r in judged), 2) if judged else None}
    decisions: dict = {}
    for r in judged:
        d = r.decision
        if d is None:
            continue
        row = decisions.setdefault(d.reason, {"steps": 0, "expected_tokens": 0.0, "emitted_tokens": 0,
                                              "seconds": 0.0})
        row["steps"] += 1
        row["emitted_tokens"] += r.emitted_tokens
        row["seconds"] += r.timings.total
        rate = d.expected_rate
        if rate == rate and rate != float("inf"):
            row["expected_tokens"] += rate * r.timings.total
    for row in decisions.values():
        row["expected_over_emitted"] = round(row["expected_tokens"] / row["emitted_tokens"], 4) \
            if row["emitted_tokens"] else None
        row["expected_tokens"], row["seconds"] = round(row["expected_tokens"], 1), round(row["seconds"], 4)
    out["decisions"] = decisions
    return out
