"""The cost-curve budget rule and the AR fallback in the running executor, on a `ModelledClock`: every second
the executor sees is the cost model's, so these outcomes do not depend on how fast or busy the machine is.
Outputs never change (greedy == AR)."""

import pytest
import torch

from echo_trtllm.core import EchoConfig
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
    reqs = [ex.make_request(p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)) for p in prompts]
    for r in reqs:
        ex.submit(r)
    reports = []
    while ex.has_work:
        reports.append(ex.step())
    return [r.output_token_ids for r in reqs], reports


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
    real draft."""
    target, draft, tok = default_pair
    outs_self, rep_self = run(target, target, tok, prompts[:8], FLAT)
    outs_real, rep_real = run(target, draft, tok, prompts[:8], FLAT)
    assert outs_self == ar_outputs and outs_real == ar_outputs

    def verified_per_request(reports):
        spec = [r for r in reports if r.speculated]
        return sum(r.verified_tokens for r in spec) / sum(r.batch_size for r in spec)

    assert verified_per_request(rep_self) > max(1.5, verified_per_request(rep_real))
    spec = [r for r in rep_self if r.speculated]
    # slow start: the first speculative step drafts one level (2 tokens per request); then deeper trees pay
    assert spec[0].emitted_tokens == 2 * spec[0].batch_size and len(spec[0].draft.state.frontier_sizes) == 1
    assert max(r.emitted_tokens / r.batch_size for r in spec) > 3


@pytest.mark.parametrize("batch_size", [1, 4])
def test_uncalibrated_engine_starts_safe(default_pair, prompts, ar_outputs, batch_size):
    """No calibration. Where the curve says a level cannot pay (STEEP, issue 9's bf16-on-AVX2 shape) the engine
    never speculates; where it may (MARGINAL) the first step of each batch size is plain AR, speculation is probed,
    and the run costs at most a few percent more than AR in modelled time; where it clearly pays (FLAT) the same
    engine is faster than AR."""
    target, draft, tok = default_pair
    for name, cost, bound in (("STEEP", STEEP, 1.0 + 1e-9), ("MARGINAL", MARGINAL, 1.05), ("FLAT", FLAT, 0.9)):
        _, ar = run(target, None, tok, prompts[:8], None, batch_size, policy="ar", clock_cost=cost)
        outs, echo = run(target, draft, tok, prompts[:8], cost, batch_size)
        assert outs == ar_outputs
        assert not echo[0].speculated, "an uncalibrated engine's first step must be plain AR"
        ratio = decode_seconds(echo) / decode_seconds(ar)
        assert ratio <= bound, f"ECHO took {ratio:.3f}x AR's modelled decode time on {name}"
        if name == "STEEP":
            assert not any(r.speculated for r in echo)
        else:
            assert any(r.speculated for r in echo), f"speculation was never tried on {name}"


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


def test_the_draft_is_prefilled_only_where_speculation_can_pay(default_pair, prompts):
    """Under a curve where no level can pay at the batch size, admission skips the draft's prompt prefill (the
    draft would catch up if a later step speculated); where it can pay, the draft is prefilled with the target."""
    target, draft, tok = default_pair
    for cost, prefilled in ((STEEP, False), (FLAT, True)):
        ex = Executor(target, draft, tok, EchoConfig(k_max=64), max_batch_size=4, max_seq_len=256, cost_model=cost,
                      clock=ModelledClock(cost))
        for p in prompts[:4]:
            ex.submit(ex.make_request(p, SamplingParams(max_tokens=4, temperature=0)))
        ex.admit()
        assert all((r.draft_ctx == r.target_ctx > 0) == prefilled for r in ex.running)


def test_a_probe_after_a_long_ar_stretch_re_primes_the_draft_with_a_short_window(default_pair, prompts, ar_outputs):
    """After many AR steps the draft does not replay everything it missed: a request whose pending chain is longer
    than the bound the cost model allows (one AR step's worth of draft work) restarts the draft from its last
    few tokens. Outputs stay AR's."""
    target, draft, tok = default_pair
    dear_draft = curve(lambda t: 0.010, lambda t: 0.001 + 0.001 * t)  # t_draft(8 per request at B=4) ~ one step
    ex = Executor(target, draft, tok, EchoConfig(k_max=64, max_nodes_per_request=16), max_batch_size=4,
                  max_seq_len=256, cost_model=dear_draft, clock=ModelledClock(dear_draft))
    steps = iter(range(10**6))
    ex.tracker.should_speculate = lambda b: next(steps) % 10 == 9  # nine AR steps, then a probe
    root_chains = []
    real = ex.drafter.model.forward

    def spy(batch, cache):
        if batch.logits_index is not None and batch.logits_index.numel():  # the root level: pending chains
            root_chains.append(int(batch.input_ids.numel()) / int(batch.slots.numel()))
        return real(batch, cache)

    ex.drafter.model.forward = spy
    reqs = [ex.make_request(p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)) for p in prompts[:8]]
    for r in reqs:
        ex.submit(r)
    while ex.has_work:
        ex.step()
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


