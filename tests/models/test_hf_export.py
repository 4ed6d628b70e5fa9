"""Hugging Face directory export (`echo-trtllm export --format hf`): the directory holds HF's names and config, and
both this project's loader and `transformers` (the independent reference) read it back to the source model's
logits; a GGUF source (a tiny one written here, quantised like the real ones) comes out as float weights with a
tokenizer that encodes like the GGUF's."""

import json

import numpy as np
import pytest
import torch

from echo_trtllm.cli import main as cli_main
from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET
from echo_trtllm.models.hf_export import save_hf
from echo_trtllm.models.loader import _GGUF_BLOCK, _GGUF_NAMES, load_model
from echo_trtllm.runtime.inputs import sequence_logits

TEXTS = ["ROMEO:\nBut soft, what light through yonder window", "def main():\n    return 1", "O"]


def _logits(model, ids):
    return sequence_logits(model, torch.tensor(ids))


@torch.no_grad()
def _hf_logits(path, ids_list, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    return [hf(torch.tensor([ids])).logits[0].float() for ids in ids_list]


def _tensors(path):
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable


def _permute(w, heads):
    """llama.cpp's Q/K row order for the `llama` architecture (the inverse of the loader's _unpermute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_gguf(path, arch):
    """The embedded target as a GGUF file of architecture `arch` with its byte-level BPE vocabulary (as llama.cpp's
    converter writes Qwen2.5's): the projections Q8_0 where a row is 32-divisible, the rest float32. qwen2 gets
    random q/k/v biases and keeps the tied head; llama gets llama.cpp's Q/K row permutation and its own head."""
    import gguf
    from gguf import quants

    model, _ = load_model(DEFAULT_TARGET, with_tokenizer=False)
    c = model.config
    tj = json.loads((DEFAULT_TARGET / "tokenizer.json").read_text())
    vocab = sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["id"] for t in tj["added_tokens"] if t["special"]}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "llama-bpe")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i in special else 1 for _, i in vocab])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]])
    w.add_eos_token_id(0)
    w.add_bos_token_id(0)
    w.add_chat_template("{% for m in messages %}<|endoftext|>{{ m['content'] }}{% endfor %}")
    gen = torch.Generator().manual_seed(0)
    state = dict(model.state_dict())
    if arch == "qwen2":
        state.pop("lm_head.weight")
        for i in range(c.num_hidden_layers):
            for p in ("q_proj", "k_proj", "v_proj"):
                rows = state[f"model.layers.{i}.self_attn.{p}.weight"].shape[0]
                state[f"model.layers.{i}.self_attn.{p}.bias"] = 0.1 * torch.randn(rows, generator=gen)
    else:
        state["lm_head.weight"] = state["lm_head.weight"] + 0.01 * torch.randn(state["lm_head.weight"].shape,
                                                                               generator=gen)
    to_gguf = {v: k for k, v in _GGUF_NAMES.items()}
    block = {v: k for k, v in _GGUF_BLOCK.items()}
    for name, t in state.items():
        if name in to_gguf:
            g = to_gguf[name]
        else:
            parts = name.split(".")  # model.layers.N.self_attn.q_proj.weight
            g = f"blk.{parts[2]}.{block['.'.join(parts[3:-1])]}.{parts[-1]}"
        if arch == "llama" and ".q_proj." in name:
            t = _permute(t, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            t = _permute(t, c.num_key_value_heads)
        a = np.ascontiguousarray(t.float().numpy())
        if a.ndim == 2 and a.shape[-1] % 32 == 0:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(g, quants.quantize(a, q8), raw_dtype=q8)
        else:
            w.add_tensor(g, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny_gguf(request, tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf", request.param)


@pytest.fixture(scope="module")
def qwen2_gguf(tmp_path_factory):
    """The architecture of the Qwen2.5-Coder pairs the command is for."""
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf", "qwen2")


@pytest.mark.parametrize("which", ["target", "draft"])
def test_float32_export_loads_back_to_the_same_logits_here_and_in_transformers(default_pair, tmp_path, which):
    target, draft, tok = default_pair
    model = target if which == "target" else draft
    out = save_hf(model, tok, tmp_path / which, "float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["torch_dtype"] == "float32" and cfg["tie_word_embeddings"] is model.config.tie_word_embeddings
    tensors = _tensors(out)
    expected = {k for k in model.state_dict() if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    assert set(tensors) == expected and not any("inv_freq" in k for k in tensors)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}

    back, back_tok = load_model(out)
    ids_list = [tok.encode(t) for t in TEXTS]
    for ids, ref in zip(ids_list, _hf_logits(out, ids_list)):
        source = _logits(model, ids)
        assert torch.equal(_logits(back, ids), source)
        torch.testing.assert_close(ref, source, rtol=1e-4, atol=1e-4)
    assert [back_tok.encode(t) for t in TEXTS] == ids_list


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_exports_hold_the_rounded_weights(default_pair, tmp_path, dtype):
    _, draft, tok = default_pair
    out = save_hf(draft, tok, tmp_path / dtype, dtype)
    dt = getattr(torch, dtype)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == dtype
    tensors = _tensors(out)
    source = draft.state_dict()
    assert all(t.dtype == dt and torch.equal(t, source[k].to(dt)) for k, t in tensors.items())
    back, _ = load_model(out, dtype=dtype)
    assert back.dtype == dt
    assert draft.dtype == torch.float32  # the source model is left as it was


def test_gguf_exports_to_float_weights_transformers_loads(tiny_gguf, tmp_path):
    arch = "qwen2" if "qwen2" in tiny_gguf.name else "llama"
    model, tok = load_model(tiny_gguf)  # float32, dequantised
    assert model.config.tie_word_embeddings is (arch == "qwen2")
    out = save_hf(model, tok, tmp_path / "hf", "float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"]
    assert ("lm_head.weight" in _tensors(out)) is (arch == "llama")

    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(out))
    texts = [*TEXTS, "  two spaces\tand a tab <|endoftext|>"]
    ids_list = [tok.encode(t) for t in texts]
    assert [hf_tok.encode(t) for t in texts] == ids_list
    assert hf_tok.chat_template == tok.hf.chat_template
    assert hf_tok.eos_token == "<|endoftext|>"

    back, back_tok = load_model(out)
    for ids, ref in zip(ids_list, _hf_logits(out, ids_list)):
        source = _logits(model, ids)
        assert torch.equal(_logits(back, ids), source)
        torch.testing.assert_close(ref, source, rtol=1e-4, atol=1e-4)
    assert [back_tok.encode(t) for t in texts] == ids_list


def test_cli_exports_a_gguf_pair_in_bfloat16(qwen2_gguf, tmp_path, capsys):
    out = tmp_path / "pair"
    assert cli_main(["export", "--format", "hf", "--model", str(qwen2_gguf), "--draft-model", str(qwen2_gguf),
                     "--output", str(out)]) == 0
    assert capsys.readouterr().out.split() == [str(out / "target"), str(out / "draft")]
    source, _ = load_model(qwen2_gguf, with_tokenizer=False)
    state = source.state_dict()
    for name in ("target", "draft"):
        assert json.loads((out / name / "config.json").read_text())["torch_dtype"] == "bfloat16"
        tensors = _tensors(out / name)
        assert all(t.dtype == torch.bfloat16 and torch.equal(t, state[k].bfloat16()) for k, t in tensors.items())
    # transformers reads the bf16 directory to the weights this project reads from it
    back, tok = load_model(out / "target")
    ids = tok.encode(TEXTS[0])
    torch.testing.assert_close(_hf_logits(out / "target", [ids])[0], _logits(back, ids), rtol=1e-4, atol=1e-4)


def test_cli_exports_the_embedded_pair(default_pair, tmp_path, capsys):
    target, draft, tok = default_pair
    out = tmp_path / "pair"
    out.mkdir()  # an empty directory is fine
    assert cli_main(["export", "--format", "hf", "--dtype", "float32", "--output", str(out)]) == 0
    assert capsys.readouterr().out.split() == [str(out / "target"), str(out / "draft")]
    ids = tok.encode(TEXTS[0])
    for name, model in (("target", target), ("draft", draft)):
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (out / name).iterdir()}
        back, _ = load_model(out / name)
        assert torch.equal(_logits(back, ids), _logits(model, ids))
    assert sorted(p.name for p in out.iterdir()) == ["draft", "target"]  # no trtllm_build.sh


def test_cli_trtllm_format_keeps_its_defaults(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert cli_main(["export", "--format", "trtllm", "--draft-model", str(DEFAULT_DRAFT), "--output", str(out)]) == 0
    assert (out / "target" / "rank0.safetensors").is_file() and (out / "draft" / "rank0.safetensors").is_file()
    script = (out / "trtllm_build.sh").read_text()
    assert "libecho_plugin.so" in script and "64" in script


@pytest.mark.parametrize("argv, message", [
    (["--model", "missing/model"], "--model path 'missing/model' does not exist"),
    (["--draft-model", "missing.gguf"], "--draft-model path 'missing.gguf' does not exist"),
    (["--tp-size", "2"], "--tp-size: only for --format trtllm"),
    (["--plugin-lib", "x.so", "--max-batch-size", "8"], "--plugin-lib, --max-batch-size: only for --format trtllm"),
    (["--engine-dir", "e", "--model", str(DEFAULT_TARGET)], "--engine-dir names its own models"),
])  # fmt: skip
def test_cli_errors_name_the_argument_and_write_nothing(tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    assert cli_main(["export", "--format", "hf", "--output", str(out), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_cli_refuses_a_used_output_and_an_unknown_format(tmp_path, capsys):
    used = tmp_path / "used"
    used.mkdir()
    (used / "x").write_text("x")
    afile = tmp_path / "file"
    afile.write_text("x")
    for out in (used, afile):
        assert cli_main(["export", "--format", "hf", "--output", str(out)]) == 2
        assert f"--output {out} exists and is not an empty directory" in capsys.readouterr().err
    assert sorted(p.name for p in used.iterdir()) == ["x"]
    with pytest.raises(SystemExit) as e:
        cli_main(["export", "--format", "gguf", "--output", str(tmp_path / "new")])
    assert e.value.code == 2
    assert "--format: invalid choice: 'gguf'" in capsys.readouterr().err


def test_save_hf_refuses_what_it_cannot_write(default_pair, tmp_path):
    _, draft, tok = default_pair
    with pytest.raises(ValueError, match="tokenizer NoneType cannot be saved"):
        save_hf(draft, None, tmp_path / "a")
    assert not (tmp_path / "a").exists()

    class Broken:
        def save_pretrained(self, path):
            raise OSError("disk full")

    with pytest.raises(ValueError, match=r"cannot save the tokenizer Broken \(OSError: disk full\)"):
        save_hf(draft, Broken(), tmp_path / "b")
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        save_hf(draft, tok, tmp_path / "c", "float64")
    from echo_trtllm.models.fp8 import quantize_model

    fp8, _ = load_model(DEFAULT_DRAFT, with_tokenizer=False)
    quantize_model(fp8, "per_channel")
    with pytest.raises(ValueError, match="FP8-quantised"):
        save_hf(fp8, tok, tmp_path / "d")
