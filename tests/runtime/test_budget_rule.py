"""The budget rule, the online prices and the AR fallback (the speculation controller) in the running executor, on
a `ModelledClock`: every second the executor sees is the cost model's, so these outcomes do not depend on how fast
or busy the machine is. Outputs never change (greedy == AR)."""

import pytest
import torch

from echo_trtllm.core import EchoConfig
from echo_trtllm.core.controller import Decision
from echo_trtllm.core.cost import CostModel
from echo_trtllm.core.gating import GateSamples
from echo_trtllm.models.llama import CausalLM
from echo_trtllm.runtime.calibrate import measure_cost_model
from echo_trtllm.runtime.clock import ModelledClock
from echo_trtllm.runtime.executor import Executor
from echo_trtllm.runtime.request import SamplingParams

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def curve(verify, draft) -> CostModel:
    """A cost model from two functions of the token count (seconds)."""
    return CostModel(TOKENS, tuple(verify(t) for t in TOKENS), TOKENS, tuple(draft(t) for t in TOKENS))


# GPU-like: verification nearly free up to 64 tokens; a cheap draft
FLAT = curve(lambda t: 0.010 + 0.00002 * t, lambda t: 0.001 + 0.00001 * t)
# a CPU kernel whose cost is linear in the tokens (every verified token costs a decode step), dear draft
LINEAR = curve(lambda t: 0.010 * t, lambda t: 0.004 * t)
# issue 9's bf16-on-AVX2 shape: a 64-row step ~50x a 1-row one; the draft 40 % of the target per level
STEEP = curve(lambda t: 0.1 * (1 + 0.8 * (t - 1)), lambda t: 0.04 * (1 + 0.8 * (t - 1)))
# a curve on which a level can pay in principle (lambda < 1 at B = 1 and 4) but is not cheap
MARGINAL = curve(lambda t: 0.1 * (1 + 0.1 * (t - 1)), lambda t: 0.03 * (1 + 0.1 * (t - 1)))


def run(target, draft, tok, prompts, cost, batch_size=4, max_tokens=24, policy="echo", clock_cost=None,
        fallback=None, gate_samples=None):
    ex = Executor(target, draft, tok, EchoConfig(policy=policy, k_max=64, max_nodes_per_request=16),
                  max_batch_size=batch_size, max_seq_len=256, cost_model=cost,
                  clock=ModelledClock(clock_cost or cost or FLAT), fallback=fallback, gate_samples=gate_samples)
    run.executor = ex
    reqs, reports = drive(ex, prompts, max_tokens)
    return [r.output_token_ids for r in reqs], reports


def drive(ex: Executor, prompts, max_tokens: int) -> tuple[list, list]:
    """Submit one greedy request per prompt to the executor and step until every one ends: (requests, reports)."""
    reqs = [ex.make_request(p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)) for p in prompts]
    for r in reqs:
        ex.submit(r)
    reports = []
    while ex.has_work:
        reports.append(ex.step())
    return reqs, reports


def decode_seconds(reports) -> float:
    return sum(r.timings.total for r in reports)


@pytest.fixture(scope="module")
def ar_outputs(default_pair, prompts):
    target, _, tok = default_pair
    outs, _ = run(target, None, tok, prompts[:8], None, policy="ar")
    return outs


def test_measured_cost_curve_has_every_point(default_pair):
    target, draft, _ = default_pair
    cost = measure_cost_model(target, draft, tokens=(1, 4, 16), repeats=1)
    assert cost.verify_tokens == cost.draft_tokens == (1, 4, 16)
    assert all(t > 0 for t in cost.verify_seconds + cost.draft_seconds)


def test_random_weight_draft_falls_back_to_ar(default_pair, prompts, ar_outputs):
    target, draft, tok = default_pair
    torch.manual_seed(0)
    useless = CausalLM(draft.config).eval()  # random weights: its drafts are never accepted
    outs, reports = run(target, useless, tok, prompts[:8], FLAT)
    assert outs == ar_outputs
    speculated = sum(r.speculated for r in reports) / len(reports)
    assert speculated <= 0.25, f"speculated in {speculated:.0%} of steps with a useless draft"


