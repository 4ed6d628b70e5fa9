"""Elastic budget scheduler: one global verification budget K_max for the whole Super-Tree.

Invariants: sum_i K_i <= K_max, K_i >= 1 (every request keeps its root, so it always makes progress),
K_i <= max_nodes_per_request, every chosen node's parent is chosen. K_max = B gives plain AR for everyone.

Allocation, after drafting (all vectorised, no loop over requests or nodes):

0. Roots: one node per request (B of the budget).
1. Priority 1, global depth extension. A request that passed gates up to depth g_i (its `spine_depth`, 0 if it
   failed the first gate) owns a spine: its most likely depth-g_i node and that node's ancestors. All spines'
   nodes compete for the remaining budget in the order (path probability desc, depth asc, index asc): with
   scarce budget the high-confidence requests deepen and the low-confidence ones keep only their roots.
2. Priority 2, opportunistic width expansion. Leftover budget goes to every candidate not chosen yet (the
   truncated requests' siblings at their truncated depth, the passing requests' side branches) in the same
   order. Under low load this widens trees; under high load nothing is left for it.

The order keeps ancestor closure: path probabilities never grow along a path and ties go to the shallower
node, so a node's parent always precedes it (in the same phase, or it was chosen in an earlier phase).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .tree import SuperTree, per_request_max, priority_order, segment_rank

__all__ = ["BudgetAllocation", "allocate_budget", "greedy_fill", "spine_mask"]

ROOT, DEPTH, WIDTH = 0, 1, 2  # phases recorded in BudgetAllocation.phase


@dataclass
class BudgetAllocation:
    """Which candidates the target verifies."""

    # (N_tot,) bool
    selected: Tensor
    # (N_tot,) int8: 0 root, 1 priority-1 depth, 2 priority-2 width, -1 not selected
    phase: Tensor
    # (B,) int64: K_i, root included
    num_nodes: Tensor
    # (K - B,) int64: the non-root nodes in the order they were taken (P1, then P2); every prefix is
    # ancestor-closed, so a budget rule may keep just a prefix (`truncated`)
    order: Tensor

    @property
    def total(self) -> int:
        return int(self.num_nodes.sum())

    def truncated(self, budget: int, request_ids: Tensor) -> "BudgetAllocation":
        """The same allocation cut to `budget` tokens (roots plus the first budget - B taken nodes)."""
        b = self.num_nodes.numel()
        keep = self.order[: max(budget - b, 0)]
        selected = self.phase == ROOT
        selected[keep] = True
        phase = torch.where(selected, self.phase, torch.full_like(self.phase, -1))
        return BudgetAllocation(selected, phase, torch.bincount(request_ids[selected], minlength=b), keep)


def greedy_fill(
    candidates: Tensor,
    order: Tensor,
    request_ids: Tensor,
    batch_size: int,
    budget: int | None,
    cap: Tensor | None,
) -> Tensor:
    """Take candidates in `order` while the per-request `cap` (B,) and the global `budget` allow.

    Returns the (N,) bool mask of taken nodes. Example: candidates of requests [0, 0, 1] in that order,
    cap [1, 5], budget 2 -> the first node of request 0 and the node of request 1.
    """
    ordered = order[candidates[order]]  # candidate flat indices in priority order
    if cap is not None:
        rank = segment_rank(request_ids, ordered, batch_size)
        ordered = ordered[rank < cap[request_ids[ordered]]]
    if budget is not None:
        ordered = ordered[: max(budget, 0)]
    taken = torch.zeros_like(candidates)
    taken[ordered] = True
    return taken


def spine_mask(tree: SuperTree, spine_depth: Tensor) -> Tensor:
    """(N_tot,) bool: each request's best node at depth spine_depth[i] (ties: lowest index) and its ancestors.
    Requests with spine_depth 0 (or no node that deep) have no spine."""
    b = tree.batch_size
    req = tree.request_ids
    n = tree.total_nodes
    at_depth = (tree.depths == spine_depth[req]) & (tree.depths > 0)  # (N_tot,)
    # Best node per request: max path prob, then the lowest index among equals.
    idx = torch.arange(n, device=req.device)
    prob = torch.where(at_depth, tree.path_probs, torch.full_like(tree.path_probs, -1.0))
    best_prob = per_request_max(prob, req, b, fill=-1.0)  # (B,)
    tied = at_depth & (prob == best_prob[req])
    first = torch.full((b,), n, dtype=torch.long, device=req.device).scatter_reduce(
        0, req, torch.where(tied, idx, n), reduce="amin", include_self=True
    )
    cur = first.clamp(max=n - 1)[first < n]  # (<=B,) best node of each request with a spine
    mask = torch.zeros(n, dtype=torch.bool, device=req.device)
    gp = tree.global_parents
    for _ in range(int(spine_depth.max()) if cur.numel() else 0):  # walk up; roots are cleared below
        mask[cur] = True
        cur = gp[cur].clamp(min=0)
    return mask & (tree.depths > 0)


def allocate_budget(
    tree: SuperTree, spine_depth: Tensor, budget: int, max_nodes_per_request: int | None = None
) -> BudgetAllocation:
    """Choose the verified nodes of the whole batch under the global `budget` (K_max); see the module docstring.

    tree: all drafted candidates; spine_depth (B,) int: deepest gate depth each request passed (0 = none).
    """
    b = tree.batch_size
    if spine_depth.shape != (b,):
        raise ValueError(f"spine_depth must have shape ({b},), got {tuple(spine_depth.shape)}")
    if budget < b:
        raise ValueError(f"budget K_max = {budget} is below the batch size {b}: every request needs its root")
    if max_nodes_per_request is not None and max_nodes_per_request < 1:
        raise ValueError(f"max_nodes_per_request must be >= 1, got {max_nodes_per_request}")
    req = tree.request_ids
    root = tree.is_root
    order = priority_order(tree.path_probs, tree.depths)
    cap = None
    if max_nodes_per_request is not None:
        cap = torch.full((b,), max_nodes_per_request - 1, dtype=torch.long, device=req.device)

    remaining = budget - b
    depth_phase = greedy_fill(spine_mask(tree, spine_depth.long()), order, req, b, remaining, cap)
    depth_order = order[depth_phase[order]]
    remaining -= int(depth_phase.sum())
    if cap is not None:
        cap = cap - torch.bincount(req[depth_phase], minlength=b)
    width_candidates = ~root & ~depth_phase
    width_phase = greedy_fill(width_candidates, order, req, b, remaining, cap)

    selected = root | depth_phase | width_phase
    phase = torch.full((tree.total_nodes,), -1, dtype=torch.int8, device=req.device)
    phase[root] = ROOT
    phase[depth_phase] = DEPTH
    phase[width_phase] = WIDTH
    taken = torch.cat([depth_order, order[width_phase[order]]])
    return BudgetAllocation(selected, phase, torch.bincount(req[selected], minlength=b), taken)
