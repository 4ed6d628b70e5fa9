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


# ---------------------------------------------------------------- OnlineAcceptance


def weighted_minmax(y: list[float], w: list[float]) -> list[float]:
    """The min-max formula with weights: y*_i = max_{a <= i} min_{b >= i} (weighted mean of y_a..y_b)."""
    n = len(y)

    def mean(a, b):
        return sum(y[k] * w[k] for k in range(a, b + 1)) / sum(w[a : b + 1])

    return [max(min(mean(a, b) for b in range(i, n)) for a in range(i + 1)) for i in range(n)]


def hand_estimate(steps, probe, prior_weight, half_life, prior=lambda x: x):
    """One table's estimate at `probe` computed by hand from its raw samples, steps = [(confidences, accepted)]
    oldest first (an empty pair for a step with none of its nodes): per bin, (accepted + prior weight x prior) /
    (count + prior weight) after the decay, made non-decreasing by the weighted min-max formula, read piecewise-
    linearly between the bins' mean confidences, plus the prior's own shape (prior: by default the draft's
    probability) in proportion to its weight in the probe's bin."""
    from echo_trtllm.core.acceptance import BIN_EDGES

    decay = 0.5 ** (1 / half_life)
    bins = len(BIN_EDGES) - 1
    k, cnt, csum = [0.0] * bins, [0.0] * bins, [0.0] * bins
    for age, (c, a) in enumerate(reversed(steps)):
        for ci, ai in zip(c.tolist(), a.tolist()):
            b = max(i for i in range(bins) if BIN_EDGES[i] <= ci)
            f = decay ** age
            k[b] += f * ai
            cnt[b] += f
            csum[b] += f * ci
    mids = [(BIN_EDGES[i] + BIN_EDGES[i + 1]) / 2 for i in range(bins)]
    p0 = [prior(m) for m in mids]
    raw = [(k[b] + prior_weight * p0[b]) / (cnt[b] + prior_weight) for b in range(bins)]
    fit = weighted_minmax(raw, [cnt[b] + prior_weight for b in range(bins)])
    centres = [csum[b] / cnt[b] if cnt[b] > 1e-9 else mids[b] for b in range(bins)]

    def linear(ys, x):
        if x <= centres[0]:
            return ys[0]
        if x >= centres[-1]:
            return ys[-1]
        j = max(i for i in range(bins) if centres[i] <= x)
        return ys[j] + (ys[j + 1] - ys[j]) * (x - centres[j]) / (centres[j + 1] - centres[j])

    out = []
    for x in probe.tolist():
        b = max(i for i in range(bins) if BIN_EDGES[i] <= x)
        share = prior_weight / (cnt[b] + prior_weight)
        out.append(min(1.0, max(0.0, linear(fit, x) + share * (prior(x) - linear(p0, x)))))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("seed", range(10))
def test_the_online_estimate_is_the_weighted_isotonic_fit_of_the_bins(seed):
    """One table (depth 1, greedy nodes) against the formula computed by hand from the raw samples, at the bins'
    mean confidences and between them."""
    from echo_trtllm.core.acceptance import OnlineAcceptance

    gen = torch.Generator().manual_seed(seed)
    online = OnlineAcceptance(2, prior_weight=3.0, half_life=5.0)
    steps = []
    for _ in range(6):
        n = int(torch.randint(5, 40, (1,), generator=gen))
        c = torch.rand(n, generator=gen, dtype=torch.float64)
        a = torch.rand(n, generator=gen) < (c.float() * 0.8 if seed % 2 else torch.rand(n, generator=gen))
        online.observe(torch.ones(n, dtype=torch.long), c, a)
        steps.append((c, a))
    probe = torch.cat([torch.cat([c for c, _ in steps]), torch.rand(50, generator=gen, dtype=torch.float64)])
    torch.testing.assert_close(online.estimate(probe, 1), hand_estimate(steps, probe, 3.0, 5.0))


