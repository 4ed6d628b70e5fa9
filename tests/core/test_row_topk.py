"""row_topk against torch.topk (the oracle): the same values in every row, largest first, and indices that hold
them, distinct in each row; the same indices where a row has no ties. Ties, NaN, infinities and block edges."""

import pytest
import torch

from echo_trtllm.core.tree import DraftTopK, row_topk


def _check(x: torch.Tensor, k: int, chunk: int | None = None, no_ties: bool = False) -> None:
    values, index = row_topk(x, k, chunk)
    ref_values, ref_index = torch.topk(x, k, dim=-1)
    torch.testing.assert_close(values, ref_values, rtol=0, atol=0, equal_nan=True)  # the same floats
    assert index.dtype == torch.long and index.shape == ref_index.shape
    torch.testing.assert_close(x.gather(1, index), values, rtol=0, atol=0, equal_nan=True)  # they hold the values
    if index.numel():
        assert (index.sort(-1).values.diff(dim=-1) > 0).all(), "an entry taken twice"
    if no_ties:
        assert torch.equal(index, ref_index)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("rows,vocab,k", [(64, 8192, 4), (64, 8192, 8), (16, 8192, 1), (5, 151_936, 8),
                                          (3, 8192, 10), (1, 8192, 4), (64, 8000, 4), (40, 1024, 4)])
def test_equals_topk_on_random_rows(dtype, rows, vocab, k):
    g = torch.Generator().manual_seed(rows * vocab + k)
    x = torch.randn(rows, vocab, generator=g, dtype=torch.float64).to(dtype)
    _check(x, k, no_ties=dtype != torch.bfloat16)  # bfloat16 rows tie often
    _check(torch.softmax(x.float(), -1), k, no_ties=dtype != torch.bfloat16)


@pytest.mark.parametrize("chunk", [4, 8, 64])
def test_ties_nan_infinities_and_block_edges(chunk):
    v = 256
    x = torch.zeros(12, v)
    x[0, [5, 200, 201, 7]] = 3.0  # ties across and inside blocks
    x[1, [chunk - 1, chunk]] = 2.0  # the edge between two blocks
    x[2, v - 1] = 1.0  # the last column
    x[3] = float("-inf")
    x[4, [30, 90]] = float("inf")
    x[5, 100] = float("nan")  # NaN ranks first, then the largest finite entries, one of them in the NaN's block
    x[5, 101], x[5, 3] = 9.0, 8.0
    x[6, [10, 11, 12, 13, 14, 15]] = float("nan")
    x[7] = torch.arange(v, dtype=torch.float32) % 5  # many ties at every value
    x[8, 0] = 1e-30  # one positive entry over zeros: the rest ties
    x[9] = -0.0
    x[10] = torch.arange(v, dtype=torch.float32)  # increasing: the top k in the last block
    x[11] = -torch.arange(v, dtype=torch.float32)  # decreasing: in the first
    for k in (1, 2, 3, 4, 6):
        for dtype in (torch.float32, torch.bfloat16):
            _check(x.to(dtype), k, chunk)


def test_fallbacks_and_shapes():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3000, 9, generator=g).t()  # (9, 3000) transposed view, 3000 = no block size of 64 divides
    _check(x, 4, no_ties=True)
    _check(torch.randn(9, 4096, generator=g).t().contiguous().t(), 4, chunk=8, no_ties=True)  # non-contiguous
    _check(torch.randn(4, 64, generator=g), 8, chunk=4, no_ties=True)  # k x chunk too near the row: torch.topk
    assert row_topk(torch.empty(0, 8192), 4)[0].shape == (0, 4)
    ints = torch.randint(0, 1000, (4, 8192), generator=g)  # not floating point: torch.topk itself
    assert torch.equal(row_topk(ints, 3)[0], torch.topk(ints, 3).values)


def test_draft_top_k_reads_row_topk():
    """DraftTopK.of, what every drafter hands the drafting loop, gives torch.topk's values of the distribution."""
    g = torch.Generator().manual_seed(11)
    probs = torch.softmax(torch.randn(64, 8192, generator=g), -1)
    top = DraftTopK.of(probs, 6)
    ref = torch.topk(probs, 6, dim=-1)
    assert torch.equal(top.probs, ref.values) and torch.equal(top.tokens, ref.indices)


def test_bad_block_size_is_refused():
    with pytest.raises(ValueError, match="chunk must be a positive block size"):
        row_topk(torch.randn(4, 8192), 3, -64)
