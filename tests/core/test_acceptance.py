"""Isotonic acceptance estimates against an independent reference: the min-max formula of isotonic least squares,
y*_i = max_{a <= i} min_{b >= i} mean(y_a..y_b) (for distinct x in ascending order)."""

import pytest
import torch

from echo_trtllm.core import EchoConfig
from echo_trtllm.core.acceptance import AcceptanceModel, isotonic_fit
from echo_trtllm.core.gating import GateSamples
from echo_trtllm.core.policies import make_policy


def minmax_reference(y: list[float]) -> list[float]:
    n = len(y)
    return [max(min(sum(y[a : b + 1]) / (b + 1 - a) for b in range(i, n)) for a in range(i + 1)) for i in range(n)]


def step_values(starts, values, x):
    i = (torch.searchsorted(starts, x.double(), right=True) - 1).clamp(min=0)
    return values[i]


@pytest.mark.parametrize("seed", range(30))
def test_pav_equals_the_minmax_formula(seed):
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 14, (1,), generator=gen))
    x = torch.randperm(100, generator=gen)[:n].double() / 100  # distinct
    y = (torch.rand(n, generator=gen) < torch.rand(1, generator=gen)).double() if seed % 2 else torch.rand(n, generator=gen).double()
    starts, values = isotonic_fit(x, y)
    order = torch.argsort(x)
    want = torch.tensor(minmax_reference(y[order].tolist()), dtype=torch.float64)
    torch.testing.assert_close(step_values(starts, values, x[order]), want)
    assert bool((values[1:] >= values[:-1]).all())


def test_the_docstring_example_and_ties():
    x = torch.tensor([0.1, 0.2, 0.4, 0.5, 0.8], dtype=torch.float64)
    starts, values = isotonic_fit(x, torch.tensor([0.0, 1, 0, 1, 1]))
    assert starts.tolist() == [0.1, 0.2, 0.5, 0.8] and values.tolist() == [0.0, 0.5, 1.0, 1.0]
    starts, values = isotonic_fit(torch.tensor([0.3, 0.3, 0.3], dtype=torch.float64), torch.tensor([1.0, 0, 0]))
    assert starts.tolist() == [0.3] and values.tolist() == pytest.approx([1 / 3])
    # a tie with the last point of a merged block joins that block
    starts, values = isotonic_fit(torch.tensor([0.1, 0.2, 0.2], dtype=torch.float64), torch.tensor([1.0, 0, 1]))
    assert starts.tolist() == [0.1] and values.tolist() == pytest.approx([2 / 3])


def test_a_depth_without_enough_evidence_keeps_the_raw_probability():
    gen = torch.Generator().manual_seed(0)
    c = torch.rand(200, generator=gen)
    depths = torch.cat([torch.full((100,), 1), torch.full((90,), 2), torch.full((10,), 3)])
    accepted = torch.rand(200, generator=gen) < c / 2  # an overconfident draft: accepted half as often
    accepted[100:190] = True  # depth 2: one outcome only
    model = AcceptanceModel.from_samples(depths, c, accepted)
    assert set(model.fits) == {1, 2}
    q = torch.tensor([0.9, 0.9, 0.9])
    est = model.estimate(q, torch.tensor([1, 2, 3]))
    assert est[2] == pytest.approx(0.9)  # depth 3: 10 samples, the raw probability
    assert est[0] < 0.75  # corrected down at depth 1
    # depth 2, 90 of 90 accepted: every confidence gets (90 + 1/2) / 91, whatever its value
    assert model.estimate(torch.tensor([0.01, 0.9]), 2).tolist() == pytest.approx([90.5 / 91] * 2)


def test_a_depth_never_accepted_is_priced_near_zero_not_at_its_confidence():
    """60 confident nodes at depth 4, none accepted (the Qwen EAGLE-3 head's deep levels): the estimate is
    (0 + 1/2) / 61, so a cost rule stops drafting there instead of trusting the head's confidence."""
    c = torch.linspace(0.2, 0.9, 60)
    model = AcceptanceModel.from_samples(torch.full((60,), 4), c, torch.zeros(60, dtype=torch.bool))
    assert model.estimate(torch.tensor([0.95, 0.5, 0.1]), 4).tolist() == pytest.approx([0.5 / 61] * 3)


def test_echo_weighs_candidates_by_the_calibrated_estimates():
    gen = torch.Generator().manual_seed(1)
    c = torch.rand(400, generator=gen)
    depths = torch.randint(1, 4, (400,), generator=gen)
    accepted = torch.rand(400, generator=gen) < c * 0.3
    samples = GateSamples(depths, c, accepted, max_depth=3)
    policy = make_policy(EchoConfig(max_depth=3), None, samples)
    raw = make_policy(EchoConfig(max_depth=3))
    p = torch.tensor([0.8, 0.6])
    assert torch.equal(raw.acceptance_estimates(p, torch.tensor([1, 2])), p)
    est = policy.acceptance_estimates(p, torch.tensor([1, 2]))
    assert bool((est < p).all()) and bool((est >= 0).all())


@pytest.mark.parametrize("seed", range(20))
def test_every_block_is_valued_by_its_own_samples_smoothed_and_the_map_rises(seed):
    """Against a direct count: each block's value is (k + 1/2) / (n + 1) of the samples whose confidence falls in
    it; values are strictly rising, never 0 or 1; and with distinct raw means that KT smoothing keeps in order,
    the blocks are the isotonic fit's."""
    from echo_trtllm.core.acceptance import smoothed_blocks

    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 60, (1,), generator=gen))
    x = torch.rand(n, generator=gen).double()
    y = (torch.rand(n, generator=gen) < x).double()
    starts, values = smoothed_blocks(x, y)
    assert bool((values[1:] > values[:-1]).all()) and bool(((values > 0) & (values < 1)).all())
    block = (torch.searchsorted(starts, x, right=True) - 1).clamp(min=0)
    for i in range(starts.numel()):
        sel = block == i
        assert int(sel.sum()) > 0
        assert float(values[i]) == pytest.approx((float(y[sel].sum()) + 0.5) / (int(sel.sum()) + 1))


def test_a_block_never_accepted_is_not_priced_at_zero():
    """Seven low-confidence nodes rejected, then accepted ones: the low block is 0.5 / 8, not 0 (a budget rule
    reading 0 refuses a node whose verification is nearly free at B = 1)."""
    x = torch.tensor([0.1, 0.12, 0.15, 0.2, 0.25, 0.3, 0.33, 0.5, 0.6, 0.9], dtype=torch.float64)
    y = torch.tensor([0.0] * 7 + [1.0, 0.0, 1.0])
    model = AcceptanceModel.from_samples(torch.ones(10, dtype=torch.long), x.float(), y.bool(), min_samples=5)
    assert model.estimate(torch.tensor([0.2]), 1).item() == pytest.approx(0.5 / 8)
    # then blocks 1 of 2 (0.5, 0.6) and 1 of 1 (0.9): 1.5 / 3 and 1.5 / 2
    assert model.estimate(torch.tensor([0.55, 0.95]), 1).tolist() == pytest.approx([0.5, 0.75])
