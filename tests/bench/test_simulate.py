"""The simulator against hand-computed steps, and the oracle's pieces against hand-worked cases."""

import math

import pytest

from echo_trtllm.bench.simulate import GPUS, MODELS, roofline_cost, simulate, simulate_method
from echo_trtllm.bench.trace import StepEntry, hindsight_flags, oracle_emitted
from echo_trtllm.core.cost import CostModel

# t_verify(T) = 0.1 + 0.01 T and t_draft(T) = 0.01 + 0.001 T, exact under linear interpolation
COST = CostModel((1, 100), (0.11, 1.1), (1, 100), (0.011, 0.11))
R0 = {"probs": [0.9, 0.05], "accepted": [1, 0], "verified": 3, "emitted": 2, "levels": 2}
R1 = {"probs": [0.6], "accepted": [1], "verified": 2, "emitted": 2, "levels": 1}


def t_verify(t):
    return 0.1 + 0.01 * t


def t_draft(t):
    return 0.01 + 0.001 * t


def test_ar_step_by_hand():
    row = simulate_method("ar", [R0, R1], 2, COST, steps=1)
    assert row["tokens_per_s"] == pytest.approx(2 / t_verify(2), rel=1e-12)
    assert row["mat"] == 1.0


def test_fixed_tree_step_by_hand():
    # emitted 2 + 2, verified 3 + 2; 2 levels, 3 drafted -> 2 per level
    row = simulate_method("chain", [R0, R1], 2, COST, steps=1)
    assert row["tokens_per_s"] == pytest.approx(4 / (t_verify(5) + 2 * t_draft(2)), rel=1e-12)
    assert row["verified_per_step"] == 5


def test_echo_step_by_hand():
    # candidates by probability: 0.9 (accepted), 0.6 (accepted), 0.05; drafting 2 * t_draft(2) is sunk.
    spent = 2 * t_draft(2)
    rates = [(2 + sum([0.9, 0.6, 0.05][:n])) / (spent + t_verify(2 + n)) for n in range(4)]
    n_best = max(range(4), key=lambda n: rates[n])
    assert n_best == 2  # the 0.05 candidate is not worth its verification
    row = simulate_method("echo", [R0, R1], 2, COST, steps=1)
    assert row["verified_per_step"] == 4
    assert row["tokens_per_s"] == pytest.approx(4 / (spent + t_verify(4)), rel=1e-12)
    # a budget cap binds: K_max = 3 takes only the 0.9 candidate
    capped = simulate_method("echo", [R0, R1], 2, COST, steps=1, k_max=3)
    assert capped["tokens_per_s"] == pytest.approx(3 / (spent + t_verify(3)), rel=1e-12)


def test_records_are_taken_cyclically():
    rows = simulate({"ar": [R0], "chain": [R0, R1]}, [1], lambda b: COST, steps=2)
    chain = next(r for r in rows if r["method"] == "chain")
    # step 0 takes R0, step 1 takes R1
    expected = 4 / (t_verify(3) + 2 * t_draft(1) + t_verify(2) + t_draft(1))
    assert chain["tokens_per_s"] == pytest.approx(expected, rel=1e-12)
    assert chain["speedup_vs_ar"] == pytest.approx(expected / (1 / t_verify(1)), rel=1e-12)


def test_roofline_is_memory_bound_then_compute_bound():
    model, gpu = MODELS["70b"], GPUS["H100"]
    cost = roofline_cost(model, gpu, "bf16", batch_size=1, context=0, mfu=0.5, bw_efficiency=0.8, fixed_overhead=0)
    t_mem = model.total_params * 2 / (gpu.bandwidth * 8 * 0.8)
    assert float(cost.verify_time(1)) == pytest.approx(t_mem)
    per_token = 2 * model.active_params / (gpu.bf16_flops * 8 * 0.5)
    assert float(cost.verify_time(16384)) == pytest.approx(per_token * 16384)
    with pytest.raises(ValueError, match="dtype"):
        roofline_cost(model, gpu, "int4", 1, 0)


def test_hindsight_flags_follow_the_output():
    # root -> a(5) -> b(6); root -> c(7); a -> d(9). Output after the step's position 2: [.., .., 5, 6, 8]
    e = StepEntry(0, 2, [5, 7, 6, 9], [-1, -1, 0, 0], [0.9, 0.1, 0.8, 0.05], [1, 1, 2, 2], 3, 2)
    assert hindsight_flags(e, [1, 2, 5, 6, 8]) == [True, False, True, False]
    assert hindsight_flags(e, [1, 2, 5]) == [True, False, False, False]  # output ends: nothing deeper is known
    assert oracle_emitted([2, 0, 3], verified_total=6) == 3 + 3  # budget binds: 6 - 3 spare slots
    assert oracle_emitted([2, 0, 3], verified_total=20) == 3 + 5
    assert math.isclose(oracle_emitted([], 0), 0)


