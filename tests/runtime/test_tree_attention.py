"""The target verifies a packed Super-Tree through TensorRT-LLM's contract tensors (runtime.inputs.tree_batch), the
path every verification step runs: against plain causal forwards of each node's root path, in both mask layouts,
and with one bit of spec_decoding_packed_mask flipped."""

import pytest
import torch

from echo_trtllm.core.pack import pack, words_per_row
from echo_trtllm.core.tree import SuperTree
from echo_trtllm.runtime.inputs import chain_batch, tree_batch
from tests.helpers import naive_ancestors, random_parents


def _setup(target, batch_size: int, seed: int):
    """Random trees over random contexts; the contexts prefilled into slots 0..B-1 of a fresh cache."""
    gen = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    parents = [random_parents(int(torch.randint(1, 40, (1,), generator=gen)), gen) for _ in range(batch_size)]
    tree = SuperTree.from_parents(parents, [torch.randint(0, vocab, (p.numel(),), generator=gen) for p in parents])
    ctx = torch.randint(1, 12, (batch_size,), generator=gen)
    contexts = [torch.randint(0, vocab, (int(c),), generator=gen) for c in ctx]
    return parents, tree, ctx, contexts, _prefill(target, contexts)


def _prefill(target, contexts):
    """A fresh cache with context b prefilled into slot b."""
    b = len(contexts)
    cache = target.allocate_cache(b, 64)
    target(chain_batch(contexts, torch.zeros(b, dtype=torch.long), torch.arange(b), "none"), cache)
    return cache


def _assert_each_node_equals_its_root_path(target, logits, tree, parents, contexts):
    """Every node's verification logits == a causal forward of its request's context and the node's root path."""
    ref_cache = target.allocate_cache(1, 64)
    for node in range(tree.total_nodes):
        i = int(tree.request_ids[node])
        start = int(tree.cu_num_nodes[i])
        path = [start + a for a in naive_ancestors(parents[i].tolist(), node - start)]
        chain = torch.cat([contexts[i], tree.token_ids[path]])
        ref = target(chain_batch([chain], torch.tensor([0]), torch.tensor([0])), ref_cache)[0]
        torch.testing.assert_close(logits[node], ref, rtol=1e-4, atol=1e-4, msg=f"node {node} of request {i}")


def _verify(target, packed, ctx, cache):
    return target(tree_batch(packed, ctx, torch.arange(ctx.numel())), cache)


@pytest.mark.parametrize("batch_size", [1, 4])
def test_tree_verification_equals_causal_forward_of_each_root_path(default_pair, batch_size):
    target = default_pair[0]
    parents, tree, ctx, contexts, cache = _setup(target, batch_size, 10 + batch_size)
    packed = pack(tree, ctx)
    logits = _verify(target, packed, ctx, cache)  # (N_tot, V)
    assert logits.shape == (tree.total_nodes, target.config.vocab_size)
    _assert_each_node_equals_its_root_path(target, logits, tree, parents, contexts)


def test_fixed_stride_layout_gives_the_same_logits(default_pair):
    """pack(max_generation_length=S): position_offsets (B, S) and packed_mask (N_tot, ceil(S/32)), as an engine
    built with max_draft_len = S - 1 expects them; the target reads either layout the same way."""
    target = default_pair[0]
    _, tree, ctx, _, cache = _setup(target, 3, 7)
    compact = pack(tree, ctx)
    stride = 70
    padded = pack(tree, ctx, max_generation_length=stride)
    assert padded.position_offsets.shape == (3, stride)
    assert padded.packed_mask.shape == (tree.total_nodes, words_per_row(stride))
    n = compact.max_nodes
    assert torch.equal(padded.position_offsets[:, :n], compact.position_offsets)
    assert not padded.position_offsets[:, n:].any()
    assert torch.equal(padded.packed_mask[:, : compact.packed_mask.shape[1]], compact.packed_mask)
    assert not padded.packed_mask[:, compact.packed_mask.shape[1]:].any()
    torch.testing.assert_close(_verify(target, padded, ctx, cache), _verify(target, compact, ctx, cache), rtol=0, atol=0)
    with pytest.raises(ValueError, match="max_generation_length"):
        pack(tree, ctx, max_generation_length=n - 1)


