"""TensorRT-LLM checkpoint export (`echo-trtllm export --format trtllm`): the layout TensorRT-LLM 1.2's converters
write (names, fused qkv order, fc = gate_proj, config keys), read back by this project's loader and compared with
the source model: float exactly, FP8 within the export's own re-rounding of the fused qkv."""

import json

import pytest
import torch

from echo_trtllm import LLM, EchoConfig, SamplingParams
from echo_trtllm.models.fp8 import calibrate_amax, fp8_layers, quantize_model
from echo_trtllm.models.loader import load_model
from echo_trtllm.models.trtllm_checkpoint import export_checkpoint, load_checkpoint
from echo_trtllm.runtime.inputs import sequence_logits

# the keys TensorRT-LLM's PretrainedConfig.from_dict needs (architecture, dtype and three sizes) and those a
# LLaMA build reads; a fact taken from its 1.2 sources, not code
REQUIRED = {"architecture", "dtype", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
            "num_key_value_heads", "head_size", "intermediate_size", "norm_epsilon", "position_embedding_type",
            "rotary_base", "hidden_act", "mapping", "quantization"}
QUANT_KEYS = {"quant_algo", "kv_cache_quant_algo", "group_size", "smoothquant_val", "clamp_val", "use_meta_recipe",
              "has_zero_point", "pre_quant_scale", "exclude_modules", "mamba_ssm_cache_dtype"}


def _logits(model, ids):
    return sequence_logits(model, torch.tensor(ids))


