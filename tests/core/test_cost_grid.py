"""The cost model's verification grid (tokens x cached context per request), by hand-computed interpolation."""

import pytest
import torch

from echo_trtllm.core.cost import CostModel, choose_budget, interpolate

GRID = dict(grid_tokens=(1, 16), grid_contexts=(100, 1000), grid_seconds=((0.010, 0.020), (0.030, 0.120)))


def test_bilinear_in_tokens_and_context_and_the_curve_without_a_context():
    cost = CostModel((1, 16), (0.01, 0.03), **GRID)
    assert float(cost.verify_time(1, 100)) == pytest.approx(0.010)
    assert float(cost.verify_time(16, 1000)) == pytest.approx(0.120)
    # context 550 is halfway: rows (0.015, 0.075); 8.5 tokens is halfway between them: 0.045
    assert float(cost.verify_time(8.5, 550)) == pytest.approx(0.045)
    # beyond the grid: extrapolated along its last segments (context 1900: rows 0.03, 0.21)
    assert float(cost.verify_time(16, 1900)) == pytest.approx(0.21)
    # no context, or no grid: the curve
    assert float(cost.verify_time(16)) == pytest.approx(0.03)
    assert float(CostModel((1, 16), (0.01, 0.03)).verify_time(16, 1000)) == pytest.approx(0.03)
    torch.testing.assert_close(cost.verify_time(torch.tensor([1, 16]), 100),
                               torch.tensor([0.010, 0.030], dtype=torch.float64))


