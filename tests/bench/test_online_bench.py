"""The prices' predicted-vs-measured report (`echo-trtllm bench-online`): its figures recomputed by hand on
synthetic step reports, and one real run on the embedded pair."""

import json
from types import SimpleNamespace

import pytest

from echo_trtllm.bench.online import prediction_report
from echo_trtllm.cli.bench_online import main
from echo_trtllm.core.controller import Decision
from echo_trtllm.core.prices import StepPrediction
from echo_trtllm.runtime.executor import StepTimings


def step(pred, meas, speculated, decision=None, emitted=4):
    return SimpleNamespace(batch_size=4, speculated=speculated, emitted_tokens=emitted,
                           timings=StepTimings(total=meas), decision=decision,
                           prediction=StepPrediction(pred / 2, pred / 2, meas / 2, meas / 2))


def test_the_report_by_hand():
    plain = Decision(False, "plain", 4, ratio=0.5, plain_seconds=0.01)  # expects 400 tokens/s
    reports = [step(1.0, 1.0, False)] * 3 + [step(0.011, 0.01, False, plain), step(0.018, 0.02, True, emitted=8)]
    r = prediction_report(reports, skip=3)
    assert r["steps"] == 2 and r["speculative_share"] == 0.5
    assert r["step"]["median_abs_rel_error"] == pytest.approx(0.1)  # |0.011 - 0.01| / 0.01 and |0.018 - 0.02| / 0.02
    assert r["step"]["predicted_over_measured"] == pytest.approx(0.029 / 0.03, abs=1e-4)
    assert r["plain"]["steps"] == 1 and r["speculative"]["steps"] == 1
    assert r["decisions"] == {"plain": {"steps": 1, "expected_tokens": 4.0, "emitted_tokens": 4, "seconds": 0.01,
                                        "expected_over_emitted": 1.0}}


def test_one_run_on_the_embedded_pair(tmp_path):
    out = tmp_path / "online.json"
    assert main(["--batch-sizes", "2", "--steps", "60", "--max-tokens", "16", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["batch_size"] == 2 and row["steps"] >= 10 and row["mean_batch"] == 2
    assert row["step"]["median_abs_rel_error"] is not None and row["speculation_stats"]["steps"] > 0
    assert set(row["decisions"]) <= {"exploit", "probe", "plain", "plain-probe", "forced"}
