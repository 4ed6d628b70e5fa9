"""The per-phase step profile (echo_trtllm.bench.phases, `bench --profile-phases`): the step's phase timings on the
executor's real path, read on a modelled clock; the layer timer's parts against the forward they split; the profile
through the engine `bench` builds."""

import itertools

import pytest
import torch

from echo_trtllm.bench.phases import LAYER_KINDS, STEP_PHASES, LayerTimer, combine_rounds, phase_table, profile_steps
from echo_trtllm.bench.run import make_engine
from echo_trtllm.cli import bench as bench_cli
from echo_trtllm.core import EchoConfig
from echo_trtllm.models.llama import CausalLM
from echo_trtllm.runtime.clock import ModelledClock
from echo_trtllm.runtime.executor import Executor
from echo_trtllm.runtime.inputs import chain_batch
from tests.runtime.test_budget_rule import FLAT, drive


@pytest.mark.parametrize("policy", ["ar", "echo"])
def test_step_phases_are_what_the_clock_saw_on_the_executors_own_path(default_pair, prompts, policy):
    """On a ModelledClock only forwards advance time: the target's forward phase is the cost model's price of the
    step's verified tokens, the host phases after it are zero, and the phases add up to the step."""
    target, draft, tok = default_pair
    ex = Executor(target, draft if policy != "ar" else None, tok, EchoConfig(policy=policy, k_max=64), max_batch_size=4,
                  max_seq_len=256, cost_model=FLAT, clock=ModelledClock(FLAT), fallback=False)
    _, reports = drive(ex, prompts[:4], 12)
    steps = [r for r in reports if r.batch_size]
    assert steps
    for r in steps:
        t = r.timings
        assert t.forward == pytest.approx(float(FLAT.verify_time(r.verified_tokens)))
        assert t.verify == pytest.approx(t.forward)  # building the inputs costs no modelled time
        assert (t.accept, t.finish, t.commit) == (0.0, 0.0, 0.0)
        assert t.total == pytest.approx(t.control + t.draft_model + t.verify)
    if policy == "echo":
        assert any(r.timings.draft_model > 0 for r in steps if r.speculated)


def test_the_layer_timer_splits_a_forward_into_parts_that_add_up_to_it(default_pair):
    target = default_pair[0]
    ticks = itertools.count()
    clock = lambda: float(next(ticks))  # noqa: E731 - every reading one tick later: exact arithmetic
    cache = target.allocate_cache(1, 64)
    batch = chain_batch([torch.arange(5)], torch.tensor([0]), torch.tensor([0]))
    spans = []
    handle_pre = target.register_forward_pre_hook(lambda m, a: spans.append(clock()), prepend=True)
    handle_post = target.register_forward_hook(lambda m, a, o: spans.append(clock()))
    try:
        with LayerTimer(target, clock) as timer:
            target(batch, cache)
            parts = timer.take()
            assert timer.take() == dict.fromkeys(LAYER_KINDS, 0.0)
    finally:
        handle_pre.remove()
        handle_post.remove()
    assert set(parts) == set(LAYER_KINDS) and all(v > 0 for v in parts.values()), parts
    # the outer pre-hook reads before the timer's, the outer post-hook (registered first) before the timer's too:
    # the timer's whole-model span is the outer span shifted by one tick, and its parts add up to it exactly
    assert sum(parts.values()) == spans[1] - spans[0]
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in target.modules())


def test_the_layer_timer_refuses_a_head():
    from echo_trtllm.models.eagle3 import Eagle3Head

    head = Eagle3Head.__new__(Eagle3Head)
    with pytest.raises(ValueError, match="target CausalLM"):
        LayerTimer(head)


