"""Request's token views used on the hot path equal the plain list they stand for (all_token_ids)."""

import itertools

import pytest

from echo_trtllm.runtime.request import Request, SamplingParams


def _request(prompt_len: int, out_len: int) -> Request:
    r = Request(request_id=0, prompt_token_ids=list(range(100, 100 + prompt_len)), params=SamplingParams())
    r.output_token_ids = list(range(500, 500 + out_len))
    return r


@pytest.mark.parametrize("prompt_len,out_len", [(1, 0), (3, 0), (3, 1), (5, 4), (1, 6)])
def test_views_equal_slices_of_all_token_ids(prompt_len, out_len):
    r = _request(prompt_len, out_len)
    full = r.all_token_ids
    assert r.num_tokens == len(full)
    assert r.last_token_id == full[-1]
    n = len(full)
    for start, stop in itertools.product(range(n + 3), [None, *range(n + 3)]):
        assert r.token_ids(start, stop) == full[start:stop], (start, stop)


def test_negative_bounds_are_refused():
    r = _request(3, 2)
    with pytest.raises(ValueError, match="non-negative"):
        r.token_ids(-1)
    with pytest.raises(ValueError, match="non-negative"):
        r.token_ids(0, -1)