def test_linear_cost_curve_falls_back_to_ar(default_pair, prompts, ar_outputs):
    target, draft, tok = default_pair
    outs, reports = run(target, draft, tok, prompts[:8], LINEAR)
    assert outs == ar_outputs
    assert sum(r.speculated for r in reports) / len(reports) <= 0.25, "drafting cannot pay on a linear curve"
    verified = sum(r.verified_tokens for r in reports)
    assert verified <= 1.25 * sum(r.batch_size for r in reports)


def test_perfect_drafts_get_more_budget(default_pair, prompts, ar_outputs):
    """The target as its own draft: every draft is accepted, so speculative steps take more budget than with the
    real draft. On a curve where a verified token costs 1 % of a step (on FLAT verification is nearly free and both
    drafts fill the per-request cap: budget is then not what separates them)."""
    target, draft, tok = default_pair
    priced = curve(lambda t: 0.010 * (1 + 0.01 * (t - 1)), lambda t: 0.001 + 0.00001 * t)
    outs_self, rep_self = run(target, target, tok, prompts[:8], priced)
    outs_real, rep_real = run(target, draft, tok, prompts[:8], priced)
    assert outs_self == ar_outputs and outs_real == ar_outputs

    def verified_per_request(reports):
        spec = [r for r in reports if r.speculated]
        return sum(r.verified_tokens for r in spec) / sum(r.batch_size for r in spec)

    assert verified_per_request(rep_self) > max(1.5, verified_per_request(rep_real))
    spec = [r for r in rep_self if r.speculated]
    assert max(r.emitted_tokens / r.batch_size for r in spec) > 3


@pytest.mark.parametrize("batch_size", [1, 4])
def test_uncalibrated_engine_starts_safe(default_pair, prompts, ar_outputs, batch_size):
    """No calibration, no warm-up. Where no draft level can pay (STEEP, issue 9's bf16-on-AVX2 shape) and where one
    may (MARGINAL), speculation is probed within the exploration budget (the start's credit of 2 step-equivalents
    per batch-size bucket: 4 % of this 48-step run at the full batch, more where its drain visits smaller buckets) and the run costs at most that more than AR in modelled time; on STEEP the probes'
    measured losses keep them probes (never exploited), a few in the run. Where it clearly pays (FLAT) the same
    engine is faster than AR."""
    target, draft, tok = default_pair
    for name, cost, bound in (("STEEP", STEEP, 1.07), ("MARGINAL", MARGINAL, 1.07), ("FLAT", FLAT, 0.9)):
        _, ar = run(target, None, tok, prompts[:8], None, batch_size, policy="ar", clock_cost=cost)
        outs, echo = run(target, draft, tok, prompts[:8], cost, batch_size)
        assert outs == ar_outputs
        ratio = decode_seconds(echo) / decode_seconds(ar)
        assert ratio <= bound, f"ECHO took {ratio:.3f}x AR's modelled decode time on {name}"
        assert any(r.speculated for r in echo), f"speculation was never tried on {name}"
        if name == "STEEP":
            spec = [r for r in echo if r.speculated]
            assert len(spec) <= 0.12 * len(echo), f"{len(spec)} of {len(echo)} steps speculated where none can pay"
            assert all(r.decision is not None and r.decision.reason == "probe" for r in spec), \
                "a losing speculative step was exploited, not probed"


def test_the_decision_is_the_clocks_not_the_machines(default_pair, prompts):
    """Two runs on the modelled clock make the same decisions step for step, whatever the machine did between."""
    target, draft, tok = default_pair
    a = [(r.speculated, r.verified_tokens) for r in run(target, draft, tok, prompts[:8], STEEP)[1]]
    b = [(r.speculated, r.verified_tokens) for r in run(target, draft, tok, prompts[:8], STEEP)[1]]
    assert a == b


