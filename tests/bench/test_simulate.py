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


def chain_record(accepted_depth: int, drafted_depth: int = 4) -> dict:
    """A drafted chain of `drafted_depth` nodes (plus one rejected sibling at depth 1) whose first
    `accepted_depth` nodes the target accepted."""
    depths = list(range(1, drafted_depth + 1)) + [1]
    return {"depths": depths, "parents": list(range(-1, drafted_depth - 1)) + [-1],
            "accepted": [int(d <= accepted_depth) for d in depths[:-1]] + [0]}


def test_the_oracle_step_by_hand():
    from echo_trtllm.bench.simulate import oracle_step

    # chains 2, 0, 1: depth 1 holds two accepted tokens, depth 2 one; shallowest first
    choices = oracle_step([2, 0, 1], COST)
    assert [e for e, _ in choices] == [3, 4, 5, 6]
    expected = [t_verify(3), t_verify(4) + t_draft(1), t_verify(5) + t_draft(2), t_verify(6) + t_draft(2) + t_draft(1)]
    assert [t for _, t in choices] == pytest.approx(expected, rel=1e-12)
    # a level over two nodes dearer than two levels over one: two tokens drafted down one chain, not across two
    convex = CostModel((1, 100), (0.11, 1.1), (1, 2), (0.01, 0.05))
    _, two = oracle_step([2, 2], convex)[2]
    assert two == pytest.approx(t_verify(4) + 2 * 0.01, rel=1e-12)


@pytest.mark.parametrize("seed", range(40))
def test_the_oracle_is_the_best_of_every_per_request_choice(seed):
    """Brute force: every request of every step picks any depth up to its accepted chain, independently; the best
    tokens-over-seconds of all those combinations is the oracle's rate."""
    import itertools
    import random

    from echo_trtllm.bench.simulate import simulate_oracle

    rng = random.Random(seed)
    verify = sorted(rng.uniform(0.05, 0.4) for _ in range(4))
    cost = CostModel((1, 3, 6, 12), tuple(verify), (1, 2, 6), tuple(sorted(rng.uniform(0.001, 0.08) for _ in range(3))))
    steps = [[rng.randint(0, 3) for _ in range(2)] for _ in range(3)]
    records = [chain_record(c) for step in steps for c in step]

    def step_options(chains):
        out = []
        for depths in itertools.product(*(range(c + 1) for c in chains)):
            frontiers = [sum(d >= k for d in depths) for k in range(1, max(depths) + 1)]
            out.append((len(chains) + sum(depths),
                        float(cost.verify_time(len(chains) + sum(depths))) + cost.drafting_time(frontiers)))
        return out

    best = max(sum(e for e, _ in combo) / sum(t for _, t in combo)
               for combo in itertools.product(*(step_options(c) for c in steps)))
    row = simulate_oracle(records, 2, cost, steps=3)
    assert row["tokens_per_s"] == pytest.approx(best, rel=1e-9)
    assert row["allocation"] == "hindsight ceiling"


def test_the_oracle_needs_a_tree_source():
    with pytest.raises(ValueError, match="oracle.*needs a tree source"):
        simulate({"ar": [R0]}, [1], lambda b: COST, steps=1, methods=["ar", "oracle"])


def random_tree_record(rng, nodes: int = 12) -> dict:
    """A drafted tree: random parents and conditional probabilities, the target's accepted chain one path of it
    (accepted nodes' parents accepted), in the trace's layout (parents before children)."""
    parents, cond, depths = [], [], []
    for j in range(nodes):
        up = rng.randrange(-1, j)
        parents.append(up)
        depths.append(1 if up < 0 else depths[up] + 1)
        cond.append(rng.uniform(0.01, 1.0))
    probs: list[float] = []
    for c, up in zip(cond, parents):
        probs.append(c * (1.0 if up < 0 else probs[up]))
    accepted, at = [0] * nodes, -1
    while True:  # walk down from the root, each level accepting one child or stopping
        kids = [j for j, up in enumerate(parents) if up == at]
        if not kids or rng.random() < 0.3:
            break
        at = rng.choice(kids)
        accepted[at] = 1
    return {"probs": probs, "accepted": accepted, "depths": depths, "parents": parents, "verified": 1,
            "emitted": 1, "levels": max(depths)}


