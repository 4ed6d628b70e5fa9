"""`simulate` replays the real gate and budget: fed the trees an ECHO run drafted, grouped as that run's steps,
with the run's tree options and cost model, the replay verifies exactly the nodes the runtime verified and emits
what the runtime emitted (the runtime is the reference; the replay shares only the core's policy code). The runs
here use fixed prices (`adapt=False`): a replay prices every step with one cost model, as a what-if does."""

import pytest

from echo_trtllm.bench.simulate import make_policy, replay_step, simulate_method
from echo_trtllm.bench.trace import TraceRecorder
from echo_trtllm.core import EchoConfig
from echo_trtllm.core.cost import CostModel
from echo_trtllm.runtime.executor import Executor
from echo_trtllm.runtime.request import SamplingParams

# verification cheap up to 8 tokens, then linear; a draft level costs ~10 % of a step: the budget rule and the
# cost-aware stop both bind on some steps
COST = CostModel((1, 8, 16, 32, 64, 128), (0.10, 0.11, 0.16, 0.26, 0.46, 0.86), (1, 8, 64), (0.01, 0.012, 0.03))


def traced_run(default_pair, prompts, policy, batch_size, **config):
    target, draft, tok = default_pair
    cfg = EchoConfig(policy=policy, **config)
    ex = Executor(target, draft, tok, cfg, max_batch_size=batch_size, max_seq_len=256, cost_model=COST,
                  fallback=False, adapt=False)
    reqs = [ex.make_request(p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
            for p in prompts[:batch_size]]
    for r in reqs:
        ex.submit(r)
    recorder = TraceRecorder(ex.policy.max_tree_nodes - 1)
    sizes = []
    while ex.has_work:
        rep = ex.step()
        if rep.draft is not None and rep.batch_size:
            recorder.record(rep)
            sizes.append(rep.batch_size)
    assert not ex.failures, ex.last_error
    records = recorder.evaluate({r.request_id: r.output_token_ids for r in reqs})["records"]
    steps, at = [], 0
    for b in sizes:
        steps.append(records[at:at + b])
        at += b
    return cfg, steps


@pytest.mark.parametrize("policy", ["echo", "echo-dense", "chain", "static", "eagle2", "ddd"])
def test_the_replay_verifies_what_the_runtime_verified(default_pair, prompts, policy):
    cfg, steps = traced_run(default_pair, prompts, policy, 6, k_max=40, max_nodes_per_request=12)
    runner = make_policy(cfg, COST)
    replayed = verified_total = cut = 0
    for step in steps:
        verified, emitted, _ = replay_step(runner, step, cfg.k_max if runner.shares_budget else None)
        assert verified == [r["verified"] for r in step]
        # the runtime's count is cut at max_tokens on a request's last step, at most once per request
        assert all(e >= r["emitted"] for e, r in zip(emitted, step))
        cut += sum(e != r["emitted"] for e, r in zip(emitted, step))
        replayed += 1
        verified_total += sum(verified)
    assert replayed >= 8 and cut <= 6
    assert verified_total > sum(len(s) for s in steps)  # some drafts were verified: the rule did something


def test_shapes_no_run_drafted_replay_on_a_wider_source(default_pair, prompts):
    """Tuning by replay: chains of 1..3 and a 8-node eagle2 on the trees a 32-node eagle2 drafted; each stays
    inside its shape, and a longer chain never emits less than a shorter one on the same trees."""
    from echo_trtllm.bench.simulate import simulate

    cfg, steps = traced_run(default_pair, prompts, "eagle2", 6, total_tokens=32)
    traces = {"eagle2": [r for s in steps for r in s]}
    specs = ["ar", "chain:num_draft_tokens=1", "chain:num_draft_tokens=3", "eagle2:total_tokens=8"]
    rows = {r["method"]: r for r in simulate(traces, [6], lambda b: COST, steps=10, methods=specs,
                                             tree_source="eagle2")}
    assert rows["chain:num_draft_tokens=1"]["verified_per_step"] <= 6 * 2
    assert rows["chain:num_draft_tokens=3"]["verified_per_step"] <= 6 * 4
    assert rows["eagle2:total_tokens=8"]["verified_per_step"] <= 6 * 8
    assert rows["chain:num_draft_tokens=3"]["mat"] >= rows["chain:num_draft_tokens=1"]["mat"] > 1.0
    assert rows["ar"]["mat"] == 1.0
    with pytest.raises(ValueError, match="not traced"):
        simulate(traces, [6], lambda b: COST, steps=1, methods=["chain"])


def test_the_replay_reacts_to_a_tighter_budget(default_pair, prompts):
    """The same trees under a smaller K_max: never more verified than the budget; the budget binds."""
    cfg, steps = traced_run(default_pair, prompts, "echo", 6, k_max=60, max_nodes_per_request=16)
    records = [r for s in steps for r in s]
    loose = simulate_method("echo", records, 6, COST, steps=10, config=cfg)
    tight = simulate_method("echo", records, 6, COST, steps=10, k_max=7, config=cfg)
    assert loose["allocation"] == tight["allocation"] == "replayed"
    assert tight["verified_per_step"] <= 7 < loose["verified_per_step"]
    assert loose["records"] == len(records)


def test_no_replayed_shape_beats_the_oracle_on_the_same_trees(default_pair, prompts):
    """The hindsight ceiling bounds every method replayed on the same drafts (a grid of shapes, echo included)."""
    from echo_trtllm.bench.simulate import simulate

    cfg, steps = traced_run(default_pair, prompts, "eagle2", 6, total_tokens=32)
    traces = {"eagle2": [r for s in steps for r in s]}
    specs = ["ar", "chain:num_draft_tokens=1", "chain:num_draft_tokens=3", "static:static_nodes=8",
             "eagle2:total_tokens=8", "ddd:total_tokens=8", "echo", "echo-dense", "oracle"]
    for b in (1, 6):
        rows = {r["method"]: r for r in simulate(traces, [b], lambda b: COST, steps=10, methods=specs,
                                                 tree_source="eagle2")}
        ceiling = rows.pop("oracle")["tokens_per_s"]
        assert all(r["tokens_per_s"] <= ceiling * (1 + 1e-9) for r in rows.values()), (ceiling, rows)
        assert ceiling > rows["ar"]["tokens_per_s"]


def test_with_perfect_knowledge_echo_verifies_no_rejected_token_and_stays_under_the_ceiling(default_pair, prompts):
    """WHAT-IF (simulate --confidence-shift inf): each node's confidence is its outcome, so the acceptance estimates
    price every rejected node at the calibration's smoothing floor (1/2 of n + 1 samples, a few thousandths here)
    and, where every verified token costs (break-even acceptance ~0.2-0.5 on this linear curve), the budget rule
    verifies none of them. A real run's trees through the runtime's own gate and budget rule."""
    import math

    from echo_trtllm.bench.simulate import simulate

    linear = CostModel((1, 100), (0.11, 1.1), (1, 100), (0.011, 0.11))  # 0.1 + 0.01 T; a level 0.01 + 0.001 T
    cfg, steps = traced_run(default_pair, prompts, "eagle2", 6, total_tokens=32)
    traces = {"eagle2": [r for s in steps for r in s]}
    for b in (1, 6):
        rows = {r["method"]: r for r in simulate(traces, [b], lambda b: linear, steps=10, config=cfg,
                                                 methods=["ar", "echo", "oracle"], tree_source="eagle2",
                                                 confidence_shift=math.inf)}
        echo = rows["echo"]
        assert echo["allocation"] == "replayed, confidence shifted by inf (what-if)"
        # verified = roots + verified drafts; emitted = bonus tokens + accepted drafts: equal iff none rejected
        assert echo["verified_per_step"] == pytest.approx(echo["mat"] * b, rel=1e-12)
        assert echo["mat"] > 1.0
        assert echo["tokens_per_s"] <= rows["oracle"]["tokens_per_s"] * (1 + 1e-9)
