"""A scripted engine: step times and acceptance follow a script on a modelled clock, so the whole decision loop
(the online prices of `core/prices.py`, the speculation controller of `core/controller.py`) runs without a model
and without the wall clock. Tests drive it (tests/core/test_controller.py); this module's command prints the
scenarios' table that docs/online.md shows:

    python -m echo_trtllm.bench.scripted [--json out.json]

The engine's true costs (`Machine`, seconds, times the phase's `speed`): a plain step of B requests at context C
costs step + per_token B + per_context B C + per_request B; a speculative step drafts a chain of `depth` tokens
per request (draft forwards of B (2 + catch-up) then B tokens each, draft_forward + draft_token t each, plus
tree) and verifies B (1 + depth) tokens. Every step's time carries log-normal noise and, now and then, a burst
(another process on the machine: time only added). A request accepts each next draft token with probability p
(the phase's `acceptance`), so a speculative step emits 1 + (accepted run) tokens per request. After plain
steps the draft has tokens to catch up on (one per plain step and request, bounded by `max_pending`).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field

import numpy as np

from echo_trtllm.core.controller import Decision, SpeculationController
from echo_trtllm.core.cost import CostModel
from echo_trtllm.core.prices import StepCostModel
from echo_trtllm.core.steps import StepSample

__all__ = ["Machine", "Phase", "ScriptedEngine", "run_script", "SCENARIOS"]


@dataclass(frozen=True)
class Machine:
    """True costs of the scripted engine (seconds), before a phase's speed factor."""

    step: float = 0.004
    per_token: float = 0.00005
    per_context: float = 2e-8  # per verified token and cached token of context
    per_request: float = 5e-5
    draft_forward: float = 0.0006
    draft_token: float = 0.00001
    tree: float = 0.0003
    plain_host: float = 5e-5  # a plain step's drafting phase (its root-only tree)
    noise: float = 0.03  # log-normal deviation of every phase
    burst_rate: float = 0.02  # share of steps slowed by another process
    burst: float = 0.5  # how much a burst adds (x 1.5)
    max_pending: int = 64

    def forwards(self, b: int, depth: int, catch_up: int) -> tuple[int, ...]:
        """Token counts of a speculative step's draft forwards."""
        return (b * 2 + catch_up,) + (b,) * (depth - 1)

    def prior(self) -> CostModel:
        """What a load-time measurement of these forwards would give: the target's and the draft's forward times
        by tokens (host work and attention not included, as at load)."""
        tokens = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
        verify = tuple(self.step + self.per_token * t for t in tokens)
        draft = tuple(self.draft_forward + self.draft_token * t for t in tokens)
        return CostModel(tokens, verify, tokens, draft)


@dataclass(frozen=True)
class Phase:
    """A stretch of the script: from step `start` on, this batch size, acceptance and machine speed."""

    start: int
    batch_size: int
    acceptance: float
    speed: float = 1.0
    context: float = 256.0


class ScriptedEngine:
    """Runs steps as `Machine` and the script say (module docstring); seeded."""

    def __init__(self, machine: Machine = Machine(), depth: int = 4, seed: int = 0) -> None:
        self.machine, self.depth = machine, depth
        self.rng = np.random.default_rng(seed)
        self.pending = 0  # plain steps since the draft last ran (tokens per request to catch up on)

    def _noisy(self, seconds: float) -> float:
        m = self.machine
        factor = math.exp(self.rng.normal(0.0, m.noise))
        if self.rng.random() < m.burst_rate:
            factor *= 1.0 + m.burst
        return seconds * factor

    def step(self, phase: Phase, speculate: bool) -> tuple[StepSample, int]:
        """One step: (its sample as an engine would measure it, tokens produced)."""
        m, b, c, speed = self.machine, phase.batch_size, phase.context, phase.speed
        if not speculate:
            verify = m.step + (m.per_token + m.per_context * c + m.per_request) * b
            self.pending = min(self.pending + 1, m.max_pending)
            return StepSample(b, b, c, (), self._noisy(speed * m.plain_host), self._noisy(speed * verify)), b
        catch_up = b * self.pending
        forwards = m.forwards(b, self.depth, catch_up)
        drafting = m.tree + sum(m.draft_forward + m.draft_token * t for t in forwards)
        verified = b * (1 + self.depth)
        verify = m.step + (m.per_token + m.per_context * c) * verified + m.per_request * b + m.tree
        # accepted run per request: each next draft token with probability p, up to depth
        runs = np.minimum(self.rng.geometric(1.0 - phase.acceptance, size=b) - 1, self.depth) \
            if phase.acceptance < 1 else np.full(b, self.depth)
        self.pending = 0
        sample = StepSample(b, verified, c, forwards, self._noisy(speed * drafting), self._noisy(speed * verify),
                            catch_up)
        return sample, int(b + runs.sum())

    def expected_rates(self, phase: Phase) -> tuple[float, float]:
        """(plain, steady speculative) tokens per second of this phase, from the script: expected times with the
        noise's mean (log-normal and bursts) included."""
        m, b, c, p = self.machine, phase.batch_size, phase.context, phase.acceptance
        noise = math.exp(m.noise ** 2 / 2) * (1 + m.burst_rate * m.burst) * phase.speed
        plain = b / (noise * (m.plain_host + m.step + (m.per_token + m.per_context * c + m.per_request) * b))
        forwards = m.forwards(b, self.depth, 0)
        t_spec = noise * (m.tree + sum(m.draft_forward + m.draft_token * t for t in forwards) + m.step
                          + (m.per_token + m.per_context * c) * b * (1 + self.depth) + m.per_request * b + m.tree)
        tokens = b * (1 + sum(p ** d for d in range(1, self.depth + 1)))
        return plain, tokens / t_spec


