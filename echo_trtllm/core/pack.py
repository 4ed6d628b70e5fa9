"""Flatten & pack: the selected Super-Tree as one dense verification batch in TensorRT-LLM's layout.

TensorRT-LLM's GPT attention plugin verifies draft trees from three tensors (remove-input-padding form),
which `pack` produces exactly:

    spec_decoding_generation_lengths [B]         int32  N_i, nodes of request i (root included)
    spec_decoding_position_offsets   [B, N_max]  int32  depth of node j of request i; 0-padded
    spec_decoding_packed_mask        [N_tot, W]  int32  row r: bit b of word w set <=> node r attends
                                                        node 32*w + b of its own request (LSB first)

Worked example (DESIGN.md §4): one request, nodes [r, a, b, c], parents [-1, 0, 0, 1]::

    generation_lengths = [4]
    position_offsets   = [[0, 1, 1, 2]]
    packed_mask        = [[0b0001], [0b0011], [0b0101], [0b1011]] = [[1], [3], [5], [11]]

Bit 31 of a word is the int32 sign bit: a node attending node 31 has a negative word, as in TensorRT-LLM.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

import torch
from torch import Tensor

from .tree import SuperTree, global_parent_ids, nodes_by_depth, request_ids_from_cu

__all__ = ["PackedVerifyBatch", "pack", "pack_from_parents", "unpack_mask", "words_per_row"]


def words_per_row(n_max: int) -> int:
    """W = ceil(N_max / 32)."""
    return max(1, (n_max + 31) // 32)


def _to_int32_words(words: Tensor) -> Tensor:
    """Reinterpret unsigned 32-bit values held in int64 as two's-complement int32."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@dataclass
class PackedVerifyBatch:
    """One target forward's worth of tree tokens for the whole batch."""

    # (N_tot,) int64: token fed at each node
    input_ids: Tensor
    # (N_tot,) int64: absolute position = context length (tokens already in the KV cache) + depth
    position_ids: Tensor
    # (N_tot,) int32: parent within the request, -1 for the root
    parents: Tensor
    # (N_tot,) int32: depth of each node (flat form of position_offsets)
    node_depths: Tensor
    # (B+1,) int32
    cu_num_nodes: Tensor
    # (B,) int32 — TensorRT-LLM spec_decoding_generation_lengths
    generation_lengths: Tensor
    # (B, N_max) int32 — TensorRT-LLM spec_decoding_position_offsets
    position_offsets: Tensor
    # (N_tot, W) int32 — TensorRT-LLM spec_decoding_packed_mask
    packed_mask: Tensor

    @property
    def batch_size(self) -> int:
        return self.generation_lengths.numel()

    @property
    def total_nodes(self) -> int:
        return self.input_ids.numel()

    @property
    def max_nodes(self) -> int:
        return self.position_offsets.shape[1]

    @cached_property
    def request_ids(self) -> Tensor:
        """(N_tot,) int64."""
        return request_ids_from_cu(self.cu_num_nodes, self.input_ids.numel())

    @cached_property
    def global_parents(self) -> Tensor:
        """(N_tot,) int64 flat parent index, -1 for roots."""
        return global_parent_ids(self.parents, self.cu_num_nodes)

    def to(self, device: torch.device | str) -> "PackedVerifyBatch":
        return PackedVerifyBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def pack(tree: SuperTree, context_lengths: Tensor | None = None,
         max_generation_length: int | None = None) -> PackedVerifyBatch:
    """Flatten the (selected) Super-Tree into a `PackedVerifyBatch`.

    context_lengths (B,): tokens of each request already in the target's KV cache; the root sits at that
    position. Without it, position_ids are the depths.
    max_generation_length: the engine's fixed stride (TensorRT-LLM's max_draft_len + 1): position_offsets become
    (B, max_generation_length) and packed_mask (N_tot, ceil(max_generation_length / 32)), zero-padded, as an
    engine built with that max_draft_len expects them. None: the stride is this batch's largest tree.
    """
    b = tree.batch_size
    dev = tree.token_ids.device
    n_i = tree.num_nodes  # (B,)
    n_max = int(n_i.max())
    if max_generation_length is not None:
        if isinstance(max_generation_length, bool) or not isinstance(max_generation_length, int) \
                or max_generation_length < n_max:
            raise ValueError(f"max_generation_length must be an int >= the largest tree ({n_max} nodes), "
                             f"got {max_generation_length!r}")
        n_max = max_generation_length
    w = words_per_row(n_max)
    req = tree.request_ids  # (N_tot,)
    starts = tree.cu_num_nodes[:-1][req]  # (N_tot,)
    local = torch.arange(tree.total_nodes, device=dev) - starts  # (N_tot,) index within the request

    # Own bit, then OR in the parent's row level by level: a row holds the node and all its ancestors.
    words64 = torch.zeros(tree.total_nodes, w, dtype=torch.long, device=dev)  # (N_tot, W) unsigned values
    words64[torch.arange(tree.total_nodes, device=dev), local // 32] = torch.ones_like(local) << (local % 32)
    gp = tree.global_parents
    for at in nodes_by_depth(tree.depths)[1:]:
        words64[at] |= words64[gp[at]]

    position_offsets = torch.zeros(b, n_max, dtype=torch.int32, device=dev)
    position_offsets[req, local] = tree.depths.to(torch.int32)
    if context_lengths is None:
        position_ids = tree.depths.clone()
    else:
        if context_lengths.shape != (b,):
            raise ValueError(f"context_lengths must have shape ({b},), got {tuple(context_lengths.shape)}")
        position_ids = context_lengths.to(dev).long()[req] + tree.depths
    return PackedVerifyBatch(
        input_ids=tree.token_ids.clone(),
        position_ids=position_ids,
        parents=tree.parents.to(torch.int32),
        node_depths=tree.depths.to(torch.int32),
        cu_num_nodes=tree.cu_num_nodes.to(torch.int32),
        generation_lengths=n_i.to(torch.int32),
        position_offsets=position_offsets,
        packed_mask=_to_int32_words(words64),
    )


def pack_from_parents(parents: list[Tensor]) -> PackedVerifyBatch:
    """Pack a batch given only each request's parent list (int tensor, -1 for the root, parent before child).

    >>> pack_from_parents([torch.tensor([-1, 0, 0, 1])]).packed_mask.tolist()
    [[1], [3], [5], [11]]
    """
    return pack(SuperTree.from_parents(parents))


def unpack_mask(packed_mask: Tensor, n_max: int) -> Tensor:
    """(N_tot, W) int32 words -> (N_tot, n_max) bool, LSB first."""
    if packed_mask.ndim != 2:
        raise ValueError(f"packed_mask must be 2-D (N_tot, W), got shape {tuple(packed_mask.shape)}")
    words = packed_mask.long() & 0xFFFFFFFF  # (N_tot, W) unsigned
    cols = torch.arange(n_max, device=packed_mask.device)
    return ((words[:, cols // 32] >> (cols % 32)) & 1).bool()
