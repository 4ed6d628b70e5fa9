"""Build `ForwardBatch`es: chains (prompt prefill, pending tokens) and trees (verification, draft levels).

Every new token t of request b sees the cache positions p < prefix_len[b] (the request's committed context) plus
an explicit list of further positions (its chain predecessors or its tree ancestors, itself included). Padded
query rows see position 0 only, so no SDPA row is fully masked; their outputs are never read.

Example: one request with 3 committed tokens, a tree [r, a, b] (parents [-1, 0, 0]) written at positions 3, 4, 5:
rows see {0,1,2} plus r: {3}; a: {3, 4}; b: {3, 5}. For the verification tree those sets come from the packed
mask's bits (r: 0b001, a: 0b011, b: 0b101), the only input the target reads about the tree's shape.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from echo_trtllm.core.pack import PackedVerifyBatch, unpack_mask
from echo_trtllm.models.llama import ForwardBatch, dense_layout

__all__ = ["make_batch", "chain_batch", "sequence_logits", "level_batch", "tree_batch"]


def _pad_rows(mask: Tensor, counts: Tensor) -> None:
    """Padded query rows (index >= their request's count) see cache position 0 only (module docstring)."""
    padded = torch.arange(mask.shape[1], device=mask.device)[None, :] >= counts[:, None]  # (B, N_max)
    mask[padded] = False
    mask[..., 0] |= padded


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
    _pad_rows(mask, counts)
    return ForwardBatch(input_ids, position_ids, slots, token_request, token_local, write_pos, mask, logits_index)


def chain_batch(chains: list[Tensor] | list[list[int]], starts: Tensor, slots: Tensor,
                logits: str = "last") -> ForwardBatch:
    """Causal chains: request b's tokens go to positions starts[b], starts[b]+1, ... (prefill, pending tokens).
    chains: 1-D tensors, or lists of token ids (then one tensor is made for all of them, not one per request).

    logits: "last" (each chain's last token), "all" or "none".

    Built directly rather than through `make_batch` (the same batch, tests/runtime/test_inputs.py): token t of a
    chain sees every position up to its own, p <= pos[t], and a padded row position 0 only, so the mask is one
    comparison; chains of one length are the dense layout (`ForwardBatch.laid_out_dense`). A step's pending
    chains are built at every step, where make_batch runs two dozen small operations.
    """
    if logits not in ("last", "all", "none"):
        raise ValueError(f"logits must be 'last', 'all' or 'none', got {logits!r}")
    dev = slots.device
    sizes = [len(c) for c in chains]
    if 0 in sizes:
        raise ValueError("chain_batch needs non-empty chains")
    if all(isinstance(c, list) for c in chains):
        ids = torch.tensor(list(itertools.chain.from_iterable(chains)), dtype=torch.long, device=dev)
    else:
        ids = torch.cat([torch.as_tensor(c).to(dev) for c in chains]).long()
    b, n_max, total = len(sizes), max(sizes), sum(sizes)
    first = starts.tolist()  # host values (the mask's width); starts given on the device are read once
    l_max = max(s + n for s, n in zip(first, sizes))
    starts = starts.to(dev).long()
    even = b * n_max == total
    if even:  # the padded layout is the token order
        req, local = dense_layout(b, n_max, dev)
        padded = starts[:, None] + torch.arange(n_max, device=dev)  # (B, N_max) each token's position
        pos = padded.reshape(-1)
    else:
        lengths = torch.tensor(sizes, device=dev)
        req = torch.repeat_interleave(torch.arange(b, device=dev), lengths, output_size=total)
        local = torch.arange(total, device=dev) - (torch.cumsum(lengths, 0) - lengths)[req]
        pos = starts[req] + local
        padded = torch.zeros(b, n_max, dtype=torch.long, device=dev)  # a padded row sees position 0 only
        padded[req, local] = pos
    mask = torch.arange(l_max, device=dev) <= padded[:, :, None]  # (B, N_max, L_max)
    if logits == "last":  # only the rows asked for are made (each chain's last: its running total - 1)
        index = torch.tensor([n - 1 for n in itertools.accumulate(sizes)], dtype=torch.long, device=dev)
    else:
        index = None if logits == "all" else torch.zeros(0, dtype=torch.long, device=dev)
    batch = ForwardBatch(ids, pos, slots, req, local, pos, mask, index)
    return batch.laid_out_dense() if even else batch


@torch.no_grad()
def sequence_logits(model, ids: Tensor, logits: str = "all") -> Tensor:
    """One whole token sequence through `model` in a fresh one-slot cache, outside any runtime (scoring,
    stateless drafting): the logits of every position ("all", (T, V)) or of the last ("last", (1, V))."""
    cache = model.allocate_cache(1, ids.numel() + 1)
    zero = torch.zeros(1, dtype=torch.long)
    return model(chain_batch([ids], zero, zero, logits=logits), cache)


def level_batch(input_ids: Tensor, position_ids: Tensor, write_pos: Tensor, slots: Tensor, prefix_len: Tensor,
                visible: Tensor, max_tokens: int) -> ForwardBatch:
    """A fixed-shape draft level: W new tokens for each of R requests, (R, W) each; token (b, w) sees the positions
    p < prefix_len[b] and visible[b, w] (R, W, E; -1: none, as `make_batch`). max_tokens: the cache positions
    attention reads (> every position involved), known on the host: nothing is read back from the device."""
    r, w = input_ids.shape
    dev = input_ids.device
    cols = torch.arange(max_tokens + 1, device=dev)  # the last column takes the -1 entries and is dropped
    mask = (cols[None, None, :] < prefix_len[:, None, None]).expand(r, w, max_tokens + 1).clone()
    mask = mask.scatter_(2, torch.where(visible >= 0, visible, max_tokens), True)[..., :max_tokens]  # (R, W, L)
    token_request, token_local = dense_layout(r, w, dev)
    return ForwardBatch(input_ids.reshape(-1), position_ids.reshape(-1), slots, token_request, token_local,
                        write_pos.reshape(-1), mask).laid_out_dense()


def tree_batch(packed: PackedVerifyBatch, context_lengths: Tensor, slots: Tensor,
               max_tokens: int | None = None, float_logits: bool = True) -> ForwardBatch:
    """The packed Super-Tree as the target sees it, built from TensorRT-LLM's contract tensors alone:
    spec_decoding_generation_lengths (N_b), spec_decoding_position_offsets (depths, any stride >= max N_b),
    spec_decoding_packed_mask (row r, bit c: attends node c of its own request) and the context lengths.

    Node j of request b is written at cache position ctx_b + j with RoPE position ctx_b + offset; it sees the
    context p < ctx_b and position ctx_b + c for every set bit c. Everything runs on the slots' device.
    max_tokens: max_b (ctx_b + N_b), the keys attention reads, when the caller knows it on the host; with it no
    value is read back from the device (None: computed from the tensors). float_logits: `ForwardBatch`'s.
    """
    dev = slots.device
    ctx = context_lengths.to(dev).long()  # (B,)
    gen = packed.generation_lengths.to(dev).long()  # (B,)
    offsets = packed.position_offsets.to(dev).long()  # (B, S): S = the stride
    b, stride = offsets.shape
    bits = unpack_mask(packed.packed_mask.to(dev), stride)  # (N_tot, S)
    n_tot = packed.input_ids.numel()
    req = torch.repeat_interleave(torch.arange(b, device=dev), gen, output_size=n_tot)  # (N_tot,)
    local = torch.arange(n_tot, device=dev) - (torch.cumsum(gen, 0) - gen)[req]
    n_max = max(stride, 1)  # query rows per request: the stride (rows past N_b are padding)
    if max_tokens is None:
        max_tokens = int((ctx + gen).max()) if b else 1
    l_max = max(max_tokens, 1)
    tree = torch.zeros(b, n_max, stride, dtype=torch.bool, device=dev)  # (B, N_max, S) per-request bits
    tree[req, local] = bits
    rel = torch.arange(l_max, device=dev)[None, :] - ctx[:, None]  # (B, L): tree column of each cache position
    in_tree = (rel >= 0) & (rel < gen[:, None])
    index = rel.clamp(0, stride - 1)[:, None, :].expand(b, n_max, l_max)
    mask = (torch.gather(tree, 2, index) & in_tree[:, None, :]) | (rel < 0)[:, None, :]
    _pad_rows(mask, gen)
    write = ctx[req] + local
    return ForwardBatch(packed.input_ids.to(dev), ctx[req] + offsets[req, local], slots, req, local, write, mask,
                        float_logits=float_logits)
