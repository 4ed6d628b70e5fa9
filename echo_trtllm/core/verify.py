"""Verification: which drafted nodes the target accepts, and the token it adds after them.

`verify_greedy` (temperature 0): accept the deepest root path whose every node equals the target's argmax at
its parent (ties: the lowest node index), then add the argmax after its last node (the bonus token).

`verify_sampling` with deterministic drafts (the runtime's: top-k by draft probability, `draft_probs=None`):
the target's own sample at every node, s(n) = inverse-CDF(p(n), u_{position of n}), then the greedy rule with s in
place of the argmax. The uniforms are keyed by output position (request i's u_t is the t-th draw of its own
stream, whatever the tree), so the emitted tokens are exactly those of plain AR sampling with the same uniforms:
lossless, and reproducible per seed whatever the drafts, the budget or the AR fallback chose. It accepts some
child of a node with probability sum_children p(x), as the recursive point-mass rule does.

`verify_sampling` with sampled drafts (`draft_probs` given): lossless multi-draft speculative sampling, the
recursive residual rule of SpecInfer / Sequoia. Walking down from the root with the target distribution p at the
current node (after temperature, top-k and top-p) and the draft distribution q there:

    for each child x in index order:       accept x with probability min(1, p(x) / q(x))
        accepted -> move to x, p <- p at x, q <- q at x
        rejected -> p <- norm(max(p - q, 0));  q <- norm(q with x removed)   (drafts without replacement)
    no child accepted -> sample the bonus token from p and stop (from the node's target distribution if
                         rounding left p without mass)

There request i draws N_i uniforms from its own generator once per step (node j's test uses the j-th, the bonus
draw uses the 0th, the root's, which is never tested).

Result layout (flat, `cu_accepted` [B+1]): request i owns positions cu[i]..cu[i+1]; its accepted_node_ids are
the root then the accepted drafts (for KV compaction) and its accepted_token_ids the accepted draft tokens
then the bonus token. Example: tree [r, a, b, c] with a and c accepted -> nodes [r, a, c], tokens [a, c, t].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from .pack import PackedVerifyBatch
from .tree import ancestor_paths, segment_rank

__all__ = ["SamplingTensors", "VerifyResult", "AcceptedPaths", "process_logits", "verify_greedy", "verify_sampling",
           "verify", "verify_paths", "depth_uniforms", "row_argmax"]

ARGMAX_CHUNK = 1024  # vocabulary entries per block of `row_argmax`'s first pass


def row_argmax(x: Tensor, chunk: int = ARGMAX_CHUNK) -> Tensor:
    """x.argmax(-1) of a (N, V) floating-point tensor, equal to it everywhere (the first index of each row's
    maximum; a row with a NaN: its first NaN), in two passes PyTorch's CPU kernels vectorise: the maximum of every
    block of `chunk` entries (amax), then the argmax inside the first block holding the row's maximum. PyTorch's
    CPU argmax over a vocabulary is a scalar loop: at 64 rows of Qwen's 151,936 it takes 4 ms in float32 and
    7 ms in bfloat16 (which it is asked for once the verification keeps bfloat16 logits), this 0.2 / 1.5 ms
    (docs/performance.md). On other devices torch.argmax itself. Never reads x back to the host."""
    if x.ndim != 2 or not x.is_floating_point() or x.shape[1] <= chunk or x.device.type != "cpu":
        return x.argmax(-1)  # a GPU's argmax is already one parallel reduction
    x = x.contiguous()
    n, v = x.shape
    main = v - v % chunk
    block_max = x[:, :main].view(n, main // chunk, chunk).amax(-1)  # (N, main / chunk)
    if main < v:
        block_max = torch.cat([block_max, x[:, main:].amax(-1, keepdim=True)], dim=1)
    top = block_max.amax(-1, keepdim=True)
    # the first block holding the maximum; NaN: amax propagates it, so the first block holding a NaN
    first = ((block_max == top) | block_max.isnan()).to(torch.uint8).argmax(-1)  # (N,)
    cols = (first[:, None] * chunk + torch.arange(chunk, device=x.device)).clamp(max=v - 1)  # (N, chunk)
    # the tail block's columns past V repeat V - 1: its argmax still finds the first occurrence
    return cols.gather(1, x.gather(1, cols).argmax(-1, keepdim=True)).squeeze(1)


@dataclass
class SamplingTensors:
    """Per-request sampling parameters of a step."""

    # (B,) float: 0 = greedy
    temperature: Tensor
    # (B,) int64: 0 = no top-k
    top_k: Tensor
    # (B,) float in (0, 1]: 1 = no top-p
    top_p: Tensor

    @classmethod
    def uniform(cls, batch_size: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> "SamplingTensors":
        return cls(
            torch.full((batch_size,), float(temperature)),
            torch.full((batch_size,), int(top_k), dtype=torch.long),
            torch.full((batch_size,), float(top_p)),
        )

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature <= 0).all())


@dataclass
class VerifyResult:
    # (A_tot,) int64: flat batch indices of the accepted path, root first
    accepted_node_ids: Tensor
    # (A_tot,) int64: accepted draft tokens, then the bonus token
    accepted_token_ids: Tensor
    # (B+1,) int64
    cu_accepted: Tensor

    @property
    def num_accepted_drafts(self) -> Tensor:
        """(B,) accepted draft tokens per request (the emitted tokens are one more)."""
        return self.cu_accepted[1:] - self.cu_accepted[:-1] - 1

    def token_lists(self) -> list[list[int]]:
        cu = self.cu_accepted.tolist()
        toks = self.accepted_token_ids.tolist()
        return [toks[cu[i] : cu[i + 1]] for i in range(len(cu) - 1)]

    def node_lists(self) -> list[list[int]]:
        cu = self.cu_accepted.tolist()
        nodes = self.accepted_node_ids.tolist()
        return [nodes[cu[i] : cu[i + 1]] for i in range(len(cu) - 1)]


def process_logits(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """(N, V) logits -> (N, V) float32 probabilities after temperature, top-k, then top-p (per row).

    Temperature 0 gives a one-hot argmax. Top-p keeps the smallest prefix of the sorted (top-k-filtered)
    distribution whose mass reaches top_p; the most likely token is always kept.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be (N, V), got shape {tuple(logits.shape)}")
    n, v = logits.shape
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if t.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},), got {tuple(t.shape)}")
    dev = logits.device
    temperature, top_k, top_p = temperature.to(dev), top_k.to(dev), top_p.to(dev)
    greedy = temperature <= 0
    # Shift by the row maximum before dividing: with a tiny temperature (1e-40) the maximum maps to 0 and every
    # other logit to -inf, so the softmax is the argmax (ties shared) instead of inf/inf = NaN.
    full = logits.float()  # one float32 copy (the runtime's logits are in the model's dtype)
    shifted = full - full.amax(dim=-1, keepdim=True)
    probs = torch.softmax(shifted / torch.where(greedy, 1.0, temperature.float())[:, None], dim=-1)
    need = ((top_k > 0) & (top_k < v)) | (top_p < 1)
    need &= ~greedy
    if bool(need.any()):
        rows = torch.nonzero(need, as_tuple=True)[0]
        sorted_p, idx = torch.sort(probs[rows], dim=-1, descending=True, stable=True)  # (R, V)
        rank = torch.arange(v, device=dev)[None, :]
        k = top_k[rows][:, None]
        keep = (k <= 0) | (rank < k)
        kept = sorted_p * keep
        before = torch.cumsum(kept, dim=-1) - kept  # mass strictly before each token
        keep &= (before < top_p[rows][:, None].float() * kept.sum(-1, keepdim=True)) | (rank == 0)
        filtered = torch.zeros_like(sorted_p).scatter_(1, idx, sorted_p * keep)
        probs[rows] = filtered / filtered.sum(-1, keepdim=True)
    if bool(greedy.any()):
        rows = torch.nonzero(greedy, as_tuple=True)[0]
        probs[rows] = torch.nn.functional.one_hot(row_argmax(logits[rows]), v).float()
    return probs