def test_gate_thresholds_rise_with_load(default_pair, prompts):
    """The calibration's gate, re-derived per batch size from the cost curve, is at least as strict under load as
    at B = 1 (a fixed curve: lambda does not depend on the machine)."""
    from echo_trtllm.core.gating import GateSchedule
    from echo_trtllm.runtime.calibrate import calibrate

    target, draft, tok = default_pair
    config = EchoConfig(max_depth=4)
    cal = calibrate(target, draft, tok, config, prompts[:4], batch_size=4, max_tokens=12, cost_model=FLAT)
    load_dependent = curve(lambda t: 0.01 * (1 + t / 64), lambda t: 0.001)  # flat at B = 1, dear at B = 128
    gates = GateSchedule(config, load_dependent, cal.gate_samples())
    small, large = gates.calibration_for(1), gates.calibration_for(128)
    assert small.min_accept_prob < large.min_accept_prob
    assert all(a <= b for a, b in zip(small.dense_thresholds, large.dense_thresholds))
    assert gates.calibration_for(1) is small  # cached per break-even probability


def test_the_draft_is_prefilled_only_where_speculation_is_not_a_confident_loss(default_pair, prompts):
    """Admission skips the draft's prompt prefill where the controller's last estimate at the batch size is a
    confident loss (after the probes on STEEP measured losing steps; the draft would catch up if a later step
    speculated); before any estimate, and where speculation pays (FLAT), the draft is prefilled with the target. (A
    probe that finds the budget rule verifying its roots alone verifies as many drafted tokens as requests, dearer on
    STEEP: the credit pays for fewer probes and the estimate takes a few rounds to become confident.)"""
    target, draft, tok = default_pair
    for cost in (STEEP, FLAT):
        ex = Executor(target, draft, tok, EchoConfig(k_max=64), max_batch_size=4, max_seq_len=256, cost_model=cost,
                      clock=ModelledClock(cost))
        for round_ in range(8):
            expected = not ex.controller.expects_plain(4)
            for p in (prompts[(4 * round_ + i) % len(prompts)] for i in range(4)):
                ex.submit(ex.make_request(p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)))
            ex.admit()
            started = [r for r in ex.running if r.target_ctx > 0]  # a long prompt's prefill may come in chunks
            assert started and all((r.draft_ctx == r.target_ctx) == expected for r in started), (round_, cost is FLAT)
            if not expected:
                break
            while ex.has_work:
                ex.step()
        assert ex.controller.expects_plain(4) == (cost is STEEP), "STEEP's losses must become a confident estimate"


def test_a_probe_after_a_long_ar_stretch_re_primes_the_draft_with_a_short_window(default_pair, prompts, ar_outputs):
    """After many AR steps the draft does not replay everything it missed: a request whose pending chain is longer
    than the bound the cost model allows (one AR step's worth of draft work) restarts the draft from its last
    few tokens. Outputs stay AR's."""
    target, draft, tok = default_pair
    dear_draft = curve(lambda t: 0.010, lambda t: 0.001 + 0.001 * t)  # t_draft(8 per request at B=4) ~ one step
    ex = Executor(target, draft, tok, EchoConfig(k_max=64, max_nodes_per_request=16), max_batch_size=4,
                  max_seq_len=256, cost_model=dear_draft, clock=ModelledClock(dear_draft))
    steps = iter(range(10**6))
    # nine plain steps, then a probe (whatever the prices say)
    ex._decide = lambda reqs, context: Decision(next(steps) % 10 == 9, "probe", len(reqs), plain_seconds=0.01)
    root_chains = []
    real = ex.drafter.model.forward

    def spy(batch, cache):
        if batch.logits_index is not None and batch.logits_index.numel():  # the root level: pending chains
            root_chains.append(int(batch.input_ids.numel()) / int(batch.slots.numel()))
        return real(batch, cache)

    ex.drafter.model.forward = spy
    reqs, _ = drive(ex, prompts[:8], 24)
    assert [r.output_token_ids for r in reqs] == ar_outputs
    assert ex._max_pending(4) == 8
    assert root_chains and max(root_chains) <= 8, f"catch-up chains {root_chains} exceed the 8-token bound"
    assert any(r.draft_offset > 0 for r in reqs), "the case must re-prime some request"