def test_the_wider_oracle_counts_what_another_method_drafted():
    """Method A drafted [5, 1] (the second token wrong); method B drafted [5, 6, 7] at the same position of the
    same output. A's own oracle is A itself (ratio 1); the wider one knows B showed 6 was there: with A's budget of
    two drafts it emits 1 + 2 = 3 against A's 2. B verified all it drafted and everything it drafted was
    accepted: 1.0 either way. A request whose output differs from the reference lends nothing."""
    from echo_trtllm.bench.run import widen_oracles
    from echo_trtllm.bench.trace import TraceRecorder

    out = [5, 6, 7, 8, 9]

    def recorded(tokens, verified, emitted, request=7):
        rec = TraceRecorder(per_request_cap=4, max_depth=4)
        rec.steps = [[StepEntry(request, 0, tokens, list(range(-1, len(tokens) - 1)), [0.5] * len(tokens),
                                list(range(1, len(tokens) + 1)), verified, emitted)]]
        return rec

    a, b = recorded([5, 1], 3, 2), recorded([5, 6, 7], 4, 4)
    cells = {"ar": {"token_ids": [out]},
             "A": {"token_ids": [out], "_oracle": (a, {7: out}, {7: 0})},
             "B": {"token_ids": [out], "_oracle": (b, {7: out}, {7: 0})}}
    widen_oracles(cells)
    assert a.evaluate({7: out})["mat_vs_own_oracle"] == 1.0
    assert cells["A"]["mat_vs_oracle"] == pytest.approx(2 / 3)
    assert cells["B"]["mat_vs_oracle"] == 1.0
    # B's output parts from the reference: its drafts no longer widen A's oracle
    other = [5, 6, 7, 8, 0]
    cells["B"] = {"token_ids": [other], "_oracle": (b, {7: other}, {7: 0})}
    widen_oracles(cells)
    assert cells["A"]["mat_vs_oracle"] == 1.0


def test_tuning_picks_each_policy_its_fastest_simulated_shape():
    from echo_trtllm.bench.run import parse_method
    from echo_trtllm.bench.tune import GRID, best_shapes, grid_methods

    rows = [{"method": "ar", "batch_size": 4, "tokens_per_s": 10.0},
            {"method": "chain:num_draft_tokens=1", "batch_size": 4, "tokens_per_s": 12.0},
            {"method": "chain:num_draft_tokens=2", "batch_size": 4, "tokens_per_s": 13.0},
            {"method": "chain:num_draft_tokens=2", "batch_size": 16, "tokens_per_s": 99.0},
            {"method": "echo:beam_width=1:max_nodes_per_request=8", "batch_size": 4, "tokens_per_s": 14.0}]
    best = best_shapes(rows, 4)
    assert {p: r["method"] for p, r in best.items()} == {"chain": "chain:num_draft_tokens=2",
                                                          "echo": "echo:beam_width=1:max_nodes_per_request=8"}
    with pytest.raises(ValueError, match="no drafting rows at batch size 64"):
        best_shapes(rows, 64)
    shapes = grid_methods()
    assert shapes[0] == "ar" and len(shapes) == 1 + sum(len(g) for g in GRID.values())
    for s in shapes:  # every shape of the grid is a valid bench entry
        parse_method(s)


def test_one_shape_picks_the_latency_shape_and_the_maximin_shape_by_hand():
    from echo_trtllm.bench.tune import one_shape, one_shape_table

    def row(method, b, rate):
        return {"method": method, "batch_size": b, "tokens_per_s": rate}

    # best per batch size: B = 1: 30 (wide chain), B = 64: 200 (echo). chain:1 worst 18/30 = 0.6 (B = 1),
    # chain:4 worst 100/200 = 0.5 (B = 64): maximin chain:1, latency chain:4; echo worst 25/30
    rows = [row("ar", 1, 10), row("ar", 64, 100),
            row("chain:num_draft_tokens=1", 1, 18), row("chain:num_draft_tokens=1", 64, 150),
            row("chain:num_draft_tokens=4", 1, 30), row("chain:num_draft_tokens=4", 64, 100),
            row("echo:beam_width=1", 1, 25), row("echo:beam_width=1", 64, 200)]
    got = one_shape(rows)
    assert got["chain"]["latency"] == "chain:num_draft_tokens=4"
    assert got["chain"]["maximin"] == "chain:num_draft_tokens=1" and got["chain"]["worst"] == pytest.approx(0.6)
    assert got["echo"]["latency"] == got["echo"]["maximin"] == "echo:beam_width=1"
    assert got["echo"]["worst"] == pytest.approx(25 / 30)
    table = one_shape_table(rows)
    assert "| chain | latency: `chain:num_draft_tokens=4` | 3.00 | 1.00 | 0.50 |" in table
    assert "| echo | maximin: `echo:beam_width=1` | 2.50 | 2.00 | 0.83 |" in table
    with pytest.raises(ValueError, match="no drafting rows"):
        one_shape([row("ar", 1, 10)])
