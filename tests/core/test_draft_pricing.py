"""The echo family's budget rule before drafting (`EchoPolicy.drafts`): a step drafts only when a typical
batch's first level, priced with its draft forward, is expected to beat a plain step. Checked against the rule
computed by hand from the calibration's quantiles, and through the drafting loop itself."""

import pytest
import torch

from echo_trtllm.core import EchoConfig, draft_tree, make_policy
from echo_trtllm.core.cost import CostModel
from echo_trtllm.core.gating import GateSamples

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)
# verification nearly free up to 64 tokens, a cheap draft (a GPU at moderate load)
FLAT = CostModel(TOKENS, tuple(0.010 + 0.00002 * t for t in TOKENS), TOKENS, tuple(0.001 + 0.00001 * t for t in TOKENS))
# every verified token costs as much as a decode step (an AVX2 CPU in float32 under load)
LINEAR = CostModel(TOKENS, tuple(0.010 * t for t in TOKENS), TOKENS, tuple(0.001 * t for t in TOKENS))


def samples(first_level_confidences, accepted=None) -> GateSamples:
    """Calibration evidence with these first-level confidences (and a second level, so the depth axis is real)."""
    c = torch.tensor(first_level_confidences, dtype=torch.float32)
    acc = torch.rand(c.numel(), generator=torch.Generator().manual_seed(0)) < c if accepted is None else accepted
    depths = torch.cat([torch.ones(c.numel(), dtype=torch.long), torch.full((c.numel(),), 2)])
    return GateSamples(depths, torch.cat([c, c * 0.5]), torch.cat([acc, torch.zeros_like(acc)]), max_depth=3)


def echo(policy="echo", cost=FLAT, gate_samples=None, **config):
    return make_policy(EchoConfig(policy=policy, max_depth=3, **{"k_max": 256, **config}), cost, gate_samples)


def test_the_expected_first_level_is_the_calibrations_quantiles_through_the_acceptance_model():
    conf = [i / 100 for i in range(1, 100)]
    policy = echo(gate_samples=samples(conf), gate_depths=(2,), gate_thresholds=(0.1,))
    for b, m in ((2, 64), (100, 100)):  # at least 64 points, B when B is larger
        q = (torch.arange(m, dtype=torch.float64) + 0.5) / m
        expected = policy.acceptance.estimate(torch.quantile(torch.tensor(conf, dtype=torch.float64), q).flip(0), 1)
        est, weight = policy.expected_first_level(b)
        assert torch.allclose(est, expected) and weight == pytest.approx(b / m)
    # a gate at depth 1 cuts the points a batch would lose there: confidences 0.5 and above pass
    gated = echo(gate_samples=samples(conf), gate_depths=(1,), gate_thresholds=(0.5,))
    assert gated.expected_first_level(4)[0].numel() == 32


def test_expected_rates_weigh_each_quantile_by_its_share_of_the_batch():
    """B = 1 with a draft that is confident one step in four (c = 0.99, accepted) and useless otherwise: the median
    request says never draft, but drafting every step and verifying only when confident pays on a cost where a
    second verified token costs 30 % of a step and the draft 1 %. By hand, the ratio of expectations:
    (1 + 0.25 * 1.0) / (0.01 + 0.1 + 0.25 * 0.03) = 10.64 tokens/s against the plain step's 1 / 0.1 = 10."""
    cost = CostModel((1, 2), (0.1, 0.13), (1, 2), (0.01, 0.02))
    conf = [0.99] * 25 + [0.01] * 75
    acc = torch.tensor([True] * 25 + [False] * 75)
    policy = echo(cost=cost, gate_samples=samples(conf, accepted=acc), gate_depths=(3,), gate_thresholds=(0.0,))
    assert policy.drafts(1)
    assert (1 + 0.25) / (0.01 + 0.1 + 0.25 * 0.03) > 10
    dear = CostModel((1, 2), (0.1, 0.13), (1, 2), (0.03, 0.04))  # (1.25) / (0.03 + 0.1075) = 9.09 < 10
    assert not echo(cost=dear, gate_samples=samples(conf, accepted=acc), gate_depths=(3,),
                    gate_thresholds=(0.0,)).drafts(1)
    # the same with the cheap forward and 20 ms of host work per draft level (`draft_level_overhead_seconds`)
    hosted = CostModel((1, 2), (0.1, 0.13), (1, 2), (0.01, 0.02), draft_level_overhead_seconds=0.02)
    assert not echo(cost=hosted, gate_samples=samples(conf, accepted=acc), gate_depths=(3,),
                    gate_thresholds=(0.0,)).drafts(1)


def test_confident_drafts_on_a_flat_curve_draft_and_a_linear_curve_does_not():
    good = samples([0.95] * 50, accepted=torch.ones(50, dtype=torch.bool))
    for b in (1, 4, 16):
        assert echo(cost=FLAT, gate_samples=good).drafts(b)
        assert not echo(cost=LINEAR, gate_samples=good).drafts(b)
        assert echo("echo-always-draft", cost=LINEAR, gate_samples=good).drafts(b)  # the ablation
    # useless drafts do not pay even where verification is nearly free: the draft forward is the whole loss
    useless = samples([0.95] * 50, accepted=torch.zeros(50, dtype=torch.bool))
    assert not echo(cost=FLAT, gate_samples=useless).drafts(4)