@pytest.mark.parametrize("which", ["target", "draft"])
def test_float_export_reads_back_to_identical_logits(default_pair, tmp_path, which):
    target, draft, tok = default_pair
    model = target if which == "target" else draft
    out = export_checkpoint(model, tmp_path / which, tok)
    cfg = json.loads((out / "config.json").read_text())
    assert REQUIRED <= set(cfg) and set(cfg["quantization"]) <= QUANT_KEYS
    assert cfg["architecture"] == "LlamaForCausalLM" and cfg["position_embedding_type"] == "rope_gpt_neox"
    from safetensors import safe_open

    with safe_open(str(out / "rank0.safetensors"), "pt") as f:
        names = set(f.keys())
        c = model.config
        qkv = f.get_tensor("transformer.layers.0.attention.qkv.weight")
        assert qkv.shape == ((c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim, c.hidden_size)
        # rows q | k | v, and fc is gate_proj (the SiLU branch), gate is up_proj
        layer = model.model.layers[0]
        assert torch.equal(qkv[: c.num_attention_heads * c.head_dim], layer.self_attn.q_proj.weight)
        assert torch.equal(f.get_tensor("transformer.layers.0.mlp.fc.weight"), layer.mlp.gate_proj.weight)
        assert torch.equal(f.get_tensor("transformer.layers.0.mlp.gate.weight"), layer.mlp.up_proj.weight)
    assert {"transformer.vocab_embedding.weight", "transformer.ln_f.weight", "lm_head.weight"} <= names
    back, back_tok = load_model(out)
    ids = tok.encode("ROMEO:\nBut soft, what light through yonder window")
    assert torch.equal(_logits(back, ids), _logits(model, ids))
    assert back_tok.encode("HAMLET") == tok.encode("HAMLET")


def test_fp8_export_reads_back_within_the_requantisation(default_pair, prompts, tmp_path):
    from echo_trtllm.models import DEFAULT_TARGET

    _, _, tok = default_pair
    model, _ = load_model(DEFAULT_TARGET, with_tokenizer=False)

    def run():
        with LLM(model, None, tokenizer=tok, speculative_config=EchoConfig(policy="ar"), cost_model=None) as llm:
            llm.generate(prompts[:6], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)

    quantize_model(model, "per_tensor", calibrate_amax(model, run))
    out = export_checkpoint(model, tmp_path / "fp8", tok)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["quant_algo"] == "FP8" and "lm_head" in cfg["quantization"]["exclude_modules"]
    from safetensors import safe_open

    with safe_open(str(out / "rank0.safetensors"), "pt") as f:
        assert f.get_tensor("transformer.layers.0.attention.qkv.weight").dtype == torch.float8_e4m3fn
        s = f.get_tensor("transformer.layers.0.attention.qkv.weights_scaling_factor")
        assert s.shape == (1,) and s.dtype == torch.float32
        a = model.model.layers[0].self_attn
        assert float(s) == max(float(a.q_proj.weight_scale), float(a.k_proj.weight_scale), float(a.v_proj.weight_scale))
        assert f.get_tensor("transformer.layers.0.mlp.proj.activation_scaling_factor").shape == (1,)
    back = load_checkpoint(out)
    assert len(fp8_layers(back)) == len(fp8_layers(model))
    # layers exported as they were are bit-identical; the fused qkv was re-rounded to the shared scale
    la, lb = model.model.layers[0], back.model.layers[0]
    assert torch.equal(la.mlp.down_proj.qweight, lb.mlp.down_proj.qweight)
    for p in ("q_proj", "k_proj", "v_proj"):
        wa, wb = getattr(la.self_attn, p).dequantized_weight(), getattr(lb.self_attn, p).dequantized_weight()
        step = float(getattr(lb.self_attn, p).weight_scale)  # one e4m3 step at the shared scale is at most 32 x this
        assert (wa - wb).abs().max() <= 32 * step
    ids = tok.encode("KING LEAR:\nBlow, winds, and crack your cheeks")
    la_, lb_ = _logits(model, ids), _logits(back, ids)
    rel = (la_ - lb_).norm() / la_.norm()
    assert rel < 0.02, f"FP8 export moved the logits by {rel:.4f} (relative)"
    assert (la_.argmax(-1) == lb_.argmax(-1)).float().mean() > 0.9


def test_export_refuses_what_it_cannot_write(default_pair, tmp_path):
    from echo_trtllm.models import DEFAULT_TARGET

    model, _ = load_model(DEFAULT_TARGET, with_tokenizer=False)
    quantize_model(model, "per_channel")
    with pytest.raises(ValueError, match="per-tensor"):
        export_checkpoint(model, tmp_path / "x")
    target, _, tok = default_pair
    out = export_checkpoint(target, tmp_path / "y", tok)
    cfg = json.loads((out / "config.json").read_text())
    cfg["mapping"].update(tp_size=2, world_size=2)
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"rank files \[1\] are missing"):
        load_checkpoint(out)
    cfg["mapping"].update(tp_size=1, world_size=2, pp_size=2)
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="pipeline"):
        load_checkpoint(out)
    with pytest.raises(ValueError, match="splits heads and the MLP evenly"):
        export_checkpoint(target, tmp_path / "z", tp_size=4)  # 2 KV heads over 4 ranks


