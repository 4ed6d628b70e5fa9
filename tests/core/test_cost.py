"""The budget rule against hand-computed cases and its limiting behaviours."""

import math

import pytest
import torch

from echo_trtllm.core.cost import (CostModel, SpeculationTracker, batch_bucket, break_even_accept_prob, choose_budget,
                                   drafting_pays, interpolate)


def test_docstring_example_by_hand():
    cost = CostModel.linear(0.1, 0.01)
    # n=0: 1/0.13=7.69; n=1: 1.9/0.14=13.57; n=2: 2.4/0.15=16.0; n=3: 2.5/0.16=15.625
    assert choose_budget(torch.tensor([0.9, 0.5, 0.1]), 1, cost, spent_seconds=0.02) == 3


def test_exhaustive_search_matches_a_naive_loop():
    gen = torch.Generator().manual_seed(0)
    cost = CostModel((1, 8, 16, 64, 256), (0.20, 0.22, 0.35, 0.70, 2.2), control_seconds=0.003)
    for b in (1, 4, 16):
        est = torch.sort(torch.rand(120, generator=gen) ** 2, descending=True).values
        best, best_k = -1.0, None
        for n in range(est.numel() + 1):
            t = float(cost.verify_time(b + n)) + 0.05 + (0.003 if n else 0.0)
            r = (b + float(est[:n].sum())) / t
            if r > best + 1e-12:
                best, best_k = r, b + n
        assert choose_budget(est, b, cost, spent_seconds=0.05) == best_k


def test_drafting_pays_by_hand():
    """Before drafting nothing is sunk: the draft's seconds count against the plain step, B / t_verify(B)."""
    cost = CostModel.linear(0.1, 0.01)  # plain step at B = 1: 1 / 0.11 = 9.09 tokens/s
    # one confident candidate, a cheap draft: 1.9 / (0.02 + 0.12) = 13.6 > 9.09
    assert drafting_pays(torch.tensor([0.9]), 1, cost, draft_seconds=0.02)
    # a poor candidate: 1.05 / 0.14 = 7.5 < 9.09
    assert not drafting_pays(torch.tensor([0.05]), 1, cost, draft_seconds=0.02)
    # a dear draft: 1.9 / (0.2 + 0.12) = 5.9 < 9.09, although choose_budget would verify the candidate once drafted
    assert not drafting_pays(torch.tensor([0.9]), 1, cost, draft_seconds=0.2)
    assert choose_budget(torch.tensor([0.9]), 1, cost, spent_seconds=0.2) == 2
    assert not drafting_pays(torch.zeros(0), 4, cost, draft_seconds=0.0)  # nothing to verify: nothing to gain


def test_drafting_pays_matches_a_naive_loop():
    gen = torch.Generator().manual_seed(1)
    cost = CostModel((1, 8, 16, 64, 256), (0.20, 0.22, 0.35, 0.70, 2.2), control_seconds=0.003)
    for b in (1, 4, 16, 64):
        for _ in range(20):
            est = torch.sort(torch.rand(b, generator=gen) ** 3, descending=True).values
            draft = float(torch.rand(1, generator=gen)) * 0.1
            best = max((b + float(est[:n].sum())) / (draft + 0.003 + float(cost.verify_time(b + n)))
                       for n in range(1, b + 1))
            assert drafting_pays(est, b, cost, draft) == (best > b / float(cost.verify_time(b)))


def test_linear_cost_like_a_cpu_kernel_means_ar():
    """Verification costing as much per token as a decode step: nothing is worth verifying."""
    cost = CostModel.linear(0.0, 0.2)
    assert choose_budget(torch.tensor([0.95, 0.9, 0.8]), 1, cost) == 1
    assert choose_budget(torch.full((64,), 0.9), 16, cost) == 16