def test_without_calibration_evidence_or_a_draft_curve_every_step_drafts():
    assert echo(cost=LINEAR).drafts(16)  # no samples: nothing to price the first level with
    assert echo(cost=CostModel.linear(0.0, 0.01), gate_samples=samples([0.9] * 10)).drafts(16)  # no draft curve
    assert echo(cost=None, gate_samples=samples([0.9] * 10)).drafts(16)
    assert not echo(cost=FLAT, k_max=4).drafts(4)  # no budget beyond the roots


def test_a_step_that_does_not_pay_runs_no_draft_forward_and_verifies_the_roots():
    good = samples([0.95] * 50, accepted=torch.ones(50, dtype=torch.bool))

    def draft_fn(level, frontier):  # a draft forward; must not run when the rule declines
        calls.append(frontier.numel())
        return torch.full((frontier.numel(), 8), 1 / 8)

    roots = torch.arange(4)
    calls = []
    result = draft_tree(echo(cost=LINEAR, gate_samples=good), roots, draft_fn)
    assert calls == [] and result.state.frontier_sizes == []
    assert torch.equal(result.selected.request_ids, roots) and int(result.selected.total_nodes) == 4
    calls = []
    draft_tree(echo(cost=FLAT, gate_samples=good), roots, draft_fn)
    assert calls and calls[0] == 4


def test_the_rule_reads_the_context_the_step_attends():
    """A grid on which extra tokens are free at short contexts and dear at long ones."""
    grid = CostModel(TOKENS, tuple(0.010 for _ in TOKENS), TOKENS, tuple(0.0001 * t for t in TOKENS),
                     grid_tokens=(1, 128), grid_contexts=(16, 1024), grid_seconds=((0.01, 0.01), (0.011, 2.0)))
    policy = echo(cost=grid, gate_samples=samples([0.9] * 50, accepted=torch.ones(50, dtype=torch.bool)))
    assert policy.drafts(8, context=16) and not policy.drafts(8, context=1024)


@pytest.mark.parametrize("b", [1, 7, 64, 100])
def test_the_rule_equals_the_ratio_of_expectations_by_hand(b):
    """The decision recomputed here from its definition: M quantiles, estimates, best verified prefix weighted by
    B / M, against AR."""
    gen = torch.Generator().manual_seed(b)
    conf = torch.rand(200, generator=gen)
    policy = echo(cost=FLAT, gate_samples=samples(conf.tolist()), gate_depths=(3,), gate_thresholds=(0.1,))
    m = max(b, 64)
    q = (torch.arange(m, dtype=torch.float64) + 0.5) / m
    est = policy.acceptance.estimate(torch.quantile(conf.double(), q).flip(0), 1)
    w = b / m
    draft = float(FLAT.draft_time(b))
    best = max((b + w * float(est[:n].sum())) / (draft + float(FLAT.verify_time(b + w * n))) for n in range(1, m + 1))
    assert policy.drafts(b) == (best > b / float(FLAT.verify_time(b)))


def test_the_cost_stop_prices_the_next_level_at_the_next_depths_acceptance():
    """After a confident first level, drafting a second level pays when depth 2 is accepted as often as depth 1,
    and stops when the calibration never saw depth 2 accepted (60 of 60 rejected: estimate 1/122), however
    confident the head is; without calibration evidence the raw probability decides (it goes on)."""
    from echo_trtllm.core.policies import DraftState

    c = torch.linspace(0.3, 0.99, 60)
    acc = torch.rand(60, generator=torch.Generator().manual_seed(0)) < c
    depth2_like_depth1 = GateSamples(torch.cat([torch.ones(60, dtype=torch.long), torch.full((60,), 2)]),
                                     torch.cat([c, c]), torch.cat([acc, acc]), max_depth=3)
    depth2_never = GateSamples(torch.cat([torch.ones(60, dtype=torch.long), torch.full((60,), 2)]),
                               torch.cat([c, c]), torch.cat([acc, torch.zeros(60, dtype=torch.bool)]), max_depth=3)
    cost = CostModel(TOKENS, tuple(0.1 + 0.001 * t for t in TOKENS), TOKENS, tuple(0.002 for _ in TOKENS))

    def drafts_on(gate_samples) -> bool:
        policy = echo(cost=cost, gate_samples=gate_samples, gate_depths=(3,), gate_thresholds=(0.0,))
        state = DraftState(4, 64, torch.ones(4, dtype=torch.bool), torch.ones(4, dtype=torch.long),
                           confidence=[torch.full((4,), 0.9)], context=64.0)
        policy._cost_stop(state)
        return bool(state.active.all())

    assert drafts_on(depth2_like_depth1)
    assert not drafts_on(depth2_never)
    assert drafts_on(None)