def test_a_confidence_shift_keeps_paths_ordered_and_never_lowers_any_depths_auc():
    import random

    from echo_trtllm.bench.simulate import depth_aucs, shift_confidence

    rng = random.Random(0)
    records = [random_tree_record(rng) for _ in range(200)]
    assert shift_confidence(records, 0.0)[0]["probs"] == pytest.approx(records[0]["probs"], rel=1e-6)
    assert [r["probs"] for r in shift_confidence(records, math.inf)] == [
        [float(a) for a in r["accepted"]] for r in records]

    # depth 1's AUC against a pairwise count (ties 1/2)
    pos = [p for r in records for p, a, e in zip(r["probs"], r["accepted"], r["depths"]) if e == 1 and a]
    neg = [p for r in records for p, a, e in zip(r["probs"], r["accepted"], r["depths"]) if e == 1 and not a]
    pairs = sum((x > y) + 0.5 * (x == y) for x in pos for y in neg) / (len(pos) * len(neg))
    previous = depth_aucs(records, 3)
    assert previous[0] == pytest.approx(pairs, rel=1e-12)
    assert all(0.3 < a < 0.8 for a in previous)  # the random confidence ranks the outcome poorly to start with
    for shift in (0.25, 0.5, 1.0, 2.0, 4.0, math.inf):
        shifted = shift_confidence(records, shift)
        for r in shifted:
            assert all(p <= r["probs"][up] + 1e-12 for p, up in zip(r["probs"], r["parents"]) if up >= 0)
        now = depth_aucs(shifted, 3)
        assert all(b >= a - 1e-12 for a, b in zip(previous, now)), (shift, previous, now)
        previous = now
    assert previous == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="confidence shift must be >= 0"):
        shift_confidence(records, -1.0)


def test_gate_samples_from_records_take_each_depths_most_probable_node():
    from echo_trtllm.bench.simulate import records_gate_samples

    r = {"probs": [0.9, 0.05, 0.5, 0.3, 0.2], "accepted": [1, 0, 0, 1, 0], "depths": [1, 1, 2, 2, 3],
         "parents": [-1, -1, 0, 0, 3]}
    s = records_gate_samples([r], max_depth=2)
    assert s.depths.tolist() == [1, 2]
    assert s.confidences.tolist() == pytest.approx([0.9, 0.5])
    assert s.accepted.tolist() == [True, False]


def test_the_what_if_on_the_command_line_writes_strict_json_and_refuses_what_it_would_ignore(tmp_path, capsys):
    import json
    from pathlib import Path

    from echo_trtllm.cli import main

    trace = str(Path(__file__).parents[2] / "docs" / "bench" / "qwen-eagle3-h2-tune-trace.json")
    source = "eagle2:total_tokens=8:max_depth=6"
    out = tmp_path / "sim.json"
    assert main(["simulate", "--trace", trace, "--tree-source", source, "--batch-sizes", "4", "--steps", "5",
                 "--methods", "ar,echo,oracle", "--confidence-shift", "inf", "--json", str(out)]) == 0
    assert "WHAT-IF" in capsys.readouterr().out

    def strict(name):
        raise ValueError(f"not strict JSON: {name}")

    data = json.loads(out.read_text(), parse_constant=strict)
    assert data["confidence_shift"] == "inf" and data["confidence_auc_by_depth"][:5] == [1.0] * 5
    rows = {r["method"]: r for r in data["rows"]}
    assert rows["echo"]["allocation"].endswith("confidence shifted by inf (what-if)")
    assert rows["oracle"]["allocation"] == "hindsight ceiling" and rows["ar"]["allocation"] == "as recorded"
    assert main(["simulate", "--trace", trace, "--confidence-shift", "-1"]) == 2
    assert "--confidence-shift must be a number >= 0" in capsys.readouterr().err
    assert main(["simulate", "--trace", trace, "--confidence-shift", "1", "--gate-calibration", trace]) == 2
    assert "--gate-calibration does not apply with --confidence-shift" in capsys.readouterr().err
