"""A table of bad inputs: each raises a clear error naming the argument, before anything is submitted or loaded,
and the engine still returns the reference output afterwards."""

import json
import shutil
from dataclasses import dataclass

import pytest
import torch

from echo_trtllm import LLM, EchoConfig, SamplingParams
from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET
from echo_trtllm.models.loader import Tokenizer

REFERENCE_PROMPT = "To be, or not to be"
REFERENCE_PARAMS = SamplingParams(max_tokens=8, temperature=0)
SP = SamplingParams(max_tokens=4)


def corrupt_engine(tmp_path, mutate):
    from echo_trtllm.engine_build import build_engine

    out = build_engine(tmp_path / "engine", DEFAULT_TARGET, DEFAULT_DRAFT, EchoConfig(k_max=32))
    meta = json.loads((out / "engine.json").read_text())
    text = mutate(meta)
    (out / "engine.json").write_text(text if isinstance(text, str) else json.dumps(meta))
    return out


def corrupt_model(tmp_path, name, content):
    model = tmp_path / "model"
    shutil.copytree(DEFAULT_TARGET, model)
    (model / name).write_bytes(content)
    return model


def written(path, text):
    path.write_text(text)
    return path


def broken_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 20)
    return path


CASES = [
    # SamplingParams: every field, wrong type or range
    ("max_tokens=0", lambda llm, p: SamplingParams(max_tokens=0), ValueError, "max_tokens"),
    ("max_tokens<0", lambda llm, p: SamplingParams(max_tokens=-3), ValueError, "max_tokens"),
    ("max_tokens float", lambda llm, p: SamplingParams(max_tokens=1.5), ValueError, "max_tokens"),
    ("max_tokens bool", lambda llm, p: SamplingParams(max_tokens=True), ValueError, "max_tokens"),
    ("max_tokens str", lambda llm, p: SamplingParams(max_tokens="8"), ValueError, "max_tokens"),
    ("temperature<0", lambda llm, p: SamplingParams(temperature=-0.1), ValueError, "temperature"),
    ("temperature nan", lambda llm, p: SamplingParams(temperature=float("nan")), ValueError, "temperature"),
    ("temperature inf", lambda llm, p: SamplingParams(temperature=float("inf")), ValueError, "temperature"),
    ("temperature str", lambda llm, p: SamplingParams(temperature="0.5"), ValueError, "temperature"),
    ("top_k<0", lambda llm, p: SamplingParams(top_k=-1), ValueError, "top_k"),
    ("top_k float", lambda llm, p: SamplingParams(top_k=1.5), ValueError, "top_k"),
    ("top_k bool", lambda llm, p: SamplingParams(top_k=True), ValueError, "top_k"),
    ("top_p=0", lambda llm, p: SamplingParams(top_p=0.0), ValueError, "top_p"),
    ("top_p>1", lambda llm, p: SamplingParams(top_p=1.5), ValueError, "top_p"),
    ("top_p nan", lambda llm, p: SamplingParams(top_p=float("nan")), ValueError, "top_p"),
    ("seed<0", lambda llm, p: SamplingParams(seed=-1), ValueError, "seed"),
    ("seed bool", lambda llm, p: SamplingParams(seed=True), ValueError, "seed"),
    ("seed>=2**63", lambda llm, p: SamplingParams(seed=2**63), ValueError, "seed"),
    ("seed float", lambda llm, p: SamplingParams(seed=1.0), ValueError, "seed"),
    ("stop int", lambda llm, p: SamplingParams(stop=123), ValueError, "stop"),
    ("stop empty string", lambda llm, p: SamplingParams(stop=[""]), ValueError, "stop"),
    ("stop mixed", lambda llm, p: SamplingParams(stop=["ok", 5]), ValueError, "stop"),
    ("stop_token_ids int", lambda llm, p: SamplingParams(stop_token_ids=5), ValueError, "stop_token_ids"),
    ("stop_token_ids<0", lambda llm, p: SamplingParams(stop_token_ids=[-1]), ValueError, "stop_token_ids"),
    ("stop_token_ids str", lambda llm, p: SamplingParams(stop_token_ids=["a"]), ValueError, "stop_token_ids"),
    ("ignore_eos str", lambda llm, p: SamplingParams(ignore_eos="yes"), ValueError, "ignore_eos"),
    # prompts
    ("empty prompt", lambda llm, p: llm.generate("", SP), ValueError, "prompt is empty"),
    ("empty prompt list", lambda llm, p: llm.generate([], SP), ValueError, "prompts is empty"),
    ("dict prompts", lambda llm, p: llm.generate({"a": 1}, SP), TypeError, "prompts must be"),
    ("set prompts", lambda llm, p: llm.generate({"a", "b"}, SP), TypeError, "prompts must be"),
    ("None prompts", lambda llm, p: llm.generate(None, SP), TypeError, "prompts must be"),
    ("int prompts", lambda llm, p: llm.generate(42, SP), TypeError, "prompts must be"),
    ("bytes prompt", lambda llm, p: llm.generate(b"hello", SP), TypeError, "prompts must be"),
    ("empty token list in a list", lambda llm, p: llm.generate(["ok", []], SP), ValueError, "prompt 1: prompt is empty"),
    ("int among prompts", lambda llm, p: llm.generate(["fine", 5], SP), TypeError, "prompt 1: prompt must be"),
    ("float token ids", lambda llm, p: llm.generate([1.5, 2], SP), TypeError, "prompt 0: prompt must be"),
    ("str among token ids", lambda llm, p: llm.generate([[1, "a"]], SP), TypeError, "token ids must be integers"),
    ("negative token id", lambda llm, p: llm.generate([-1], SP), ValueError, "outside the vocabulary"),
    ("token id too large", lambda llm, p: llm.generate([10**9], SP), ValueError, "outside the vocabulary"),
    ("lone surrogate", lambda llm, p: llm.generate("abc\ud800", SP), ValueError, "not valid Unicode"),
    ("prompt too long", lambda llm, p: llm.generate([5] * 300, SP), ValueError, "context holds 256"),
    ("sampling_params dict", lambda llm, p: llm.generate("x", {"max_tokens": 3}), TypeError, "sampling_params"),
    ("sampling_params count", lambda llm, p: llm.generate(["a", "b"], [SP]), ValueError, "sampling_params has 1"),
    ("sampling_params item", lambda llm, p: llm.generate(["a", "b"], [SP, "x"]), TypeError, "prompt 1: sampling_params"),
    ("async list", lambda llm, p: llm.generate_async(["a", "b"], SP), TypeError, "generate_async takes one prompt"),
    ("async params list", lambda llm, p: llm.generate_async("a", [SP]), TypeError, "sampling_params"),
    # LLM construction: refused before any model is loaded
    ("max_batch_size=0", lambda llm, p: LLM(max_batch_size=0), ValueError, "max_batch_size"),
    ("max_batch_size bool", lambda llm, p: LLM(max_batch_size=True), ValueError, "max_batch_size"),
    ("max_seq_len=0", lambda llm, p: LLM(max_seq_len=0), ValueError, "max_seq_len"),
    ("max_num_tokens=0", lambda llm, p: LLM(max_num_tokens=0), ValueError, "max_num_tokens"),
    ("dtype", lambda llm, p: LLM(dtype="float8"), ValueError, "dtype"),
    ("device", lambda llm, p: LLM(device="gpu0"), ValueError, "device"),
    ("speculative_config dict", lambda llm, p: LLM(speculative_config={"k_max": 4}), TypeError, "speculative_config"),
    ("cost_model", lambda llm, p: LLM(cost_model="fast"), ValueError, "cost_model"),
    ("calibration int", lambda llm, p: LLM(calibration=5), TypeError, "calibration"),
    ("iter stats", lambda llm, p: LLM(iter_stats_max_iterations=-1), ValueError, "iter_stats_max_iterations"),
    ("fallback", lambda llm, p: LLM(fallback="yes"), ValueError, "fallback must be 'auto', True or False"),
    ("missing gguf", lambda llm, p: LLM(p / "missing.gguf"), FileNotFoundError, "model path"),
    ("model int", lambda llm, p: LLM(123), TypeError, "model must be a path"),
    ("draft not a model", lambda llm, p: LLM(DEFAULT_TARGET, p), FileNotFoundError, "config.json is missing"),
    ("engine and model", lambda llm, p: LLM(DEFAULT_TARGET, engine_dir=p), ValueError, "either engine_dir"),
    ("policy", lambda llm, p: EchoConfig(policy="medusa"), ValueError, "policy"),
    ("k_max", lambda llm, p: EchoConfig(k_max=0), ValueError, "k_max"),
    ("k_max below batch", lambda llm, p: LLM(speculative_config=EchoConfig(k_max=2), max_batch_size=4), ValueError,
     "k_max"),
    # corrupted files: the error names the file
    ("engine.json not JSON", lambda llm, p: LLM(engine_dir=corrupt_engine(p, lambda m: "{not json")), ValueError,
     "engine.json: not valid JSON"),
    ("engine.json without echo_config", lambda llm, p: LLM(engine_dir=corrupt_engine(p, lambda m: m.pop("echo_config"))),
     ValueError, "engine.json: field 'echo_config'"),
    ("engine.json bad echo_config",
     lambda llm, p: LLM(engine_dir=corrupt_engine(p, lambda m: m["echo_config"].update(k_max=-1))), ValueError,
     "engine.json: echo_config is invalid"),
    ("engine.json bad dtype", lambda llm, p: LLM(engine_dir=corrupt_engine(p, lambda m: m.update(dtype="int3"))),
     ValueError, "engine.json: dtype"),
    ("config.json not JSON", lambda llm, p: LLM(corrupt_model(p, "config.json", b"{"), speculative_config=EchoConfig(
        policy="ar")), ValueError, "config.json: not valid JSON"),
    ("config.json no sizes", lambda llm, p: LLM(corrupt_model(p, "config.json", b'{"model_type": "llama"}'),
                                                speculative_config=EchoConfig(policy="ar")), ValueError,
     "config.json: config.json lacks"),
    ("safetensors truncated", lambda llm, p: LLM(corrupt_model(p, "model.safetensors", b"\x00" * 10),
                                                 speculative_config=EchoConfig(policy="ar")), ValueError,
     "model.safetensors: cannot read"),
    ("tokenizer corrupted", lambda llm, p: LLM(corrupt_model(p, "tokenizer.json", b"{]"),
                                               speculative_config=EchoConfig(policy="ar"), dtype="float32"),
     ValueError, "cannot load the tokenizer"),
    ("calibration missing", lambda llm, p: LLM(calibration=p / "none.json"), FileNotFoundError,
     "calibration file"),
    ("calibration not JSON", lambda llm, p: LLM(calibration=written(p / "c.json", "[1, 2")), ValueError,
     "c.json: not valid JSON"),
    ("calibration without fields", lambda llm, p: LLM(calibration=written(p / "c.json", '{"format_version": 1}')),
     ValueError, "c.json: calibration JSON lacks fields"),
    ("gguf corrupted", lambda llm, p: LLM(broken_gguf(p), speculative_config=EchoConfig(policy="ar")), ValueError,
     "x.gguf: cannot read the GGUF file"),
    ("cuda without a GPU", lambda llm, p: LLM(device="cuda") if not torch.cuda.is_available() else LLM(device="cuda:99"),
     ValueError, "device"),
]


