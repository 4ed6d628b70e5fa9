"""ECHO for an engine that hands over rows of token ids each step (vLLM's custom proposer): a draft KV cache matched
to rows by content, and the step loop that prices the engine's own measured steps.

Such an engine calls the proposer once per step with, per row of its batch, the row's committed tokens (this step's
sampled ones included) and takes back one chain of draft tokens per row, which its next step verifies. It says
nothing else: no request ids (rows move when requests finish), no hidden states, no timings. What ECHO needs is
recovered from the rows themselves:

- The draft's cache (`RowDraftCache`): each slot holds the tokens whose draft K/V it stores; a row takes the slot
  whose tokens share the longest prefix with the row's context (its own slot from the last step, as a rule) and the
  draft reads only the rest. So a step's first draft forward reads each row's sampled tokens (steady speculation:
  the bonus token, and the accepted drafts the draft never read), a new row its whole context once, and a row back
  from plain steps what it missed. Wrong matches cost time, never correctness: the engine verifies every draft.
- The step's outcome (`RowSpeculator`): a row's last chain against the tokens its context gained gives the
  accepted length, which trains the acceptance estimates (every chain node lies on the draft's greedy path).
- The step's price: the time from one call's return to the next call is the engine's verification step (its target
  forward, sampling and scheduling); the call itself is the drafting phase. Together they are a `StepSample`, and
  the whole-step cost model (`core.prices.StepCostModel`) learns from them: its prices drive the echo policy's
  rules (the gate's lambda, the cost stop, K per step) and the speculation controller (`core.controller`), which
  runs plain steps where speculation does not pay. A step whose verification also prefilled (a new row, a row
  still prefilling) is not a decode step's price and is not learned from; neither is a step whose rows do not
  follow from the last call's (the engine restarted or ran steps without the proposer).

The prior of the prices: the draft's forwards measured at start, and the target's taken as the draft's scaled by
the two models' weights (`weights_ratio`), uncertain by a factor of two: an engine's real steps correct both within
a few dozen steps.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np
import torch

from echo_trtllm.core import EchoConfig, draft_tree, make_policy
from echo_trtllm.core.controller import Decision, SpeculationController
from echo_trtllm.core.cost import CostModel
from echo_trtllm.core.prices import StepCostModel
from echo_trtllm.core.steps import StepSample
from echo_trtllm.models.llama import CausalLM, ModelConfig
from echo_trtllm.runtime.inputs import chain_batch

__all__ = ["RowDraftCache", "RowSpeculator", "chain_config", "chains_of", "learn_acceptance", "linear_weights",
           "priced_policy", "prior_cost_model", "weights_scaled_prior"]


def chain_config(config: EchoConfig, max_draft_len: int) -> EchoConfig:
    """The echo policy restricted to chains of at most max_draft_len tokens (one child per node, one node per
    level): what an engine that verifies linear drafts takes."""
    if not isinstance(max_draft_len, int) or isinstance(max_draft_len, bool) or max_draft_len < 1:
        raise ValueError(f"max_draft_len must be an integer >= 1, got {max_draft_len!r}")
    return dataclasses.replace(config, top_k=1, beam_width=1, max_depth=min(config.max_depth, max_draft_len),
                               max_nodes_per_request=max_draft_len + 1)


def chains_of(selected, num_requests: int, max_draft_len: int) -> list[list[tuple[int, float]]]:
    """Each request's chain in a selected tree of chains, in depth order: (token, path probability) per node, at
    most max_draft_len."""
    depth, req, tok = selected.depths.tolist(), selected.request_ids.tolist(), selected.token_ids.tolist()
    conf = selected.path_probs.tolist()
    nodes: list[list[tuple[int, int, float]]] = [[] for _ in range(num_requests)]
    for k in range(selected.total_nodes):
        if depth[k] > 0:
            nodes[req[k]].append((depth[k], tok[k], conf[k]))
    return [[(t, c) for _, t, c in sorted(n)][:max_draft_len] for n in nodes]


def learn_acceptance(policy, stats: dict, outcomes: list[tuple[list[float], int]]) -> None:
    """Each chain's node confidences (path probabilities, in depth order) against the length the engine accepted,
    into the policy's acceptance estimates and the running drafted / accepted counts."""
    depths, probs, accepted = [], [], []
    for confidences, a in outcomes:
        for d, c in enumerate(confidences, start=1):
            depths.append(d)
            probs.append(c)
            accepted.append(d <= a)
    if depths:
        policy.acceptance.observe(torch.tensor(depths), torch.tensor(probs, dtype=torch.float32),
                                  torch.tensor(accepted), torch.ones(len(depths), dtype=torch.bool))
        stats["drafted"] += len(depths)
        stats["accepted"] += int(sum(accepted))


