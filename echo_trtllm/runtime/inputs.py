"""Build `ForwardBatch`es: chains (prompt prefill, pending tokens) and trees (verification, draft levels).

Every new token t of request b sees the cache positions p < prefix_len[b] (the request's committed context) plus
an explicit list of further positions (its chain predecessors or its tree ancestors, itself included). Padded
query rows see position 0 only, so no SDPA row is fully masked; their outputs are never read.

Example: one request with 3 committed tokens, a tree [r, a, b] (parents [-1, 0, 0]) written at positions 3, 4, 5:
rows see {0,1,2} plus r: {3}; a: {3, 4}; b: {3, 5}.
"""

from __future__ import annotations

import torch
from torch import Tensor

from echo_trtllm.core.pack import PackedVerifyBatch
from echo_trtllm.models.llama import ForwardBatch

__all__ = ["make_batch", "chain_batch", "tree_batch"]


def make_batch(
    input_ids: Tensor,
    token_request: Tensor,
    position_ids: Tensor,
    write_pos: Tensor,
    slots: Tensor,
    prefix_len: Tensor,
    visible: Tensor,
    logits_index: Tensor | None = None,
) -> ForwardBatch:
    """General builder. token_request (T,) must be non-decreasing; visible (T, E) cache positions, -1 padded."""
    dev = input_ids.device
    b = slots.numel()
    counts = torch.bincount(token_request, minlength=b)
    token_local = torch.arange(input_ids.numel(), device=dev) - (torch.cumsum(counts, 0) - counts)[token_request]
    n_max = max(int(counts.max()), 1)
    l_max = max(int(write_pos.max()) + 1 if write_pos.numel() else 1, int(prefix_len.max()) if b else 1, 1)
    mask = (torch.arange(l_max, device=dev)[None, None, :] < prefix_len[:, None, None]).expand(b, n_max, l_max).clone()
    valid = visible >= 0
    rows = torch.arange(input_ids.numel(), device=dev)[:, None].expand_as(visible)[valid]
    mask[token_request[rows], token_local[rows], visible[valid]] = True
    padded = torch.arange(n_max, device=dev)[None, :] >= counts[:, None]  # (B, N_max)
    mask[padded] = False
    mask[..., 0] |= padded
    return ForwardBatch(input_ids, position_ids, slots, token_request, token_local, write_pos, mask, logits_index)


def chain_batch(chains: list[Tensor], starts: Tensor, slots: Tensor, logits: str = "last") -> ForwardBatch:
    """Causal chains: request b's tokens go to positions starts[b], starts[b]+1, ... (prefill, pending tokens).

    logits: "last" (each chain's last token), "all" or "none".
    """
    dev = slots.device
    lengths = torch.tensor([c.numel() for c in chains], device=dev)
    if bool((lengths == 0).any()):
        raise ValueError("chain_batch needs non-empty chains")
    ids = torch.cat([c.to(dev) for c in chains]).long()
    req = torch.repeat_interleave(torch.arange(len(chains), device=dev), lengths)
    local = torch.arange(ids.numel(), device=dev) - (torch.cumsum(lengths, 0) - lengths)[req]
    pos = starts.to(dev).long()[req] + local
    n_max = int(lengths.max())
    # Chain predecessors and self: positions starts[b] .. pos[t].
    offs = torch.arange(n_max, device=dev)[None, :]
    visible = torch.where(offs <= local[:, None], starts.to(dev).long()[req][:, None] + offs, torch.full_like(offs, -1))
    index = {"last": torch.cumsum(lengths, 0) - 1, "all": None, "none": torch.zeros(0, dtype=torch.long, device=dev)}
    if logits not in index:
        raise ValueError(f"logits must be 'last', 'all' or 'none', got {logits!r}")
    return make_batch(ids, req, pos, pos, slots, starts.to(dev).long(), visible, index[logits])


def tree_batch(packed: PackedVerifyBatch, context_lengths: Tensor, slots: Tensor) -> ForwardBatch:
    """The packed Super-Tree, written after each request's context (node j of request b at ctx_b + j)."""
    dev = slots.device
    ctx = context_lengths.to(dev).long()
    req = packed.request_ids.to(dev)
    local = torch.arange(packed.total_nodes, device=dev) - packed.cu_num_nodes.to(dev).long()[:-1][req]
    write = ctx[req] + local
    path = packed.path_nodes().to(dev)  # (N_tot, D+1) flat ancestors
    starts = packed.cu_num_nodes.to(dev).long()[:-1][req]
    visible = torch.where(path >= 0, ctx[req][:, None] + path - starts[:, None], torch.full_like(path, -1))
    return make_batch(packed.input_ids.to(dev), req, ctx[req] + packed.node_depths.to(dev).long(), write, slots, ctx,
                      visible)