@pytest.fixture(scope="module")
def llm(pair_llm):
    with pair_llm(speculative_config=EchoConfig(k_max=64), max_batch_size=4, max_seq_len=256) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(llm):
    return llm.generate(REFERENCE_PROMPT, REFERENCE_PARAMS).token_ids


def test_the_table_is_big_enough():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name, call, error, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_clearly_and_the_engine_keeps_serving(llm, reference, tmp_path, name, call, error,
                                                                  message):
    waiting_before = len(llm.executor.waiting)
    with pytest.raises(error, match=message.replace("(", r"\(")):
        call(llm, tmp_path)
    assert len(llm.executor.waiting) == waiting_before, "nothing may be submitted for a refused call"
    assert llm.generate(REFERENCE_PROMPT, REFERENCE_PARAMS).token_ids == reference
    assert sorted(llm.executor.free_slots) == list(range(4))


@dataclass
class ForeignTokenizer(Tokenizer):
    """A tokenizer of a bigger vocabulary: its ids run past the model's."""

    offset: int = 0

    def encode(self, text):
        return [t + self.offset for t in super().encode(text)]


def test_a_tokenizer_from_another_model_is_refused_before_submission(default_pair):
    target, draft, tok = default_pair
    with LLM(target, draft, tokenizer=ForeignTokenizer(tok.hf, tok.eos_token_ids, target.config.vocab_size), max_batch_size=1) as llm:
        with pytest.raises(ValueError, match="outside the model's vocabulary .* pass the model's own tokenizer"):
            llm.generate("hello", SP)
        assert not llm.executor.waiting and llm.executor.free_slots == [0]