def test_a_measured_curve_is_made_non_decreasing_by_lowering_inflated_points():
    from echo_trtllm.runtime.calibrate import nondecreasing

    assert nondecreasing((0.400, 0.265, 0.270, 0.453)) == (0.265, 0.265, 0.270, 0.453)
    assert nondecreasing((0.1, 0.2, 0.3)) == (0.1, 0.2, 0.3)


@pytest.mark.parametrize("policy", ["chain", "eagle2", "echo"])
def test_the_ar_fallback_is_an_option_for_every_method(default_pair, prompts, ar_outputs, policy):
    """On a linear curve (no speculation can pay): with fallback=True every method, the fixed-shape baselines
    too, falls back to AR; with fallback=False ("pure") every step speculates, the echo family's budget rule
    included. Outputs equal AR's either way."""
    target, draft, tok = default_pair
    outs, on = run(target, draft, tok, prompts[:8], LINEAR, policy=policy, fallback=True)
    assert outs == ar_outputs
    assert sum(r.speculated for r in on) / len(on) <= 0.25
    outs, pure = run(target, draft, tok, prompts[:8], LINEAR, policy=policy, fallback=False)
    assert outs == ar_outputs
    assert all(r.speculated for r in pure if r.batch_size)
    assert decode_seconds(on) < decode_seconds(pure)


class ContextClock(ModelledClock):
    """A modelled clock on which a target forward over T tokens also costs `per_pair` seconds per token and cached
    token of the batch's longest context (what the executor's padded attention reads), read from the executor."""

    def __init__(self, cost, per_pair: float) -> None:
        super().__init__(cost)
        self.per_pair, self.executor = per_pair, None

    def forward(self, kind, tokens):
        if kind == "target" and self.executor is not None and self.executor.running:
            self.time += self.per_pair * tokens * max(r.target_ctx for r in self.executor.running)
        return super().forward(kind, tokens)


def test_the_budget_rule_prices_each_step_at_the_batchs_own_context(default_pair, prompts, ar_outputs):
    """Extra verified tokens nearly free at short contexts and dear at long ones (attention costs 2 ms per token
    and 1,024 cached tokens): pure ECHO verifies wide trees while its requests' contexts are short and shrinks K as
    the contexts grow, pricing each step at the batch's own context. The step reports carry the context the rule
    saw; outputs stay AR's."""
    target, draft, tok = default_pair
    cost = curve(lambda t: 0.010 + 0.00002 * t, lambda t: 0.0001 * t)
    clock = ContextClock(cost, per_pair=2e-5)
    ex = Executor(target, draft, tok, EchoConfig(k_max=64, max_nodes_per_request=16), max_batch_size=4,
                  max_seq_len=512, cost_model=cost, clock=clock, fallback=False)
    clock.executor = ex
    _, reports = drive(ex, prompts[:4], 200)
    short = [r.verified_tokens / r.batch_size for r in reports if r.batch_size and r.context < 40]
    long = [r.verified_tokens / r.batch_size for r in reports if r.batch_size and r.context > 150]
    assert short and long
    assert sum(short) / len(short) > 1.5 * sum(long) / len(long), (short, long)
    assert ex.step_cost.describe()["verification"]["verify tokens x context"] > 0  # learnt from the steps


def confident_samples(n: int = 64) -> GateSamples:
    """Calibration evidence of a draft whose first level is confident and accepted (a second level too)."""
    depths = torch.cat([torch.ones(n, dtype=torch.long), torch.full((n,), 2)])
    conf = torch.cat([torch.full((n,), 0.9), torch.full((n,), 0.6)])
    return GateSamples(depths, conf, torch.ones(2 * n, dtype=torch.bool), max_depth=6)


