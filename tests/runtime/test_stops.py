"""StopMatcher against the naive search it replaced: every stop string searched in the whole text once per token
(`str.find`), and the held-back end computed by trying every prefix of every stop string."""

import random

import pytest

from echo_trtllm.runtime.stops import StopMatcher


def naive_first_hit(text: str, stops: list[str]) -> int | None:
    hits = [text.find(s) for s in stops if s in text]
    return min(hits) if hits else None


def naive_hold(text: str, stops: list[str]) -> int:
    """The longest end of `text` that is a proper prefix of a stop string."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


@pytest.mark.parametrize("seed", range(40))
def test_stop_matcher_equals_the_naive_search_on_random_texts(seed):
    rnd = random.Random(seed)
    alphabet = "ab" if seed % 2 else "abc日"
    stops = ["".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 6))) for _ in range(rnd.randint(1, 4))]
    m = StopMatcher(stops)
    text = ""
    for _ in range(60):
        text += "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 4)))  # one token's characters
        hit = m.feed(text)
        assert hit == naive_first_hit(text, stops), (stops, text)
        if hit is not None:
            return
        assert m.hold == naive_hold(text, stops), (stops, text)


def test_stop_matcher_reads_again_a_text_that_does_not_extend_the_last():
    m = StopMatcher(["xy"])
    assert m.feed("ax") is None and m.hold == 1
    assert m.feed("b") is None and m.hold == 0  # rewritten, not extended
    assert m.feed("bxy") == 1


def test_stop_matcher_on_long_stop_strings_sharing_a_prefix():
    """16 stop strings of 256 characters sharing 255 (SamplingParams' cap of 4,096 together), fed 4 characters a
    token: the held end and the hit as the naive search gives them."""
    stops = ["a" * 255 + chr(ord("b") + i) for i in range(16)]
    m = StopMatcher(stops)
    text = ""
    for _ in range(100):
        text += "aaaa"
        assert m.feed(text) is None and m.hold == naive_hold(text, stops) == min(len(text), 255)
    text += "aae"
    assert m.feed(text) == naive_first_hit(text, stops) == len(text) - 256


def test_stop_matcher_refuses_empty_stop_strings():
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(["a", ""])


# ----------------------------------------------------------------------------------- as the executor runs it


class _ByteTokenizer:
    """Token i is byte i; decoding replaces undecodable bytes (a half multi-byte character at the end, stray
    continuation bytes) by U+FFFD, as byte-level BPE tokenizers do."""

    eos_token_ids = ()

    @staticmethod
    def decode(ids):
        return bytes(ids).decode("utf-8", errors="replace")


def _old_finish(tokenizer, max_seq_len, req, tokens):
    """The executor's stop handling before StopMatcher: the whole output decoded and every stop searched in it at
    every token; the text cut at the earliest hit."""
    stop_ids, stops, kept = set(req.params.stop_token_ids or []), req.params.stop_strings, 0
    for tok in tokens:
        req.output_token_ids.append(tok)
        kept += 1
        if tok in stop_ids:
            req.finish_reason = "stop"
        elif stops:
            text = tokenizer.decode(req.output_token_ids)
            hits = [text.find(s) for s in stops if s in text]
            if hits:
                req.text, req.finish_reason = text[: min(hits)], "stop"
                return kept
        if req.finish_reason is None and len(req.output_token_ids) >= req.params.max_tokens:
            req.finish_reason = "length"
        if req.finish_reason is not None:
            break
    req.text = tokenizer.decode(req.output_token_ids)
    return kept


def _old_held_back(text, stops):
    partial = len(text) - len(text.rstrip("\ufffd"))
    whole = text[: len(text) - partial]
    hold = 0
    for s in stops:
        for k in range(min(len(s) - (0 if partial else 1), len(whole)), 0, -1):
            if whole.endswith(s[:k]):
                hold = max(hold, k)
                break
    return partial + hold


@pytest.mark.parametrize("seed", range(60))
def test_the_executor_stops_and_holds_back_as_the_naive_search_did(seed):
    """Executor._finish and the streaming hold-back against the code they replaced, on byte tokens: multi-byte
    characters split across tokens and steps, stray bytes that stay U+FFFD, overlapping stops, several tokens a
    step (a speculative step's accepted tokens)."""
    from types import SimpleNamespace

    from echo_trtllm.runtime.engine import _held_back
    from echo_trtllm.runtime.executor import Executor
    from echo_trtllm.runtime.request import Request, SamplingParams

    rnd = random.Random(seed)
    pieces = ["a", "b", "ab", "日", "本", "é", "\x80"]  # "\x80" alone: a byte that never decodes
    stops = list({"".join(rnd.choice(pieces[:6]) for _ in range(rnd.randint(1, 3))) for _ in range(rnd.randint(1, 3))})
    stream = b"".join((rnd.choice(pieces).encode() if rnd.random() > 0.1 else b"\x80") for _ in range(40))
    params = SamplingParams(max_tokens=len(stream), stop=stops, ignore_eos=True)
    tok = _ByteTokenizer()
    new = Request(0, [1], params, stop_matcher=StopMatcher(stops))
    old = Request(0, [1], params)
    fake = SimpleNamespace(tokenizer=tok, max_seq_len=10**6)
    at = 0
    while at < len(stream) and new.finish_reason is None:
        step = list(stream[at: at + rnd.randint(1, 4)])
        at += len(step)
        kept = Executor._finish(fake, new, step)
        assert kept == _old_finish(tok, 10**6, old, step)
        assert (new.output_token_ids, new.text, new.finish_reason) == (old.output_token_ids, old.text,
                                                                        old.finish_reason), (stops, stream)
        if new.finish_reason is None:
            assert _held_back(new) == _old_held_back(old.text, stops), (stops, new.text)
