"""The output text decoded a few tokens at a time (runtime/detok.py) against decoding the whole output (the oracle),
after every step: byte-level tokens with multi-byte characters split across tokens and steps and stray bytes that
never decode, a SentencePiece decoder (the `tokenizers` library's Llama-2 decoder: leading-space rule, byte
fallback), a decoder that rewrites earlier text, and the embedded model's own tokenizer."""

import random

import pytest

from echo_trtllm.runtime.detok import MAX_HALF, IncrementalText


def _grow(decode, ids: list[int], seed: int, most: int = 6):
    """Feed ids in random steps of 1..most tokens; after each, IncrementalText's text against decode of them all.
    Returns the IncrementalText and the lengths of the token lists it decoded."""
    rnd = random.Random(seed)
    lengths = []

    def counted(part):
        lengths.append(len(part))
        return decode(part)

    inc, at = IncrementalText(counted), 0
    while at < len(ids):
        at = min(len(ids), at + rnd.randint(1, most))
        assert inc.text(ids[:at]) == decode(ids[:at]), (ids[:at], seed)
    return inc, lengths


def _bytes_decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("seed", range(40))
def test_byte_tokens_split_characters_and_stray_bytes(seed):
    rnd = random.Random(seed)
    pieces = ["a", " b", "日本", "é", "🙂", "\n"]
    stream = b"".join(rnd.choice(pieces).encode() if rnd.random() > 0.05 else b"\x80" for _ in range(120))
    _grow(_bytes_decode, list(stream), seed)


def test_windows_stay_short_on_whole_characters():
    """Without stray bytes no decode reads more than a step's tokens and the window's few before them, however long
    the output: the work a step does does not grow with the output (the whole decode did)."""
    stream = list(("déjà vu, 日本語 🙂 " * 200).encode())
    inc, lengths = _grow(_bytes_decode, stream, seed=1, most=6)
    assert len(stream) > 2000 and max(lengths) <= 6 + MAX_HALF + 6 and inc.full_decodes == 0


def _llama2_decoder():
    from tokenizers import decoders

    return decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                              decoders.Strip(" ", 1, 0)])


@pytest.mark.parametrize("seed", range(20))
def test_sentencepiece_decoder_leading_space_and_byte_fallback(seed):
    """Llama-2's decoder strips one leading space of the whole text and joins byte tokens into characters: decoding
    only the new tokens would drop the space before each step's first word; the window keeps it."""
    dec = _llama2_decoder()
    vocab = ["▁the", "▁cat", "s", "▁", ",", "<0xE6>", "<0x97>", "<0xA5>", "<0xC3>", "<0xA9>", "▁日"]
    decode = lambda ids: dec.decode([vocab[i] for i in ids])  # noqa: E731
    rnd = random.Random(seed)
    ids = []
    for _ in range(60):
        ids += rnd.choice([[0], [1], [2], [3], [4], [5, 6, 7], [8, 9], [10], [5], [8]])
    _grow(decode, ids, seed)
    assert decode([1]) + decode([1]) != decode([1, 1])  # the rule the window is there for


@pytest.mark.parametrize("seed", range(10))
def test_sentencepiece_with_skipped_special_tokens(seed):
    """A special token decodes to nothing (skip_special_tokens): a window cannot start at it, or the word after it
    would be the window's first and lose its leading space ("Hello</s> world" -> "Helloworld")."""
    dec = _llama2_decoder()
    vocab = ["▁Hello", "</s>", "▁world", "s", "<0xC3>", "<0xA9>"]
    decode = lambda ids: dec.decode([vocab[i] for i in ids if i != 1])  # noqa: E731
    _grow(decode, [0, 1, 2], seed, most=1)
    rnd = random.Random(seed)
    _grow(decode, [rnd.choice([0, 1, 1, 2, 3, 4, 5]) for _ in range(120)], seed)


def test_a_long_run_of_stray_bytes_keeps_the_window_short():
    """Bytes that never decode (U+FFFD each) at every step's end: the window is cut before the run's last few tokens
    where the two sides decode apart, so its length stays bounded."""
    stream = list(b"ok " + b"\x80" * 600 + "日本".encode() + b"\xff" * 300)
    inc, lengths = _grow(_bytes_decode, stream, seed=5, most=3)
    assert max(lengths) <= 2 * (3 + MAX_HALF) + 3 and inc.full_decodes == 0


def test_a_decoder_that_rewrites_earlier_text_is_decoded_whole_again():
    """A clean-up rule (" ," -> ",") changes text already read when the next token arrives: the window sees its
    head rewritten and decodes the whole output once, staying equal to the oracle."""
    vocab = ["a", " ", ",", "b"]
    decode = lambda ids: "".join(vocab[i] for i in ids).replace(" ,", ",")  # noqa: E731
    ids = [0, 1, 2, 3, 1, 3, 1, 2, 0] * 20
    inc, _ = _grow(decode, ids, seed=3, most=1)
    assert inc.full_decodes > 0


def test_ids_shorter_than_those_read_start_again():
    inc = IncrementalText(_bytes_decode)
    assert inc.text(list(b"hello world")) == "hello world"
    assert inc.text(list(b"help")) == "help" and inc.full_decodes == 1
    assert inc.text(list("help 日本".encode())[:-1]) == _bytes_decode(list("help 日本".encode())[:-1])
    assert inc.text(list("help 日本".encode())) == "help 日本"


@pytest.mark.parametrize("seed", range(10))
def test_the_embedded_models_tokenizer(default_pair, seed):
    tok = default_pair[2]
    rnd = random.Random(seed)
    text = "".join(rnd.choice(["def f(x):\n", "    return x", " # é ü", " 日本語", " 🙂", "\t", "  "])
                   for _ in range(80))
    ids = tok.encode(text)
    ids += [rnd.randrange(tok.vocab_size) for _ in range(80)]  # any token the model may emit, special ones included
    _grow(tok.decode, ids, seed)