def test_the_budget_rule_prices_each_step_at_the_batchs_own_context(default_pair, prompts, ar_outputs):
    """A grid on which extra verified tokens are nearly free at short contexts and dear at long ones: the same
    requests verify wide trees while their contexts are short and shrink K as the contexts grow past the grid's
    crossover. The step reports carry the context the rule saw; outputs stay AR's."""
    target, draft, tok = default_pair
    grid = CostModel(TOKENS, tuple(0.010 + 0.00002 * t for t in TOKENS), TOKENS, tuple(0.0001 * t for t in TOKENS),
                     grid_tokens=(1, 256), grid_contexts=(1, 16, 24, 256),
                     grid_seconds=((0.010, 0.010, 0.010, 0.010), (0.011, 0.011, 20.0, 20.0)))
    outs, reports = run(target, draft, tok, prompts[:8], grid, fallback=False, max_tokens=24)
    assert outs == ar_outputs
    short = [r.verified_tokens / r.batch_size for r in reports if r.batch_size and r.context < 16]
    long = [r.verified_tokens / r.batch_size for r in reports if r.batch_size and r.context > 24]
    assert short and long
    assert min(short) > 1.5 and max(long) <= 1.0 + 1e-9, (short, long)


def confident_samples(n: int = 64) -> GateSamples:
    """Calibration evidence of a draft whose first level is confident and accepted (a second level too)."""
    depths = torch.cat([torch.ones(n, dtype=torch.long), torch.full((n,), 2)])
    conf = torch.cat([torch.full((n,), 0.9), torch.full((n,), 0.6)])
    return GateSamples(depths, conf, torch.ones(2 * n, dtype=torch.bool), max_depth=6)


def test_pure_echo_prices_its_first_draft_level_before_drafting(default_pair, prompts, ar_outputs):
    """Pure ECHO (no AR fallback) with calibration evidence. On LINEAR no first level can pay: no step drafts (no
    draft forward, roots only) and the modelled decode time is AR's, while the ablation without draft pricing
    drafts in every step and costs more. On FLAT every step drafts. Outputs stay AR's."""
    target, draft, tok = default_pair
    _, ar = run(target, None, tok, prompts[:8], None, policy="ar", clock_cost=LINEAR)
    outs, priced = run(target, draft, tok, prompts[:8], LINEAR, fallback=False, gate_samples=confident_samples())
    assert outs == ar_outputs
    assert not any(r.speculated or (r.draft is not None and r.draft.state.frontier_sizes) for r in priced)
    assert decode_seconds(priced) == pytest.approx(decode_seconds(ar))
    outs, always = run(target, draft, tok, prompts[:8], LINEAR, policy="echo-always-draft", fallback=False,
                       gate_samples=confident_samples())
    assert outs == ar_outputs
    assert all(r.speculated for r in always if r.batch_size)
    assert decode_seconds(always) > 1.05 * decode_seconds(priced)
    outs, flat = run(target, draft, tok, prompts[:8], FLAT, fallback=False, gate_samples=confident_samples())
    assert outs == ar_outputs and all(r.speculated for r in flat if r.batch_size)


def test_steps_the_policy_runs_plain_are_not_the_fallbacks_measurements(default_pair, prompts, ar_outputs):
    """With the AR fallback on and a policy that declines to draft: the tracker wanted to probe speculation, the
    policy ran plain steps, and the tracker counts no speculative step it did not see."""
    target, draft, tok = default_pair
    outs, reports = run(target, draft, tok, prompts[:8], MARGINAL, fallback=True, clock_cost=MARGINAL,
                        gate_samples=GateSamples(torch.ones(64, dtype=torch.long), torch.full((64,), 0.9),
                                                 torch.zeros(64, dtype=torch.bool), max_depth=6))
    assert outs == ar_outputs and not any(r.speculated for r in reports)
    tracker = run.executor.tracker
    assert all(r.spec_steps == 0 for r in tracker.buckets.values())
    assert any(r.ar_steps >= tracker.min_ar_steps for r in tracker.buckets.values())


def test_a_calibrated_fallback_starts_where_its_calibration_points(default_pair, prompts, ar_outputs):
    """ECHO with the AR fallback and calibration evidence: where the calibration expects speculation to pay
    (a confident first level on FLAT) the first step already speculates with the policy's own depth (no AR start,
    no one-level slow start), and the run costs at most 10 % more modelled time than pure ECHO (measuring AR); where it
    expects a loss (first levels rejected on MARGINAL) the first step is plain AR. Outputs stay AR's."""
    target, draft, tok = default_pair
    # FLAT with a draft level at 4 % of a step: the calibrated start applies only below PRIOR_MAX_LEVEL_COST
    flat = curve(lambda t: 0.010 + 0.00002 * t, lambda t: 0.0002 + 0.00001 * t)
    outs, on = run(target, draft, tok, prompts[:8], flat, fallback=True, gate_samples=confident_samples())
    assert outs == ar_outputs
    assert on[0].speculated and len(on[0].draft.state.frontier_sizes) > 1
    _, pure = run(target, draft, tok, prompts[:8], flat, fallback=False, gate_samples=confident_samples())
    assert decode_seconds(on) <= 1.10 * decode_seconds(pure)  # 1.03 here; 1.16 with the AR start (no prior)
    rejected = GateSamples(torch.ones(64, dtype=torch.long), torch.full((64,), 0.9), torch.zeros(64, dtype=torch.bool),
                           max_depth=6)
    outs, off = run(target, draft, tok, prompts[:8], MARGINAL, fallback=True, gate_samples=rejected)
    assert outs == ar_outputs and not off[0].speculated


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
