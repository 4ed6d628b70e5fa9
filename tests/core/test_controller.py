"""The speculation controller (core/controller.py) driving the scripted engine (bench/scripted.py) on a modelled
clock: step times and acceptance follow a script, including a machine that slows down by half and a workload that
switches, so every outcome here is a function of the seeds, not of this machine's speed. The references are the
script's own expected rates of always-plain and always-speculating (noise means included)."""

import math

import pytest

from echo_trtllm.bench.scripted import SCENARIOS, Machine, Phase, ScriptedEngine, run_script
from echo_trtllm.core.controller import Decision, SpeculationController
from echo_trtllm.core.cost import CostModel
from echo_trtllm.core.prices import StepCostModel
from echo_trtllm.core.steps import StepSample


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_it_converges_to_speculation_where_speculation_pays(seed):
    (result,), stats = run_script(*SCENARIOS["pays at B=1"], seed=seed)
    assert result.spec_tokens_per_s > 1.5 * result.plain_tokens_per_s  # the script: speculation pays 1.7 x
    assert result.speculative_share > 0.95
    assert result.vs_best > 0.95
    assert result.prediction_error_after_50 < 0.10


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_it_settles_on_plain_steps_where_speculation_loses_and_exploration_stays_in_its_budget(seed):
    (result,), stats = run_script(*SCENARIOS["loses at B=16"], seed=seed)
    assert result.spec_tokens_per_s < 0.7 * result.plain_tokens_per_s  # the script: speculation loses 0.62 x
    assert result.speculative_share < 0.02
    assert result.vs_plain > 0.98
    # exploration: at most the 1 % budget plus the start's credit (2 step-equivalents of 16 tokens)
    assert stats["exploration_share"] <= 0.01 + 2 * 16 / stats["tokens"]


def test_it_follows_a_machine_that_slows_by_half():
    results, _ = run_script(*SCENARIOS["machine slows by half"])
    before, after = results
    assert after.speed == 2.0 and before.speculative_share > 0.95 and after.speculative_share > 0.95
    assert before.vs_best > 0.95 and after.vs_best > 0.95
    assert after.prediction_error_after_50 < 0.10  # the prices caught up within 50 steps


def test_it_follows_a_workload_that_switches_and_switches_back():
    code, prose, code_again = run_script(*SCENARIOS["workload switches"])[0]
    assert code.speculative_share > 0.95 and code.vs_best > 0.95
    assert prose.speculative_share < 0.1 and prose.vs_plain > 0.96  # stops within a few dozen steps
    assert code_again.speculative_share > 0.8 and code_again.vs_best > 0.95  # and finds it again


def test_it_judges_each_load_on_its_own():
    """One controller through batch sizes 1, 4, 16, 64 and back to 4: speculation pays at 1 and 4 (1.2-1.3 x),
    breaks even at 16 and loses at 64 (0.8 x); every phase ends within a few percent of its better mode."""
    results, _ = run_script(*SCENARIOS["load rises and falls"])
    by_b = {(r.start, r.batch_size): r for r in results}
    assert by_b[(0, 1)].speculative_share > 0.9 and by_b[(1700, 4)].speculative_share > 0.9
    assert by_b[(1100, 64)].speculative_share < 0.05
    assert all(r.vs_best > 0.96 for r in results), [(r.batch_size, r.vs_best) for r in results]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sixteen_rows_arriving_after_a_first_request_that_lost_start_speculating_at_once(seed):
    """A server's start: one request alone whose drafts are poor (its probes lose), then sixteen whose drafts pay.
    The sixteen rows probe with their own credit and exploit within a few steps (with one credit for all they ran
    plain for 178-264 of their 600 steps and reached 0.93-0.95 of always speculating)."""
    first, sixteen = run_script(*SCENARIOS["a server starts"], seed=seed)[0]
    assert first.batch_size == 1 and sixteen.batch_size == 16
    assert sixteen.spec_tokens_per_s > 1.1 * sixteen.plain_tokens_per_s  # the script: speculation pays there
    assert sixteen.speculative_share > 0.9 and sixteen.vs_best > 0.97


def test_a_run_is_a_function_of_its_seed():
    a = run_script(*SCENARIOS["workload switches"], seed=5)
    b = run_script(*SCENARIOS["workload switches"], seed=5)
    assert a == b


def fresh(prior: CostModel | None = None, **options) -> SpeculationController:
    return SpeculationController(StepCostModel.from_cost_model(prior or Machine().prior()), **options)


def test_with_no_evidence_a_plain_price_it_does_not_know_is_measured_first():
    ctl = fresh()
    first = ctl.decide(4, 256.0)
    assert not first.speculate and math.isnan(first.ratio)
    engine = ScriptedEngine()
    phase = Phase(0, 4, 0.75)
    for _ in range(20):  # plain steps teach the plain price
        sample, produced = engine.step(phase, False)
        ctl.cost.observe(sample)
        ctl.observe(sample, produced, ctl.decide(4, 256.0))
    d = ctl.decide(4, 256.0, catch_up_tokens=4 * engine.pending)
    assert d.speculate and d.reason == "probe" and d.expected_loss > 0  # now a blind probe, paid from the credit


