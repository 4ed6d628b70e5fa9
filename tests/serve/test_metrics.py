"""The server's Prometheus metrics from step reports, with an injected clock (no dependence on time)."""

from types import SimpleNamespace

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from echo_trtllm.core.controller import Decision  # noqa: E402
from echo_trtllm.core.prices import StepPrediction  # noqa: E402
from echo_trtllm.runtime.executor import StepTimings  # noqa: E402
from echo_trtllm.serve.metrics import ServerMetrics  # noqa: E402


def report(batch_size, verified_tokens, emitted_tokens, speculated, seconds=0.01, prediction=None, decision=None):
    """What the metrics read of a `StepReport`."""
    return SimpleNamespace(batch_size=batch_size, verified_tokens=verified_tokens, emitted_tokens=emitted_tokens,
                           speculated=speculated, timings=StepTimings(total=seconds), prediction=prediction,
                           decision=decision)


def _values(m: ServerMetrics) -> dict:
    return {s.name: s.value for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples
            if not s.labels}


def test_ratios_are_exact_sums_over_steps_and_tokens_per_second_uses_the_window():
    now = [100.0]
    m = ServerMetrics(load=lambda: (3, 5), window_s=10.0, clock=lambda: now[0])
    # step 1: 4 requests, 12 tokens verified (8 drafts), 7 emitted (3 drafts accepted); step 2: plain AR, 4 requests
    m.on_step(report(4, 12, 7, True))
    now[0] = 105.0
    m.on_step(report(4, 4, 4, False))
    v = _values(m)
    assert v["echo_trtllm_steps_total"] == 2 and v["echo_trtllm_speculative_steps_total"] == 1
    assert v["echo_trtllm_acceptance_rate"] == pytest.approx(3 / 8)
    assert v["echo_trtllm_mean_accepted_tokens"] == pytest.approx(11 / 8)
    assert v["echo_trtllm_speculative_step_share"] == pytest.approx(0.5)
    assert v["echo_trtllm_mean_verified_tokens_per_step"] == pytest.approx(8.0)
    assert v["echo_trtllm_tokens_per_second"] == pytest.approx(11 / 10)
    assert v["echo_trtllm_requests_running"] == 3 and v["echo_trtllm_requests_waiting"] == 5
    now[0] = 112.0  # the first step left the 10 s window
    assert _values(m)["echo_trtllm_tokens_per_second"] == pytest.approx(4 / 10)


def test_an_idle_server_reports_zeros_not_nan():
    v = _values(ServerMetrics(load=lambda: (0, 0)))
    for name in ("acceptance_rate", "mean_accepted_tokens", "speculative_step_share",
                 "mean_verified_tokens_per_step", "tokens_per_second"):
        assert v[f"echo_trtllm_{name}"] == 0.0


def test_the_prices_and_the_controllers_decisions_are_counted():
    """Step seconds measured and predicted, their absolute error, decisions by reason, and the tokens the decisions
    expected (expected rate x the step's measured seconds) against those emitted; exploration from the LLM's
    speculation stats."""
    stats = {"exploration_loss_tokens": 5.0, "exploration_gain_tokens": 2.0, "step_prediction_error": 0.07}
    m = ServerMetrics(load=lambda: (0, 0), speculation=lambda: stats)
    plain = Decision(False, "plain", 4, ratio=0.8, plain_seconds=0.01)  # expects 4 / 0.01 = 400 tokens/s
    m.on_step(report(4, 4, 4, False, 0.012, StepPrediction(0.001, 0.009, 0.002, 0.010), plain))
    probe = Decision(True, "probe", 4, ratio=1.5, plain_seconds=0.01)  # expects 600 tokens/s
    m.on_step(report(4, 12, 6, True, 0.02, StepPrediction(0.005, 0.010, 0.008, 0.012), probe))
    m.on_step(report(4, 4, 4, False, 0.01))  # no decision (pure, or no controller)
    v = _values(m)
    assert v["echo_trtllm_step_seconds_total"] == pytest.approx(0.042)
    assert v["echo_trtllm_predicted_step_seconds_total"] == pytest.approx(0.025)
    assert v["echo_trtllm_step_prediction_abs_error_seconds_total"] == pytest.approx(0.002 + 0.005)
    assert v["echo_trtllm_expected_tokens_total"] == pytest.approx(400 * 0.012 + 600 * 0.02)
    assert v["echo_trtllm_decided_tokens_total"] == 10
    assert v["echo_trtllm_exploration_loss_tokens"] == 5.0 and v["echo_trtllm_step_prediction_error"] == 0.07
    reasons = {s.labels["reason"]: s.value for fam in text_string_to_metric_families(m.render().decode())
               for s in fam.samples if s.name == "echo_trtllm_speculation_decisions_total"}
    assert reasons == {"plain": 1.0, "probe": 1.0}
