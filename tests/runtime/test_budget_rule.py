"""The cost-curve budget rule in the running executor: it falls back to AR by itself when drafting cannot pay,
takes more budget when drafts are perfect, and never changes the output."""

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