@pytest.mark.parametrize("seed", range(4))
def test_greedy_path_nodes_and_the_others_have_their_own_tables_per_depth(seed):
    """Nodes at depths 1-3, on the draft's greedy path or not, observed in one stream: each (depth, greedy) pair's
    estimate is its own samples' fit computed by hand (the other tables' samples do not move it, except that the
    greedy rows below depth 1 take their prior from the depth-1 greedy estimate), and one call with a mixed batch
    of nodes gives every node its own table's value."""
    from echo_trtllm.core.acceptance import OnlineAcceptance

    gen = torch.Generator().manual_seed(seed)
    online = OnlineAcceptance(3, prior_weight=2.0, half_life=7.0)
    per_table = {(d, g): [] for d in (1, 2, 3) for g in (True, False)}
    for _ in range(8):
        n = int(torch.randint(10, 60, (1,), generator=gen))
        depth = torch.randint(1, 5, (n,), generator=gen)  # 4 is past max_depth: counted at 3
        greedy = torch.rand(n, generator=gen) < 0.4
        c = torch.rand(n, generator=gen, dtype=torch.float64) ** 2
        # greedy nodes accepted far more often than their probability says, the others less
        a = torch.rand(n, generator=gen, dtype=torch.float64) < torch.where(greedy, 0.3 + 0.7 * c, 0.5 * c)
        online.observe(depth, c, a, greedy)
        for key, steps in per_table.items():
            sel = (depth.clamp(max=3) == key[0]) & (greedy == key[1])
            steps.append((c[sel], a[sel]))
    probe = torch.rand(40, generator=gen, dtype=torch.float64)

    def prior(d, g):  # greedy rows below depth 1: the depth-1 greedy estimate per token, to the path's length
        if not g or d == 1:
            return lambda x: x
        first = per_table[(1, True)]
        return lambda x: float(hand_estimate(first, torch.tensor([x ** (1 / d)]), 2.0, 7.0)) ** d

    def want(d, g, x):
        return hand_estimate(per_table[(d, g)], x, 2.0, 7.0, prior(d, g))

    for d, g in per_table:
        torch.testing.assert_close(online.estimate(probe, d, g), want(d, g, probe))
    depths = torch.randint(1, 4, (40,), generator=gen)
    flags = torch.rand(40, generator=gen) < 0.5
    mixed = online.estimate(probe, depths, flags)
    for i in range(40):
        torch.testing.assert_close(mixed[i : i + 1], want(int(depths[i]), bool(flags[i]), probe[i : i + 1]))


def test_the_fit_is_redone_once_every_refit_every_steps():
    """With refit_every = 4, the estimate reads the last fit until four more steps were observed, then the fit of
    everything observed (the same as an estimator that refits every step)."""
    from echo_trtllm.core.acceptance import OnlineAcceptance

    gen = torch.Generator().manual_seed(5)
    lazy, eager = OnlineAcceptance(2, refit_every=4), OnlineAcceptance(2)
    probe = torch.linspace(0.0, 1.0, 21, dtype=torch.float64)
    first = lazy.estimate(probe, 1)
    for step in range(1, 9):
        c = torch.rand(30, generator=gen, dtype=torch.float64)
        a = torch.ones(30, dtype=torch.bool)  # everything accepted: the estimate rises
        for online in (lazy, eager):
            online.observe(torch.ones(30, dtype=torch.long), c, a)
        if step % 4:
            torch.testing.assert_close(lazy.estimate(probe, 1), first if step < 4 else refit)
        else:
            refit = eager.estimate(probe, 1)
            torch.testing.assert_close(lazy.estimate(probe, 1), refit)
            assert float((refit - first).max()) > 0.2


def test_the_online_threshold_is_where_the_estimate_crosses_lambda():
    from echo_trtllm.core.acceptance import OnlineAcceptance

    gen = torch.Generator().manual_seed(0)
    online = OnlineAcceptance(3)
    c = torch.rand(2000, generator=gen, dtype=torch.float64)
    online.observe(torch.full((2000,), 2), c, torch.rand(2000, generator=gen, dtype=torch.float64) < c ** 2)
    for lam in (0.05, 0.2, 0.5, 0.8):
        tau = online.threshold(2, lam)
        assert 0.0 < tau < 1.0
        est = online.estimate(torch.tensor([tau - 1e-3, tau + 1e-3], dtype=torch.float64), 2)
        assert float(est[0]) < lam <= float(est[1]) + 1e-9
        assert abs(tau - lam ** 0.5) < 0.08  # the truth: accepted with probability c^2
    never = OnlineAcceptance(1)
    never.observe(torch.ones(500, dtype=torch.long), c[:500], torch.zeros(500, dtype=torch.bool))
    assert never.threshold(1, 0.5) == 1.0  # nobody reaches it
    assert never.threshold(1, 0.0) == 0.0  # everybody does


