"""ECHO over an engine's own draft runner, one level at a time (vLLM's draft-model proposer, `backends.vllm_draft`).

Such an engine drafts every row of its batch level by level with its own (fast) draft model and verifies what it is
handed back. ECHO does not run the draft here; it decides around it, from what the engine says of each step:

- Before the draft runs (`begin`): whether this step speculates at all. A plain step skips the draft entirely, so
  it costs the engine's plain step and nothing more, unlike the engine's own "zero draft tokens" step, which still
  runs the draft over the step's tokens to keep the draft's KV cache in sync. The rows of a skipped step fall
  behind: the speculator remembers, per request, the first position whose draft KV is missing (`lag`), and the
  next speculative step prepends what each row missed to its first draft forward (the catch-up, bounded by what
  the draft's buffers hold; a row that does not fit stays behind and drafts nothing this step). A request first
  seen past position 0 (a prefix-cache hit, a request resumed after preemption) is read from position 0: its
  cached blocks may have been written while the draft did not run.
- As each level arrives (`level`): the echo policy restricted to chains (`rows.chain_config`) through
  `core.DraftLoop`, fed each row's drafted token and its probability: sparse confidence gating at the calibrated
  depths, the budget and cost stops, the global budget across the batch. When the policy expands no node any more,
  `level` says stop and the engine's loop ends early (the levels not drafted are not paid for).
- After the last level (`finish`): one chain per row, the policy's selection (a row gated off early gets a shorter
  chain; rows the engine drafted past the policy's stop are cut).
- The outcome, at the next step's `begin`: the engine says how many of each row's drafts it rejected; the accepted
  lengths train the policy's acceptance estimates, and the time from the last call's return to this call's start is
  the engine's verification step, the call itself the drafting phase: a `core.steps.StepSample` for the whole-step
  cost model (`core.prices.StepCostModel`) and the speculation controller (`core.controller`), which chooses plain
  steps where speculation does not pay. Steps that prefilled, or whose rows do not follow the last call's, are
  not priced; nor is a step more than 4x slower than the fitted model predicts, or the first step of a shape more
  than 2x slower (an engine's first step of a new shape, a stall of the machine): those are counted as outliers.

Nothing here imports an engine; tests drive it with a scripted engine and a modelled clock.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable, Sequence

import torch

from echo_trtllm.core import DraftLoop, EchoConfig
from echo_trtllm.core.controller import Decision
from echo_trtllm.core.cost import CostModel
from echo_trtllm.core.steps import StepSample
from echo_trtllm.core.tree import DraftTopK

from .rows import chain_config, chains_of, learn_acceptance, priced_policy

__all__ = ["LevelSpeculator", "StepPlan"]

# a step measured at more than OUTLIER_RATIO x its predicted seconds, once OUTLIER_AFTER steps are priced, is an outlier
OUTLIER_RATIO, OUTLIER_AFTER = 4.0, 8
# the first step of a (batch, verified tokens) shape at more than FIRST_SHAPE_RATIO x its prediction is one too
FIRST_SHAPE_RATIO = 2.0
# decode steps a priced speculator starts with, speculative and plain in turn (`LevelSpeculator` warm_up)
WARM_UP_STEPS = 8


@dataclasses.dataclass
class StepPlan:
    """What `begin` decided for a step: whether the draft runs, which rows read back what they missed (row index
    -> the first position to re-read), and which rows get a chain."""

    speculate: bool
    prepend: dict[int, int]
    drafting: list[bool]
    decision: Decision | None = None
    catch_up: int = 0  # tokens the prepends add to the first draft forward


@dataclasses.dataclass
class _Last:
    """What one call left for the next."""

    requests: list[Hashable]
    chains: dict[Hashable, list[int]]
    confidences: dict[Hashable, list[float]]
    context: float
    forwards: tuple[int, ...]
    catch_up: int
    drafting_seconds: float
    end: float
    decision: Decision | None
    warm: int = -1  # the step's index in the warm-up (-1: not a warm-up step)


class LevelSpeculator:
    """ECHO's decisions around an engine's level-by-level draft runner (module docstring).

    max_draft_len: the engine's draft depth (its loop's levels). k_max: the step's global budget in tokens (roots
    included; None: unlimited). cost: the prices' prior (None with prices=False). prices: learn prices from the
    engine's steps and let the controller choose plain steps (False: every step speculates, unpriced). cycle:
    (speculative, plain) steps in a fixed duty cycle instead of the controller (a measurement tool: it exercises
    the catch-up at known steps). warm_up: the first decode steps (no row prefilling) alternate speculative and
    plain steps chosen here ("forced"), not by the controller: the first of each kind pays an engine's one-off costs
    and is not learnt from; the others teach the prices both kinds of step, and the speculative ones are the
    controller's first evidence without charging its exploration budget (the engine's own warm-up at load does
    the same, `Executor.warm_up`, except that its steps, of one prompt at one and four rows, teach only the
    speculative step's constants; these are the traffic's own steps, at its batch sizes and contexts, and teach
    every coefficient). 0: none."""

    def __init__(self, config: EchoConfig, max_draft_len: int, k_max: int | None = None, cost: CostModel | None = None,
                 clock: Callable[[], float] = time.perf_counter, prices: bool = True,
                 cycle: tuple[int, int] | None = None, warm_up: int = WARM_UP_STEPS) -> None:
        self.config = chain_config(config, max_draft_len)
        if not isinstance(warm_up, int) or isinstance(warm_up, bool) or warm_up < 0:
            raise ValueError(f"warm_up must be an integer >= 0 (decode steps), got {warm_up!r}")
        self.max_draft_len, self.k_max, self.clock = max_draft_len, k_max, clock
        if cycle is not None and (len(cycle) != 2 or min(cycle) < 0 or cycle[0] < 1):
            raise ValueError(f"cycle must be (speculative >= 1, plain >= 0) steps, got {cycle!r}")
        self.cycle = cycle
        self.step_cost, self.policy, self.controller = priced_policy(self.config,
                                                                     cost if prices and cycle is None else None)
        self.lag: dict[Hashable, int] = {}  # request -> first position whose draft KV is missing
        self.known: set[Hashable] = set()
        self._shapes: set[tuple[int, int]] = set()  # (batch, verified tokens) of the steps priced
        self.last: _Last | None = None
        self.last_interval: float | None = None
        self._loop: DraftLoop | None = None
        self._step: dict | None = None
        self.steps = 0
        # decode steps of the warm-up still to run (only with the controller)
        self.warm_up = warm_up if self.controller is not None else 0
        self._warm = 0  # warm-up steps run
        self.stats = {"steps": 0, "speculative_steps": 0, "priced_steps": 0, "drafted": 0, "accepted": 0,
                      "catch_up_tokens": 0, "stopped_early": 0, "outliers": 0}

    # ------------------------------------------------------------------ before the draft runs

    def begin(self, requests: Sequence[Hashable], starts: Sequence[int], lengths: Sequence[int],
              rejected: Sequence[int] | None = None, live: Sequence[bool] | None = None,
              capacity: int | None = None) -> StepPlan:
        """A step's plan. Per row of the engine's batch, in its order: the request, the first position of the
        step's tokens the engine verified (its query), how many tokens that was, how many of them the engine
        rejected (drafts of the last step; None: none), and whether the row samples a token (False while it is
        still prefilling). capacity: the most tokens the draft's first forward takes (catch-up included)."""
        start = self.clock()
        n = len(requests)
        if not (len(starts) == len(lengths) == n):
            raise ValueError(f"requests, starts and lengths must have one entry per row, got {n}, {len(starts)}, "
                             f"{len(lengths)}")
        rejected = [0] * n if rejected is None else [int(r) for r in rejected]
        live = [True] * n if live is None else [bool(x) for x in live]
        starts, lengths = [int(s) for s in starts], [int(q) for q in lengths]
        self.last_interval = None if self.last is None else start - self.last.end
        self._learn(start, requests, lengths, rejected, live)
        self._track(requests, starts)
        context = float(sum(s + q for s, q in zip(starts, lengths)) / max(n, 1))
        lagging = [i for i, r in enumerate(requests) if r in self.lag]
        speculate, decision, warm = self._decide(requests, starts, lengths, live, lagging, context)
        self.steps += 1
        self.stats["steps"] += 1
        step = {"start": start, "requests": list(requests), "context": context, "decision": decision, "warm": warm}
        if not speculate or n == 0:
            for r, s in zip(requests, starts):
                self.lag.setdefault(r, s)
            self._step = {**step, "forwards": (), "catch_up": 0}
            return StepPlan(False, {}, [False] * n, decision)
        room = None if capacity is None else capacity - sum(lengths) - n
        prepend: dict[int, int] = {}
        drafting = list(live)
        catch_up = 0
        for i in lagging:
            need = starts[i] - self.lag[requests[i]]
            if room is not None and need > room:
                drafting[i] = False  # stays behind; its first draft forward is wasted this step
                continue
            prepend[i] = self.lag.pop(requests[i])
            catch_up += need
            if room is not None:
                room -= need
        self.stats["speculative_steps"] += 1
        self.stats["catch_up_tokens"] += catch_up
        rows = [i for i in range(n) if drafting[i]]
        budget = None if self.k_max is None else max(self.k_max, len(rows))
        self._rows = torch.tensor(rows, dtype=torch.long)
        floor = decision.min_tokens(len(rows)) if decision is not None and self.config.probe_floor else 0
        self._loop = DraftLoop(self.policy, torch.zeros(len(rows), dtype=torch.long), budget=budget, context=context,
                               min_tokens=floor)
        self._step = {**step, "forwards": [sum(lengths) + catch_up + n], "catch_up": catch_up}
        return StepPlan(True, prepend, drafting, decision, catch_up)

    def _track(self, requests: Sequence[Hashable], starts: Sequence[int]) -> None:
        """Forget requests that left; a new request that arrives past its first position lags from position 0."""
        for r in list(self.lag):
            if r not in requests:
                del self.lag[r]
        self.known.intersection_update(requests)
        for r, s in zip(requests, starts):
            if r not in self.known:
                self.known.add(r)
                if s > 0:
                    self.lag[r] = 0

    def _decide(self, requests, starts, lengths, live, lagging, context) -> tuple[bool, Decision | None, int]:
        """(speculate, the controller's decision or None, the warm-up step's index or -1): a fixed cycle, the
        warm-up's alternation, the controller, or always."""
        n = len(requests)
        if self.cycle is not None:
            return self.steps % (self.cycle[0] + self.cycle[1]) < self.cycle[0], None, -1
        if self._warm < self.warm_up and n > 0 and self.prefill_tokens(lengths, live) == 0:
            speculate = self._warm % 2 == 0
            warm, self._warm = self._warm, self._warm + 1
            return speculate, Decision(speculate, "forced", n), warm
        if self.controller is not None and n > 0:
            # beyond steady speculation the draft's first forward reads what lagging rows missed and the step's
            # prefill (rows still prefilling, or finishing their prompt: more tokens than a chain verifies)
            extra = sum(starts[i] - self.lag[requests[i]] for i in lagging) + self.prefill_tokens(lengths, live)
            decision = self.controller.decide(n, context, extra)
            return decision.speculate, decision, -1
        return n > 0, None, -1

    def prefill_tokens(self, lengths: Sequence[int], live: Sequence[bool]) -> int:
        """Tokens of a step's rows that prefill (not yet sampling, or more tokens than a chain's 1 + max_draft_len):
        the draft reads them in its first forward if the step speculates."""
        return sum(q for q, lv in zip(lengths, live) if not lv or q > 1 + self.max_draft_len)

    # ------------------------------------------------------------------ as the levels arrive

    def level(self, tokens: torch.Tensor, probs: torch.Tensor) -> bool:
        """One drafted level for every row of the batch: each row's token and its probability under the draft.
        True: the policy expands nodes of this level (the engine may draft the next one); False: drafting ends."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("level() outside a speculative step: call begin() and check its plan first")
        if loop.depth > 1:
            self._step["forwards"].append(int(tokens.shape[0]))
        frontier = loop.frontier()
        if frontier is None:
            return False
        engine_rows = self._rows[loop.levels[-1].request_ids[frontier]]
        loop.feed(DraftTopK(probs[engine_rows].float().reshape(-1, 1), tokens[engine_rows].long().reshape(-1, 1)))
        return loop.frontier() is not None

    def finish(self, num_rows: int) -> list[list[int]]:
        """Each row's chain (empty for rows not drafted, or for every row after a plain step)."""
        step, self._step = self._step, None
        if step is None:
            raise RuntimeError("finish() without begin()")
        out: list[list[int]] = [[] for _ in range(num_rows)]
        chains: dict[Hashable, list[int]] = {}
        confs: dict[Hashable, list[float]] = {}
        loop, self._loop = self._loop, None
        if loop is not None:
            # the policy ended drafting before the engine's last level (the engine stopped its loop there)
            self.stats["stopped_early"] += int(loop.done and len(loop.levels) - 1 < self.max_draft_len)
            result = loop.result()
            rows = self._rows.tolist()
            for j, chain in enumerate(chains_of(result.selected, len(rows), self.max_draft_len)):
                r = step["requests"][rows[j]]
                out[rows[j]] = chains[r] = [t for t, _ in chain]
                confs[r] = [c for _, c in chain]
        end = self.clock()
        self.last = _Last(step["requests"], chains, confs, step["context"], tuple(step["forwards"]), step["catch_up"],
                          end - step["start"], end, step["decision"], step["warm"])
        return out

    def fail(self, starts: Sequence[int]) -> None:
        """The engine's draft failed inside a step begun: every row of it is read again from where the step began
        (or where it already lagged); the step is not priced."""
        step, self._step, self._loop = self._step, None, None
        if step is not None:
            for r, s in zip(step["requests"], starts):
                self.lag.setdefault(r, int(s))
        self.last = None

    # ------------------------------------------------------------------ the last step's outcome

    def _learn(self, now: float, requests, lengths, rejected, live) -> None:
        """Acceptance from the step the engine ran since the last call, and its price where it was a clean decode
        step (every row follows the last call's: the same requests, each verifying its chain, none prefilling)."""
        last, self.last = self.last, None
        if last is None:
            return
        follows = len(requests) == len(last.requests) and set(requests) == set(last.requests)
        outcomes: list[tuple[list[float], int]] = []
        produced = 0
        for r, q, rej, lv in zip(requests, lengths, rejected, live):
            chain = last.chains.get(r, [])
            if r not in last.requests or q != len(chain) + 1 or not lv or not 0 <= rej <= len(chain):
                follows = False
                continue
            produced += len(chain) - rej + 1
            outcomes.append((last.confidences.get(r, []), len(chain) - rej))
        learn_acceptance(self.policy, self.stats, outcomes)
        if self.step_cost is None or not follows or not last.requests or 0 <= last.warm < 2:
            return  # (the warm-up's first speculative and plain steps pay an engine's one-off costs)
        b = len(last.requests)
        drafted = sum(len(c) for c in last.chains.values())
        sample = StepSample(b, b + drafted, last.context, last.forwards, last.drafting_seconds,
                            max(now - last.end, 0.0), min(last.catch_up, last.forwards[0]) if last.forwards else 0)
        predicted = self.step_cost.predict_sample(sample)
        measured = sample.drafting_seconds + sample.verification_seconds
        shape = (b, b + drafted)
        first = shape not in self._shapes
        self._shapes.add(shape)
        if (first and measured > FIRST_SHAPE_RATIO * predicted) or \
                (self.stats["priced_steps"] >= OUTLIER_AFTER and measured > OUTLIER_RATIO * predicted):
            # a step far slower than predicted (an engine's first step of a new shape, a stall of the machine) says
            # nothing about the next one: it is counted, not learnt from
            self.stats["outliers"] += 1
            return
        self.step_cost.observe(sample)
        if last.warm >= 0:
            self.controller.record(sample, produced)  # evidence, no decision, nothing charged
        else:
            self.controller.observe(sample, produced, last.decision)
        self.stats["priced_steps"] += 1
