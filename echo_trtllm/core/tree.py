"""Super-Tree: the batch's ragged draft trees as flat tensors.

Drafting grows every request's tree level by level. Each level is a `DraftLevel` in *level-major* order
(all requests' depth-d candidates together, as the draft model produces them). `SuperTree.from_levels`
turns the levels into *request-major* order: the nodes of request 0, then those of request 1, ..., each
request's nodes ordered by depth so that a parent always precedes its children.

Worked example (B = 2). Request 0 drafts root r0, children a (p=.6) and b (p=.3), and a's child c (p=.5);
request 1 drafts only its root r1::

    level 0: tokens [r0, r1]  request_ids [0, 1]        parent_ids [-1, -1]
    level 1: tokens [a, b]    request_ids [0, 0]        parent_ids [0, 0]    (index into level 0)
    level 2: tokens [c]       request_ids [0]           parent_ids [0]       (index into level 1)

    SuperTree: token_ids    [r0, a, b, c, r1]
               parents      [-1, 0, 0, 1, -1]       (index within the request, -1 for the root)
               depths       [ 0, 1, 1, 2,  0]
               path_probs   [ 1, .6, .3, .3, 1]
               cu_num_nodes [0, 4, 5]

Index tensors are int64 (torch indexing); `pack` converts what TensorRT-LLM reads to int32.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "DraftLevel",
    "DraftTopK",
    "row_topk",
    "SuperTree",
    "root_level",
    "expand_level",
    "request_ids_from_cu",
    "global_parent_ids",
    "depths_from_parents",
    "greedy_path",
    "ancestor_table",
    "ancestor_paths",
    "nodes_by_depth",
    "per_request_max",
    "priority_order",
    "segment_rank",
]


# --------------------------------------------------------------------------------------------------------------
# Index helpers shared by the tree, the packer and the verifier
# --------------------------------------------------------------------------------------------------------------


def request_ids_from_cu(cu_num_nodes: Tensor, total: int | None = None) -> Tensor:
    """Request index of every node. cu_num_nodes [0, 3, 5] -> [0, 0, 0, 1, 1]. total: N_tot where the caller knows
    it (a tensor's length): repeat_interleave then needs no read of the device's sum (6x faster on the CPU for a
    batch's tree, no host synchronisation on a GPU)."""
    # cu_num_nodes: (B+1,)
    counts = (cu_num_nodes[1:] - cu_num_nodes[:-1]).long()  # (B,)
    return torch.repeat_interleave(torch.arange(counts.numel(), device=cu_num_nodes.device), counts,
                                   output_size=total)  # (N_tot,)


def global_parent_ids(parents: Tensor, cu_num_nodes: Tensor) -> Tensor:
    """Parents as indices into the flat batch (-1 for roots). parents [-1, 0, 0, -1, 0], cu [0, 3, 5]
    -> [-1, 0, 0, -1, 3]."""
    # parents: (N_tot,) within-request indices
    parents = parents.long()
    offsets = cu_num_nodes[:-1].long()[request_ids_from_cu(cu_num_nodes, parents.numel())]  # (N_tot,)
    return torch.where(parents >= 0, parents + offsets, parents)


def depths_from_parents(global_parents: Tensor) -> Tensor:
    """Depth of every node by pointer chasing (one vectorised gather per tree level)."""
    # global_parents: (N_tot,)
    depth = torch.zeros_like(global_parents)
    cur = global_parents.clone()
    while bool((cur >= 0).any()):
        up = cur >= 0
        depth += up.long()
        cur = torch.where(up, global_parents[cur.clamp(min=0)], cur)
    return depth


def greedy_path(global_parents: Tensor, ranks: Tensor) -> Tensor:
    """(N_tot,) bool: whether every node on the path from the root to each node (itself included) is its parent's
    best child (rank 0): the draft's own greedy continuation. Roots are on it. One vectorised step up per level.

    Parents [-1, 0, 0, 1], ranks [0, 0, 1, 0] -> [True, True, False, True]."""
    on = ranks == 0
    cur = global_parents.clone()
    while bool((cur >= 0).any()):
        up = cur >= 0
        on &= ~up | (ranks[cur.clamp(min=0)] == 0)
        cur = torch.where(up, global_parents[cur.clamp(min=0)], cur)
    return on


def ancestor_paths(nodes: Tensor, global_parents: Tensor, depths: Tensor, max_depth: int | None = None) -> Tensor:
    """path[r, d] = flat index of the ancestor at depth d of node nodes[r] (path[r, depth] = nodes[r]), -1 past
    the node's depth. One vectorised step up the tree per level, without reading the device: max_depth, the
    deepest depth in `depths` where the caller knows it from the host (None: read here; a larger value adds -1
    columns; a smaller one is the caller's error and gives wrong paths, never an out-of-range index).

    Parents [-1, 0, 0, 1] (depths [0, 1, 1, 2]), nodes [3, 2] -> [[0, 1, 3], [0, 2, -1]].
    """
    # nodes: (S,) flat indices; global_parents, depths: (N_tot,)
    if max_depth is None:
        max_depth = int(depths.max()) if depths.numel() else 0
    dev = nodes.device
    path = torch.full((nodes.numel(), max_depth + 2), -1, dtype=torch.long, device=dev)  # last column: a sink
    cur = nodes.long()
    col = depths[cur]
    rows = torch.arange(nodes.numel(), device=dev)
    for _ in range(max_depth + 1):
        live = col >= 0
        path[rows, torch.where(live, col.clamp(max=max_depth), max_depth + 1)] = torch.where(live, cur, -1)  # sink
        cur = torch.where(live, global_parents[cur], cur).clamp(min=0)
        col = col - 1
    return path[:, : max_depth + 1]


def ancestor_table(global_parents: Tensor, depths: Tensor) -> Tensor:
    """ancestor_paths of every node: (N_tot, D+1).

    Parents [-1, 0, 0, 1] (depths [0, 1, 1, 2]) -> [[0, -1, -1], [0, 1, -1], [0, 2, -1], [0, 1, 3]].
    """
    return ancestor_paths(torch.arange(global_parents.numel(), device=global_parents.device), global_parents, depths)


def nodes_by_depth(depths: Tensor) -> list[Tensor]:
    """Flat node indices of each depth 0..D, ascending: depths [0, 1, 1, 2, 0] -> [[0, 4], [1, 2], [3]]."""
    order = torch.sort(depths, stable=True).indices
    counts = torch.bincount(depths, minlength=int(depths.max()) + 1 if depths.numel() else 1)
    return list(torch.split(order, counts.tolist()))


def per_request_max(values: Tensor, request_ids: Tensor, batch_size: int, fill: float = 0.0) -> Tensor:
    """Segment maximum: out[i] = max of values of request i (fill where request i has none)."""
    out = torch.full((batch_size,), fill, dtype=values.dtype, device=values.device)  # (B,)
    return out.scatter_reduce(0, request_ids, values, reduce="amax", include_self=True)


def priority_order(scores: Tensor, depths: Tensor) -> Tensor:
    """Permutation sorting nodes by score descending, then depth ascending, then index ascending.

    Because a child's path probability never exceeds its parent's (a product of factors <= 1), taking any
    prefix of this order per request keeps every chosen node's parent chosen.

    One stable sort of an int64 key: the float32 bit pattern of a score >= 0 is monotone in its value, so
    key = (bits of the largest float32 - bits of the score) * 2^16 + depth orders exactly as described.
    """
    s = scores.float()
    if s.numel() and bool(((s < 0) | s.isnan()).any()):
        raise ValueError("priority_order needs scores >= 0 (probabilities; no NaN)")
    bits = (s + 0.0).contiguous().view(torch.int32).long()  # (N,) monotone in the score; + 0.0 turns -0.0 into 0.0
    key = (0x7F7FFFFF - bits) * 65536 + depths.long()
    return torch.sort(key, stable=True).indices


def segment_rank(request_ids: Tensor, order: Tensor, batch_size: int) -> Tensor:
    """Rank of each node of `order` among the nodes of its own request, in the order given.

    request_ids [0, 1, 0, 0], order [3, 1, 0, 2] -> ranks (aligned with `order`) [0, 0, 1, 2].
    """
    # order: (M,) flat node indices
    req = request_ids[order]  # (M,)
    grouped = torch.sort(req, stable=True).indices  # (M,) positions in `order`, grouped by request
    counts = torch.bincount(req, minlength=batch_size)
    starts = torch.cumsum(counts, 0) - counts  # (B,)
    rank = torch.empty_like(order)
    rank[grouped] = torch.arange(order.numel(), device=order.device) - starts[req[grouped]]
    return rank


# --------------------------------------------------------------------------------------------------------------
# Levels: what drafting produces
# --------------------------------------------------------------------------------------------------------------


@dataclass
class DraftLevel:
    """The candidates drafted at one depth for the whole batch, level-major (M nodes).

    Level 0 holds the roots (one per request, M = B): the last committed token of each request, whose target
    logits give the next token."""

    depth: int
    # (M,) int64: request of each node
    request_ids: Tensor
    # (M,) int64: index of the parent within the previous level; -1 at level 0
    parent_ids: Tensor
    # (M,) int64
    token_ids: Tensor
    # (M,) float32: q(token | parent path); 1 at the roots
    draft_probs: Tensor
    # (M,) float32: product of draft_probs from the root
    path_probs: Tensor
    # (M,) int64: rank of the token among its siblings (0 = the draft's best); 0 at the roots
    ranks: Tensor

    @property
    def num_nodes(self) -> int:
        return self.token_ids.numel()


def root_level(root_token_ids: Tensor) -> DraftLevel:
    """Level 0: one root per request."""
    if root_token_ids.ndim != 1:
        raise ValueError(f"root_token_ids must be 1-D (B,), got shape {tuple(root_token_ids.shape)}")
    b = root_token_ids.numel()
    dev = root_token_ids.device
    return DraftLevel(
        depth=0,
        request_ids=torch.arange(b, device=dev),
        parent_ids=torch.full((b,), -1, dtype=torch.long, device=dev),
        token_ids=root_token_ids.long(),
        draft_probs=torch.ones(b, device=dev),
        path_probs=torch.ones(b, device=dev),
        ranks=torch.zeros(b, dtype=torch.long, device=dev),
    )


class DraftTopK(NamedTuple):
    """The draft's k most likely next tokens after each frontier node, best first: what a drafter hands the
    drafting loop instead of the (F, V) distribution (computed where the draft model runs; F x k comes back)."""

    # (F, k) float32, descending along each row
    probs: Tensor
    # (F, k) int64 token ids
    tokens: Tensor

    @classmethod
    def of(cls, probs: Tensor, k: int) -> "DraftTopK":
        """The top-k of a (F, V) distribution (k capped at V; `row_topk`)."""
        values, tokens = row_topk(probs if probs.dtype == torch.float32 else probs.float(), min(k, probs.shape[-1]))
        return cls(values, tokens)


# rows x vocabulary entries below which `row_topk` is torch.topk itself (one small row: the two passes cost more)
TOPK_MIN_ENTRIES = 16_384


def row_topk(x: Tensor, k: int, chunk: int | None = None) -> tuple[Tensor, Tensor]:
    """torch.topk(x, k, dim=-1) of a (N, V) CPU floating-point tensor: the same values in every row, largest first,
    and indices of entries holding them (among equal values any of them, as torch.topk's own choice among equals
    is unspecified; so is which of -0.0 and 0.0 comes back). Two passes: the maximum of every block of `chunk`
    entries, then torch.topk over the k blocks with the largest maxima, which hold the row's k largest entries (a
    block outside them has a maximum no larger than the k-th largest entry). PyTorch's CPU topk over a row is a
    partial sort: at 64 rows it takes 0.31 ms over a draft vocabulary of 8,192 and 5.5 ms over Qwen's 151,936, this
    0.12 / 0.65 ms (two threads; docs/performance.md). NaN ranks above everything in both passes, as in torch.topk.
    Elsewhere (other devices, small inputs, a vocabulary no block size divides, k too large for blocks to help)
    torch.topk itself; which path a call takes depends on its rows, so among exactly equal entries the index a
    row gets may depend on how many rows were asked with it. chunk: the block size (None: 64 below 65,536 entries a
    row, else 128; given, small inputs take the two passes too)."""
    if chunk is not None and chunk < 1:
        raise ValueError(f"row_topk: chunk must be a positive block size, got {chunk}")
    n, v = x.shape if x.ndim == 2 else (0, 0)
    small = chunk is None and n * v < TOPK_MIN_ENTRIES
    chunk = chunk or (64 if v < 65_536 else 128)
    if (x.ndim != 2 or x.device.type != "cpu" or not x.is_floating_point() or small or v % chunk
            or 4 * k * chunk > v):
        return torch.topk(x, k, dim=-1)
    x = x.contiguous()
    blocks = torch.topk(x.view(n, v // chunk, chunk).amax(-1), k, dim=-1).indices  # (N, k)
    cols = (blocks[:, :, None] * chunk + torch.arange(chunk, device=x.device)).reshape(n, k * chunk)
    values, at = torch.topk(x.gather(1, cols), k, dim=-1)
    return values, cols.gather(1, at)


def expand_level(prev: DraftLevel, frontier: Tensor, child_probs: Tensor | DraftTopK,
                 num_children: int) -> DraftLevel:
    """Grow one level: the top-`num_children` tokens of the draft distribution at each frontier node.

    frontier [F] indexes `prev`; child_probs is the (processed) draft distribution of the token that follows each
    frontier node, either whole (F, V) or as its top k >= num_children (`DraftTopK`). Children are emitted
    frontier-major, best sibling first.
    """
    if frontier.ndim != 1:
        raise ValueError(f"frontier must be 1-D (F,), got shape {tuple(frontier.shape)}")
    top = child_probs if isinstance(child_probs, DraftTopK) else None
    full = top.probs if top is not None else child_probs
    what = "DraftTopK probs" if top is not None else "child_probs"
    if full.ndim != 2 or full.shape[0] != frontier.numel():
        raise ValueError(f"{what} must be (F, {'k' if top is not None else 'V'}) with F = {frontier.numel()} "
                         f"frontier nodes, got {tuple(full.shape)}")
    if top is not None and top.tokens.shape != full.shape:
        raise ValueError(f"DraftTopK tokens must have the shape of its probs {tuple(full.shape)}, "
                         f"got {tuple(top.tokens.shape)}")
    if not 1 <= num_children <= full.shape[1]:
        width = f"k={full.shape[1]}" if top is not None else f"V={full.shape[1]}"
        raise ValueError(f"num_children must be in [1, {width}], got {num_children}")
    if top is not None:
        probs, tokens = top.probs[:, :num_children].float(), top.tokens[:, :num_children].long()
    else:
        probs, tokens = torch.topk(child_probs.float(), num_children, dim=-1)  # (F, k), (F, k)
    frontier = frontier.long()
    parent_path = prev.path_probs[frontier]  # (F,)
    k = num_children
    return DraftLevel(
        depth=prev.depth + 1,
        request_ids=prev.request_ids[frontier].repeat_interleave(k),  # (F*k,)
        parent_ids=frontier.repeat_interleave(k),
        token_ids=tokens.reshape(-1),
        draft_probs=probs.reshape(-1),
        path_probs=(parent_path[:, None] * probs).reshape(-1),
        ranks=torch.arange(k, device=frontier.device).repeat(frontier.numel()),
    )


# --------------------------------------------------------------------------------------------------------------
# The Super-Tree
# --------------------------------------------------------------------------------------------------------------


@dataclass
class SuperTree:
    """All requests' draft trees as one flat, request-major node list (see the module docstring)."""

    # (N_tot,) int64
    token_ids: Tensor
    # (N_tot,) int64: parent index within the request, -1 for the root; parent < child
    parents: Tensor
    # (N_tot,) int64: root 0
    depths: Tensor
    # (N_tot,) float32
    draft_probs: Tensor
    # (N_tot,) float32: the draft's probability of the whole root path (confidence of the node)
    path_probs: Tensor
    # (N_tot,) int64: sibling rank in the draft's top-k (0 = best)
    ranks: Tensor
    # (B+1,) int64
    cu_num_nodes: Tensor
    # (N_tot,) int64: where each node came from — its index in the level-major concatenation of the drafted
    # levels (from_levels) or its flat input index (from_parents); kept by select(). The runtime maps drafted
    # nodes back to its own per-node state (e.g. the draft model's KV positions) through it.
    source_index: Tensor

    @property
    def batch_size(self) -> int:
        return self.cu_num_nodes.numel() - 1

    @property
    def num_nodes(self) -> Tensor:
        """(B,) nodes per request, root included (K_i)."""
        return self.cu_num_nodes[1:] - self.cu_num_nodes[:-1]

    @property
    def total_nodes(self) -> int:
        return self.token_ids.numel()

    @cached_property
    def request_ids(self) -> Tensor:
        return request_ids_from_cu(self.cu_num_nodes, self.total_nodes)

    @cached_property
    def global_parents(self) -> Tensor:
        return global_parent_ids(self.parents, self.cu_num_nodes)

    @cached_property
    def on_greedy_path(self) -> Tensor:
        """(N_tot,) bool: nodes on the draft's greedy path (every rank along it 0; `greedy_path`)."""
        return greedy_path(self.global_parents, self.ranks)

    @property
    def is_root(self) -> Tensor:
        return self.parents < 0

    def path_nodes(self) -> Tensor:
        """(N_tot, D+1) flat indices of each node's ancestors by depth (see `ancestor_table`)."""
        return ancestor_table(self.global_parents, self.depths)

    @classmethod
    def from_levels(cls, levels: list[DraftLevel]) -> "SuperTree":
        """Concatenate level-major drafts and reorder them request-major (one stable sort)."""
        if not levels or levels[0].depth != 0:
            raise ValueError("levels must start with the root level (depth 0) from root_level()")
        sizes = torch.tensor([lv.num_nodes for lv in levels])
        level_start = torch.cumsum(sizes, 0) - sizes  # (L,)
        dev = levels[0].token_ids.device
        # Parents as indices into the level-major concatenation.
        parent_flat = torch.cat(
            [levels[0].parent_ids] + [lv.parent_ids + int(level_start[d - 1]) for d, lv in enumerate(levels) if d > 0]
        )
        request_ids = torch.cat([lv.request_ids for lv in levels])
        batch_size = levels[0].num_nodes
        order = torch.sort(request_ids, stable=True).indices  # (N_tot,) level-major -> request-major
        new_index = torch.empty_like(order)
        new_index[order] = torch.arange(order.numel(), device=dev)
        counts = torch.bincount(request_ids, minlength=batch_size)
        cu = torch.zeros(batch_size + 1, dtype=torch.long, device=dev)
        cu[1:] = torch.cumsum(counts, 0)
        parent_sorted = parent_flat[order]
        req_sorted = request_ids[order]
        # parents as flat request-major indices, then within their request
        global_parents = torch.where(parent_sorted >= 0, new_index[parent_sorted.clamp(min=0)], -1)
        local_parent = torch.where(global_parents >= 0, global_parents - cu[req_sorted], -1)
        depth = torch.cat([torch.full((lv.num_nodes,), lv.depth, dtype=torch.long, device=dev) for lv in levels])
        ranks = torch.cat([lv.ranks for lv in levels])
        # the greedy path level by level (a child is on it iff its parent is and it is the best sibling): one
        # gather per level instead of `greedy_path`'s walk up from every node
        greedy = [torch.ones(levels[0].num_nodes, dtype=torch.bool, device=dev)]
        for lv in levels[1:]:
            greedy.append(greedy[-1][lv.parent_ids] & (lv.ranks == 0))
        tree = cls(
            token_ids=torch.cat([lv.token_ids for lv in levels])[order],
            parents=local_parent,
            depths=depth[order],
            draft_probs=torch.cat([lv.draft_probs for lv in levels])[order],
            path_probs=torch.cat([lv.path_probs for lv in levels])[order],
            ranks=ranks[order],
            cu_num_nodes=cu,
            source_index=order,
        )
        # derived per-node tensors known here already (the cached properties would recompute them)
        tree.__dict__.update(request_ids=req_sorted, global_parents=global_parents, on_greedy_path=torch.cat(greedy)[order])
        return tree

    @classmethod
    def from_parents(cls, parents: list[Tensor], token_ids: list[Tensor] | None = None) -> "SuperTree":
        """A tree from per-request parent lists (-1 for the root at index 0, parent before child).

        Probabilities are unknown and set to 1; `token_ids` default to zeros."""
        if not parents:
            raise ValueError("parents must hold at least one request")
        checked = []
        for i, p in enumerate(parents):
            p = torch.as_tensor(p)
            if p.ndim != 1 or p.numel() == 0:
                raise ValueError(f"parents[{i}] must be a non-empty 1-D tensor, got shape {tuple(p.shape)}")
            p = p.long()
            idx = torch.arange(p.numel())
            if int(p[0]) != -1:
                raise ValueError(f"parents[{i}][0] must be -1 (the root), got {int(p[0])}")
            bad = (p[1:] < 0) | (p[1:] >= idx[1:])
            if bool(bad.any()):
                j = int(idx[1:][bad][0])
                raise ValueError(
                    f"parents[{i}][{j}] = {int(p[j])}: every non-root node needs a parent in [0, {j - 1}] "
                    "(one root at index 0, parents before children)"
                )
            checked.append(p)
        counts = torch.tensor([p.numel() for p in checked])
        cu = torch.zeros(len(checked) + 1, dtype=torch.long)
        cu[1:] = torch.cumsum(counts, 0)
        flat_parents = torch.cat(checked)
        if token_ids is None:
            tokens = torch.zeros(int(cu[-1]), dtype=torch.long)
        else:
            if len(token_ids) != len(checked):
                raise ValueError(f"token_ids has {len(token_ids)} requests, parents has {len(checked)}")
            tokens = torch.cat([torch.as_tensor(t).long().reshape(-1) for t in token_ids])
            if tokens.numel() != int(cu[-1]):
                raise ValueError("token_ids must have one token per node of parents")
        depths = depths_from_parents(global_parent_ids(flat_parents, cu))
        ones = torch.ones(int(cu[-1]))
        return cls(tokens, flat_parents, depths, ones, ones.clone(), torch.zeros_like(tokens), cu, torch.arange(tokens.numel()))

    def select(self, mask: Tensor) -> "SuperTree":
        """The sub-tree of the nodes where `mask` is True. Every root and every selected node's parent must be
        selected; the relative order of nodes is kept, so parents still precede children."""
        if mask.shape != (self.total_nodes,) or mask.dtype != torch.bool:
            raise ValueError(f"mask must be bool of shape ({self.total_nodes},), got {mask.dtype} {tuple(mask.shape)}")
        gp = self.global_parents
        if not bool(mask[self.is_root].all()):
            raise ValueError("selection must keep every request's root")
        orphan = mask & (gp >= 0) & ~mask[gp.clamp(min=0)]
        if bool(orphan.any()):
            raise ValueError(f"selection is not ancestor-closed: node {int(orphan.nonzero()[0])} lacks its parent")
        new_index = torch.cumsum(mask.long(), 0) - 1  # (N_tot,) flat index after selection
        counts = torch.zeros(self.batch_size, dtype=torch.long, device=mask.device)
        counts.index_add_(0, self.request_ids, mask.long())
        cu = torch.zeros_like(self.cu_num_nodes)
        cu[1:] = torch.cumsum(counts, 0)
        req = self.request_ids[mask]
        gp_sel = gp[mask]
        gp_new = torch.where(gp_sel >= 0, new_index[gp_sel.clamp(min=0)], gp_sel)  # flat indices after selection
        parents = torch.where(gp_new >= 0, gp_new - cu[req], gp_new)
        tree = SuperTree(
            token_ids=self.token_ids[mask],
            parents=parents,
            depths=self.depths[mask],
            draft_probs=self.draft_probs[mask],
            path_probs=self.path_probs[mask],
            ranks=self.ranks[mask],
            cu_num_nodes=cu,
            source_index=self.source_index[mask],
        )
        # an ancestor-closed selection keeps every kept node's path: its greedy flag carries over; its request
        # and global parent are known here
        tree.__dict__.update(request_ids=req, global_parents=gp_new)
        if "on_greedy_path" in self.__dict__:
            tree.__dict__["on_greedy_path"] = self.on_greedy_path[mask]
        return tree

    def to(self, device: torch.device | str) -> "SuperTree":
        """The tree on `device`: itself when every field is there already (as `Tensor.to`), else a copy with the
        derived tensors it has computed moved along."""
        device = torch.device(device)
        if all(getattr(self, f.name).device == device for f in fields(self)):
            return self
        tree = SuperTree(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})
        for name in ("request_ids", "global_parents", "on_greedy_path"):
            if name in self.__dict__:
                tree.__dict__[name] = self.__dict__[name].to(device)
        return tree