def test_useless_drafts_mean_ar_and_perfect_drafts_take_the_flat_region():
    # The CPU curve of Qwen2.5-Coder-1.5B quoted in issue 4 (T -> seconds).
    cost = CostModel((1, 4, 8, 16, 32, 64, 128, 256), (0.225, 0.205, 0.249, 0.411, 0.423, 0.682, 1.184, 2.230))
    # (T = 4 measured cheaper than T = 1 there, so useless drafts still ride along up to 4 tokens.)
    assert choose_budget(torch.full((255,), 0.001), 1, cost, spent_seconds=0.08) == 4
    monotone = CostModel((1, 8, 16, 64), (0.225, 0.249, 0.411, 0.682))
    assert choose_budget(torch.full((63,), 0.001), 1, monotone, spent_seconds=0.08) == 1
    perfect = choose_budget(torch.ones(255), 1, cost, spent_seconds=0.08)
    decaying = choose_budget(0.7 ** torch.arange(1, 256, dtype=torch.float64), 1, cost, spent_seconds=0.08)
    assert perfect == 256 and 1 < decaying < 16


def test_interpolation_and_json_round_trip(tmp_path):
    assert interpolate((1, 3), (1.0, 3.0), torch.tensor([2.0, 5.0])).tolist() == [2.0, 5.0]
    cost = CostModel((1, 8), (0.1, 0.2), (1, 4), (0.01, 0.02), 0.001, "cpu")
    cost.save(tmp_path / "cost.json")
    assert CostModel.load(tmp_path / "cost.json") == cost
    with pytest.raises(ValueError, match="strictly increasing"):
        CostModel((4, 2), (0.1, 0.2))
    with pytest.raises(ValueError, match="positive"):
        CostModel((1,), (0.0,))


def test_break_even_probability_by_hand():
    assert break_even_accept_prob(CostModel.linear(0.1, 0.01), 10) == pytest.approx((0.3 - 0.2) / 0.2)
    assert break_even_accept_prob(CostModel.linear(0.0, 0.01), 4) == 0.95  # linear: never pays, clamped
    assert break_even_accept_prob(CostModel((1, 64), (0.01, 0.01)), 4) == 0.02  # flat: always pays, clamped
    # with the draft: one more level of 2 nodes per request for 10 requests costs t_draft(20) on top
    with_draft = CostModel((1, 100), (0.11, 1.1), (1, 100), (0.011, 0.11))  # t_d(T) = 0.01 + 0.001 T
    assert break_even_accept_prob(with_draft, 10, draft_width=2) == pytest.approx((0.3 - 0.2 + 0.03) / 0.2)


def test_batch_buckets():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 256)] == [1, 2, 4, 4, 8, 8, 16, 16, 32, 256]
    with pytest.raises(ValueError, match="batch_size"):
        batch_bucket(0)


def test_tracker_starts_with_ar_then_probes_and_spaces_probes_by_hand():
    tr = SpeculationTracker(smoothing=0.3, min_ar_steps=1)
    assert not tr.should_speculate(1)  # nothing measured: plain AR first (it cannot lose)
    tr.update(1, speculated=False, emitted=1, seconds=0.5)  # AR: 2 tokens/s
    assert tr.rates(1).ar_rate == 2.0 and tr.should_speculate(1)  # then speculation, once
    # a speculative step after AR steps: 3 s, of which 2 s were the draft catching up -> rate 4 tokens / 1 s
    tr.update(1, True, emitted=4, seconds=3.0, one_off_seconds=2.0)
    r = tr.rates(1)
    assert r.spec_rate == 4.0 and r.steps_since_probe == 2
    r.spec_steps = r.ar_steps = 100  # past the equal-weight start: an EMA keeping 0.7, as the comments compute
    for _ in range(5):
        assert tr.should_speculate(1)
        tr.update(1, True, 4, 1.0)
    assert not tr.should_speculate(1)  # the 8th step probes AR
    tr.update(1, False, 1, 0.5)
    # confirmed: loss = 0.5 s x 4 tokens/s - 1 token = 1 token against 4 tokens per speculative step
    assert r.probe_every == max(16, math.ceil(1.0 / (0.02 * 4.0))) and r.steps_since_probe == 0
    # a probe that overturns the choice resets the spacing
    r.steps_since_probe = r.probe_every - 1
    tr.update(1, False, 1, 0.01)  # AR seconds EMA 0.7 * 0.5 + 0.3 * 0.01 = 0.353: 2.8 tokens/s, still < 4
    assert r.probe_every > tr.min_probe_every
    for _ in range(3):
        r.steps_since_probe = r.probe_every - 1
        tr.update(1, False, 1, 0.01)  # AR keeps measuring fast: its rate passes speculation's
    assert r.ar_rate > r.spec_rate and r.probe_every == tr.min_probe_every
    r.steps_since_probe = 0
    assert not tr.should_speculate(1)  # AR is now the choice


