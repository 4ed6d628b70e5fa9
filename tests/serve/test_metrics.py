"""The server's Prometheus metrics from step reports, with an injected clock (no dependence on time)."""

from types import SimpleNamespace

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from echo_trtllm.serve.metrics import ServerMetrics  # noqa: E402


def _values(m: ServerMetrics) -> dict:
    return {s.name: s.value for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples
            if not s.labels}


def test_ratios_are_exact_sums_over_steps_and_tokens_per_second_uses_the_window():
    now = [100.0]
    m = ServerMetrics(load=lambda: (3, 5), window_s=10.0, clock=lambda: now[0])
    # step 1: 4 requests, 12 tokens verified (8 drafts), 7 emitted (3 drafts accepted); step 2: plain AR, 4 requests
    m.on_step(SimpleNamespace(batch_size=4, verified_tokens=12, emitted_tokens=7, speculated=True))
    now[0] = 105.0
    m.on_step(SimpleNamespace(batch_size=4, verified_tokens=4, emitted_tokens=4, speculated=False))
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