def test_a_probe_is_charged_what_it_lost_and_a_paying_probe_pays_credit_back():
    ctl = fresh(initial_credit=3.0, explore_share=0.0)
    plain = StepSample(4, 4, 256.0, (), 0.0001, 0.01)
    for _ in range(5):
        ctl.cost.observe(plain)
    d = ctl.decide(4, 256.0)
    assert d.speculate and d.probe
    t_plain = d.plain_seconds
    spec = StepSample(4, 20, 256.0, (8, 4, 4, 4), 0.003, 0.012)
    ctl.observe(spec, 4.0, d)  # 4 tokens in 0.015 s where plain steps would have emitted 4 x 0.015 / t_plain
    lost = spec.seconds / t_plain * 4 - 4.0
    assert ctl.stats.exploration_loss == pytest.approx(lost)
    assert ctl.credit == pytest.approx(3.0 - lost / 4)
    d = ctl.decide(4, 256.0)
    before = ctl.credit
    if d.probe and d.speculate:
        ctl.observe(spec, 40.0, d)  # a probe that paid: credit comes back, capped
        assert ctl.credit > before and ctl.credit <= ctl.max_credit


def test_warm_up_evidence_counts_no_step_and_no_credit():
    ctl = fresh()
    ctl.record(StepSample(1, 5, 64.0, (2, 1, 1, 1), 0.002, 0.005), 3)
    assert ctl.records.size == 1 and ctl.stats.steps == 0 and ctl.credit == 2.0
    ctl.record(StepSample(1, 1, 64.0), 1)  # a plain step is no evidence about speculation
    assert ctl.records.size == 1


def test_a_steady_speculative_shape_is_priced_without_its_catch_up():
    """The rate of steady speculation leaves out the catch-up a probe after plain steps paid: two records of the
    same step, one with 64 catch-up tokens in its first draft forward, estimate the same ratio."""
    base = StepSample(4, 20, 64.0, (8, 4, 4, 4), 0.004, 0.01)
    caught = StepSample(4, 20, 64.0, (72, 4, 4, 4), 0.009, 0.01, catch_up_tokens=64)
    ratios = []
    for sample in (base, caught):
        ctl = fresh()
        for _ in range(8):
            ctl.cost.observe(StepSample(4, 4, 64.0, (), 0.0001, 0.006))
        ctl.record(sample, 12)
        ratios.append(ctl.estimate(4, 64.0)[0])
    assert ratios[0] == pytest.approx(ratios[1])


def test_bad_options_are_refused_by_name():
    cost = StepCostModel.from_cost_model(CostModel.linear(0.01, 0.001))
    with pytest.raises(ValueError, match="explore_share"):
        SpeculationController(cost, explore_share=1.5)
    with pytest.raises(ValueError, match="memory_half_life"):
        SpeculationController(cost, memory_half_life=0)
    with pytest.raises(ValueError, match="initial_credit"):
        SpeculationController(cost, initial_credit=10.0, max_credit=8.0)
    with pytest.raises(ValueError, match="batch_size"):
        SpeculationController(cost).decide(0, 1.0)


def _paying(ctl: SpeculationController, steps: int) -> None:
    """Plain steps teach the plain price, then speculative steps that emit 3x what a plain step does."""
    plain = StepSample(4, 4, 256.0, (), 0.0001, 0.01)
    for _ in range(8):
        ctl.cost.observe(plain)
    spec = StepSample(4, 20, 256.0, (8, 4, 4, 4), 0.002, 0.011)
    for _ in range(steps):
        ctl.cost.observe(spec)
        ctl.observe(spec, 12.0, ctl.decide(4, 256.0))


def test_an_estimate_is_kept_for_refresh_every_steps_while_steps_add_evidence_and_read_at_the_first_record():
    """The estimate reads every kept record: it is reused for refresh_every steps even though each speculative step
    adds a record, then read again, and what it kept is close to the estimate read anew (the reference:
    `_estimate_now` at the same records); an estimate without evidence (nan) is read again at the first record."""
    ctl = fresh(refresh_every=4)
    _paying(ctl, 40)
    reads = []
    now = ctl._estimate_now
    ctl._estimate_now = lambda b, c: reads.append(ctl.step) or now(b, c)
    spec = StepSample(4, 20, 256.0, (8, 4, 4, 4), 0.002, 0.011)
    for _ in range(12):  # new evidence every step, a read every 4th
        ctl.observe(spec, 12.0, ctl.decide(4, 256.0))
    assert len(reads) == 3 and reads[1] - reads[0] == 4 and reads[2] - reads[1] == 4
    if ctl.step - reads[-1] >= 4:  # the next decision reads again: take that read as the kept one
        ctl.estimate(4, 256.0)
    n = len(reads)
    kept = ctl.estimate(4, 256.0)
    assert len(reads) == n and kept[0] == pytest.approx(now(4, 256.0)[0], rel=0.05)  # kept, and near a fresh read
    assert ctl.estimate(8, 256.0) is not kept and len(reads) == n + 1  # another batch size reads anew
    unsure = fresh(refresh_every=4)
    reads.clear()
    first = unsure._estimate_now
    unsure._estimate_now = lambda b, c: reads.append(unsure.step) or first(b, c)
    assert math.isnan(unsure.estimate(4, 256.0)[0])
    unsure.record(spec, 12.0)
    assert not math.isnan(unsure.estimate(4, 256.0)[0]) and len(reads) == 2