def test_pure_echo_drafts_every_step_and_its_budget_rule_verifies_what_pays(default_pair, prompts, ar_outputs):
    """Pure ECHO (no AR fallback) is pure: every step drafts, whatever the prices. On LINEAR (every verified token
    costs a step) its budget rule verifies far fewer drafts than on FLAT (once drafting is sunk a confident draft can
    still be worth a token's verification), and the drafting makes the run dearer than AR's: what the +fallback
    mode exists for. Outputs stay AR's."""
    target, draft, tok = default_pair
    _, ar = run(target, None, tok, prompts[:8], None, policy="ar", clock_cost=LINEAR)
    outs, linear = run(target, draft, tok, prompts[:8], LINEAR, fallback=False, gate_samples=confident_samples())
    assert outs == ar_outputs
    assert all(r.draft is not None and r.draft.state.frontier_sizes for r in linear if r.batch_size)
    assert decode_seconds(linear) > decode_seconds(ar)
    outs, flat = run(target, draft, tok, prompts[:8], FLAT, fallback=False, gate_samples=confident_samples())
    assert outs == ar_outputs and all(r.speculated for r in flat if r.batch_size)

    def per_request(reports):
        return sum(r.verified_tokens for r in reports) / sum(r.batch_size for r in reports)

    assert per_request(flat) > 2 and per_request(flat) > 1.5 * per_request(linear)


def test_steps_the_policy_runs_plain_are_not_the_controllers_measurements(default_pair, prompts, ar_outputs):
    """With the AR fallback on and a policy that cannot draft (K_max = B: no budget beyond the roots): whatever the
    controller chose, the steps ran plain, and it records no speculative step and charges no probe it did not see."""
    target, draft, tok = default_pair
    ex = Executor(target, draft, tok, EchoConfig(k_max=4), max_batch_size=4, max_seq_len=256, cost_model=MARGINAL,
                  clock=ModelledClock(MARGINAL), fallback=True)
    wanted, decide = [], ex.controller.decide
    ex.controller.decide = lambda *a, **k: wanted.append(decide(*a, **k)) or wanted[-1]
    reqs, reports = drive(ex, prompts[:4], 16)
    assert [r.output_token_ids for r in reqs] == [o[:16] for o in ar_outputs[:4]]
    assert not any(r.speculated for r in reports)
    assert any(d.speculate for d in wanted), "the case needs a wanted probe"
    # no report carries a decision the step did not follow: a wanted probe ran plain, so it is no report's decision
    assert not any(r.decision is not None and r.decision.speculate for r in reports)
    assert any(r.decision is not None for r in reports), "the plain decisions it followed are reported"
    stats = ex.controller.stats
    assert stats.speculative_steps == stats.probes == 0 and stats.steps == len(reports)