@pytest.mark.parametrize("policy, fallback", [("ar", "auto"), ("echo", "off")])
def test_profile_steps_through_the_bench_engine(default_pair, prompts, policy, fallback):
    target, draft, tok = default_pair
    # ECHO without prices: with the curve measured at load, whether the budget rule verifies any drafted token
    # depends on this machine's speed (a start that prices a token dear verifies roots only; docs/performance.md)
    cost = "auto" if policy == "ar" else None
    llm = make_engine(target, draft, tok, EchoConfig(policy=policy, k_max=64), 2, 512, cost_model=cost,
                      fallback=fallback)
    try:
        out = profile_steps(llm, prompts, 2, steps=4, warm=1)
    finally:
        llm.shutdown()
    kind, other = ("plain", "speculative") if policy == "ar" else ("speculative", "plain")
    pre = out["prefill_step"]
    assert pre["prompt_tokens"] == sum(len(tok.encode(p)) - 1 for p in prompts[:2]) and pre["ms"] > 0
    assert 0 < sum(pre["layers_pass_by_kind_ms"].values()) <= pre["layers_pass_ms"] + 0.1
    s = out[kind]
    assert s["steps"] == 4 and out[other] == {"steps": 0}
    assert s["phases_ms"]["rest"] > 0  # the call's time outside its phases (admission, learning, the report)
    assert set(s["phases_ms"]) == set(STEP_PHASES)
    assert sum(s["phases_ms"].values()) == pytest.approx(s["total_ms"], abs=0.05)
    assert s["phases_ms"]["forward"] > 0
    lp = s["layers_pass"]
    assert lp["steps"] == 4 and 0 < sum(lp["forward_by_kind_ms"].values()) <= lp["forward_ms"] + 0.05
    if policy == "ar":
        assert s["emitted_per_step"] == 2 and s["verified_per_step"] == 2 and s["phases_ms"]["draft_model"] == 0
        assert s["draft_forwards_per_step"] == 0 and "draft_ms_per_forward" not in s
    else:
        assert s["verified_per_step"] > 2 and s["phases_ms"]["draft_model"] > 0
        # a separate draft model: one forward per level of the tree it drafted (at least the root's)
        assert s["draft_forwards_per_step"] >= 1
        assert s["draft_ms_per_forward"] == pytest.approx(s["phases_ms"]["draft_model"] / s["draft_forwards_per_step"],
                                                          abs=1e-3)


def test_profile_steps_refuses_a_context_too_short_for_the_steps(default_pair, prompts):
    target, draft, tok = default_pair
    llm = make_engine(target, None, tok, EchoConfig(policy="ar"), 1, 64)
    try:
        with pytest.raises(ValueError, match="max_seq_len"):
            profile_steps(llm, prompts, 1, steps=16)
    finally:
        llm.shutdown()


def test_the_cli_refuses_a_profile_of_no_steps(capsys):
    assert bench_cli.main(["--profile-phases", "--profile-steps", "0"]) != 0
    assert "--profile-steps" in capsys.readouterr().err


def test_a_profiled_engine_profiles_again_and_rounds_combine_into_medians(default_pair, prompts):
    """Rounds (`bench --profile-phases --rounds N`): the same engine profiled again (its requests aborted after
    each pass), the later rounds without the layers pass; combine_rounds gives each number's median over the
    rounds, its min and max, and every round's own summary."""
    target, draft, tok = default_pair
    llm = make_engine(target, draft, tok, EchoConfig(policy="echo", k_max=64), 2, 512, fallback="off")
    try:
        first = profile_steps(llm, prompts, 2, steps=3, warm=1)
        later = [profile_steps(llm, prompts, 2, steps=3, warm=1, layers=False) for _ in range(2)]
        assert not llm.executor.has_work  # every pass returned its requests
    finally:
        llm.shutdown()
    assert "layers_pass" not in later[0]["speculative"] and "layers_pass_ms" not in later[0]["prefill_step"]
    assert later[1]["speculative"]["steps"] == 3
    assert combine_rounds([first]) is first
    out = combine_rounds([first, *later])
    s, runs = out["speculative"], [p["speculative"] for p in (first, *later)]
    assert s["steps"] == 9 and len(s["rounds"]) == 3 and out["plain"] == {"steps": 0}
    for key in ("total_ms", "tokens_per_s", "verified_per_step"):
        values = sorted(r[key] for r in runs)
        assert s[key] == pytest.approx(values[1], abs=1e-3) and s["spread"][key] == [values[0], values[2]]
    for p in STEP_PHASES:
        values = sorted(r["phases_ms"][p] for r in runs)
        assert s["phases_ms"][p] == pytest.approx(values[1], abs=1e-3)
        assert s["spread"]["phases_ms"][p] == [values[0], values[2]]
    assert s["layers_pass"] == first["speculative"]["layers_pass"] and out["prefill_step"] == first["prefill_step"]
    assert "layers_pass" not in s["rounds"][0]
    # the layers pass may come from any round (the CLI runs it in the last); a table of layer-less rounds prints
    last = combine_rounds([*later, first])
    assert last["prefill_step"] == first["prefill_step"] and last["speculative"]["layers_pass"] == s["layers_pass"]
    assert "| - |" in phase_table([{"method": "echo", "batch_size": 2, **combine_rounds(later)}])