def test_tracker_seeds_ar_with_the_median_of_its_first_steps():
    """A first AR step slowed by other work on the machine (3 s instead of 0.5 s) must not make a losing
    speculation (1.5 tokens/s against AR's 2) look better: AR's time starts as the median of min_ar_steps
    steps. (Seeded by the first step, an EMA with weight 0.1 chose speculation in 38 of these 40 steps.)"""
    tr = SpeculationTracker(smoothing=0.1)
    for seconds in (3.0, 0.5, 0.5):
        assert not tr.should_speculate(1)
        tr.update(1, False, 1, seconds)
    r = tr.rates(1)
    assert r.ar_seconds == 0.5  # the median, not 0.9 * 3 + 0.1 * 0.5
    chosen = []
    for _ in range(40):
        spec = tr.should_speculate(1)
        chosen.append(spec)
        tr.update(1, spec, 3 if spec else 1, 2.0 if spec else 0.5)
    assert sum(chosen) <= 2 and not any(chosen[-30:])  # a probe, then AR


def test_tracker_does_not_count_steps_where_speculation_cannot_pay():
    """B = 5..8 share a bucket; at B = 8 this curve forbids speculation (t(16) = 3 t(8)), at B = 5 it does not
    (flat to 10 tokens). Forced AR steps at B = 8 are no choice: they must not count as AR probes at B = 5."""
    tr = SpeculationTracker(cost=CostModel((1, 10, 16), (1.0, 1.0, 3.0)), min_ar_steps=1)
    assert not tr.can_pay(8) and tr.can_pay(5)
    tr.update(8, False, 8, 1.0)
    assert tr.rates(8).ar_steps == 0 and tr.rates(8).ar_rate is None
    tr.update(5, False, 5, 1.0)
    assert tr.rates(5).ar_steps == 1 and tr.rates(5) is tr.rates(8)


def test_tracker_keeps_batch_sizes_apart():
    """Speculation that pays at B = 1 says nothing about B = 16: each bucket starts safe on its own."""
    tr = SpeculationTracker(min_ar_steps=1)
    tr.update(1, False, 1, 1.0)
    tr.update(1, True, 5, 1.0)
    assert tr.should_speculate(1)
    assert not tr.should_speculate(16)  # cold bucket: AR first
    tr.update(16, False, 16, 1.0)
    tr.update(16, True, 20, 2.0)  # 1.25 tokens per request in 2 s: worse than AR's 1 per second
    assert not tr.should_speculate(12)  # 12 shares bucket 16
    assert tr.should_speculate(1)


def test_tracker_rate_is_a_ratio_of_averages():
    """Speculative steps of equal time but varying tokens: the rate is total tokens / total time, not the mean
    of per-step rates (which a lucky step would inflate)."""
    tr = SpeculationTracker(smoothing=0.5)
    tr.update(1, True, 1, 1.0)
    tr.update(1, True, 7, 1.0)  # EMA tokens 4, seconds 1
    assert tr.rates(1).spec_rate == pytest.approx(4.0)
    tr.update(1, True, 2, 3.0)  # tokens 3, seconds 2
    assert tr.rates(1).spec_rate == pytest.approx(1.5)