@pytest.mark.parametrize("fp8", [False, True])
def test_tensor_parallel_export_splits_as_trtllm_and_merges_back(default_pair, prompts, tmp_path, fp8):
    """tp_size = 2: rank r's fused qkv is [q_r | k_r | v_r], dense / proj split by columns, fc / gate / lm_head by
    rows, embedding and scales whole; reading both ranks back gives the tp = 1 export's model exactly."""
    from safetensors.torch import load_file

    from echo_trtllm.models import DEFAULT_TARGET

    target, _, tok = default_pair
    model = target
    if fp8:
        model, _ = load_model(DEFAULT_TARGET, with_tokenizer=False)

        def run():
            with LLM(model, None, tokenizer=tok, speculative_config=EchoConfig(policy="ar"), cost_model=None) as llm:
                llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)

        quantize_model(model, "per_tensor", calibrate_amax(model, run))
    one = export_checkpoint(model, tmp_path / "tp1", tok)
    two = export_checkpoint(model, tmp_path / "tp2", tok, tp_size=2)
    cfg = json.loads((two / "config.json").read_text())
    assert cfg["mapping"] == {"world_size": 2, "tp_size": 2, "pp_size": 1}
    whole = load_file(str(one / "rank0.safetensors"))
    ranks = [load_file(str(two / f"rank{r}.safetensors")) for r in range(2)]
    c = model.config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    name = "transformer.layers.0.attention.qkv.weight"
    wq, wk, wv = whole[name].float().split([q, kv, kv])
    for r, part in enumerate(ranks):
        pq, pk, pv = part[name].float().split([q // 2, kv // 2, kv // 2])
        assert torch.equal(pq, wq.chunk(2)[r]) and torch.equal(pk, wk.chunk(2)[r]) and torch.equal(pv, wv.chunk(2)[r])
        for n, dim in (("transformer.layers.1.attention.dense.weight", 1), ("transformer.layers.1.mlp.proj.weight", 1),
                       ("transformer.layers.1.mlp.fc.weight", 0), ("lm_head.weight", 0)):
            assert torch.equal(part[n].float(), whole[n].float().chunk(2, dim)[r]), n
        assert torch.equal(part["transformer.vocab_embedding.weight"], whole["transformer.vocab_embedding.weight"])
        if fp8:
            n = "transformer.layers.0.mlp.fc.weights_scaling_factor"
            assert torch.equal(part[n], whole[n])
    ids = tok.encode("ROMEO:\nBut soft, what light through yonder window")
    assert torch.equal(_logits(load_checkpoint(two), ids), _logits(load_checkpoint(one), ids))


# trtllm-build's flags in TensorRT-LLM 1.2 (tensorrt_llm/commands/build.py and plugin/plugin.py's
# add_plugin_argument), a fact taken from its sources, and the allowed speculative modes
TRTLLM_12_FLAGS = {
    "--checkpoint_dir", "--model_config", "--build_config", "--output_dir", "--max_batch_size", "--max_input_len",
    "--max_seq_len", "--max_decoder_seq_len", "--max_beam_width", "--max_num_tokens", "--opt_num_tokens",
    "--kv_cache_type", "--workers", "--log_level", "--dry_run", "--strip_plan", "--weight_streaming", "--fast_build",
    "--logits_dtype", "--gather_context_logits", "--gather_generation_logits", "--gather_all_token_logits",
    "--speculative_decoding_mode", "--max_draft_len", "--bert_attention_plugin", "--gpt_attention_plugin",
    "--gemm_plugin", "--gemm_swiglu_plugin", "--fp8_rowwise_gemm_plugin", "--lora_plugin", "--moe_plugin",
    "--nccl_plugin", "--context_fmha", "--remove_input_padding", "--tokens_per_block", "--use_paged_context_fmha",
    "--use_fp8_context_fmha", "--multiple_profiles", "--use_fused_mlp", "--reduce_fusion",
}
TRTLLM_12_SPEC_MODES = {"draft_tokens_external", "lookahead_decoding", "medusa", "explicit_draft_tokens", "eagle"}


@pytest.mark.parametrize("fp8", [False, True])
def test_trtllm_build_lines_use_only_1_2_flags_and_derive_the_draft_length(fp8, tmp_path):
    import subprocess

    from echo_trtllm.trtllm_build import build_args, build_script

    config = EchoConfig(max_nodes_per_request=48, k_max=1024)
    target = build_args("t", "e/t", config, 64, 2048, 4096, fp8=fp8)
    draft = build_args("d", "e/d", None, 64, 2048, 4096, fp8=fp8)
    for args in (target, draft):
        flags = [a for a in args if a.startswith("--")]
        assert set(flags) <= TRTLLM_12_FLAGS, set(flags) - TRTLLM_12_FLAGS
    t = dict(zip(target[::2], target[1::2]))
    assert t["--speculative_decoding_mode"] in TRTLLM_12_SPEC_MODES
    assert t["--max_draft_len"] == "47"  # max_nodes_per_request - 1
    assert int(t["--max_num_tokens"]) >= 64 * 48  # every request's full tree fits a step
    assert "--speculative_decoding_mode" not in draft
    script = tmp_path / "b.sh"
    script.write_text(build_script(config, "/opt/libecho_plugin.so", fp8=fp8))
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    text = script.read_text()
    assert "ctypes.CDLL" in text and "RTLD_GLOBAL" in text and "tensorrt_llm.commands.build" in text
    assert "NOT RUN" in text and "1.2" in text
