"""The batch builders' direct constructions against the general one (`make_batch`), and the layouts they state."""

import itertools
import random

import pytest
import torch

from echo_trtllm.models.llama import ForwardBatch, dense_layout
from echo_trtllm.runtime.inputs import chain_batch, level_batch, make_batch


def chain_batch_by_make_batch(chains, starts, slots, logits):
    """The chains through the general builder: each token sees its chain's positions up to its own (visible) and
    the request's prefix before starts[b]."""
    sizes = [len(c) for c in chains]
    lengths = torch.tensor(sizes)
    ids = torch.tensor(list(itertools.chain.from_iterable(chains)), dtype=torch.long)
    req = torch.repeat_interleave(torch.arange(len(chains)), lengths)
    local = torch.arange(ids.numel()) - (torch.cumsum(lengths, 0) - lengths)[req]
    pos = starts[req] + local
    offs = torch.arange(max(sizes))[None, :]
    visible = torch.where(offs <= local[:, None], starts[req][:, None] + offs, torch.full_like(offs, -1))
    index = {"last": torch.cumsum(lengths, 0) - 1, "all": None, "none": torch.zeros(0, dtype=torch.long)}[logits]
    return make_batch(ids, req, pos, pos, slots, starts, visible, index)


def recomputed_dense(batch: ForwardBatch) -> bool:
    fresh = ForwardBatch(batch.input_ids, batch.position_ids, batch.slots, batch.token_request, batch.token_local,
                         batch.write_pos, batch.attn_mask, batch.logits_index)
    return fresh.dense()


@pytest.mark.parametrize("sizes", [[1], [3], [2, 2, 2], [1, 4, 2], [5, 1], [3, 3, 1, 3]])
@pytest.mark.parametrize("logits", ["last", "all", "none"])
def test_chain_batch_is_the_general_builders_batch(sizes, logits):
    rng = random.Random(sum(sizes) * 7 + len(logits))
    chains = [[rng.randrange(100) for _ in range(n)] for n in sizes]
    starts = torch.tensor([rng.randrange(0, 9) for _ in sizes])
    slots = torch.tensor(rng.sample(range(8), len(sizes)))
    got = chain_batch(chains, starts, slots, logits=logits)
    want = chain_batch_by_make_batch(chains, starts, slots, logits)
    for name in ("input_ids", "position_ids", "slots", "token_request", "token_local", "write_pos", "attn_mask"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (got.logits_index is None) == (want.logits_index is None)
    if want.logits_index is not None:
        assert torch.equal(got.logits_index, want.logits_index)
    assert got.dense() == recomputed_dense(want) == (len(set(sizes)) == 1)


@pytest.mark.parametrize("sizes", [[2, 2], [1, 3, 2]])
def test_tensor_chains_and_int32_starts_make_the_same_batch(sizes):
    rng = random.Random(len(sizes))
    chains = [[rng.randrange(100) for _ in range(n)] for n in sizes]
    starts = torch.tensor([rng.randrange(0, 9) for _ in sizes])
    slots = torch.arange(len(sizes))
    want = chain_batch_by_make_batch(chains, starts, slots, "last")
    got = chain_batch([torch.tensor(c, dtype=torch.int32) for c in chains], starts.int(), slots)
    for name in ("input_ids", "position_ids", "token_request", "token_local", "write_pos", "attn_mask", "logits_index"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_chain_batch_takes_tensor_chains_and_refuses_bad_ones():
    a = chain_batch([torch.tensor([4, 5]), torch.tensor([6])], torch.tensor([2, 0]), torch.tensor([1, 0]))
    b = chain_batch([[4, 5], [6]], torch.tensor([2, 0]), torch.tensor([1, 0]))
    assert torch.equal(a.attn_mask, b.attn_mask) and torch.equal(a.input_ids, b.input_ids)
    with pytest.raises(ValueError, match="non-empty"):
        chain_batch([[1], []], torch.tensor([0, 0]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="logits must be"):
        chain_batch([[1]], torch.tensor([0]), torch.tensor([0]), logits="first")


@pytest.mark.parametrize("r, w", [(1, 1), (1, 4), (3, 1), (3, 4)])
def test_level_batch_states_the_dense_layout_it_has(r, w):
    gen = torch.Generator().manual_seed(r * 10 + w)
    prefix = torch.randint(1, 6, (r,), generator=gen)
    pos = prefix[:, None] + 1 + torch.arange(w)
    visible = torch.cat([prefix[:, None, None].expand(r, w, 1), pos[..., None]], dim=2)
    batch = level_batch(torch.randint(0, 50, (r, w), generator=gen), pos - 1, pos, torch.arange(r), prefix, visible,
                        int(pos.max()) + 1)
    assert batch.dense() and recomputed_dense(batch)
    assert torch.equal(batch.token_request, torch.arange(r).repeat_interleave(w))
    assert torch.equal(batch.token_local, torch.arange(w).repeat(r))


@pytest.mark.parametrize("b, n", [(0, 3), (2, 0), (1, 1), (1, 5), (4, 1), (4, 3)])
def test_dense_layout_is_the_repeated_aranges(b, n):
    req, local = dense_layout(b, n, "cpu")
    assert torch.equal(req, torch.arange(b).repeat_interleave(n))
    assert torch.equal(local, torch.arange(n).repeat(b))


def test_a_batch_out_of_order_is_not_dense():
    batch = make_batch(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 0, 1, 1]), torch.tensor([3, 4, 3, 4]),
                       torch.tensor([3, 4, 3, 4]), torch.tensor([0, 1]), torch.tensor([3, 3]),
                       torch.tensor([[3], [4], [3], [4]]))
    assert batch.dense()
    swapped = ForwardBatch(batch.input_ids, batch.position_ids, batch.slots, batch.token_request,
                           torch.tensor([1, 0, 0, 1]), batch.write_pos, batch.attn_mask)
    assert not swapped.dense()