def _check_logits(batch: PackedVerifyBatch, logits: Tensor, name: str) -> None:
    if logits.ndim != 2 or logits.shape[0] != batch.total_nodes:
        raise ValueError(f"{name} must be (N_tot={batch.total_nodes}, V), got shape {tuple(logits.shape)}")


@dataclass
class AcceptedPaths:
    """Each request's accepted path in fixed shapes, computed where the logits are without reading the device: one
    read of these three tensors brings a step's verification to the host, where `flatten` makes the
    `VerifyResult`."""

    # (B, W) int64: flat node indices of the root path, root first, -1 padded (W: the tree's levels or more)
    nodes: Tensor
    # (B, W) int64: the accepted draft tokens, then the bonus token (past it: padding)
    tokens: Tensor
    # (B,) int64: tokens emitted (accepted drafts + 1)
    counts: Tensor

    def flatten(self) -> VerifyResult:
        on_path = torch.arange(self.nodes.shape[1], device=self.nodes.device)[None, :] < self.counts[:, None]
        cu = torch.zeros(self.counts.numel() + 1, dtype=torch.long, device=self.counts.device)
        cu[1:] = torch.cumsum(self.counts, 0)
        return VerifyResult(self.nodes[on_path], self.tokens[on_path], cu)


def _paths(batch: PackedVerifyBatch, last_node: Tensor, bonus: Tensor, max_depth: int | None) -> AcceptedPaths:
    """Each request's root path to `last_node` (B,) plus its `bonus` (B,) token."""
    path = ancestor_paths(last_node, batch.global_parents, batch.node_depths.long(), max_depth)  # (B, D+1)
    # token at position t: node t+1's token while the path goes on, then the bonus
    next_node = torch.cat([path[:, 1:], torch.full_like(path[:, :1], -1)], dim=1)
    tokens = torch.where(next_node >= 0, batch.input_ids[next_node.clamp(min=0)], bonus[:, None])
    return AcceptedPaths(path, tokens, batch.node_depths.long()[last_node] + 1)


