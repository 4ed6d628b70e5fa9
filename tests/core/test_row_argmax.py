"""row_argmax against torch.argmax (the oracle): the same index in every row, ties, NaN and infinities included."""

import pytest
import torch

from echo_trtllm.core.verify import row_argmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("vocab,chunk", [(151_936, 1024), (5000, 1024), (4096, 1024), (1025, 1024), (300, 64),
                                         (64, 64), (10, 64)])
def test_equals_argmax_on_random_rows(dtype, vocab, chunk):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(7, vocab, generator=g).to(dtype)
    assert torch.equal(row_argmax(x, chunk), x.argmax(-1))


def test_ties_nan_and_infinities_pick_what_argmax_picks():
    v, chunk = 1000, 64
    x = torch.zeros(12, v)
    x[0, [5, 700]] = 3.0  # a tie across blocks: the first
    x[1, [70, 71]] = 2.0  # a tie inside a block
    x[2, [999, 998]] = 1.0  # in the tail block (1000 = 15 * 64 + 40)
    x[3, 999] = 1.0  # the last column
    x[4] = float("-inf")  # every entry -inf: index 0
    x[5, 300] = float("inf")
    x[5, 900] = float("inf")
    x[6, 800] = float("nan")  # NaN beats everything, even an earlier larger value
    x[6, 10] = 5.0
    x[7, [400, 20]] = float("nan")  # the first NaN
    x[8, 950] = float("nan")  # a NaN in the tail block
    x[9] = -0.0
    x[9, 500] = 0.0  # -0.0 == 0.0: index 0
    x[10, 63], x[10, 64] = 4.0, 4.0  # the edge between two blocks
    x[11, 0] = 1e-30
    for dtype in (torch.float32, torch.bfloat16):
        y = x.to(dtype)
        assert torch.equal(row_argmax(y, chunk), y.argmax(-1)), dtype


def test_non_contiguous_and_degenerate_shapes():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3000, 9, generator=g).t()  # (9, 3000) transposed view
    assert torch.equal(row_argmax(x, 256), x.argmax(-1))
    assert row_argmax(torch.empty(0, 5000), 1024).shape == (0,)
    ints = torch.randint(0, 5, (4, 3000), generator=g)  # not floating point: torch.argmax itself
    assert torch.equal(row_argmax(ints, 256), ints.argmax(-1))


def test_equals_argmax_on_logit_shaped_rows():
    """Rows shaped like a model's: a few large logits over a flat sea, many near-ties in bfloat16."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(64, 151_936, generator=g) * 2).bfloat16()
    x[:, torch.randint(0, 151_936, (40,), generator=g)] += 12
    assert torch.equal(row_argmax(x), x.argmax(-1))
    assert torch.equal(row_argmax(x), x.float().argmax(-1))