def test_acceptance_estimates_start_from_the_calibration_and_follow_the_traffic(default_pair, prompts, ar_outputs):
    """A calibration that says first-level drafts of path probability 0.2 are rejected: the policy's estimates
    there start near zero; the real draft is underconfident on its greedy path (its greedy drafts of probability
    0.1-0.3 are accepted about half the time, its other drafts there far less often), and after a pure run each of
    the two estimates at 0.2 (on the greedy path, off it) has moved towards what verification measured for its own
    nodes, the greedy one most of the way. Outputs stay AR's."""
    target, draft, tok = default_pair
    rejected = GateSamples(torch.ones(64, dtype=torch.long), torch.full((64,), 0.2), torch.zeros(64, dtype=torch.bool),
                           max_depth=6)
    ex = Executor(target, draft, tok, EchoConfig(k_max=64, max_nodes_per_request=16), max_batch_size=4,
                  max_seq_len=256, cost_model=FLAT, clock=ModelledClock(FLAT), fallback=False, gate_samples=rejected)
    probe = torch.tensor([0.2], dtype=torch.float64)
    before = {g: float(ex.policy.acceptance.estimate(probe, 1, g)) for g in (True, False)}
    reqs, reports = drive(ex, prompts[:8], 48)
    assert [r.output_token_ids[:24] for r in reqs] == ar_outputs
    # what verification measured at depth 1 around the probe (path probability 0.1 to 0.3), per kind of node
    hits, total = {True: 0, False: 0}, {True: 0, False: 0}
    for r in reports:
        if r.speculated:
            sel = r.draft.selected
            accepted = torch.zeros(sel.total_nodes, dtype=torch.bool)
            accepted[r.result.accepted_node_ids] = True
            confident = (sel.depths == 1) & (sel.path_probs >= 0.1) & (sel.path_probs < 0.3)
            for g in (True, False):
                mine = confident & (sel.on_greedy_path == g)
                hits[g] += int(accepted[mine].sum())
                total[g] += int(mine.sum())
    measured = {g: hits[g] / total[g] for g in (True, False)}
    assert total[True] >= 20 and total[False] >= 20
    assert measured[True] > 0.3 and measured[True] > measured[False] + 0.2
    after = {g: float(ex.policy.acceptance.estimate(probe, 1, g)) for g in (True, False)}
    assert before[True] < 0.1 and before[False] < 0.1
    assert abs(after[True] - measured[True]) < 0.5 * abs(before[True] - measured[True]), (before, after, measured)
    # the other table has fewer nodes in these bins and the calibration's prior over its neighbours: it moves less
    assert before[False] + 0.05 < after[False] <= measured[False] and after[False] < after[True] - 0.2


class HostWorkClock(ModelledClock):
    """A modelled clock on which every forward also costs a fixed host term (the work a real step does around
    its forwards): `target_extra` seconds per target forward, `draft_extra` per draft forward."""

    def __init__(self, cost, target_extra: float, draft_extra: float) -> None:
        super().__init__(cost)
        self.extra = {"target": target_extra, "draft": draft_extra}

    def forward(self, kind, tokens):
        self.time += self.extra[kind]
        return super().forward(kind, tokens)


def test_the_fitted_overheads_are_the_host_work_of_the_runtimes_own_steps(default_pair, prompts):
    """`fit_overheads` on the executor's step reports finds the host terms the clock charged beyond the cost
    model's forwards: 3 ms per step on the verification side and the 2 ms charged per draft forward on the draft
    side (one forward per level: the median step has no catch-up forward), while a clock with no host work fits
    neither."""
    from echo_trtllm.runtime.calibrate import fit_overheads

    target, draft, tok = default_pair
    config = EchoConfig(policy="chain", num_draft_tokens=3)
    fitted = {}
    for extra in ((0.0, 0.0), (0.003, 0.002)):
        ex = Executor(target, draft, tok, config, max_batch_size=4, max_seq_len=256, cost_model=FLAT,
                      clock=HostWorkClock(FLAT, *extra), fallback=False)
        for p in prompts[:4]:
            ex.submit(ex.make_request(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)))
        reports = []
        while ex.has_work:
            reports.append(ex.step())
        assert all(r.speculated and len(r.draft.state.frontier_sizes) == 3 for r in reports if r.batch_size)
        fitted[extra] = fit_overheads(FLAT, reports)
    bare, host = fitted[(0.0, 0.0)], fitted[(0.003, 0.002)]
    assert bare.step_overhead_seconds == pytest.approx(0.0, abs=1e-9)
    assert bare.draft_level_overhead_seconds == pytest.approx(0.0, abs=1e-9)
    assert host.step_overhead_seconds == pytest.approx(0.003)
    assert host.draft_level_overhead_seconds == pytest.approx(0.002)


def test_a_failure_in_the_online_learning_or_the_decision_ends_no_request(default_pair, prompts, ar_outputs):
    """The prices and the controller are optimisations: if learning from a step or deciding the next one raises,
    the failure is contained (recorded, the step plain or its output kept) and every request still ends with AR's
    output."""
    target, draft, tok = default_pair
    ex = Executor(target, draft, tok, EchoConfig(k_max=64, max_nodes_per_request=16), max_batch_size=4,
                  max_seq_len=256, cost_model=FLAT, clock=ModelledClock(FLAT), fallback=True)

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    ex.step_cost.observe = broken
    ex.controller.decide = broken
    reqs, _ = drive(ex, prompts[:8], 24)
    assert [r.output_token_ids for r in reqs] == ar_outputs
    assert ex.failures.get("learning from a step", 0) > 0 and ex.failures.get("speculation decision", 0) > 0