def linear_weights(config: ModelConfig) -> int:
    """Weights a decoder's forward multiplies by (its linears and the output head; the embedding is a lookup)."""
    h, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    q = config.num_attention_heads * config.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size
    return config.num_hidden_layers * per_layer + h * config.vocab_size


def prior_cost_model(draft: CausalLM, target_config: ModelConfig, tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
                     repeats: int = 2, measure: Callable | None = None) -> CostModel:
    """The prices' prior: the draft's forward curve measured here, and the target's taken as the draft's scaled by
    `linear_weights` (the target runs in the other engine; its real steps correct this). measure(model, tokens,
    repeats) -> seconds per point (default `runtime.calibrate.measure_forward_seconds`, made non-decreasing)."""
    from echo_trtllm.runtime.calibrate import measure_forward_seconds, nondecreasing

    if measure is None:
        def measure(model, toks, reps):
            return nondecreasing(measure_forward_seconds(model, toks, repeats=reps))
    return weights_scaled_prior(tokens, measure(draft, tokens, repeats), draft.config, target_config)


def weights_scaled_prior(tokens: tuple[int, ...], draft_seconds, draft_config: ModelConfig,
                         target_config: ModelConfig) -> CostModel:
    """The prices' prior from the draft's forward seconds at each token count: the target's taken as the draft's
    scaled by `linear_weights` (uncertain; the engine's real steps correct both)."""
    draft_seconds = tuple(float(s) for s in draft_seconds)
    ratio = linear_weights(target_config) / linear_weights(draft_config)
    return CostModel(tokens, tuple(s * ratio for s in draft_seconds), tokens, draft_seconds, device="cpu")


def priced_policy(config: EchoConfig, cost: CostModel | None):
    """The echo policy for `config` and, given a prior `cost` (None: unpriced), the whole-step cost model it reads
    its prices from (learning from the engine's steps, the prior uncertain by 100 %) and the speculation controller
    on it: (step_cost, policy, controller), the first and last None when unpriced."""
    step_cost = StepCostModel.from_cost_model(cost, relative=1.0) if cost is not None else None
    policy = make_policy(config, step_cost.prices if step_cost is not None else None)
    return step_cost, policy, SpeculationController(step_cost) if step_cost is not None else None


class RowDraftCache:
    """A draft model's KV cache over `slots` slots of `capacity` positions, matched to rows by content (module
    docstring)."""

    def __init__(self, model: CausalLM, slots: int, capacity: int) -> None:
        if not isinstance(model, CausalLM):
            raise TypeError(f"the draft must be a CausalLM (echo_trtllm.models), got {type(model).__name__}")
        if slots < 1 or capacity < 2:
            raise ValueError(f"RowDraftCache needs slots >= 1 and capacity >= 2, got {slots}, {capacity}")
        self.model, self.slots, self.capacity = model, slots, capacity
        self.cache = model.allocate_cache(slots, capacity)
        self.tokens = np.full((slots, capacity), -1, dtype=np.int64)  # what each slot's K/V holds, by position
        self.lengths = np.zeros(slots, dtype=np.int64)
        self.last_used = np.zeros(slots, dtype=np.int64)
        self.base = np.zeros(slots, dtype=np.int64)  # the context length of the row the slot last served
        self._clock = 0
        self.row_slot: dict[int, int] = {}  # the last assignment: row -> slot (the first place a row looks)

    def assign(self, contexts: list[np.ndarray], rows: list[int] | None = None) -> tuple[list[int], list[int]]:
        """A distinct slot per context (at most `slots` contexts) and how many of its leading tokens the slot
        already holds. rows: the engine's row of each context (its last slot is tried first)."""
        if len(contexts) > self.slots:
            raise ValueError(f"{len(contexts)} rows, but the draft cache has {self.slots} slots")
        rows = list(range(len(contexts))) if rows is None else rows
        self._clock += 1
        taken = np.zeros(self.slots, dtype=bool)
        out_slot, out_len = [-1] * len(contexts), [0] * len(contexts)
        pending = []
        for i, (row, ctx) in enumerate(zip(rows, contexts)):
            s = self.row_slot.get(row)
            if s is not None and not taken[s]:
                n = self._prefix(s, ctx)
                # the same request, as a rule: the row's context extends the one the slot last served (or all the
                # slot holds, when plain steps left it behind)
                if n >= min(self.lengths[s], self.base[s]):
                    taken[s] = True
                    out_slot[i], out_len[i] = s, n
                    continue
            pending.append(i)
        for i in pending:  # the longest shared prefix among the free slots, else the least recently used one
            ctx = contexts[i]
            free = np.flatnonzero(~taken)
            common = np.array([self._prefix(int(s), ctx) for s in free])
            if common.size and common.max() > 0:
                s = int(free[int(common.argmax())])
            else:
                s = int(free[int(self.last_used[free].argmin())])
            taken[s] = True
            out_slot[i], out_len[i] = s, self._prefix(s, ctx)
        self.row_slot = {row: s for row, s in zip(rows, out_slot)}
        self.last_used[out_slot] = self._clock
        self.base[out_slot] = [len(c) for c in contexts]
        return out_slot, out_len

    def _prefix(self, slot: int, ctx: np.ndarray) -> int:
        n = min(int(self.lengths[slot]), len(ctx))
        if n == 0:
            return 0
        diff = np.flatnonzero(self.tokens[slot, :n] != ctx[:n])
        return int(diff[0]) if diff.size else n

    def read(self, slots: list[int], chains: list[np.ndarray], starts: list[int]) -> torch.Tensor:
        """One forward: chain i's tokens written at positions starts[i].. of slots[i] (the slot then holds the
        tokens before starts[i] and the chain, nothing after); the draft's distribution after each chain's last
        token, (n, V) float32."""
        for s, c, p in zip(slots, chains, starts):
            if p + len(c) > self.capacity:
                raise ValueError(f"a row of {p + len(c)} tokens does not fit the draft cache's {self.capacity}")
            self.tokens[s, p:p + len(c)] = c
            self.lengths[s] = p + len(c)
        batch = chain_batch([torch.from_numpy(np.ascontiguousarray(c)) for c in chains],
                            torch.tensor(starts, dtype=torch.long), torch.tensor(slots, dtype=torch.long))
        return torch.softmax(self.model(batch, self.cache).float(), dim=-1)