def test_an_estimate_of_few_records_or_of_records_that_advance_no_step_is_read_again():
    """Below KEEP_RECORDS records every new record is read at once (each moves the estimate most then); warm-up
    records (`record`: no step) are read once more than refresh_every of them arrived since the estimate, so a
    run of them cannot leave the estimate on the other side of 1 (the reference: `_estimate_now` read anew)."""
    from echo_trtllm.core.controller import KEEP_RECORDS

    ctl = fresh(refresh_every=4)
    good = StepSample(4, 20, 256.0, (8, 4, 4, 4), 0.002, 0.011)
    bad = StepSample(4, 20, 256.0, (8, 4, 4, 4), 0.02, 0.03)
    for _ in range(8):
        ctl.cost.observe(StepSample(4, 4, 256.0, (), 0.0001, 0.01))
    for k in range(KEEP_RECORDS - 1):  # few records: each read at once, with or without a step between
        ctl.record(good, 12.0)
        assert ctl.estimate(4, 256.0) == ctl._estimate_now(4, 256.0), k
    for _ in range(KEEP_RECORDS):
        ctl.record(good, 12.0)
    kept = ctl.estimate(4, 256.0)
    assert kept[0] > 1.0
    for _ in range(30):  # warm-up records that say speculation loses, no step advancing
        ctl.record(bad, 4.0)
    assert ctl.estimate(4, 256.0) == ctl._estimate_now(4, 256.0)
    assert ctl.estimate(4, 256.0)[0] < kept[0]


def test_each_batch_size_bucket_has_its_own_exploration_credit():
    """A server's first request runs alone and the controller explores there; probes that lose at one row leave
    that row's credit below zero, and sixteen rows arriving next still start with their own credit to probe
    (one credit for all had them run plain until it was earned back: docs/performance.md)."""
    ctl = fresh(explore_share=0.0)
    engine = ScriptedEngine()
    for b in (1, 16):
        for _ in range(20):  # plain steps teach both plain prices
            sample, _ = engine.step(Phase(0, b, 0.75), False)
            ctl.cost.observe(sample)
    losing = StepSample(1, 20, 256.0, (8, 4, 4, 4), 0.05, 0.05)  # 0.1 s for one token
    for _ in range(3):
        ctl.observe(losing, 1.0, Decision(True, "probe", 1, plain_seconds=0.005))
    assert ctl.credit_at(1) < 0 and ctl.credit == ctl.credit_at(1)
    assert ctl.credit_at(16) == ctl.initial_credit == 2.0
    assert not ctl.decide(1, 256.0).speculate  # one row: no credit left
    d = ctl.decide(16, 256.0)  # sixteen rows: nothing known there, a blind probe paid from its own credit
    assert d.speculate and d.reason == "probe" and 0 < d.expected_loss <= 2.0 and ctl.credit == 2.0
    plain16, _ = engine.step(Phase(0, 16, 0.75), False)
    ctl.observe(plain16, 16.0, Decision(False, "plain", 16, plain_seconds=plain16.seconds))
    assert ctl.credit_at(1) < 0 and ctl.credit_at(16) == 2.0  # each bucket earns and pays its own


def test_only_a_speculative_probe_asks_for_drafted_tokens():
    """`Decision.min_tokens`: 2 x rows for a speculative probe (the batch by default), 0 for every other decision."""
    assert Decision(True, "probe", 16).min_tokens() == 32 and Decision(True, "probe", 16).min_tokens(5) == 10
    for decision in (Decision(True, "exploit", 16), Decision(False, "plain", 16), Decision(False, "plain-probe", 16),
                     Decision(True, "forced", 16), Decision(False, "forced", 16), Decision(False, "probe", 16)):
        assert decision.min_tokens() == 0, decision


def test_the_last_estimate_is_what_the_last_decision_read():
    """`last_estimate` (what `LLM.speculation_stats` and `echo-trtllm generate` report): None before any estimate
    and while there is no evidence (nan), then the batch size, ratio and band the last decision carried."""
    ctl = fresh()
    assert ctl.last_estimate() is None
    assert ctl.decide(4, 256.0).reason in ("probe", "plain") and ctl.last_estimate() is None  # nothing known: nan
    _paying(ctl, 40)
    d = ctl.decide(4, 256.0)
    est = ctl.last_estimate()
    assert est["batch_size"] == 4 and not math.isnan(d.ratio)
    assert (est["ratio"], est["low"], est["high"]) == pytest.approx((d.ratio, d.low, d.high))
    assert est["low"] < est["ratio"] < est["high"]