def test_the_warm_up_teaches_the_constants_and_leaves_the_load_curve(default_pair, prompts):
    """`Executor.warm_up` on a clock that charges host work the load curve never saw (3 ms a target forward, 2 ms a
    draft forward): its steps move the speculative step's constants (drafting's host work, the draft commit and
    tree terms) and leave every forward coefficient (both phases' knots, attention) and the per-request term exactly
    as the load's curve put them, the path the engine runs before its first request (`StepCostModel.observe` with
    forwards=False). Traffic then learns every coefficient."""
    import numpy as np

    from echo_trtllm.core.prices import _CONSTANTS
    from echo_trtllm.core.steps import DRAFTING_FEATURES

    target, draft, tok = default_pair
    ex = Executor(target, draft, tok, EchoConfig(k_max=64, max_nodes_per_request=16), max_batch_size=4,
                  max_seq_len=256, cost_model=FLAT, clock=HostWorkClock(FLAT, 0.003, 0.002), fallback=True)
    d0, v0 = ex.step_cost.theta_drafting.copy(), ex.step_cost.theta_verification.copy()
    assert ex.warm_up(tok.encode(prompts[0])) > 4
    d1, v1 = ex.step_cost.theta_drafting, ex.step_cost.theta_verification
    held_d, held_v = ~_CONSTANTS[0], ~_CONSTANTS[1]
    assert np.array_equal(d1[held_d], d0[held_d]) and np.array_equal(v1[held_v], v0[held_v])
    assert not np.allclose(d1[~held_d], d0[~held_d])  # the draft forwards' host work: the speculative constant
    speculative = DRAFTING_FEATURES.index("speculative")
    assert d1[speculative] > d0[speculative]
    for p in prompts[:4]:
        ex.submit(ex.make_request(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)))
    while ex.has_work:
        ex.step()
    assert not np.allclose(ex.step_cost.theta_verification[held_v], v0[held_v])  # traffic moves the forwards


@pytest.mark.parametrize("reason,floor", [("probe", True), ("exploit", True), ("probe", False)])
def test_a_speculative_probe_verifies_drafts_where_the_rule_would_verify_none(default_pair, prompts, ar_outputs,
                                                                               reason, floor):
    """LINEAR prices (a verified token costs a step): the budget rule verifies the roots alone nearly always. With
    the controller made to speculate at every step, a step it calls a probe verifies as many drafted tokens as
    requests where the rule would take none (`Decision.min_tokens`: 2B), so the price of a verified token is measured: no
    probe verifies its roots alone; the steps it exploits verify what the rule takes, as do its probes with the floor
    off (`EchoConfig.probe_floor`, the ablation). Outputs stay AR's."""
    target, draft, tok = default_pair
    ex = Executor(target, draft, tok, EchoConfig(k_max=64, max_nodes_per_request=16, probe_floor=floor),
                  max_batch_size=4, max_seq_len=256, cost_model=LINEAR, clock=ModelledClock(LINEAR), fallback=True)
    ex.controller.decide = lambda b, *a, **k: Decision(True, reason, b)
    reqs, reports = drive(ex, prompts[:4], 16)
    assert [r.output_token_ids for r in reqs] == [o[:16] for o in ar_outputs[:4]]
    spec = [r for r in reports if r.speculated]
    assert len(spec) >= 4
    verified = [r.verified_tokens - r.batch_size for r in spec]
    if reason == "probe" and floor:
        assert min(verified) > 0 and sum(verified) >= 0.75 * sum(r.batch_size for r in spec), verified
    else:
        assert sum(verified) <= 0.25 * sum(r.batch_size for r in spec), verified
