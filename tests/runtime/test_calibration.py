"""Calibration: the samples it learns from (against a naive per-request loop), the file it writes (round trip,
engine directory), and what the runtime does with it (same outputs as AR, calibrated gate in use)."""

import json

import pytest
import torch

from echo_trtllm.api import LLM
from echo_trtllm.core import EchoConfig, draft_tree, make_policy
from echo_trtllm.core.cost import CostModel
from echo_trtllm.core.verify import VerifyResult
from echo_trtllm.engine_build import build_engine
from echo_trtllm.engine_dir import attach_calibration, read_engine
from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET
from echo_trtllm.runtime.calibrate import Calibration, calibrate, gate_samples
from echo_trtllm.runtime.request import SamplingParams
from tests.helpers import markov_draft_fn


def random_accepted_paths(tree, gen):
    """A VerifyResult accepting a random root path of every request of `tree` (flat indices)."""
    ids, cu = [], [0]
    parents, cu_nodes = tree.parents.tolist(), tree.cu_num_nodes.tolist()
    for i in range(tree.batch_size):
        lo, hi = cu_nodes[i], cu_nodes[i + 1]
        path, node = [lo], 0
        while True:
            children = [j for j in range(hi - lo) if parents[lo + j] == node]
            if not children or torch.rand(1, generator=gen).item() < 0.3:
                break
            node = children[int(torch.randint(len(children), (1,), generator=gen))]
            path.append(lo + node)
        ids += path
        cu.append(len(ids))
    t = torch.tensor(ids)
    return VerifyResult(t, tree.token_ids[t], torch.tensor(cu))


def naive_gate_samples(drafted, result):
    cand = drafted.candidates
    verified = torch.nonzero(drafted.mask).squeeze(1).tolist()
    accepted = {verified[j] for j in result.accepted_node_ids.tolist()}
    out = []
    cu = cand.cu_num_nodes.tolist()
    for i in range(cand.batch_size):
        nodes = range(cu[i], cu[i + 1])
        for d in range(1, int(cand.depths.max()) + 1):
            at_d = [n for n in nodes if int(cand.depths[n]) == d]
            if not at_d:
                continue
            best = max(at_d, key=lambda n: (float(cand.path_probs[n]), -n))  # first of ties
            if best in verified:
                out.append((d, float(cand.path_probs[best]), best in accepted))
    return sorted(out)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gate_samples_match_a_naive_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    policy = make_policy(EchoConfig(k_max=40, max_depth=4, top_k=3, beam_width=2, max_nodes_per_request=12))
    roots = torch.randint(0, 16, (5,), generator=gen)
    drafted = draft_tree(policy, roots, markov_draft_fn(16, seed), budget=40)
    result = random_accepted_paths(drafted.selected, gen)
    d, c, a = gate_samples(drafted, result)
    got = sorted(zip(d.tolist(), c.tolist(), a.tolist()))
    want = naive_gate_samples(drafted, result)
    assert [(x[0], x[2]) for x in got] == [(x[0], x[2]) for x in want]
    assert [x[1] for x in got] == pytest.approx([x[1] for x in want])
    assert any(x[2] for x in want) and len(want) > 5  # the case exercises both labels


@pytest.fixture(scope="module")
def calibration(default_pair, prompts):
    target, draft, tok = default_pair
    from tests.runtime.test_budget_rule import FLAT

    return calibrate(target, draft, tok, EchoConfig(max_depth=5), prompts[:8], batch_size=4, max_tokens=16,
                     cost_model=FLAT)


def test_calibration_is_valid_and_round_trips(calibration, tmp_path):
    g = calibration.gate
    assert g.gate_depths[0] == 1 and g.gate_depths[-1] == 5 and len(g.gate_depths) <= 4
    assert all(0.0 <= t <= 1.0 for t in g.thresholds)
    assert 0.02 <= calibration.break_even_accept_prob <= 0.95
    assert calibration.warmup["samples"] >= 8 * 4  # several depths per request-step
    assert sum(g.num_samples.values()) == calibration.warmup["samples"]
    # acceptance falls with depth (the draft's best path survives less often deeper down)
    assert g.acceptance_rate[1] > g.acceptance_rate[5]
    path = tmp_path / "cal.json"
    calibration.save(path)
    back = Calibration.load(path)
    assert back.to_json() == calibration.to_json()
    assert back.cost_model == calibration.cost_model
    bad = json.loads(path.read_text())
    del bad["gate"]
    with pytest.raises(ValueError, match="lacks fields"):
        Calibration.from_json(json.dumps(bad))


