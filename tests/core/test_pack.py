"""Flatten & pack against a dense mask built naively from parents. The target attending through these tensors:
tests/runtime/test_tree_attention.py."""

import pytest
import torch

from echo_trtllm.core.pack import pack, pack_from_parents, unpack_mask, words_per_row
from echo_trtllm.core.tree import SuperTree
from tests.helpers import naive_ancestors, naive_dense_mask, random_parents


def test_design_worked_example_exactly():
    batch = pack_from_parents([torch.tensor([-1, 0, 0, 1], dtype=torch.int32)])
    assert batch.generation_lengths.tolist() == [4]
    assert batch.position_offsets.tolist() == [[0, 1, 1, 2]]
    assert batch.packed_mask.tolist() == [[1], [3], [5], [11]]
    assert batch.packed_mask.dtype == torch.int32
    assert batch.generation_lengths.dtype == torch.int32
    assert batch.position_offsets.dtype == torch.int32


@pytest.mark.parametrize("batch_size", [1, 3, 64, 257])
def test_packed_mask_matches_naive_dense_mask(batch_size):
    gen = torch.Generator().manual_seed(batch_size)
    sizes = [1, 31, 32, 33, 64, 65, 97]
    parents = [random_parents(sizes[i % len(sizes)] if batch_size < 64 else int(torch.randint(1, 70, (1,), generator=gen)), gen)
               for i in range(batch_size)]
    batch = pack_from_parents(parents)
    n_max = max(p.numel() for p in parents)
    assert batch.packed_mask.shape == (sum(p.numel() for p in parents), words_per_row(n_max))
    assert batch.position_offsets.shape == (batch_size, n_max)
    dense = unpack_mask(batch.packed_mask, n_max)
    row = 0
    for i, p in enumerate(parents):
        plist = p.tolist()
        n = len(plist)
        expected = naive_dense_mask(plist)
        assert torch.equal(dense[row : row + n, :n], expected), f"request {i}"
        assert not dense[row : row + n, n:].any(), "bits beyond the request's own nodes"
        assert batch.position_offsets[i, :n].tolist() == [len(naive_ancestors(plist, j)) - 1 for j in range(n)]
        assert batch.position_offsets[i, n:].eq(0).all()
        row += n
    assert batch.generation_lengths.tolist() == [p.numel() for p in parents]
    assert batch.cu_num_nodes.tolist()[-1] == row


def test_bit_31_is_the_int32_sign_bit():
    chain = torch.tensor([-1] + list(range(40)))
    batch = pack_from_parents([chain])
    assert int(batch.packed_mask[31, 0]) == -1  # nodes 0..31 all set: 0xFFFFFFFF
    assert int(batch.packed_mask[30, 0]) == 2**31 - 1
    assert int(batch.packed_mask[39, 1]) == 0xFF


def test_position_ids_add_context_lengths():
    tree = SuperTree.from_parents([torch.tensor([-1, 0, 1]), torch.tensor([-1, 0, 0])])
    batch = pack(tree, torch.tensor([7, 3]))
    assert batch.position_ids.tolist() == [7, 8, 9, 3, 4, 4]


@pytest.mark.parametrize("bad, message", [
    ([torch.tensor([0, 0])], "must be -1"),
    ([torch.tensor([-1, 1])], "parent in"),
    ([torch.tensor([-1, -1])], "parent in"),
    ([torch.tensor([], dtype=torch.long)], "non-empty"),
    ([], "at least one"),
])  # fmt: skip
def test_bad_parents_are_rejected_with_a_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        pack_from_parents(bad)