@dataclass
class PhaseResult:
    start: int
    steps: int
    batch_size: int
    acceptance: float
    speed: float
    speculative_share: float
    tokens_per_s: float
    plain_tokens_per_s: float  # the script's, always plain
    spec_tokens_per_s: float  # the script's, always speculating (steady)
    vs_plain: float
    vs_best: float
    # median |predicted - measured| / measured of the whole step over the phase's steps after its 50th
    prediction_error_after_50: float
    reasons: dict = field(default_factory=dict)


def run_script(phases: list[Phase], steps: int, machine: Machine = Machine(), depth: int = 4, seed: int = 0,
               **controller) -> tuple[list[PhaseResult], dict]:
    """Run the script for `steps` steps through a fresh cost model (prior: `machine.prior()`) and controller;
    returns per-phase results and the controller's stats."""
    if not phases or phases[0].start != 0 or [p.start for p in phases] != sorted(set(p.start for p in phases)):
        raise ValueError("phases must start at step 0 and be in strictly increasing order")
    if phases[-1].start >= steps:
        raise ValueError(f"steps ({steps}) must exceed the last phase's start ({phases[-1].start})")
    engine = ScriptedEngine(machine, depth, seed)
    cost = StepCostModel.from_cost_model(machine.prior())
    ctl = SpeculationController(cost, **controller)
    bounds = [p.start for p in phases] + [steps]
    results = []
    for k, phase in enumerate(phases):
        tokens = seconds = spec = 0.0
        errors, reasons = [], {}
        for i in range(bounds[k], bounds[k + 1]):
            decision: Decision = ctl.decide(phase.batch_size, phase.context, phase.batch_size * engine.pending)
            sample, produced = engine.step(phase, decision.speculate)
            prediction = cost.observe(sample)
            ctl.observe(sample, produced, decision)
            tokens += produced
            seconds += sample.seconds
            spec += decision.speculate
            reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
            if i - bounds[k] >= 50:
                errors.append(abs(prediction.relative_error))
        n = bounds[k + 1] - bounds[k]
        plain, spec_rate = engine.expected_rates(phase)
        rate = tokens / seconds
        results.append(PhaseResult(phase.start, n, phase.batch_size, phase.acceptance, phase.speed, spec / n, rate,
                                   plain, spec_rate, rate / plain, rate / max(plain, spec_rate),
                                   float(np.median(errors)) if errors else math.nan, reasons))
    return results, ctl.stats.as_dict()


# name -> (phases, steps): the scenarios tests and docs run
SCENARIOS = {
    "pays at B=1": ([Phase(0, 1, 0.75)], 600),
    "loses at B=16": ([Phase(0, 16, 0.3)], 2000),
    "break-even at B=16": ([Phase(0, 16, 0.6)], 1500),
    "machine slows by half": ([Phase(0, 4, 0.75), Phase(500, 4, 0.75, speed=2.0)], 1200),
    "workload switches": ([Phase(0, 4, 0.75), Phase(500, 4, 0.3), Phase(1500, 4, 0.75)], 2500),
    "load rises and falls": ([Phase(0, 1, 0.6), Phase(300, 4, 0.6), Phase(700, 16, 0.6), Phase(1100, 64, 0.6),
                              Phase(1700, 4, 0.6)], 2100),
    # a server's first request alone, where its drafts are poor, then sixteen whose drafts pay
    "a server starts": ([Phase(0, 1, 0.2), Phase(30, 16, 0.75)], 630),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m echo_trtllm.bench.scripted", description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write every scenario's per-phase results here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = {}
    print(f"{'scenario':>24} {'phase':>6} {'B':>3} {'p':>5} {'speed':>5} {'spec':>6} {'x plain':>8} {'x best':>7} "
          f"{'err':>6}")
    for name, (phases, steps) in SCENARIOS.items():
        results, stats = run_script(phases, steps, seed=args.seed)
        out[name] = {"phases": [asdict(r) for r in results], "stats": stats}
        for r in results:
            print(f"{name:>24} {r.start:>6} {r.batch_size:>3} {r.acceptance:>5.2f} {r.speed:>5.1f} "
                  f"{r.speculative_share:>6.1%} {r.vs_plain:>8.3f} {r.vs_best:>7.3f} {r.prediction_error_after_50:>6.1%}")
        print(f"{'':>24} exploration share {stats['exploration_share']:.2%}, probes {stats['probes']} + "
              f"{stats['plain_probes']} plain")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