def verify_greedy(batch: PackedVerifyBatch, target_logits: Tensor) -> VerifyResult:
    """Greedy acceptance over the packed batch. target_logits (N_tot, V): the target's logits at every node."""
    return verify_paths(batch, target_logits).flatten()


def _accept_predicted(batch: PackedVerifyBatch, pred: Tensor, max_depth: int | None) -> AcceptedPaths:
    """The deepest root path whose every node equals `pred` (N_tot,) at its parent (ties: the lowest node index),
    plus pred at its last node as the bonus token. max_depth: the tree's deepest depth where the caller knows it
    (then nothing here reads the device)."""
    gp = batch.global_parents
    depths = batch.node_depths.long()
    if max_depth is None:
        max_depth = int(depths.max()) if depths.numel() else 0
    root = gp < 0
    parent = gp.clamp(min=0)
    match = root | (batch.input_ids == pred[parent])
    ok = match
    for _ in range(max_depth):  # on an accepted path iff it and its parent are: depth d is settled after d rounds
        ok = match & (root | ok[parent])
    n = batch.total_nodes
    idx = torch.arange(n, device=pred.device)
    key = torch.where(ok, depths * (n + 1) + (n - idx), torch.full_like(idx, -1))  # deepest, then lowest index
    best_key = torch.full((batch.batch_size,), -1, dtype=torch.long, device=pred.device)
    best_key = best_key.scatter_reduce(0, batch.request_ids, key, reduce="amax", include_self=True)
    last = n - best_key % (n + 1)  # (B,)
    return _paths(batch, last, pred[last], max_depth)


def depth_uniforms(batch: PackedVerifyBatch, generators: Sequence[torch.Generator | None] | None) -> Tensor:
    """(B, D+1) float64: request i's first (its own depth + 1) draws from its generator, one per tree depth
    (positions pos_i, pos_i + 1, ...); padded with 0.5. For callers without a per-position stream (tests)."""
    b = batch.batch_size
    if generators is not None and len(generators) != b:
        raise ValueError(f"generators has {len(generators)} entries for {b} requests")
    depth = batch.node_depths.long().cpu()
    own = torch.zeros(b, dtype=torch.long).scatter_reduce(0, batch.request_ids.cpu(), depth, "amax", include_self=True)
    out = torch.full((b, int(depth.max()) + 1), 0.5, dtype=torch.float64)
    for i in range(b):
        n = int(own[i]) + 1
        out[i, :n] = torch.rand(n, generator=None if generators is None else generators[i], dtype=torch.float64)
    return out


def _children_table(batch: PackedVerifyBatch) -> Tensor:
    """(N_tot, C_max) flat child indices of every node in index order, -1 padded."""
    gp = batch.global_parents
    n = batch.total_nodes
    children = torch.nonzero(gp >= 0, as_tuple=True)[0]  # ascending
    if children.numel() == 0:
        return torch.full((n, 1), -1, dtype=torch.long, device=gp.device)
    rank = segment_rank(gp, children, n)
    table = torch.full((n, int(rank.max()) + 1), -1, dtype=torch.long, device=gp.device)
    table[gp[children], rank] = children
    return table