def test_the_online_estimate_starts_from_the_calibration_and_follows_a_changing_workload():
    """Prior: a calibration whose depth-1 nodes at confidence 0.8 were all rejected. Traffic in which they are
    accepted 90 % of the time lifts the estimate there within a few half-lives (the calibration's prior still
    holds the bins above, where no traffic fell, and pools a little of it down); prose in which they are accepted
    10 % of the time brings it back down; code again lifts it."""
    from echo_trtllm.core.acceptance import OnlineAcceptance

    calibration = AcceptanceModel.from_samples(torch.ones(64, dtype=torch.long), torch.full((64,), 0.8),
                                               torch.zeros(64, dtype=torch.bool))
    online = OnlineAcceptance(2, calibration, prior_weight=4.0, half_life=32.0)
    probe = torch.tensor([0.8], dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    assert float(online.estimate(probe, 1)) < 0.05

    def traffic(rate, steps):
        for _ in range(steps):
            online.observe(torch.ones(4, dtype=torch.long), torch.full((4,), 0.8, dtype=torch.float64),
                           torch.rand(4, generator=gen) < rate)
        return float(online.estimate(probe, 1))

    assert traffic(0.9, 100) > 0.7  # code
    assert traffic(0.1, 100) < 0.2  # prose
    assert traffic(0.9, 100) > 0.7  # code again


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("calibrated", [False, True])
def test_the_compiled_estimate_equals_the_fit_read_directly(seed, calibrated):
    """The runtime's read (`estimate`: the fit compiled into linear segments) against the fit read as the class
    docstring says (`reference_estimate`), on random traffic with and without a calibration, every table row, at
    random, tiny and boundary confidences (0, 1, the bin edges, the bins' centres, the calibration's steps and
    points just beside them), per node and one row for all, after each of several refits."""
    from echo_trtllm.core.acceptance import BIN_EDGES
    from tests.helpers import random_online_acceptance

    depth = 1 + seed % 4
    online, gen = random_online_acceptance(seed, depth, calibrated, 2.0 + seed, 20.0, 1 + seed % 3)
    prior = online.prior
    for step in range(12):
        n = int(torch.randint(0, 40, (1,), generator=gen))
        c = torch.rand(n, generator=gen, dtype=torch.float64) ** (1 + step % 4)
        online.observe(torch.randint(1, depth + 3, (n,), generator=gen), c,
                       torch.rand(n, generator=gen, dtype=torch.float64) < c.sqrt(),
                       torch.rand(n, generator=gen) < 0.6)
        edges = torch.tensor(BIN_EDGES, dtype=torch.float64)
        points = [torch.rand(64, generator=gen, dtype=torch.float64), 10 ** (-6 * torch.rand(32, generator=gen)),
                  edges, online.csum.reshape(-1) / online.n.reshape(-1).clamp(min=1e-12)]
        if prior is not None:
            points += [starts for starts, _ in prior.fits.values()]
        p = torch.cat(points).double().clamp(0, 1)
        p = torch.cat([p, (p - 1e-12).clamp(0, 1), (p + 1e-12).clamp(0, 1)])
        depths = torch.randint(1, depth + 2, p.shape, generator=gen)
        greedy = torch.rand(p.shape, generator=gen) < 0.5
        torch.testing.assert_close(online.estimate(p, depths, greedy), online.reference_estimate(p, depths, greedy),
                                   rtol=0, atol=1e-12)
        for d in range(1, depth + 2):
            for g in (True, False):
                torch.testing.assert_close(online.estimate(p, d, g), online.reference_estimate(p, d, g),
                                           rtol=0, atol=1e-12)
        assert online.estimate(p.float(), 1).dtype == torch.float64
        odd = torch.tensor([-0.5, 1.5, float("inf"), -float("inf")], dtype=torch.float64)  # clamped alike
        torch.testing.assert_close(online.estimate(odd, depths[:4], greedy[:4]),
                                   online.reference_estimate(odd, depths[:4], greedy[:4]), rtol=0, atol=1e-12)


def test_with_no_traffic_the_online_estimate_is_its_prior_exactly():
    """No verified node yet: the estimate is the draft's own probability (no calibration) or the calibration's
    isotonic map, steps included, at every confidence."""
    from echo_trtllm.core.acceptance import OnlineAcceptance

    gen = torch.Generator().manual_seed(3)
    c = torch.cat([torch.rand(200, generator=gen, dtype=torch.float64), torch.tensor([0.0, 1e-5, 1.0])])
    torch.testing.assert_close(OnlineAcceptance(4).estimate(c, 2), c)
    samples = torch.rand(300, generator=gen)
    calibration = AcceptanceModel.from_samples(torch.ones(300, dtype=torch.long), samples,
                                               torch.rand(300, generator=gen) < samples ** 2)
    online = OnlineAcceptance(2, calibration)
    torch.testing.assert_close(online.estimate(c, 1), calibration.estimate(c, 1))