def test_flipping_one_packed_mask_bit_changes_that_row_and_its_descendants_only(default_pair):
    target = default_pair[0]
    torch.manual_seed(0)
    parents = [torch.tensor([-1, 0, 0, 1, 1, 2]), torch.tensor([-1, 0, 1])]
    tree = SuperTree.from_parents(parents, [torch.randint(0, target.config.vocab_size, (p.numel(),)) for p in parents])
    ctx = torch.tensor([5, 3])
    cache = target.allocate_cache(2, 32)
    contexts = [torch.randint(0, target.config.vocab_size, (int(c),)) for c in ctx]
    target(chain_batch(contexts, torch.zeros(2, dtype=torch.long), torch.arange(2), "none"), cache)
    packed = pack(tree, ctx)
    before = _verify(target, packed, ctx, cache)
    # node 3 of request 0 (parent 1) is made to see its parent's sibling, node 2: bit 2 of row 3
    packed.packed_mask[3, 0] |= 1 << 2
    after = _verify(target, packed, ctx, cache)
    changed = (after - before).abs().amax(dim=1) > 1e-4
    assert changed.tolist() == [False, False, False, True, False, False, False, False, False]
    # clearing an ancestor bit instead: node 5 (parent 2) stops seeing node 2, as does nothing else
    packed = pack(tree, ctx)
    packed.packed_mask[5, 0] &= ~(1 << 2)
    changed = (_verify(target, packed, ctx, cache) - before).abs().amax(dim=1) > 1e-4
    assert changed.tolist() == [False, False, False, False, False, True, False, False, False]
    # a bit in request 1's row 2 (its depth-2 node stops seeing its parent, node 1): only that row
    packed = pack(tree, ctx)
    packed.packed_mask[6 + 2, 0] &= ~(1 << 1)
    changed = (_verify(target, packed, ctx, cache) - before).abs().amax(dim=1) > 1e-4
    assert changed.tolist() == [False] * 8 + [True]


def test_a_ragged_batch_equals_each_root_paths_causal_forward(default_pair):
    """Requests with one new token and requests with trees of different sizes in one batch (ECHO under load): every
    node's logits equal a causal forward of its root path."""
    target = default_pair[0]
    gen = torch.Generator().manual_seed(3)
    vocab = target.config.vocab_size
    sizes = [1, 6, 1, 3, 1]
    parents = [random_parents(n, gen) if n > 1 else torch.tensor([-1]) for n in sizes]
    tree = SuperTree.from_parents(parents, [torch.randint(0, vocab, (p.numel(),), generator=gen) for p in parents])
    ctx = torch.tensor([9, 4, 30, 7, 2])
    contexts = [torch.randint(0, vocab, (int(c),), generator=gen) for c in ctx]
    logits = _verify(target, pack(tree, ctx), ctx, _prefill(target, contexts))
    _assert_each_node_equals_its_root_path(target, logits, tree, parents, contexts)


@pytest.mark.parametrize("slots", [[0, 1, 2, 3], [2, 0, 3, 1], [3, 4, 5, 6], [0, 2, 5, 7]],
                         ids=["in order", "a permuted block", "an offset block", "slots with gaps"])
def test_any_slot_layout_verifies_like_the_causal_forward(default_pair, slots):
    """Attention reads a block of consecutive slots in place (in any order) and gathers slots with gaps
    (ForwardBatch.slot_block): every layout gives each node its root path's causal logits."""
    target = default_pair[0]
    parents, tree, ctx, contexts, _ = _setup(target, 4, 31)
    slot_ids = torch.tensor(slots)
    cache = target.allocate_cache(8, 64)
    target(chain_batch(contexts, torch.zeros(4, dtype=torch.long), slot_ids, "none"), cache)
    batch = tree_batch(pack(tree, ctx), ctx, slot_ids)
    block = batch.slot_block()
    assert (block is None) == (slots == [0, 2, 5, 7])
    assert block is None or (block[1] is None) == (slots in ([0, 1, 2, 3], [3, 4, 5, 6]))
    logits = target(batch, cache)
    _assert_each_node_equals_its_root_path(target, logits, tree, parents, contexts)