def test_tracker_depth_limit_starts_at_one_doubles_when_speculation_pays_and_halves_when_not():
    tr = SpeculationTracker(max_depth=6, min_ar_steps=1)
    tr.update(4, False, 4, 1.0)  # AR: 1 token per request per second
    assert tr.depth_limit(4) == 1
    tr.update(4, True, 12, 1.0)  # 3 per request per second: paid
    assert tr.depth_limit(4) == 2
    tr.update(4, True, 12, 1.0)
    tr.update(4, True, 12, 1.0)
    assert tr.depth_limit(4) == 6  # 2 -> 4 -> 8, capped at max_depth
    tr.update(4, True, 4, 2.0)  # 0.5 per request per second: did not pay
    assert tr.depth_limit(4) == 3
    assert tr.depth_limit(1) == 1  # other buckets start at one level


def test_tracker_with_a_prior_that_expects_speculation_to_pay_speculates_first_then_measures_ar():
    """Where the calibration says speculation pays, a bucket's first min_probe_every steps speculate with the
    policy's full depth, then AR is measured, then the measured rates decide; where it says no (or at another
    bucket), the safe AR start is unchanged."""
    asked = []

    def prior(b):
        asked.append(b)
        return b < 8

    tr = SpeculationTracker(max_depth=5, min_ar_steps=2, min_probe_every=3, prior=prior)
    chosen = []
    for _ in range(3):
        chosen.append(tr.should_speculate(1))
        assert tr.depth_limit(1) == 5
        tr.update(1, True, 1, 1.0)  # 1 token per request per second: as slow as AR will be
    for _ in range(2):
        chosen.append(tr.should_speculate(1))
        tr.update(1, False, 1, 0.5)  # AR: 2 per second
    assert chosen == [True, True, True, False, False]
    assert not tr.should_speculate(1)  # measured: AR wins, the prior no longer matters
    assert not tr.should_speculate(16) and tr.depth_limit(16) == 1  # the prior says no there: AR first
    assert asked == [1, 16]  # asked once per bucket
    # measured the other way round, speculation keeps running
    tr2 = SpeculationTracker(max_depth=5, min_ar_steps=1, min_probe_every=4, prior=lambda b: True)
    for spec, emitted, seconds in [(True, 3, 1.0)] * 4 + [(False, 1, 1.0)]:
        assert tr2.should_speculate(1) == spec
        tr2.update(1, spec, emitted, seconds)
    assert tr2.should_speculate(1)


def test_tracker_prior_cannot_override_a_cost_curve_that_forbids_speculation():
    tr = SpeculationTracker(cost=CostModel((1, 10, 16), (1.0, 1.0, 3.0)), prior=lambda b: True)
    assert not tr.should_speculate(8)


def test_the_calibrated_start_is_kept_out_of_the_load_regime():
    """A prior that says "speculate" is taken only where a draft level costs under PRIOR_MAX_LEVEL_COST of a plain
    step; on a curve where a level costs 40 % of a step the bucket starts with AR."""
    from echo_trtllm.core.cost import PRIOR_MAX_LEVEL_COST, level_cost_ratio

    flat = CostModel((1, 64), (1.0, 1.02), (1, 64), (0.01, 0.01))
    dear = CostModel((1, 64), (1.0, 1.0 + 63 * 0.14), (1, 64), (0.01, 0.01))
    assert level_cost_ratio(flat, 4, 1) < PRIOR_MAX_LEVEL_COST < level_cost_ratio(dear, 4, 1) < 1.0
    for cost, first in ((flat, True), (dear, False)):
        tr = SpeculationTracker(cost=cost, draft_width=1, prior=lambda b: True)
        assert tr.trusts_prior(4) == first and tr.should_speculate(4) == first