def test_the_policy_gets_the_calibrated_gate_at_construction(calibration):
    """One way in: make_policy(config, cost_model, gate_samples). The sparse gate sits at the calibration's sweet-spot
    depths (dense: every depth), and each threshold is where the acceptance estimates, whose prior is the
    calibration's isotonic map, cross the break-even probability at the batch size: just above tau_d a node is
    worth verifying, just below it is not. echo-fixed uses one threshold. Another max_depth is refused."""
    from echo_trtllm.core.cost import break_even_accept_prob

    samples = calibration.gate_samples()
    b = calibration.operating_batch_size
    lam = break_even_accept_prob(calibration.cost_model, b, EchoConfig().beam_width)
    for policy, depths in (("echo", calibration.gate.gate_config().depths), ("echo-dense", (1, 2, 3, 4, 5)),
                           ("echo-fixed", calibration.gate.gate_config().depths)):
        p = make_policy(EchoConfig(max_depth=5, policy=policy), calibration.cost_model, samples)
        assert p.gates.source == "calibration"
        gate = p.gate_for(b)
        assert gate.depths == depths
        if policy == "echo-fixed":
            assert len(set(gate.thresholds)) == 1
            continue
        for d, tau in zip(gate.depths, gate.thresholds):
            delta = min(1e-3, tau / 2)  # the thresholds are read on a grid: geometric below 0.01
            above = float(p.acceptance_estimates(torch.tensor([min(tau * 1.02 + delta, 1.0)], dtype=torch.float64), d))
            below = float(p.acceptance_estimates(torch.tensor([max(tau * 0.98 - delta, 0.0)], dtype=torch.float64), d))
            assert (tau >= 1.0 or above >= lam - 1e-9) and (tau <= 0.0 or below < lam + 1e-9), (d, tau, above, below)
    with pytest.raises(ValueError, match="max_depth=5 but the config has max_depth=6"):
        make_policy(EchoConfig(max_depth=6), calibration.cost_model, samples)
    with pytest.raises(ValueError, match="max_depth=5 but the config has max_depth=6"):
        LLM(speculative_config=EchoConfig(max_depth=6), calibration=calibration, max_batch_size=2)


def test_calibrated_engine_directory_is_used_and_lossless(calibration, tmp_path, prompts):
    cfg = EchoConfig(k_max=64, max_depth=5, max_nodes_per_request=16)
    out = build_engine(tmp_path / "tiny", DEFAULT_TARGET, DEFAULT_DRAFT, cfg)
    attach_calibration(out, calibration)
    assert read_engine(out).calibration == out / "calibration.json"
    sp = SamplingParams(max_tokens=16, temperature=0)
    with LLM(engine_dir=out, max_batch_size=4) as llm, LLM(DEFAULT_TARGET, speculative_config=EchoConfig(policy="ar"),
                                                           max_batch_size=4, dtype="float32") as ar:
        ex = llm.executor
        assert ex.cost_model == calibration.cost_model and ex.controller is not None
        assert ex.policy.gates.source == "calibration" and ex.config.gate_depths is None
        assert ex.policy.gate_for(4).depths == calibration.gate.gate_config().depths
        got = [o.token_ids for o in llm.generate(prompts[:6], sp)]
        want = [o.token_ids for o in ar.generate(prompts[:6], sp)]
    assert got == want
    (out / "calibration.json").unlink()
    with pytest.raises(FileNotFoundError, match="calibration"):
        read_engine(out)


def test_calibration_needs_prompts(default_pair):
    target, draft, tok = default_pair
    with pytest.raises(ValueError, match="at least one warm-up prompt"):
        calibrate(target, draft, tok, EchoConfig(), [], cost_tokens=(1,), repeats=1)


@pytest.mark.parametrize("kind", ["eagle3", "draft model"])
def test_the_draft_grid_is_measured_on_the_verification_grids_axes(default_pair, kind):
    """calibrate --grid measures the draft's forwards by tokens x context like the target's (a draft level under
    load reads every request's context); both are made non-decreasing in tokens, and the cost model reads the
    draft grid at a context."""
    from echo_trtllm.models.eagle3 import load_eagle3
    from echo_trtllm.runtime.calibrate import measure_cost_model, measure_grid

    target, draft, _ = default_pair
    if kind == "eagle3":
        draft = load_eagle3(DEFAULT_DRAFT.parent / "eagle3", target)
    tokens, contexts, rows = measure_grid(draft, (1, 4, 16), (8, 64), repeats=1)
    assert (tokens, contexts) == ((1, 4, 16), (8, 64)) and len(rows) == 3 and all(len(r) == 2 for r in rows)
    assert all(rows[i][j] <= rows[i + 1][j] for i in range(2) for j in range(2)) and min(map(min, rows)) > 0
    if kind != "eagle3":
        return  # the whole calibration grid once
    cost = measure_cost_model(target, draft, tokens=(1, 4), repeats=1, grid=True)
    assert len(cost.draft_grid_seconds) == len(cost.grid_tokens) > 0
    assert all(len(r) == len(cost.grid_contexts) for r in cost.draft_grid_seconds)
    assert float(cost.draft_time(4, cost.grid_contexts[-1])) == pytest.approx(cost.draft_grid_seconds[1][-1])