@dataclasses.dataclass
class _Step:
    """What one call left for the next: the rows it drafted for, their chains and confidences, its timings."""

    contexts: dict[int, int]  # slot -> the row's context length then
    chains: dict[int, list[int]]  # slot -> the chain drafted (may be empty)
    confidences: dict[int, list[float]]  # slot -> path probability of each chain token
    batch_size: int
    forwards: tuple[int, ...]  # tokens of each draft forward
    catch_up: int
    context: float
    drafting_seconds: float
    end: float
    decision: Decision | None
    clean: bool  # the engine's step that follows verifies these rows only (no prefill in it)


class RowSpeculator:
    """ECHO's chains for an engine's rows, step after step (module docstring).

    propose(contexts, rows, clean) -> one chain per context. max_rows: the most rows drafted for in one step
    (the cache's slots; rows beyond draft nothing). prices: learn prices from the engine's steps and let the
    speculation controller choose plain steps (False: every step drafts by the policy's rules alone, unpriced)."""

    def __init__(self, draft: CausalLM, config: EchoConfig, max_draft_len: int, max_rows: int, capacity: int,
                 k_max: int | None = None, cost: CostModel | None = None, clock: Callable[[], float] = time.perf_counter,
                 prices: bool = True) -> None:
        self.config = chain_config(config, max_draft_len)
        self.max_draft_len, self.k_max = max_draft_len, k_max
        self.cache = RowDraftCache(draft, max_rows, capacity)
        self.clock = clock
        self.step_cost, self.policy, self.controller = priced_policy(self.config, cost if prices else None)
        self.last: _Step | None = None
        self.last_interval: float | None = None
        self.stats = {"steps": 0, "speculative_steps": 0, "priced_steps": 0, "drafted": 0, "accepted": 0}

    # ------------------------------------------------------------------ one call

    def propose(self, contexts: list[list[int]] | list[np.ndarray], rows: list[int] | None = None,
                clean: bool = True) -> list[list[int]]:
        """One chain per context (each a row's committed tokens, at least one). rows: the engine's row index of
        each (default 0..n-1). clean: the engine's last step did no prefill beyond these rows' (no row still
        prefilling)."""
        start = self.clock()
        # seconds since the last call returned: the engine's step in between (for traces; priced in _learn)
        self.last_interval = None if self.last is None else start - self.last.end
        n = len(contexts)
        out: list[list[int]] = [[] for _ in range(n)]
        if n == 0:
            self.last = None
            return out
        ctxs = [np.asarray(c, dtype=np.int64) for c in contexts]
        if any(c.size == 0 for c in ctxs):
            raise ValueError("every row needs at least one committed token")
        rows = list(range(n)) if rows is None else list(rows)
        fits = [i for i in range(n) if i < self.cache.slots and ctxs[i].size + self.max_draft_len < self.cache.capacity]
        slots, held = self.cache.assign([ctxs[i] for i in fits], [rows[i] for i in fits])
        self._learn(start, [ctxs[i] for i in fits], slots, clean and len(fits) == n)
        context = float(np.mean([c.size for c in ctxs]))
        decision = None
        if self.controller is not None:
            decision = self.controller.decide(n, context, lambda: self._catch_up(ctxs, fits, slots, held))
        chains: dict[int, list[int]] = {}
        confs: dict[int, list[float]] = {}
        forwards: list[int] = []
        catch_up = 0
        speculate = bool(fits) and (decision is None or decision.speculate)
        if speculate:
            forwards, catch_up = self._draft(ctxs, fits, slots, held, context, chains, confs)
            for i, s in zip(fits, slots):
                out[i] = chains[s]
        end = self.clock()
        self.last = _Step({s: int(ctxs[i].size) for i, s in zip(fits, slots)}, chains, confs, n, tuple(forwards),
                          catch_up, context, end - start, end, decision, clean)
        self.stats["steps"] += 1
        self.stats["speculative_steps"] += int(bool(forwards))
        return out

    def _catch_up(self, ctxs, fits, slots, held) -> int:
        """Tokens a speculative step's first forward would read beyond one per row (after plain steps)."""
        return int(sum(max(ctxs[i].size - max(h, 1) - 1, 0) for i, h in zip(fits, held)))

    def _draft(self, ctxs, fits, slots, held, context, chains, confs) -> tuple[list[int], int]:
        roots = torch.tensor([int(ctxs[i][-1]) for i in fits], dtype=torch.long)
        forwards: list[int] = []
        catch_up = [0]

        def draft_fn(level, frontier):
            req = [int(level.request_ids[f]) for f in frontier.tolist()]
            if level.depth == 0:  # each row's unread tokens, its root last
                starts = [min(held[j], int(ctxs[fits[j]].size) - 1) for j in req]
                reads = [ctxs[fits[j]][p:] for j, p in zip(req, starts)]
                catch_up[0] = sum(max(len(r) - 2, 0) for r in reads)
                forwards.append(sum(len(r) for r in reads))
                probs = self.cache.read([slots[j] for j in req], reads, starts)
            else:
                tokens = [int(level.token_ids[f]) for f in frontier.tolist()]
                starts = [int(self.cache.lengths[slots[j]]) for j in req]
                forwards.append(len(req))
                probs = self.cache.read([slots[j] for j in req], [np.array([t]) for t in tokens], starts)
            return probs

        budget = None if self.k_max is None else max(self.k_max, len(fits))
        result = draft_tree(self.policy, roots, draft_fn, budget=budget, context=context)
        for s, chain in zip(slots, chains_of(result.selected, len(fits), self.max_draft_len)):
            chains[s] = [t for t, _ in chain]
            confs[s] = [c for _, c in chain]
        return forwards, catch_up[0]

    # ------------------------------------------------------------------ the last step's outcome

    def _learn(self, now: float, ctxs: list[np.ndarray], slots: list[int], clean: bool) -> None:
        last, self.last = self.last, None
        if last is None:
            return
        outcomes: list[tuple[list[float], int]] = []
        produced, matched, follows = 0, 0, True
        for ctx, s in zip(ctxs, slots):
            if s not in last.contexts:
                follows = False  # a row the last call did not see: its prefill ran in the step
                continue
            n0, chain = last.contexts[s], last.chains.get(s, [])
            gained = ctx[n0:]
            if ctx.size <= n0 or ctx.size > n0 + len(chain) + 1:
                follows = False  # not the step after the last call for this row
                continue
            a = 0
            while a < len(chain) and a < gained.size and int(gained[a]) == chain[a]:
                a += 1
            if gained.size != a + 1:
                follows = False
                continue
            matched += 1
            produced += a + 1
            outcomes.append((last.confidences.get(s, [])[: len(chain)], a))
        learn_acceptance(self.policy, self.stats, outcomes)
        if self.step_cost is None or not (clean and last.clean and follows and matched):
            return
        drafted = sum(len(c) for c in last.chains.values())
        sample = StepSample(last.batch_size, last.batch_size + drafted, last.context, last.forwards,
                            last.drafting_seconds, max(now - last.end, 0.0),
                            min(last.catch_up, last.forwards[0]) if last.forwards else 0)
        self.step_cost.observe(sample)
        # rows that finished in the step are not seen again: their tokens counted at the matched rows' rate
        self.controller.observe(sample, produced * last.batch_size / matched, last.decision)
        self.stats["priced_steps"] += 1