def reference_interpolate(xs, ys, x: float) -> float:
    """Piecewise linear through the points, extrapolated along the end segments; one point: proportional."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    i = min(max(next((k for k, v in enumerate(xs) if v >= x), len(xs)), 1), len(xs) - 1)
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])


@pytest.mark.parametrize("tokens_axis,contexts_axis", [((1, 4, 16, 64), (64, 256, 1024)), ((1, 16), (100,)),
                                                         ((8,), (64, 512))])
def test_the_grid_reads_match_row_by_row_interpolation(tokens_axis, contexts_axis):
    """The tensor tables and the per-context token curves (built once, kept per context) read exactly what
    interpolating each row along the contexts and then along the tokens reads (`reference_interpolate`, written
    out here), in and beyond the grid, for the verification and the draft grid, with one-point axes (proportional)
    included, and again from the kept curve."""
    gen = torch.Generator().manual_seed(3)
    rows = lambda: tuple(tuple(float(x) for x in row) for row in  # noqa: E731
                         torch.rand(len(tokens_axis), len(contexts_axis), generator=gen).add(0.01).cumsum(0))
    grid, draft_grid = rows(), rows()
    cost = CostModel((1, 16), (0.01, 0.03), (1, 16), (0.001, 0.002), grid_tokens=tokens_axis,
                     grid_contexts=contexts_axis, grid_seconds=grid, draft_grid_seconds=draft_grid)
    tokens = torch.tensor([1, 3, 8, 16, 40, 64, 200])
    for context in (10.0, 64.0, 100.0, 300.5, 1024.0, 3000.0, 300.5):
        for table, read in ((grid, cost.verify_time), (draft_grid, cost.draft_time)):
            c = torch.tensor(context)
            at_context = tuple(reference_interpolate(contexts_axis, row, context) for row in table)
            expected = torch.tensor([reference_interpolate(tokens_axis, at_context, float(t)) for t in tokens],
                                    dtype=torch.float64).clamp(min=1e-9)
            torch.testing.assert_close(read(tokens, context), expected)
            assert float(read(5, context)) == pytest.approx(max(reference_interpolate(tokens_axis, at_context, 5.0),
                                                                1e-9))
    assert float(interpolate((4.0,), (2.0,), torch.tensor(6.0))) == pytest.approx(3.0)  # one point: proportional


def test_the_grid_round_trips_through_json_and_bad_grids_are_refused():
    cost = CostModel((1, 16), (0.01, 0.03), **GRID)
    again = CostModel.from_json(cost.to_json())
    assert again == cost and again.has_grid
    with pytest.raises(ValueError, match="grid_seconds"):
        CostModel((1,), (0.01,), grid_tokens=(1, 16), grid_contexts=(100,), grid_seconds=((0.01,),))
    with pytest.raises(ValueError, match="grid_contexts"):
        CostModel((1,), (0.01,), grid_tokens=(1,), grid_contexts=(100, 50), grid_seconds=((0.01, 0.02),))


def test_the_budget_rule_prices_each_step_at_its_own_context():
    """Cheap extra tokens at a short context, dear ones at a long context: K shrinks as the context grows."""
    cost = CostModel((1, 16), (0.01, 0.011), grid_tokens=(1, 16), grid_contexts=(100, 1000),
                     grid_seconds=((0.010, 0.020), (0.011, 0.200)))
    est = torch.full((15,), 0.5)
    assert choose_budget(est, 1, cost, context=100) == 16
    assert choose_budget(est, 1, cost, context=1000) == 1
    assert choose_budget(est, 1, cost) == 16  # the curve: flat


def test_the_step_overhead_is_the_median_residual_of_real_steps():
    """Real steps cost the forward plus a host term the forward timings miss; the fit is the median of
    measured - predicted (a slow outlier does not move it), added to every verify_time, kept in JSON."""
    import dataclasses

    from echo_trtllm.core.cost import fit_step_overhead

    cost = CostModel.linear(0.010, 0.001)
    steps = [(t, 100.0, 0.010 + 0.001 * t + 0.004) for t in (1, 3, 8, 20)] + [(5, 100.0, 0.5)]
    overhead = fit_step_overhead(cost, steps)
    assert overhead == pytest.approx(0.004)
    fitted = dataclasses.replace(cost, step_overhead_seconds=overhead)
    assert float(fitted.verify_time(10)) == pytest.approx(0.010 + 0.010 + 0.004)
    assert CostModel.from_json(fitted.to_json()) == fitted
    # refitting a fitted model finds the same term (its own overhead is not counted twice)
    assert fit_step_overhead(fitted, steps) == pytest.approx(0.004)
    # a forward timing that already covers everything: no negative overhead
    assert fit_step_overhead(cost, [(4, 10.0, 0.012)]) == 0.0
    with pytest.raises(ValueError, match="step_overhead_seconds must be >= 0"):
        CostModel((1,), (0.1,), step_overhead_seconds=-0.001)
    with pytest.raises(ValueError, match="at least one measured step"):
        fit_step_overhead(cost, [])


def test_the_draft_level_overhead_is_the_median_per_level_residual_of_real_steps():
    """Real drafting costs the draft forwards plus host work per level; the fit is the median over steps of
    (measured - the draft curve over the step's frontiers) / levels, added to every draft_level_time (not to the
    forward's draft_time), kept in JSON; steps that drafted nothing do not count."""
    import dataclasses

    from echo_trtllm.core.cost import fit_draft_overhead, level_cost_ratio

    cost = CostModel((1, 64), (0.01, 0.05), (1, 64), (0.001, 0.004))
    fwd = lambda f: float(cost.draft_time(f))  # noqa: E731
    steps = [(fr, sum(fwd(f) + 0.002 for f in fr), None) for fr in ([4], [4, 8], [4, 8, 8], [16, 2])]
    steps += [([4, 4], 0.9, None), ([], 0.5, None)]  # a slow outlier; a step that drafted no level
    overhead = fit_draft_overhead(cost, steps)
    assert overhead == pytest.approx(0.002)
    fitted = dataclasses.replace(cost, draft_level_overhead_seconds=overhead)
    assert float(fitted.draft_level_time(8)) == pytest.approx(fwd(8) + 0.002)
    assert float(fitted.draft_time(8)) == pytest.approx(fwd(8))
    assert fit_draft_overhead(fitted, steps) == pytest.approx(0.002)  # refitting does not count it twice
    assert CostModel.from_json(fitted.to_json()) == fitted
    # a level's price includes it: B = 4, one forward over 4 tokens
    assert level_cost_ratio(fitted, 4, 1) == pytest.approx(
        level_cost_ratio(cost, 4, 1) + 0.002 / float(cost.verify_time(4)))
    assert fitted.drafting_time([4, 8]) == pytest.approx(fwd(4) + fwd(8) + 2 * 0.002)
    assert float(CostModel((1,), (0.1,), draft_level_overhead_seconds=0.5).draft_level_time(3)) == 0.0  # no draft curve
    assert fit_draft_overhead(cost, [([4], 0.0, None)]) == 0.0
    with pytest.raises(ValueError, match="draft_level_overhead_seconds must be >= 0"):
        CostModel((1,), (0.1,), draft_level_overhead_seconds=-0.001)
    with pytest.raises(ValueError, match="drafted a level"):
        fit_draft_overhead(cost, [([], 0.1, None)])


def test_a_draft_grid_prices_levels_at_the_steps_context_and_the_fit_reads_it():
    """With a draft grid on the verification grid's axes, a draft level is read at the step's context (a level
    over 16 requests at context 1000 costs 4x one at context 100 here), without a context from the one-request
    curve; the per-level host fit subtracts the forwards at each step's own context, so steps that cost exactly
    the grid's forwards leave no overhead (the curve would call the context's cost host work)."""
    import dataclasses

    from echo_trtllm.core.cost import fit_draft_overhead

    cost = CostModel((1, 16), (0.01, 0.03), (1, 16), (0.001, 0.002), **GRID,
                     draft_grid_seconds=((0.001, 0.002), (0.002, 0.008)))
    assert float(cost.draft_time(16, 1000)) == pytest.approx(0.008)
    assert float(cost.draft_time(8.5, 550)) == pytest.approx(0.00325)  # rows (0.0015, 0.005), halfway
    assert float(cost.draft_time(16)) == pytest.approx(0.002)  # no context: the curve
    with_host = dataclasses.replace(cost, draft_level_overhead_seconds=0.001)
    assert with_host.drafting_time([16, 16], 1000) == pytest.approx(2 * 0.009)
    assert CostModel.from_json(cost.to_json()) == cost
    steps = [([16], 0.008, 1000.0), ([16, 16], 0.016, 1000.0), ([1], 0.001, 100.0)]
    assert fit_draft_overhead(cost, steps) == 0.0
    assert fit_draft_overhead(cost, [(f, m, None) for f, m, _ in steps]) == pytest.approx(0.006)
    with pytest.raises(ValueError, match="draft_grid_seconds"):
        CostModel((1,), (0.01,), **GRID, draft_grid_seconds=((0.001,), (0.002,)))
    with pytest.raises(ValueError, match="grid's axes"):
        CostModel((1,), (0.01,), draft_grid_seconds=((0.001,),))
