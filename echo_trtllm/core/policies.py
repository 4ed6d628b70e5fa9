"""Tree policies: how a step drafts and which candidates it sends to verification.

Every policy answers the same four questions, level by level, and `draft_tree` is the one loop that asks them:

    frontier(prev_level, state) -> which nodes of the previous level to expand (indices into it)
    num_children(depth)         -> how many top-k children each expanded node gets
    observe(level, state)       -> look at the new level (gates, stop rules); may stop requests drafting
    select(tree, state)         -> (N_tot,) bool: the candidates the target verifies (roots always)

Policies are chosen by name through `POLICIES` / `make_policy`, never by string tests elsewhere, and answer
capability questions as class attributes (`needs_draft_model`, `is_dynamic`, `shares_budget`).

| name        | drafting                                          | selection                                      |
|-------------|---------------------------------------------------|------------------------------------------------|
| ar          | none                                              | root only (K_i = 1)                            |
| chain       | top-1 chain of num_draft_tokens                   | all                                            |
| static      | the ranks of static_choices                       | the nodes on a choice path                     |
| eagle2      | top_k beam, top_k children, max_depth levels      | per request top total_tokens by path prob      |
| ddd         | eagle2 + stop when log sum(beam path probs) < thr | as eagle2                                      |
| echo        | beam_width beam, top_k children, sparse gate      | global K_max: P1 depth, then P2 width          |
| echo-dense  | echo with a gate at every depth                   | as echo                                        |
| echo-fixed  | echo with one tau at every gate depth             | as echo                                        |
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch
from torch import Tensor

from .budget import BudgetAllocation, allocate_budget, greedy_fill
from .config import EchoConfig
from .cost import CostModel, choose_budget
from .gating import GateCalibration, GateConfig, best_path_confidence, default_gate, gate
from .tree import DraftLevel, SuperTree, expand_level, priority_order, root_level, segment_rank

__all__ = [
    "DraftState",
    "DraftResult",
    "TreePolicy",
    "POLICIES",
    "make_policy",
    "draft_tree",
    "top_per_request",
]

# (level, frontier indices into it (F,)) -> (F, V) draft distribution of the token after each frontier node
DraftFn = Callable[[DraftLevel, Tensor], Tensor]


@dataclass
class DraftState:
    """Per-step drafting state of the batch."""

    batch_size: int
    # global verification budget for the step (echo family), None for per-request policies
    budget: int | None
    # (B,) bool: requests still drafting
    active: Tensor
    # (B,) int64: depth the request drafted to without failing a gate (its priority-1 spine depth)
    spine_depth: Tensor
    # c_{i,d} of every drafted level d = 1, 2, ...: each (B,), 0 where the request drafted nothing
    confidence: list[Tensor] = field(default_factory=list)
    # (B,) int64 per gate decision, for calibration/stats: depth at which the request failed a gate (0 = never)
    failed_at: Tensor | None = None
    # policy-private label of every node of every drafted level (static: its trie node), level-major
    level_tags: list[Tensor] = field(default_factory=list)
    allocation: BudgetAllocation | None = None
    # seconds the drafting loop took (draft model included); the budget rule charges it to speculation
    draft_seconds: float = 0.0


@dataclass
class DraftResult:
    # every drafted node
    candidates: SuperTree
    # (N_cand,) bool: the nodes sent to verification
    mask: Tensor
    # candidates.select(mask)
    selected: SuperTree
    state: DraftState


def top_per_request(level: DraftLevel, eligible: Tensor, width: int, batch_size: int) -> Tensor:
    """Indices (ascending) of the `width` eligible nodes of each request with the highest path probability
    (ties: lowest index). One grouping sort, then one row-wise sort of a padded (B, M_max) score matrix."""
    idx = torch.nonzero(eligible, as_tuple=True)[0]
    if idx.numel() == 0:
        return idx
    grouped = idx[torch.sort(level.request_ids[idx], stable=True).indices]  # by request, ascending within
    req = level.request_ids[grouped]
    counts = torch.bincount(req, minlength=batch_size)
    local = torch.arange(grouped.numel(), device=idx.device) - (torch.cumsum(counts, 0) - counts)[req]
    m = int(counts.max())
    scores = torch.full((batch_size, m), -1.0, device=idx.device)  # pads sort after every probability
    slots = torch.full((batch_size, m), -1, dtype=torch.long, device=idx.device)
    scores[req, local] = level.path_probs[grouped].float()
    slots[req, local] = grouped
    top = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :width]  # (B, w)
    picked = slots.gather(1, top)
    return torch.sort(picked[picked >= 0]).values


class TreePolicy:
    """Base policy: beam drafting (the `expand_width` most likely nodes per active request), no gate."""

    name: ClassVar[str] = ""
    needs_draft_model: ClassVar[bool] = True
    is_dynamic: ClassVar[bool] = False
    shares_budget: ClassVar[bool] = False

    def __init__(self, config: EchoConfig, cost_model: CostModel | None = None) -> None:
        self.config = config
        # With a cost model, the echo family picks each step's K with `choose_budget` (<= K_max).
        self.cost_model = cost_model

    @property
    def max_depth(self) -> int:
        return self.config.max_depth

    @property
    def expand_width(self) -> int:
        return self.config.top_k

    @property
    def max_tree_nodes(self) -> int:
        """Upper bound on K_i, root included (sizes the runtime's KV scratch space)."""
        return min(self.config.max_nodes_per_request, 1 + self.max_depth * self.expand_width * self.config.top_k)

    @property
    def max_expanded_nodes(self) -> int:
        """Upper bound on the nodes of one request the draft model processes per step (the frontiers)."""
        return 1 + self.max_depth * self.expand_width

    def start(self, batch_size: int, budget: int | None = None) -> DraftState:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return DraftState(
            batch_size=batch_size,
            budget=budget,
            active=torch.ones(batch_size, dtype=torch.bool),
            spine_depth=torch.zeros(batch_size, dtype=torch.long),
            failed_at=torch.zeros(batch_size, dtype=torch.long),
        )

    def frontier(self, prev: DraftLevel, state: DraftState) -> Tensor:
        eligible = state.active.to(prev.request_ids.device)[prev.request_ids]
        return top_per_request(prev, eligible, self.expand_width, state.batch_size)

    def num_children(self, depth: int) -> int:
        return self.config.top_k

    def observe(self, level: DraftLevel, state: DraftState) -> None:
        state.confidence.append(best_path_confidence(level, state.batch_size).cpu())
        has_nodes = torch.bincount(level.request_ids.cpu(), minlength=state.batch_size) > 0
        state.spine_depth[state.active & has_nodes] = level.depth

    def select(self, tree: SuperTree, state: DraftState) -> Tensor:
        raise NotImplementedError


POLICIES: dict[str, type[TreePolicy]] = {}


def register(cls: type[TreePolicy]) -> type[TreePolicy]:
    POLICIES[cls.name] = cls
    return cls


def make_policy(config: EchoConfig, cost_model: CostModel | None = None) -> TreePolicy:
    """The policy object for `config.policy` (EchoConfig has validated the name)."""
    return POLICIES[config.policy](config, cost_model)


@register
class AutoregressivePolicy(TreePolicy):
    name = "ar"
    needs_draft_model = False

    @property
    def max_depth(self) -> int:
        return 0

    @property
    def max_tree_nodes(self) -> int:
        return 1

    def select(self, tree: SuperTree, state: DraftState) -> Tensor:
        return tree.is_root.clone()


@register
class ChainPolicy(TreePolicy):
    """Vanilla speculative decoding: a chain of the draft's top-1 tokens."""

    name = "chain"

    @property
    def max_depth(self) -> int:
        return self.config.num_draft_tokens

    @property
    def expand_width(self) -> int:
        return 1

    def num_children(self, depth: int) -> int:
        return 1

    @property
    def max_tree_nodes(self) -> int:
        return 1 + self.config.num_draft_tokens

    def select(self, tree: SuperTree, state: DraftState) -> Tensor:
        return torch.ones(tree.total_nodes, dtype=torch.bool, device=tree.token_ids.device)


@register
class StaticTreePolicy(TreePolicy):
    """A fixed tree given as Medusa/EAGLE-1 style choices: paths of sibling ranks from the root."""

    name = "static"

    def __init__(self, config: EchoConfig, cost_model: CostModel | None = None) -> None:
        super().__init__(config, cost_model)
        paths = sorted(set(map(tuple, config.static_choices)), key=lambda p: (len(p), p))
        self._depth = max(len(p) for p in paths)
        self._width = max(max(p) for p in paths) + 1
        trie_id = {(): 0}
        for p in paths:
            trie_id[p] = len(trie_id)
        # child_table[t, r] = trie node reached from trie node t by sibling rank r, -1 when not a choice.
        self._child_table = torch.full((len(trie_id), self._width), -1, dtype=torch.long)
        for p, t in trie_id.items():
            if p:
                self._child_table[trie_id[p[:-1]], p[-1]] = t
        self._has_children = (self._child_table >= 0).any(dim=1)
        self._children_at_depth = [
            1 + max((p[d - 1] for p in paths if len(p) >= d), default=0) for d in range(1, self._depth + 1)
        ]

    @property
    def max_depth(self) -> int:
        return self._depth

    @property
    def max_tree_nodes(self) -> int:
        return 1 + len(self.config.static_choices)

    @property
    def max_expanded_nodes(self) -> int:
        return int(self._has_children.sum())

    def num_children(self, depth: int) -> int:
        return self._children_at_depth[depth - 1]

    def _child_trie(self, parent_trie: Tensor, ranks: Tensor) -> Tensor:
        ok = (parent_trie >= 0) & (ranks < self._width)
        table = self._child_table.to(ranks.device)
        return torch.where(ok, table[parent_trie.clamp(min=0), ranks.clamp(max=self._width - 1)], -1)

    def frontier(self, prev: DraftLevel, state: DraftState) -> Tensor:
        if prev.depth == 0:
            state.level_tags = [torch.zeros(prev.num_nodes, dtype=torch.long, device=prev.token_ids.device)]
        trie = state.level_tags[prev.depth]
        expandable = (trie >= 0) & self._has_children.to(trie.device)[trie.clamp(min=0)]
        return torch.nonzero(expandable, as_tuple=True)[0]

    def observe(self, level: DraftLevel, state: DraftState) -> None:
        super().observe(level, state)
        parent_trie = state.level_tags[level.depth - 1][level.parent_ids]
        state.level_tags.append(self._child_trie(parent_trie, level.ranks))

    def select(self, tree: SuperTree, state: DraftState) -> Tensor:
        trie = torch.where(tree.is_root, 0, -1)  # (N_tot,)
        gp = tree.global_parents
        for d in range(1, int(tree.depths.max()) + 1):
            at = tree.depths == d
            trie[at] = self._child_trie(trie[gp[at]], tree.ranks[at])
        return trie >= 0


@register
class Eagle2Policy(TreePolicy):
    """EAGLE-2 dynamic tree: top-k beam by path probability, then rerank every candidate and keep
    `total_tokens` per request (root included)."""

    name = "eagle2"
    is_dynamic = True

    @property
    def max_tree_nodes(self) -> int:
        return min(self.config.total_tokens, 1 + self.max_depth * self.expand_width * self.config.top_k)

    def select(self, tree: SuperTree, state: DraftState) -> Tensor:
        req = tree.request_ids
        cap = torch.full((tree.batch_size,), self.config.total_tokens - 1, dtype=torch.long, device=req.device)
        order = priority_order(tree.path_probs, tree.depths)
        return tree.is_root | greedy_fill(~tree.is_root, order, req, tree.batch_size, None, cap)


@register
class DynamicDepthPolicy(Eagle2Policy):
    """DDD: EAGLE-2 whose requests stop drafting when log(sum of the beam's path probabilities) drops
    below `ddd_threshold`, checked every `ddd_check_every` levels."""

    name = "ddd"

    def observe(self, level: DraftLevel, state: DraftState) -> None:
        super().observe(level, state)
        if level.depth % self.config.ddd_check_every:
            return
        beam = top_per_request(level, torch.ones_like(level.request_ids, dtype=torch.bool), self.expand_width, state.batch_size)
        mass = torch.zeros(state.batch_size, dtype=torch.float64)
        mass.index_add_(0, level.request_ids[beam].cpu(), level.path_probs[beam].double().cpu())
        keep = torch.log(mass.clamp(min=1e-300)) > self.config.ddd_threshold
        state.failed_at[state.active & ~keep] = level.depth
        state.active &= keep


@register
class EchoPolicy(TreePolicy):
    """ECHO: sparse confidence gating while drafting, elastic global budget when selecting.

    Drafting: `beam_width` most likely nodes per request expanded with `top_k` children each. At a gate depth
    d, a request still drafting continues iff c_{i,d} > tau_d; a failing request stops and its spine ends one
    level above (the gate said "truncate"). Budget-aware early stop: a request whose c_{i,d} ranks below the
    (K_max - B)-th best per-level confidence of the batch stops drafting, since none of its deeper nodes could
    win budget from the nodes already ahead of it. Selection: `allocate_budget` (P1 depth, P2 width).
    """

    name = "echo"
    is_dynamic = True
    shares_budget = True

    def __init__(self, config: EchoConfig, cost_model: CostModel | None = None) -> None:
        super().__init__(config, cost_model)
        self.gate_config = self._make_gate(config)
        # batch size -> GateCalibration (a calibration's gate_for); when set, each step's gate is the one
        # calibrated for its batch size instead of the fixed config's
        self.gate_provider: Callable[[int], GateCalibration] | None = None

    @staticmethod
    def _make_gate(config: EchoConfig) -> GateConfig:
        if config.gate_depths is not None:
            return GateConfig(tuple(config.gate_depths), tuple(config.gate_thresholds or ()))
        return default_gate(config.max_depth)

    @staticmethod
    def _gate_from(calibration: GateCalibration) -> GateConfig:
        return calibration.gate_config()

    @property
    def expand_width(self) -> int:
        return self.config.beam_width

    def start(self, batch_size: int, budget: int | None = None) -> DraftState:
        budget = self.config.k_max if budget is None else budget
        if budget < batch_size:
            raise ValueError(f"K_max = {budget} is below the batch size {batch_size}: every request needs its root")
        if self.gate_provider is not None:
            self.gate_config = self._gate_from(self.gate_provider(batch_size))
        state = super().start(batch_size, budget)
        state.active &= budget > batch_size  # no budget beyond the roots: nobody drafts (plain AR)
        return state

    def observe(self, level: DraftLevel, state: DraftState) -> None:
        c = best_path_confidence(level, state.batch_size).cpu()  # (B,)
        state.confidence.append(c)
        tau = self.gate_config.threshold_at(level.depth)
        if tau is not None:
            passed = gate(c, tau, state.active)
            state.failed_at[state.active & ~passed] = level.depth
            state.active = passed
        state.spine_depth[state.active] = level.depth
        self._budget_stop(state)

    @staticmethod
    def _budget_stop(state: DraftState) -> None:
        spare = int(state.budget or 0) - state.batch_size
        history = torch.stack(state.confidence)[:, state.active]  # (d, active)
        if history.numel() <= spare or not bool(state.active.any()):
            return
        bar = torch.topk(history.reshape(-1), spare).values[-1] if spare > 0 else torch.tensor(float("inf"))
        state.active &= state.confidence[-1] >= bar

    def select(self, tree: SuperTree, state: DraftState) -> Tensor:
        alloc = allocate_budget(
            tree, state.spine_depth.to(tree.token_ids.device), int(state.budget), self.config.max_nodes_per_request
        )
        if self.cost_model is not None and alloc.order.numel():
            k = choose_budget(tree.path_probs[alloc.order], state.batch_size, self.cost_model, state.draft_seconds)
            alloc = alloc.truncated(k, tree.request_ids)
        state.allocation = alloc
        return alloc.selected


@register
class EchoDenseGatePolicy(EchoPolicy):
    """Ablation: gate at every depth (per-depth thresholds)."""

    name = "echo-dense"

    @staticmethod
    def _make_gate(config: EchoConfig) -> GateConfig:
        sparse = EchoPolicy._make_gate(config)
        # Thresholds between configured gates are interpolated geometrically; beyond them the nearest is used.
        depths = tuple(range(1, config.max_depth + 1))
        known = dict(zip(sparse.depths, sparse.thresholds))
        xs = sorted(known)
        taus = []
        for d in depths:
            lo = max((x for x in xs if x <= d), default=xs[0])
            hi = min((x for x in xs if x >= d), default=xs[-1])
            if lo == hi or known[lo] <= 0 or known[hi] <= 0:
                taus.append(known[lo] if lo == hi else min(known[lo], known[hi]))
            else:
                t = (d - lo) / (hi - lo)
                taus.append(float(known[lo] ** (1 - t) * known[hi] ** t))
        return GateConfig(depths, tuple(taus))

    @staticmethod
    def _gate_from(calibration: GateCalibration) -> GateConfig:
        return calibration.dense_gate_config()  # its own calibrated tau_d at every depth


@register
class EchoFixedThresholdPolicy(EchoPolicy):
    """Ablation: one threshold (`fixed_threshold`) at every gate depth."""

    name = "echo-fixed"

    @staticmethod
    def _make_gate(config: EchoConfig) -> GateConfig:
        sparse = EchoPolicy._make_gate(config)
        return GateConfig(sparse.depths, tuple(config.fixed_threshold for _ in sparse.depths))

    @staticmethod
    def _gate_from(calibration: GateCalibration) -> GateConfig:
        return calibration.fixed_gate_config()


def draft_tree(
    policy: TreePolicy, root_token_ids: Tensor, draft_fn: DraftFn, budget: int | None = None
) -> DraftResult:
    """Run one step's drafting loop and selection.

    root_token_ids (B,): each request's last committed token. draft_fn(level, frontier) returns the draft
    distribution (F, V) after each frontier node; the runtime runs the draft model there, tests use synthetic
    distributions.
    """
    t0 = time.perf_counter()
    levels = [root_level(root_token_ids)]
    state = policy.start(root_token_ids.numel(), budget)
    for depth in range(1, policy.max_depth + 1):
        frontier = policy.frontier(levels[-1], state)
        if frontier.numel() == 0:
            break
        probs = draft_fn(levels[-1], frontier)  # (F, V)
        level = expand_level(levels[-1], frontier, probs, policy.num_children(depth))
        levels.append(level)
        policy.observe(level, state)
    candidates = SuperTree.from_levels(levels)
    state.draft_seconds = time.perf_counter() - t0
    mask = policy.select(candidates, state)
    return DraftResult(candidates, mask, candidates.select(mask), state)
