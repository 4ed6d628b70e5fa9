"""The cost-curve budget rule in the running executor: it falls back to AR by itself when drafting cannot pay,
takes more budget when drafts are perfect, and never changes the output."""

import math

import pytest
import torch

from echo_trtllm.core import EchoConfig
from echo_trtllm.core.cost import CostModel
from echo_trtllm.models.llama import CausalLM
from echo_trtllm.runtime.calibrate import measure_cost_model
from echo_trtllm.runtime.executor import Executor
from echo_trtllm.runtime.request import SamplingParams


def run(target, draft, tok, prompts, cost, batch_size=4, max_tokens=24, policy="echo"):
    ex = Executor(target, draft, tok, EchoConfig(policy=policy, k_max=64, max_nodes_per_request=16),
                  max_batch_size=batch_size, max_seq_len=256, cost_model=cost)
    reqs = [ex.make_request(p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)) for p in prompts]
    for r in reqs:
        ex.submit(r)
    reports = []
    while ex.has_work:
        reports.append(ex.step())
    return [r.output_token_ids for r in reqs], reports


@pytest.fixture(scope="module")
def ar_outputs(default_pair, prompts):
    target, _, tok = default_pair
    outs, _ = run(target, None, tok, prompts[:8], None, policy="ar")
    return outs


@pytest.fixture(scope="module")
def measured_cost(default_pair):
    target, draft, _ = default_pair
    return measure_cost_model(target, draft, tokens=(1, 4, 16, 64), repeats=3)


def test_measured_cost_curve_is_sane(measured_cost):
    assert len(measured_cost.verify_seconds) == 4 and all(t > 0 for t in measured_cost.verify_seconds)
    assert measured_cost.verify_seconds[-1] > measured_cost.verify_seconds[0]  # 64 tokens cost more than 1


def test_random_weight_draft_falls_back_to_ar(default_pair, prompts, ar_outputs, measured_cost):
    target, draft, tok = default_pair
    torch.manual_seed(0)
    useless = CausalLM(draft.config).eval()  # random weights: its drafts are never accepted
    outs, reports = run(target, useless, tok, prompts[:8], measured_cost)
    assert outs == ar_outputs
    speculated = sum(r.speculated for r in reports) / len(reports)
    assert speculated <= 0.25, f"speculated in {speculated:.0%} of steps with a useless draft"


def test_linear_cost_curve_falls_back_to_ar(default_pair, prompts, ar_outputs):
    target, draft, tok = default_pair
    linear = CostModel.linear(0.0, 0.01)  # every verified token costs a full decode step
    outs, reports = run(target, draft, tok, prompts[:8], linear)
    assert outs == ar_outputs
    assert sum(r.speculated for r in reports) / len(reports) <= 0.25, "drafting cannot pay on a linear curve"
    verified = sum(r.verified_tokens for r in reports)
    assert verified <= 1.5 * sum(r.batch_size for r in reports)


def test_perfect_drafts_get_more_budget(default_pair, prompts, ar_outputs, measured_cost):
    """The target as its own draft: every draft is accepted, so speculative steps take more budget than with the
    real draft. (Whether drafting pays at all is the tracker's call: a draft as costly as the target may not.)"""
    target, draft, tok = default_pair
    outs_self, rep_self = run(target, target, tok, prompts[:8], measured_cost)
    outs_real, rep_real = run(target, draft, tok, prompts[:8], measured_cost)
    assert outs_self == ar_outputs and outs_real == ar_outputs

    def verified_per_request(reports):
        spec = [r for r in reports if r.speculated]
        return sum(r.verified_tokens for r in spec) / sum(r.batch_size for r in spec)

    assert verified_per_request(rep_self) > max(1.5, verified_per_request(rep_real))
    assert rep_self[0].speculated and rep_self[0].emitted_tokens > 2 * rep_self[0].batch_size


def test_tracker_probe_spacing_and_catch_up_by_hand():
    from echo_trtllm.runtime.executor import SpeculationTracker

    tr = SpeculationTracker(smoothing=0.3)
    assert tr.should_speculate()  # nothing measured: try speculation first
    # a speculative step after AR steps: 3 s, of which 2 s were the draft catching up -> rate 4 tokens / 1 s
    tr.update(True, batch_size=1, emitted=4, seconds=3.0, one_off_seconds=2.0)
    assert tr.spec_rate == 4.0 and not tr.should_speculate()  # AR not measured yet
    tr.update(False, 1, 1, 0.5)  # AR: 2 tokens/s; not a probe (nothing was chosen before)
    assert tr.ar_rate == 2.0 and tr.steps_since_probe == 2
    for _ in range(5):
        assert tr.should_speculate()
        tr.update(True, 1, 4, 1.0)
    assert not tr.should_speculate()  # the 8th step probes AR
    tr.update(False, 1, 1, 0.5)
    # confirmed: loss = 0.5 s x 4 tokens/s - 1 token = 1 token against 4 tokens per speculative step
    assert tr.probe_every == max(16, math.ceil(1.0 / (0.02 * 4.0))) and tr.steps_since_probe == 0
    # a probe that overturns the choice resets the spacing
    tr.steps_since_probe = tr.probe_every - 1
    tr.update(False, 1, 1, 0.01)  # AR seconds EMA 0.7 * 0.5 + 0.3 * 0.01 = 0.353: 2.8 tokens/s, still < 4
    assert tr.probe_every > tr.min_probe_every
    for _ in range(3):
        tr.steps_since_probe = tr.probe_every - 1
        tr.update(False, 1, 1, 0.01)  # AR keeps measuring fast: its rate passes speculation's
    assert tr.ar_rate > tr.spec_rate and tr.probe_every == tr.min_probe_every
    tr.steps_since_probe = 0
    assert not tr.should_speculate()  # AR is now the choice


def test_tracker_rate_is_a_ratio_of_averages():
    """Speculative steps of equal time but varying tokens: the rate is total tokens / total time, not the mean
    of per-step rates (which a lucky step would inflate)."""
    from echo_trtllm.runtime.executor import SpeculationTracker

    tr = SpeculationTracker(smoothing=0.5)
    tr.update(True, 1, 1, 1.0)
    tr.update(True, 1, 7, 1.0)  # EMA tokens 4, seconds 1
    assert tr.spec_rate == pytest.approx(4.0)
    tr.update(True, 1, 2, 3.0)  # tokens 3, seconds 2
    assert tr.spec_rate == pytest.approx(1.5)


def test_gate_thresholds_rise_with_load(default_pair, prompts):
    """The calibration's gate, re-derived per batch size, is at least as strict under load as at B = 1."""
    from echo_trtllm.runtime.calibrate import calibrate

    target, draft, tok = default_pair
    cal = calibrate(target, draft, tok, EchoConfig(max_depth=4), prompts[:4], batch_size=4, max_tokens=12,
                    cost_tokens=(1, 4, 16, 64, 256), repeats=2)
    small, large = cal.gate_for(1), cal.gate_for(128)
    assert small.min_accept_prob <= large.min_accept_prob
    assert all(a <= b for a, b in zip(small.dense_thresholds, large.dense_thresholds))
    assert cal.gate_for(1) is small  # cached per break-even probability
