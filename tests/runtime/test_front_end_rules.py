"""One set of rules for every front end: what the OpenAI server refuses (tests/serve/test_bad_requests.py), the
`LLM` API and the Triton tensors refuse too, each error naming the argument or tensor. The table holds the
defects a hostile-user probe found in the API and in Triton's inputs (issue 35); each case failed before."""

import re

import numpy as np
import pytest

from echo_trtllm import SamplingParams
from echo_trtllm.serve.triton import TritonInputError, parse_inputs

VOCAB, CONTEXT = 512, 256

# (case, call(llm) -> anything, exception type, words the message must contain)
API_CASES = [
    ("stop token id outside the vocabulary",
     lambda llm: llm.generate("To be", SamplingParams(stop_token_ids=[10**9]), use_tqdm=False),
     ValueError, "stop_token_ids"),
    ("prompt + max_tokens beyond the context (was cut short with finish_reason length)",
     lambda llm: llm.generate([5] * 200, SamplingParams(max_tokens=100), use_tqdm=False),
     ValueError, "max_tokens"),
    ("16 stop strings of 250,000 characters (stalled every step of the engine thread)",
     lambda llm: SamplingParams(stop=["x" * 250_000] * 16), ValueError, "SamplingParams.stop"),
    ("17 stop strings", lambda llm: SamplingParams(stop=["x"] * 17), ValueError, "at most 16"),
    ("a stop string holding U+FFFD", lambda llm: SamplingParams(stop=["a\ufffd"]), ValueError, "U+FFFD"),
    ("257 stop token ids", lambda llm: SamplingParams(stop_token_ids=[1] * 257), ValueError, "at most 256"),
]


@pytest.mark.parametrize("case,call,error,words", API_CASES, ids=[c[0] for c in API_CASES])
def test_the_llm_api_refuses_what_the_server_refuses(pair_llm, case, call, error, words):
    with pair_llm(max_batch_size=2, max_seq_len=CONTEXT) as llm:
        with pytest.raises(error, match=re.escape(words)):
            call(llm)
        assert llm.generate("To be", SamplingParams(max_tokens=2), use_tqdm=False).finish_reason  # still serving


def test_token_ids_from_a_numpy_array_are_one_prompt(pair_llm):
    """`list(np.array([...]))` holds numpy integers: one prompt of token ids (it was taken as three prompts)."""
    with pair_llm(max_batch_size=2, max_seq_len=CONTEXT) as llm:
        ids = list(np.array([5, 6, 7]))
        out = llm.generate(ids, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        ref = llm.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        assert not isinstance(out, list) and out.prompt_token_ids == [5, 6, 7]
        assert out.token_ids == ref.token_ids


def _tensors(**extra):
    data = {"text_input": np.array([b"To be"], dtype=object), "max_tokens": np.array([4], dtype=np.int32)}
    data.update(extra)
    return data


# (case, extra tensors, the tensor the error must name)
TRITON_CASES = [
    ("stop_words not UTF-8 (raised a raw UnicodeDecodeError)", {"stop_words": np.array([b"\xff\xfe"], dtype=object)},
     "stop_words"),
    ("seed 2**64 - 1 sent as seed (was reported as random_seed)", {"seed": np.array([2**64 - 1], dtype=np.uint64)},
     "seed must"),
    ("end_id outside the vocabulary (was accepted)", {"end_id": np.array([10**9], dtype=np.int32)}, "end_id"),
    ("100 stop_words (was accepted; the server caps 16)",
     {"stop_words": np.array([f"w{i}".encode() for i in range(100)], dtype=object)}, "stop_words"),
    ("a stop word holding U+FFFD", {"stop_words": np.array(["a\ufffd".encode()], dtype=object)}, "stop_words"),
    ("text_input too long to tokenise (was tokenised first)",
     {"text_input": np.array([b"ab " * 100_000], dtype=object)}, "text_input"),
]


@pytest.mark.parametrize("case,extra,words", TRITON_CASES, ids=[c[0] for c in TRITON_CASES])
def test_triton_inputs_are_refused_naming_the_tensor(case, extra, words):
    def encode(text):
        if len(text) > 10_000:
            raise AssertionError("a text the size check refuses was handed to the tokenizer")
        return [1] * len(text.split())

    with pytest.raises(TritonInputError) as e:
        parse_inputs(_tensors(**extra), CONTEXT, encode, vocab_size=VOCAB, max_token_chars=16)
    assert str(e.value).startswith(words.split()[0]) and words in str(e.value), str(e.value)
    assert not str(e.value).startswith("random_seed")


def test_triton_inputs_within_the_rules_pass():
    prompt, params, stream, exclude = parse_inputs(_tensors(end_id=np.array([3], dtype=np.int32),
                                                            random_seed=np.array([7], dtype=np.uint64),
                                                            stop_words=np.array([b"a", b"b"], dtype=object)),
                                                   CONTEXT, vocab_size=VOCAB)
    assert (prompt, params.stop_token_ids, params.seed, params.stop) == ("To be", [3], 7, ["a", "b"])
