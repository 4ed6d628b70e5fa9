"""The budget rule against hand-computed cases and its limiting behaviours."""


import pytest
import torch

from echo_trtllm.core.cost import CostModel, break_even_accept_prob, choose_budget, interpolate


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


def test_marginal_token_time_reads_the_curve_by_hand():
    """One more verified token's price: the curve's slope between B and B + 1, by hand on linear pieces."""
    from echo_trtllm.core.cost import marginal_token_time

    assert marginal_token_time(CostModel.linear(0.1, 0.01), 16) == pytest.approx(0.01)
    # knots (1, 0.2), (8, 0.27), (16, 0.43): 0.01 a token below 8, 0.02 above
    cost = CostModel((1, 8, 16), (0.20, 0.27, 0.43))
    assert marginal_token_time(cost, 4) == pytest.approx(0.01)
    assert marginal_token_time(cost, 8) == pytest.approx(0.02)
    assert marginal_token_time(cost, 0) == marginal_token_time(cost, 1)  # no batch reads as one request
    # a curve that falls between two knots prices the token negative
    assert marginal_token_time(CostModel((1, 4), (0.3, 0.2)), 2) == pytest.approx(-0.1 / 3)


def test_budget_seconds_is_each_k_priced_alone():
    """`budget_seconds` (summed in NumPy) against a loop pricing each n alone as floats: the drafting already
    spent, the tree's constant once any drafted token is verified, the verification of B + n tokens; on the
    curve model and on the learnt step prices."""
    from echo_trtllm.core.cost import budget_seconds
    from echo_trtllm.core.prices import StepCostModel

    curve = CostModel((1, 8, 16, 64, 256), (0.20, 0.22, 0.35, 0.70, 2.2), control_seconds=0.003)
    for cost, context in ((curve, None), (StepCostModel.from_cost_model(curve).prices, 150.0)):
        got = budget_seconds(40, 16, cost, 0.05, context)
        assert got.dtype == torch.float64 and got.shape == (41,)
        want = [0.05 + (cost.control_seconds if n else 0.0) + float(cost.verify_time(16 + n, context, 16))
                for n in range(41)]
        assert got.tolist() == pytest.approx(want, rel=1e-12)