def _normalize(p: Tensor) -> Tensor:
    return p / p.sum(-1, keepdim=True).clamp(min=torch.finfo(p.dtype).tiny)


def _sample(p: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draw of one token per row of p (R, V) with uniforms u (R,); never a zero-probability token."""
    cdf = torch.cumsum(p.double(), dim=-1)
    return torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True).squeeze(1).clamp(max=p.shape[1] - 1)


def _uniforms(batch: PackedVerifyBatch, generators: Sequence[torch.Generator | None] | None) -> Tensor:
    """(N_tot,) uniforms: N_i per request from its own generator (the sampled-drafts rule)."""
    counts = batch.generation_lengths.tolist()
    if generators is not None and len(generators) != len(counts):
        raise ValueError(f"generators has {len(generators)} entries for {len(counts)} requests")
    draws = [
        torch.rand(n, generator=None if generators is None else generators[i]) for i, n in enumerate(counts)
    ]
    return torch.cat(draws).to(batch.input_ids.device)


def _residual_walk(batch: PackedVerifyBatch, p_all: Tensor, draft_probs: Tensor, u: Tensor, roots: Tensor):
    """Each request's walk down its tree (module docstring): at each node its children are tested in order
    against the residual target distribution; an accepted child moves the walk, a rejected one leaves the
    residuals p - q (renormalised). Returns (the node each walk ended at (B,), the residual there (B, V))."""
    table = _children_table(batch)  # (N_tot, C)
    b = batch.batch_size
    cur = roots.clone()
    p_res = p_all[cur].clone()  # (B, V)
    q_res = None if draft_probs is None else draft_probs[cur].float().clone()
    done = torch.zeros(b, dtype=torch.bool, device=cur.device)
    rows_all = torch.arange(b, device=cur.device)
    for _ in range(int(batch.node_depths.max()) + 1):
        moved = torch.zeros_like(done)
        for c in range(table.shape[1]):
            child = table[cur, c]  # (B,)
            test = ~done & ~moved & (child >= 0)
            if not bool(test.any()):
                continue
            r = rows_all[test]
            x_node = child[r]
            x = batch.input_ids[x_node]
            px = p_res[r, x]
            ratio = px if q_res is None else (px / q_res[r, x].clamp(min=torch.finfo(torch.float32).tiny)).clamp(max=1)
            acc = u[x_node] < ratio
            rej_rows, rej_tok = r[~acc], x[~acc]
            if rej_rows.numel():
                if q_res is None:
                    p_res[rej_rows, rej_tok] = 0.0
                    p_res[rej_rows] = _normalize(p_res[rej_rows])
                else:
                    p_res[rej_rows] = _normalize((p_res[rej_rows] - q_res[rej_rows]).clamp(min=0))
                    q_res[rej_rows, rej_tok] = 0.0
                    q_res[rej_rows] = _normalize(q_res[rej_rows])
            acc_rows, acc_node = r[acc], x_node[acc]
            if acc_rows.numel():
                cur[acc_rows] = acc_node
                p_res[acc_rows] = p_all[acc_node]
                if q_res is not None:
                    q_res[acc_rows] = draft_probs[acc_node].float()
                moved[acc_rows] = True
        done |= ~moved
        if bool(done.all()):
            break
    return cur, p_res


def verify_sampling(
    batch: PackedVerifyBatch,
    target_logits: Tensor,
    sampling: SamplingTensors,
    generators: Sequence[torch.Generator | None] | None = None,
    draft_probs: Tensor | None = None,
    position_uniforms: Tensor | None = None,
) -> VerifyResult:
    """Lossless tree speculative sampling (module docstring).

    target_logits (N_tot, V); draft_probs (N_tot, V) or None: the processed draft distribution each node's
    children were sampled from (without replacement), None for deterministic top-k drafts. position_uniforms
    (B, >= D+1): request i's uniforms for its next positions (deterministic drafts; default `depth_uniforms`).
    """
    return _sampling_paths(batch, target_logits, sampling, generators, draft_probs, position_uniforms, None).flatten()


def _per_node(values: Tensor, req: Tensor) -> Tensor:
    """A per-request tensor read per node (where `values` is, so a device tensor is not read back)."""
    return values[req.to(values.device)]


def _sampling_paths(batch: PackedVerifyBatch, target_logits: Tensor, sampling: SamplingTensors, generators,
                    draft_probs: Tensor | None, position_uniforms: Tensor | None, max_depth: int | None) -> AcceptedPaths:
    _check_logits(batch, target_logits, "target_logits")
    b = batch.batch_size
    req = batch.request_ids
    p_all = process_logits(target_logits, _per_node(sampling.temperature, req), _per_node(sampling.top_k, req),
                           _per_node(sampling.top_p, req))
    if draft_probs is None:
        u_pos = depth_uniforms(batch, generators) if position_uniforms is None else position_uniforms
        depth = batch.node_depths.long()
        deepest = int(depth.max()) if max_depth is None else max_depth
        if u_pos.ndim != 2 or u_pos.shape[0] != b or u_pos.shape[1] <= deepest:
            raise ValueError(f"position_uniforms must be (B={b}, >= {deepest + 1}), got {tuple(u_pos.shape)}")
        u = u_pos.to(p_all.device)[req, depth]  # (N_tot,) node n's uniform is its position's
        return _accept_predicted(batch, _sample(p_all, u), max_depth)
    _check_logits(batch, draft_probs, "draft_probs")
    u = _uniforms(batch, generators)  # (N_tot,)
    roots = batch.cu_num_nodes[:-1].long()  # (B,)
    cur, p_res = _residual_walk(batch, p_all, draft_probs, u, roots)
    # A residual can lose all its mass to rounding (the drafts covered p up to float error, e.g. a draft equal to
    # the target); sampling from nothing would return an arbitrary id, so those rows fall back to the target's
    # distribution at the node.
    empty = ~(p_res.sum(-1) > 0)
    if bool(empty.any()):
        p_res[empty] = p_all[cur[empty]]
    bonus = _sample(p_res, u[roots])
    return _paths(batch, cur, bonus, max_depth)


def verify_paths(
    batch: PackedVerifyBatch,
    target_logits: Tensor,
    sampling: SamplingTensors | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    draft_probs: Tensor | None = None,
    position_uniforms: Tensor | None = None,
    max_depth: int | None = None,
    acceptor: Callable[[PackedVerifyBatch, Tensor, int | None], AcceptedPaths] | None = None,
    reader: Callable[[PackedVerifyBatch, Tensor, int | None], AcceptedPaths | None] | None = None,
) -> AcceptedPaths:
    """`verify`'s accepted paths in fixed shapes (`AcceptedPaths`): greedy without `sampling`, else the sampling
    rule (greedy rows one-hot). max_depth: the tree's deepest depth, known on the host (it must not be below the
    real one; position_uniforms then need max_depth + 1 columns): greedy verification then never reads the device,
    and sampling with deterministic drafts reads it only in `process_logits`' two checks (whether any row needs
    top-k / top-p filtering, whether any is greedy). The runtime reads the result once. acceptor(batch, pred,
    max_depth): greedy acceptance of the target's top-1 `pred` (default `_accept_predicted`; on the CPU the runtime
    passes the host library's, `kernels.host_greedy_acceptor`, of which `_accept_predicted` is the oracle).
    reader(batch, logits, max_depth): greedy acceptance reading the logits itself, or None where it does not apply
    (then the argmax of every row and `acceptor`); the runtime passes `kernels.host_greedy_logits_acceptor` on the
    CPU (every step but a plain one of many rows), which reads a row's top-1 only where the walk needs it."""
    if sampling is None:
        _check_logits(batch, target_logits, "target_logits")
        if reader is not None:
            paths = reader(batch, target_logits, max_depth)
            if paths is not None:
                return paths
        return (acceptor or _accept_predicted)(batch, row_argmax(target_logits), max_depth)
    return _sampling_paths(batch, target_logits, sampling, generators, draft_probs, position_uniforms, max_depth)


def verify(
    batch: PackedVerifyBatch,
    target_logits: Tensor,
    sampling: SamplingTensors | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    draft_probs: Tensor | None = None,
    position_uniforms: Tensor | None = None,
) -> VerifyResult:
    """`verify_greedy` when every request is greedy, else `verify_sampling` (greedy rows become one-hot): the flat
    result of `verify_paths`."""
    greedy = sampling is None or sampling.all_greedy
    return verify_paths(batch, target_logits, None if greedy else sampling, generators, draft_probs,
                        position_uniforms).flatten()
