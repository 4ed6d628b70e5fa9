"""Tree policies: how a step drafts and which candidates it sends to verification.

Every policy answers the same four questions, level by level, and `draft_tree` is the one loop that asks them:

    frontier(prev_level, state) -> which nodes of the previous level to expand (indices into it)
    num_children(depth)         -> how many top-k children each expanded node gets
    observe(level, state)       -> look at the new level (gates, stop rules); may stop requests drafting
    select(tree, state)         -> (N_tot,) bool: the candidates the target verifies (roots always)

Policies are chosen by name through `POLICIES` / `make_policy`, never by string tests elsewhere, and answer
capability questions as class attributes (`needs_draft_model`, `is_dynamic`, `shares_budget`). A policy gets
everything a calibration holds at construction, once: `make_policy(config, cost_model, gate_samples)`.

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
| echo-no-budget-stop | echo without the budget-aware early stop  | as echo                                        |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar, Protocol

import torch
from torch import Tensor

from .budget import BudgetAllocation, allocate_budget, greedy_fill
from .config import EchoConfig
from .acceptance import AcceptanceModel, OnlineAcceptance
from .cost import CostModel, budget_seconds, choose_budget
from .pack import PackedVerifyBatch
from .gating import GATE_REFRESH, GateConfig, GateSamples, GateSchedule, best_path_confidence, gate
from .tree import DraftLevel, DraftTopK, SuperTree, expand_level, priority_order, root_level

__all__ = [
    "DraftState",
    "DraftResult",
    "TreePolicy",
    "POLICIES",
    "make_policy", "policy_class",
    "draft_tree",
    "DraftLoop",
    "draft_tree_batched",
    "LevelDrafter",
    "top_per_request",
]

# (level, frontier indices into it (F,)) -> the draft distribution of the token after each frontier node: (F, V),
# or its top k (`DraftTopK`, k >= the policy's `max_children`) as the runtime's drafters return it
DraftFn = Callable[[DraftLevel, Tensor], "Tensor | DraftTopK"]


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
    # frontier nodes expanded by the draft per level (level 0: the roots); the budget rule charges their
    # modelled draft time (the cost model's t_draft) to the step
    frontier_sizes: list[int] = field(default_factory=list)
    # the gate of this step (echo family: chosen for its batch size)
    gate: GateConfig | None = None
    # cached tokens per request as the step's attention reads them (the cost grid's context axis; None: unknown)
    context: float | None = None
    # per drafted level (level-major, like the levels): each node's slot in the fixed-shape frontier it was
    # expanded from (-1: not expanded). Set by `draft_tree_batched`; the drafter places KV entries by it.
    frontier_slots: list[Tensor] | None = None
    # (levels, B) float32: the confidences of a step whose levels the host library replays (`EchoPolicy.replay_level`);
    # `confidence`'s entries are its rows
    history: Tensor | None = None
    # the tokens the step verifies, roots included, where the echo family's budget rule would verify its roots alone
    # (as many as were drafted and the budget allows): a speculative probe's floor, `core.controller.Decision.
    # min_tokens`; 0: the rule alone
    min_tokens: int = 0


@dataclass
class DraftResult:
    # every drafted node
    candidates: SuperTree
    # (N_cand,) bool: the nodes sent to verification
    mask: Tensor
    # candidates.select(mask)
    selected: SuperTree
    state: DraftState
    # selected packed for verification where the drafting loop packed it (`draft_tree_batched`'s context_lengths);
    # None: the caller packs it
    packed: PackedVerifyBatch | None = None


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
    # the frontier is the beam rule (the `expand_width` most likely nodes of each active request): the drafting
    # loop can then run on the drafter's device in fixed shapes (`draft_tree_batched`)
    beam_frontier: ClassVar[bool] = True

    def __init__(self, config: EchoConfig, cost_model: CostModel | None = None,
                 gate_samples: GateSamples | None = None) -> None:
        self.config = config
        # With a cost model, the echo family picks each step's K with `choose_budget` (<= K_max).
        self.cost_model = cost_model
        # the budget allocation `select` runs (the echo family): the core's, or a plugin backend's with the same
        # signature and results that the runtime installs (echo_trtllm.kernels.allocate_budget)
        self.allocator = allocate_budget
        # the Super-Tree from the drafted levels: None, the core's `SuperTree.from_levels`; the runtime installs the
        # host library's (kernels.host_tree_builder, the same tree)
        self.tree_builder = None
        # the selected sub-tree: None, the core's `SuperTree.select`; the runtime installs the host library's
        # (kernels.host_tree_selector, the same tree)
        self.tree_selector = None

    @classmethod
    def uses_cost_curve(cls, fallback: bool | None) -> bool:
        """Whether an engine of this policy measures (or takes) a cost curve: the echo family always (budget
        rule, gate), any drafting policy whose AR fallback is on (the speculation controller's prices)."""
        return cls.shares_budget or (bool(fallback) and cls.needs_draft_model)

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

    def start(self, batch_size: int, budget: int | None = None, context: float | None = None) -> DraftState:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return DraftState(
            batch_size=batch_size,
            budget=budget,
            active=torch.ones(batch_size, dtype=torch.bool),
            spine_depth=torch.zeros(batch_size, dtype=torch.long),
            failed_at=torch.zeros(batch_size, dtype=torch.long),
            context=context,
        )

    def drafts(self, batch_size: int, budget: int | None = None, context: float | None = None) -> bool:
        """Whether a step of `batch_size` requests drafts at all (decided before any draft forward): always,
        for the fixed shapes."""
        return True

    def learn(self, selected: SuperTree, accepted_node_ids: Tensor) -> None:
        """A speculative step's verified tree and the flat indices of its accepted nodes (roots included), for
        policies that re-learn acceptance as traffic goes (the echo family); nothing for the fixed shapes."""

    def frontier(self, prev: DraftLevel, state: DraftState) -> Tensor:
        eligible = state.active.to(prev.request_ids.device)[prev.request_ids]
        return top_per_request(prev, eligible, self.expand_width, state.batch_size)

    def num_children(self, depth: int) -> int:
        return self.config.top_k

    def sync_depths(self, state: DraftState) -> frozenset[int]:
        """Depths after which the batched drafting loop hands the levels drafted so far to the host, so that
        requests its decisions stopped leave the device's batch (`draft_tree_batched`). None by default: the
        host decides once, after the last level."""
        return frozenset()

    @property
    def max_children(self) -> int:
        """The most children any drafted node gets: the k a drafter's top-k must cover."""
        return max(self.num_children(d) for d in range(1, max(self.max_depth, 1) + 1))

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


def policy_class(config: EchoConfig) -> type[TreePolicy]:
    """The class of `config.policy`: its capability flags (`needs_draft_model`, `shares_budget`, ...) without building
    one."""
    return POLICIES[config.policy]


def make_policy(config: EchoConfig, cost_model: CostModel | None = None,
                gate_samples: GateSamples | None = None) -> TreePolicy:
    """The policy object for `config.policy` (EchoConfig has validated the name). cost_model: measured forward
    times (the echo family then picks each step's K and its gate's lambda from them); gate_samples: a
    calibration's warm-up evidence (the echo family's gate is then calibrated per batch size)."""
    return POLICIES[config.policy](config, cost_model, gate_samples)


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
    beam_frontier = False  # its frontier follows the choice trie

    def __init__(self, config: EchoConfig, cost_model: CostModel | None = None,
                 gate_samples: GateSamples | None = None) -> None:
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

    def sync_depths(self, state: DraftState) -> frozenset[int]:
        """The first check depth (as the echo family syncs at its first gate)."""
        return frozenset({self.config.ddd_check_every})

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
    level above (the gate said "truncate"). Budget-aware early stop (a heuristic; `echo-no-budget-stop` is the
    ablation without it): a request whose c_{i,d} ranks below the (K_max - B)-th best per-level confidence of
    the batch stops drafting, on the reasoning that its deeper nodes would lose budget to the nodes ahead of it.
    That is not exact: the confidences it counts are each request's best node per level, which become
    priority-1 spine nodes only if that request's spine later runs through them (a request that fails a later
    gate, or whose deepest best node descends from another branch, funds fewer), so the stop can cut a spine the
    allocation would have funded. Cost-aware stop (with a cost model): drafting stops for the
    whole batch when the next level cannot pay for itself, i.e. when the tokens it may add, at most
    sum_active c_{i,d}, are worth less than its cost, t_draft(active * beam) + t_verify(K + active) - t_verify(K)
    seconds at the AR rate of B / t_verify(B) tokens per second, where K = B + the spines so far is the
    verification already claimed (on a steep curve the next token costs more the more are claimed). Selection: `allocate_budget` (P1 depth, P2
    width), then `choose_budget` picks K along that order.

    Whether a step drafts at all is not the policy's to decide: with the AR fallback the runtime's
    `core.controller.SpeculationController` decides before drafting, from measured steps; without it ("pure")
    every step drafts and the rules above choose the tree.

    Acceptance estimates (the budget rule's and the cost stop's weights, the gate's thresholds) come from an
    `OnlineAcceptance` re-learned from every verified node (`learn`), its prior the calibration's isotonic map
    when there are samples, else the draft's own path probability. The gate's tau_d at batch size B is the
    confidence at which that estimate reaches the break-even probability lambda(B) (`GateSchedule`).
    """

    name = "echo"
    is_dynamic = True
    shares_budget = True
    # which gate of the schedule this policy uses (gating.GATE_VARIANTS)
    gate_variant: ClassVar[str] = "sparse"
    # whether drafting applies the budget-aware early stop (the class docstring)
    budget_stop: ClassVar[bool] = True

    def __init__(self, config: EchoConfig, cost_model: CostModel | None = None,
                 gate_samples: GateSamples | None = None) -> None:
        super().__init__(config, cost_model)
        # the host library's replay of a drafted level (`kernels.host_level_replayer`, installed by
        # `kernels.install_host`); None: `draft_tree_batched` replays in torch and calls `observe`
        self.level_replayer = None
        # the host library's allocation and budget rule in one call (`kernels.host_selector`); None: `allocator`
        # then `choose_budget`
        self.selector = None
        # the tree, the selection, the selected tree and its packed batch in one call of the host library
        # (`kernels.host_draft_resulter`, `draft_result_on_host`); None: the four calls
        self.draft_resulter = None
        calibrated = None if gate_samples is None else AcceptanceModel.from_samples(
            gate_samples.depths, gate_samples.confidences, gate_samples.accepted)
        # acceptance estimates for the budget rule, the cost-aware stop and the gate: re-learned online, starting
        # from the calibration's isotonic map per depth (core.acceptance), else from the raw path probabilities
        self.acceptance = OnlineAcceptance(config.max_depth, calibrated,
                                           prior_weight=4.0 if calibrated is not None else 2.0,
                                           refit_every=GATE_REFRESH)
        self.gates = GateSchedule(config, cost_model, gate_samples, self.acceptance)

    def learn(self, selected: SuperTree, accepted_node_ids: Tensor) -> None:
        self.acceptance.observe_nodes(selected.depths, selected.path_probs, selected.on_greedy_path,
                                      accepted_node_ids)

    def acceptance_estimates(self, path_probs: Tensor, depths: Tensor | int, greedy: Tensor | bool = True) -> Tensor:
        """Nodes' chances of acceptance; greedy: whether each is on the draft's greedy path (a level's best node,
        which the gate and the drafting stop read, is)."""
        return self.acceptance.estimate(path_probs, depths, greedy)

    def gate_for(self, batch_size: int) -> GateConfig:
        """The gate a step of `batch_size` requests uses."""
        return self.gates.gate_for(batch_size, self.gate_variant)

    def sync_depths(self, state: DraftState) -> frozenset[int]:
        """The first gate depth: under load most requests stop there, and they stop drafting on the device too.
        Later gates (and the budget and cost stops) are applied when the host reads the remaining levels."""
        return frozenset(state.gate.depths[:1])

    @property
    def expand_width(self) -> int:
        return self.config.beam_width

    def start(self, batch_size: int, budget: int | None = None, context: float | None = None) -> DraftState:
        budget = self.config.k_max if budget is None else budget
        if budget < batch_size:
            raise ValueError(f"K_max = {budget} is below the batch size {batch_size}: every request needs its root")
        state = super().start(batch_size, budget, context)
        state.gate = self.gate_for(batch_size)
        state.active &= self.drafts(batch_size, budget, context)  # the budget rule before drafting
        return state

    def drafts(self, batch_size: int, budget: int | None = None, context: float | None = None) -> bool:
        """False when there is no budget beyond the roots (then nobody drafts: a plain step)."""
        budget = self.config.k_max if budget is None else budget
        return budget > batch_size

    def observe(self, level: DraftLevel, state: DraftState) -> None:
        c = best_path_confidence(level, state.batch_size).cpu()  # (B,)
        state.confidence.append(c)
        tau = state.gate.threshold_at(level.depth)
        if tau is not None:
            passed = gate(c, tau, state.active)
            state.failed_at[state.active & ~passed] = level.depth
            state.active = passed
        state.spine_depth[state.active] = level.depth
        if self.budget_stop:
            self._budget_stop(state)
        self._cost_stop(state)

    @staticmethod
    def _budget_stop(state: DraftState) -> None:
        spare = int(state.budget or 0) - state.batch_size
        history = torch.stack(state.confidence)[:, state.active]  # (d, active)
        if history.numel() <= spare or not bool(state.active.any()):
            return
        bar = torch.topk(history.reshape(-1), spare).values[-1] if spare > 0 else torch.tensor(float("inf"))
        state.active &= state.confidence[-1] >= bar

    def _cost_stop(self, state: DraftState) -> None:
        if self.cost_model is None or not bool(state.active.any()) or not self.cost_model.draft_tokens:
            return
        # the verification already claimed: every request's root and its spine so far (priority 1)
        claimed = state.batch_size + int(state.spine_depth.sum())
        # tokens the next level may add, at most: its best nodes' path probabilities are at most this level's, so
        # their estimates at the next depth bound them (the estimates rise with the path probability at every
        # depth). The next depth's map, not this one's: a depth the calibration never saw accepted prices the
        # level that would draft it near zero
        self._stop_unless_paid(state, int(state.active.sum()), claimed, self._next_level_tokens(state))

    def _next_level_tokens(self, state: DraftState) -> float:
        """The cost stop's tokens: the active requests' estimates at the next depth, added in request order (as
        the host library adds them)."""
        return sum(self.acceptance_estimates(state.confidence[-1][state.active], len(state.confidence) + 1).tolist())

    def _stop_unless_paid(self, state: DraftState, n: int, claimed: int, gain: float) -> None:
        """The cost stop's comparison: drafting stops for the batch when the next level's `gain` tokens (n requests
        drafting, `claimed` tokens of verification claimed) are worth less than its seconds at the AR rate."""
        cost, b, ctx = self.cost_model, state.batch_size, state.context
        step = float(cost.verify_time(b, ctx, b))
        seconds = (float(cost.draft_level_time(n * self.expand_width, ctx))
                   + float(cost.verify_time(claimed + n, ctx, b)) - float(cost.verify_time(claimed, ctx, b)))
        if gain * step <= seconds * b:
            state.active = torch.zeros_like(state.active)

    @property
    def replays_on_host(self) -> bool:
        """Whether `draft_tree_batched` replays this policy's levels with `replay_level` (the host library is
        installed and the class keeps echo's own per-level decisions)."""
        return self.level_replayer is not None and self._own_decisions(
            "observe", "_cost_stop", "_budget_stop", "_next_level_tokens", "_stop_unless_paid")

    def _own_decisions(self, *methods: str) -> bool:
        """Whether these methods and the acceptance estimates are echo's own (not overridden by a subclass or on
        the instance), so the host library's calls decide what they would."""
        cls = type(self)
        return (all(getattr(cls, m) is getattr(EchoPolicy, m) and m not in vars(self)
                    for m in (*methods, "acceptance_estimates"))
                and type(self.acceptance).estimate is OnlineAcceptance.estimate)

    @property
    def chooses_frontier_on_host(self) -> bool:
        """Whether `replay_level` can also choose the next level's frontier (`next_width=`), so that
        `draft_tree_batched` drafting level by level makes one host-library call per level (`_draft_on_host`)."""
        return self.replays_on_host and getattr(self.level_replayer, "next_frontier", False)

    def replay_level(self, state: DraftState, prev: DraftLevel, prev_slots: Tensor, depth: int, slot_width: int,
                     front: Tensor, fvalid: Tensor, probs: Tensor, tokens: Tensor, row_of: Tensor,
                     parent_path: Tensor | None = None, next_width: int = 0):
        """One level the device drafted, replayed on the host library with this policy's decisions: what `_replay`'s
        loop body and `observe` do, in one call (`kernels.host_level_replayer`; the torch loop is its oracle,
        tests/plugins/test_echo_host.py). Returns the frontier slot of each node of `prev` (-1: not expanded),
        the new level (None: an empty frontier, drafting ends), its nodes' device slots and the next level.
        next_width >= 1 (`chooses_frontier_on_host`): in the same call, the next level's frontier as
        `_level_on_device` and `_keep_active` would choose it, from parent_path (R, W), the path probability of each
        node of `front` (the roots': 1): (rows kept, front, fvalid, path probabilities, tokens, parents), each
        (R kept, slots), None where drafting ends; next_width 0: None."""
        if state.history is None:
            state.history = torch.zeros(max(self.max_depth, depth), state.batch_size, dtype=torch.float32)
        if len(state.confidence) != depth - 1:
            raise RuntimeError(f"replay_level: depth {depth} after {len(state.confidence)} observed levels")
        tau = state.gate.threshold_at(depth)
        cost = self.cost_model
        priced = cost is not None and bool(cost.draft_tokens)
        # the estimates' fit as it stands: where a refit is due, the cost stop's tokens are read below as the oracle
        # reads them (a refit happens at the first read after it is due: reading here would move it)
        table = self.acceptance.fitted_segments() if priced else None
        gain_row = self.acceptance.row(depth + 1)  # the cost stop reads the next depth's greedy row
        # a budget below the roots (a state not made by `start`) stops everyone, as the oracle's infinite bar does
        spare = max(int(state.budget or 0) - state.batch_size, 0) if self.budget_stop else None
        extra = {"parent_path": parent_path, "next_width": next_width} if next_width else {}
        slot_of, ints, floats, active, n, claimed, gain, nxt = self.level_replayer(
            prev.request_ids, prev.path_probs, prev_slots, slot_width, front, fvalid, probs, tokens, row_of, depth,
            tau, spare, table, gain_row, state.active, state.spine_depth, state.failed_at, state.history, **extra)
        if ints.shape[1] == 0:
            return slot_of, None, None, None
        state.confidence.append(state.history[depth - 1])
        state.active = active
        if priced and n > 0:
            self._stop_unless_paid(state, n, claimed, gain if table is not None else self._next_level_tokens(state))
        level = DraftLevel(depth=depth, request_ids=ints[0], parent_ids=ints[1], token_ids=ints[2],
                           draft_probs=floats[0], path_probs=floats[1], ranks=ints[3])
        return slot_of, level, ints[4], nxt

    def _host_selection(self, state: DraftState, num_nodes: int):
        """(the acceptance fit, the step's seconds of verifying 0, 1, ... taken tokens, the floor of taken tokens where
        the rule takes none: a probe's) where the host library selects (`selector`, `draft_result_on_host`) as the
        rule in `select` would, else None: no prices, another allocator or decisions of a subclass, or a refit due
        (the oracle's path reads then)."""
        if (self.cost_model is None or self.selector is None
                or self.allocator is not getattr(self.selector, "allocator", None) or not self._own_decisions()):
            return None
        table = self.acceptance.fitted_segments()
        if table is None:
            return None
        drafted = self.cost_model.drafting_time(state.frontier_sizes, state.context)
        taken = max(min(num_nodes, int(state.budget)) - state.batch_size, 0)  # the most the allocation takes
        # a probe's (`select`: max(k, min_tokens) when k <= B), at most what the allocation can take
        floor = min(max(state.min_tokens - state.batch_size, 0), taken)
        return table, budget_seconds(taken, state.batch_size, self.cost_model, drafted, state.context), floor

    def draft_result_on_host(self, levels: list[DraftLevel], state: DraftState,
                             context_lengths: Tensor) -> "DraftResult | None":
        """The step's drafting result from its levels in one call of the host library (`draft_resulter`): the tree
        (`tree_builder`), `select`, the selected tree (`tree_selector`) and its packed batch for these context
        lengths (`DraftResult.packed`); None where the four calls run instead (no library entry, a subclass's
        `select`, another tree builder or selector, `_host_selection` declines, or levels the library does not
        read). The four are its oracle (tests/plugins/test_echo_host.py)."""
        resulter = self.draft_resulter
        if (resulter is None or not self._own_decisions("select")
                or self.tree_builder is not getattr(resulter, "tree_builder", None)
                or self.tree_selector is not getattr(resulter, "tree_selector", None)):
            return None  # a subclass's selection, or another tree builder or selector: the four calls
        host = self._host_selection(state, sum(lv.num_nodes for lv in levels))
        if host is None:
            return None
        table, seconds, floor = host
        out = resulter(levels, state.spine_depth, int(state.budget), self.config.max_nodes_per_request, table,
                       self.acceptance.max_depth, seconds, context_lengths, min_taken=floor)
        if out is None:
            return None
        candidates, state.allocation, selected, packed = out
        return DraftResult(candidates, state.allocation.selected, selected, state, packed)

    def select(self, tree: SuperTree, state: DraftState) -> Tensor:
        spine = state.spine_depth.to(tree.token_ids.device)
        host = self._host_selection(state, tree.total_nodes)
        if host is not None:
            # the allocation and the budget rule below in one call of the host library
            # (tests/plugins/test_echo_host.py)
            table, seconds, floor = host
            state.allocation = self.selector(tree, spine, int(state.budget), self.config.max_nodes_per_request,
                                             choose=(table, self.acceptance.max_depth, seconds, floor))
            return state.allocation.selected
        alloc = self.allocator(tree, spine, int(state.budget), self.config.max_nodes_per_request)
        if self.cost_model is not None and alloc.order.numel():
            drafted = self.cost_model.drafting_time(state.frontier_sizes, state.context)  # sunk this step
            order = alloc.order
            estimates = self.acceptance_estimates(tree.path_probs[order], tree.depths[order],
                                                  tree.on_greedy_path[order])
            k = choose_budget(estimates, state.batch_size, self.cost_model, drafted, state.context)
            if k <= state.batch_size:
                # a probe verifies drafted tokens where the prices say none pays: a step that verifies its roots only
                # cannot correct the price of a verified token that keeps the rule there (docs/performance.md)
                k = max(k, state.min_tokens)
            alloc = alloc.truncated(k, tree.request_ids)
        state.allocation = alloc
        return alloc.selected


@register
class EchoDenseGatePolicy(EchoPolicy):
    """Ablation: gate at every depth (per-depth thresholds)."""

    name = "echo-dense"
    gate_variant = "dense"


@register
class EchoFixedThresholdPolicy(EchoPolicy):
    """Ablation: one threshold (`fixed_threshold`, or the calibration's pooled one) at every gate depth."""

    name = "echo-fixed"
    gate_variant = "fixed"


@register
class EchoNoBudgetStopPolicy(EchoPolicy):
    """Ablation: ECHO without the budget-aware early stop (drafting ends by gates, depth or cost only)."""

    name = "echo-no-budget-stop"
    budget_stop = False


class DraftLoop:
    """`draft_tree`'s loop one level at a time, for a drafter that runs its own levels and hands each one over as
    it comes (vLLM's draft-model runner drafts every row of its batch per level; the loop says which nodes the
    policy expands and when it stops):

        loop = DraftLoop(policy, roots, budget)
        while (frontier := loop.frontier()) is not None:
            loop.feed(probs_after(loop.levels[-1], frontier))   # (F, V) or DraftTopK
        result = loop.result()
    """

    def __init__(self, policy: TreePolicy, root_token_ids: Tensor, budget: int | None = None,
                 max_levels: int | None = None, context: float | None = None, min_tokens: int = 0) -> None:
        self.policy = policy
        self.levels = [root_level(root_token_ids)]
        self.state = policy.start(root_token_ids.numel(), budget, context)
        self.state.min_tokens = min_tokens
        self.depth_cap = policy.max_depth if max_levels is None else min(policy.max_depth, max_levels)
        self._frontier: Tensor | None = None
        self.done = False

    @property
    def depth(self) -> int:
        """The depth of the level the next feed() adds."""
        return len(self.levels)

    def frontier(self) -> Tensor | None:
        """The nodes of the last level the policy expands next (indices into levels[-1]); None: drafting ends."""
        if self._frontier is not None:
            return self._frontier
        if self.done or self.depth > self.depth_cap:
            self.done = True
            return None
        frontier = self.policy.frontier(self.levels[-1], self.state)
        if frontier.numel() == 0:
            self.done = True
            return None
        self.state.frontier_sizes.append(frontier.numel())
        self._frontier = frontier
        return frontier

    def feed(self, probs: Tensor | DraftTopK) -> None:
        """The draft distribution after each frontier node (F, V), or its top k."""
        if self._frontier is None:
            raise RuntimeError("feed() without a frontier: call frontier() first (and stop when it is None)")
        level = expand_level(self.levels[-1], self._frontier, probs, self.policy.num_children(self.depth))
        self._frontier = None
        self.levels.append(level)
        self.policy.observe(level, self.state)

    def result(self) -> DraftResult:
        """The policy's selection over every level drafted."""
        self.done = True
        candidates = (self.policy.tree_builder or SuperTree.from_levels)(self.levels)
        mask = self.policy.select(candidates, self.state)
        return DraftResult(candidates, mask, (self.policy.tree_selector or SuperTree.select)(candidates, mask),
                           self.state)


def draft_tree(
    policy: TreePolicy, root_token_ids: Tensor, draft_fn: DraftFn, budget: int | None = None,
    max_levels: int | None = None, context: float | None = None, min_tokens: int = 0,
) -> DraftResult:
    """Run one step's drafting loop and selection.

    root_token_ids (B,): each request's last committed token. draft_fn(level, frontier) returns the draft
    distribution (F, V) after each frontier node; the runtime runs the draft model there, tests use synthetic
    distributions. max_levels: draft at most this many levels this step (None: the
    policy's max_depth). context: cached tokens per request as the step's attention reads them (for a cost grid).
    min_tokens: what the selection verifies where the budget rule would verify the roots alone
    (`DraftState.min_tokens`).
    """
    loop = DraftLoop(policy, root_token_ids, budget, max_levels, context, min_tokens)
    while (frontier := loop.frontier()) is not None:
        loop.feed(draft_fn(loop.levels[-1], frontier))  # (F, V) or DraftTopK
    return loop.result()


class LevelDrafter(Protocol):
    """What `draft_tree_batched` drives: a drafter that drafts whole levels in fixed shapes on its own device.

    Rows are the requests drafting on the device (R of them, host int64 indices into the batch). Nothing is read
    back to the host; the top-k it returns stays on the drafter's device."""

    def expand_roots(self, rows: Tensor) -> DraftTopK:
        """The top-k next tokens after each row's root: (R, k)."""

    def expand_level(self, depth: int, tokens: Tensor, parents: Tensor) -> DraftTopK:
        """Expand a frontier of W nodes per row at level depth - 1: tokens (R, W) and the frontier slot of each
        node's parent in the previous call's frontier (R, W); returns the top-k after each node, (R, W, k)."""

    def keep_rows(self, index: Tensor) -> None:
        """Only rows[index] go on drafting (index: host int64, ascending)."""


def draft_tree_batched(
    policy: TreePolicy, root_token_ids: Tensor, drafter: LevelDrafter, budget: int | None = None,
    max_levels: int | None = None, context: float | None = None,
    read: Callable[..., tuple[Tensor, ...]] | None = None, send: Callable[[Tensor], Tensor] | None = None,
    sync_every_level: bool = False, min_tokens: int = 0, context_lengths: Tensor | None = None,
) -> DraftResult:
    """`draft_tree` with the drafting loop on the drafter's device and one host read per sync point.

    Between sync points (`policy.sync_depths`, then the end of drafting) every request drafting on the device
    expands a fixed frontier: its `expand_width` most likely nodes of the previous level (ties: lowest index; a
    request with fewer nodes pads, the padding's children are invalid), chosen on the device. At a sync point
    the host reads the levels drafted since the last one (`read`, one call) and replays `draft_tree`'s loop on
    them: the frontier is the device's, restricted to the requests the policy still lets draft; `expand_level`
    and `policy.observe` run as in `draft_tree`. Requests the replay stopped leave the device's batch. Work the
    device did for a request after the policy stopped it is dropped, so the result equals `draft_tree` with the
    same distributions (tests/core/test_batched_drafting.py); what the device drafted beyond it is the cost
    of deciding less often.

    read(*tensors): the tensors on the host, one synchronisation (default: .cpu()); send(tensor): a host index
    tensor on the drafter's device (default: .to the device of the drafted levels). sync_every_level: a sync
    point after every level, for a drafter whose reads cost nothing (on a CPU the host and the device are one, and
    every level drafted for a request the policy has already stopped is a whole draft forward wasted). min_tokens:
    as `draft_tree`'s. Deciding after every level with a policy whose host-library replay also chooses the next
    frontier (`EchoPolicy.chooses_frontier_on_host`), each level is one call of the library (`_draft_on_host`).
    context_lengths (B,): the result's selection packed for verification too (`DraftResult.packed`) where the policy
    makes the tree, the selection and the packing in one host-library call (`EchoPolicy.draft_result_on_host`)."""
    if not policy.beam_frontier:
        raise ValueError(f"policy {policy.name!r} does not draft a beam frontier; use draft_tree")
    read = read or (lambda *tensors: tuple(t.cpu() for t in tensors))
    levels = [root_level(root_token_ids.cpu())]
    slots = [torch.zeros(levels[0].num_nodes, dtype=torch.long)]  # each host node's slot in its device level
    state = policy.start(root_token_ids.numel(), budget, context)
    state.frontier_slots, state.min_tokens = [], min_tokens
    depth_cap = policy.max_depth if max_levels is None else min(policy.max_depth, max_levels)
    rows = torch.nonzero(state.active, as_tuple=True)[0]
    host = getattr(policy, "replays_on_host", False)  # read once a step: the policy's methods do not change in it
    if not rows.numel():
        pass  # nobody drafts (the budget rule before drafting)
    elif host and sync_every_level and getattr(policy, "chooses_frontier_on_host", False):
        _draft_on_host(policy, state, levels, slots, drafter, rows, depth_cap, read, send)
    else:
        syncs = frozenset(range(1, depth_cap + 1)) if sync_every_level else policy.sync_depths(state)
        _draft_on_device(policy, state, levels, slots, drafter, rows, depth_cap, syncs, read, send, host)
    state.frontier_slots += [torch.full((lv.num_nodes,), -1, dtype=torch.long)
                             for lv in levels[len(state.frontier_slots):]]
    if context_lengths is not None and getattr(policy, "draft_resulter", None) is not None:
        result = policy.draft_result_on_host(levels, state, context_lengths)
        if result is not None:
            return result
    candidates = (policy.tree_builder or SuperTree.from_levels)(levels)
    mask = policy.select(candidates, state)
    return DraftResult(candidates, mask, (policy.tree_selector or SuperTree.select)(candidates, mask), state)


def _draft_on_device(policy: TreePolicy, state: DraftState, levels: list[DraftLevel], slots: list[Tensor],
                     drafter: LevelDrafter, rows: Tensor, depth_cap: int, syncs: frozenset[int], read, send,
                     host: bool) -> None:
    """`draft_tree_batched`'s loop with the frontiers chosen on the drafter's device and the levels replayed at the
    sync depths (host: on the host library, `replay_level`). Appends to levels, slots and the state's records."""
    # levels drafted on the device since the last replay: (depth, rows, slots per row of the previous level,
    # frontier slots, frontier valid, probabilities, tokens)
    pending: list[tuple[int, Tensor, int, Tensor, Tensor, Tensor, Tensor]] = []
    replaying = True  # False once the replay met an empty frontier (draft_tree's break)
    score = tokens = None  # the previous level on the device: path probabilities (padding: -1) and tokens
    width, children = policy.expand_width, 1
    row_of = _row_of(state.batch_size, rows)
    for depth in range(1, depth_cap + 1):
        width_prev = 1 if depth == 1 else score.shape[1]  # slots per row of the previous level
        front, fvalid, probs, toks, score, tokens, children = _level_on_device(
            policy, drafter, depth, rows, score, tokens, width, children)
        pending.append((depth, rows, width_prev, front, fvalid, probs, toks))
        if depth in syncs and depth < depth_cap:
            replaying = _replay(policy, state, levels, slots, pending, read, row_of, host)
            pending = []
            if not replaying or not bool(state.active.any()):
                break
            rows, score, tokens, row_of = _keep_active(state, drafter, send, rows, score, tokens, row_of)
    if pending and replaying:
        _replay(policy, state, levels, slots, pending, read, row_of, host)


def _draft_on_host(policy: TreePolicy, state: DraftState, levels: list[DraftLevel], slots: list[Tensor],
                   drafter: LevelDrafter, rows: Tensor, depth_cap: int, read, send) -> None:
    """`draft_tree_batched`'s loop deciding after every level with one host-library call per level
    (`EchoPolicy.replay_level` with next_width): the level replayed with the policy's decisions, then the next
    level's frontier of the requests still drafting, where the device loop takes a few dozen tensor operations per
    level (its frontier choice in `_level_on_device`, `_replay`, `_keep_active`). The device loop is its oracle
    (tests/plugins/test_echo_host.py). Appends to levels, slots and the state's frontier records."""
    b, r = state.batch_size, rows.numel()
    row_of = _row_of(b, rows)
    front, fvalid = torch.zeros(r, 1, dtype=torch.long), torch.ones(r, 1, dtype=torch.bool)
    path, slot_width, tokens, parents = torch.ones(r, 1), 1, None, None
    for depth in range(1, depth_cap + 1):
        k = policy.num_children(depth)
        if depth == 1:
            top = drafter.expand_roots(rows)
            probs, toks = top.probs[:, None], top.tokens[:, None]
            dev = probs.device
            send = send or (lambda t: t.to(dev))
        else:
            top = drafter.expand_level(depth, send(tokens), send(parents))
            probs, toks = top.probs, top.tokens
        probs, toks = read(probs[..., :k], toks[..., :k])
        last = depth == depth_cap
        w, level, level_slots, nxt = policy.replay_level(
            state, levels[-1], slots[-1], depth, slot_width, front, fvalid, probs, toks, row_of, parent_path=path,
            next_width=0 if last else policy.expand_width)
        if not _record_replayed(state, levels, slots, w, level, level_slots, k):
            return
        if last or nxt is None or not bool(state.active.any()):
            return
        keep, front, fvalid, path, tokens, parents = nxt
        if keep.numel() < rows.numel():  # requests the replay stopped leave the device's batch
            drafter.keep_rows(keep)
            rows = rows[keep]
            row_of = _row_of(b, rows)
        slot_width = probs.shape[1] * k


def _record_replayed(state: DraftState, levels: list[DraftLevel], slots: list[Tensor], frontier_slots: Tensor,
                     level: DraftLevel | None, level_slots: Tensor | None, k: int) -> bool:
    """A level `replay_level` made (its k children per expanded node) into the drafting loop's records; False at an
    empty frontier (level None: drafting ends)."""
    state.frontier_slots.append(frontier_slots)
    if level is None:
        return False
    state.frontier_sizes.append(level.num_nodes // k)
    levels.append(level)
    slots.append(level_slots)
    return True


def _keep_active(state: DraftState, drafter: LevelDrafter, send, rows: Tensor, score: Tensor, tokens: Tensor,
                 row_of: Tensor):
    """Requests the replay stopped leave the device's batch: (rows, score, tokens, row_of) of those still
    drafting (row_of: `_row_of` of the rows kept)."""
    keep = state.active[rows]
    if bool(keep.all()):
        return rows, score, tokens, row_of
    index = torch.nonzero(keep, as_tuple=True)[0]
    drafter.keep_rows(index)
    on_dev = send(index) if send is not None else index.to(score.device)
    return rows[index], score[on_dev], tokens[on_dev], _row_of(state.batch_size, rows[index])


def _level_on_device(policy: TreePolicy, drafter: LevelDrafter, depth: int, rows: Tensor, score: Tensor | None,
                     tokens: Tensor | None, width: int, children: int):
    """One level drafted on the device for the drafting rows: the frontier (the `width` most likely slots of the
    previous level, in level order; every slot when there are no more), their children's probabilities and tokens,
    and the new level's path probabilities (padding: -1) and tokens. Returns (front, fvalid, probs, toks, score,
    tokens, children per node)."""
    k = policy.num_children(depth)
    if depth == 1:
        top = drafter.expand_roots(rows)  # (R, k')
        probs, toks = top.probs[:, None], top.tokens[:, None]  # (R, 1, k')
        dev = probs.device
        front = torch.zeros(rows.numel(), 1, dtype=torch.long, device=dev)  # the root: slot 0 of level 0
        fvalid = torch.ones(rows.numel(), 1, dtype=torch.bool, device=dev)
    else:
        if width >= score.shape[1]:  # every slot is expanded: no choice to make
            front = torch.arange(score.shape[1], device=score.device).expand(rows.numel(), -1)
        else:
            # padding (-1) sorts after every probability; ties: lowest slot (stable)
            best = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :width]
            front = torch.sort(best, dim=1).values  # (R, w) ascending: the frontier in level order
        parent_path = score.gather(1, front)
        fvalid = parent_path >= 0
        top = drafter.expand_level(depth, tokens.gather(1, front), torch.div(front, children, rounding_mode="floor"))
        probs, toks = top.probs, top.tokens  # (R, w, k')
    if probs.shape[-1] != k:
        probs, toks = probs[..., :k], toks[..., :k]
    if depth == 1:
        score = probs.float().reshape(rows.numel(), -1)
    else:
        score = torch.where(fvalid[..., None], parent_path[..., None] * probs.float(), -1.0).reshape(rows.numel(), -1)
    return front, fvalid, probs, toks, score, toks.reshape(rows.numel(), -1), k


def _row_of(batch_size: int, rows: Tensor) -> Tensor:
    """Each request's row among the drafting rows; the others read row len(rows), the all -1 padding row of each
    frontier table (`_replay`)."""
    row_of = torch.full((batch_size,), rows.numel(), dtype=torch.long)
    row_of[rows] = torch.arange(rows.numel())
    return row_of


def _replay(policy: TreePolicy, state: DraftState, levels: list[DraftLevel], slots: list[Tensor],
            pending: list, read, row_of: Tensor, host: bool) -> bool:
    """draft_tree's loop over levels the device drafted (draft_tree_batched), the pending levels' rows mapped by
    row_of (`_row_of`); host: the policy replays on the host library (`replays_on_host`). False at an empty
    frontier."""
    flat = read(*[t for rec in pending for t in rec[3:]])  # front, fvalid, probs, tokens of every level
    pad = pending[0][1].numel()  # the same rows for every pending level: they change only after a replay
    for i, (depth, _, width, *_) in enumerate(pending):
        front, fvalid, probs, toks = flat[4 * i: 4 * i + 4]
        prev = levels[-1]
        if host:  # the loop body below and policy.observe in one call of the host library
            w, level, level_slots, _ = policy.replay_level(state, prev, slots[-1], depth, width, front, fvalid,
                                                           probs, toks, row_of)
            if not _record_replayed(state, levels, slots, w, level, level_slots, probs.shape[-1]):
                return False
            continue
        # the frontier slot of each node of the previous level (-1: not in its request's device frontier)
        table = torch.full((pad + 1, width), -1, dtype=torch.long)
        table[:pad].scatter_(1, front, torch.where(fvalid, torch.arange(front.shape[1]), -1))
        r = row_of[prev.request_ids]
        w = table[r, slots[-1]]
        eligible = state.active[prev.request_ids] & (w >= 0)
        w = torch.where(eligible, w, -1)
        state.frontier_slots.append(w)
        frontier = torch.nonzero(eligible, as_tuple=True)[0]
        if frontier.numel() == 0:
            return False
        state.frontier_sizes.append(frontier.numel())
        fr, fw = r[frontier], w[frontier]
        k = probs.shape[-1]
        level = expand_level(prev, frontier, DraftTopK(probs[fr, fw], toks[fr, fw]), k)
        levels.append(level)
        slots.append((fw[:, None] * k + torch.arange(k)).reshape(-1))
        policy.observe(level, state)
    return True
