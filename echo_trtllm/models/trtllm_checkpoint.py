"""TensorRT-LLM checkpoints (the input of `trtllm-build --checkpoint_dir`), written and read back.

Layout (TensorRT-LLM 1.2's `PretrainedConfig` / LLaMA and Qwen2 converters; facts in docs/trtllm.md):

    config.json          architecture (LlamaForCausalLM | Qwen2ForCausalLM), dtype, sizes, rope, `mapping`
                         {world_size, tp_size, pp_size}, `quantization` {quant_algo, kv_cache_quant_algo,
                         exclude_modules}
    rank0.safetensors    transformer.vocab_embedding.weight; per layer transformer.layers.{i}.{input_layernorm,
                         attention.qkv (q | k | v rows), attention.dense, post_layernorm, mlp.fc (= gate_proj, the
                         SiLU branch), mlp.gate (= up_proj), mlp.proj (= down_proj)}; transformer.ln_f; lm_head
                         (always written, a copy of the embedding when tied)

FP8 (`quant_algo: "FP8"`, per tensor): each quantised linear's `weight` is float8_e4m3fn with
`weights_scaling_factor` and `activation_scaling_factor` (float32, shape [1], dequantisation scales amax / 448).
The fused qkv gets one scale, the max of q's, k's and v's, and each e4m3 part is dequantised with its own scale and
re-quantised with the shared one (what TensorRT-LLM's loader does with per-projection FP8 checkpoints); that
re-rounding is the FP8 export's own tolerance. gate / up stay separate (`trtllm-build` fuses them). Projections the
runtime kept in float (`ignored_layers`) and the LM head are listed in `exclude_modules`.

Tensor parallelism (`tp_size` > 1, pp = 1): `rank{r}.safetensors` holds rank r's part as TensorRT-LLM's converters
split it: attention.qkv as [q_r | k_r | v_r] (heads split evenly: num_attention_heads and num_key_value_heads must
divide by tp_size), attention.dense and mlp.proj by input columns, mlp.fc / mlp.gate by rows, lm_head by rows (the
vocabulary padded with zero rows to a multiple of tp_size), the embedding (use_parallel_embedding false), norms and
FP8 scaling factors whole on every rank. The loader merges the ranks back. The FP8 per-channel scheme is refused
by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from echo_trtllm.models.fp8 import FP8, FP8_MAX, Fp8Linear, fp8_layers, ignored_layers
from echo_trtllm.models.llama import CausalLM, ModelConfig

__all__ = ["export_checkpoint", "load_checkpoint", "is_trtllm_checkpoint", "ARCHITECTURES"]

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_LINEARS = {"o_proj": "attention.dense", "gate_proj": "mlp.fc", "up_proj": "mlp.gate", "down_proj": "mlp.proj"}
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def is_trtllm_checkpoint(path: Path) -> bool:
    cfg = path / "config.json"
    if not (cfg.is_file() and (path / "rank0.safetensors").is_file()):
        return False
    try:
        return "architecture" in json.loads(cfg.read_text())
    except (ValueError, OSError):
        return False


def _config(model: CausalLM, quant: dict) -> dict:
    c = model.config
    cfg = {
        "architecture": ARCHITECTURES[c.architecture], "dtype": _DTYPES[model.dtype], "logits_dtype": "float32",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_size": c.head_dim, "intermediate_size": c.intermediate_size,
        "max_position_embeddings": c.max_position_embeddings, "norm_epsilon": c.rms_norm_eps, "hidden_act": "silu",
        "position_embedding_type": "rope_gpt_neox", "rotary_base": c.rope_theta, "rotary_scaling": c.rope_scaling,
        "use_parallel_embedding": False, "embedding_sharding_dim": 0, "tie_word_embeddings": c.tie_word_embeddings,
        "attn_bias": c.attention_bias, "mlp_bias": False,
        "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1}, "quantization": quant,
        # not TensorRT-LLM's: what this project's loader needs to rebuild the config exactly
        "echo_trtllm": {"eos_token_ids": list(c.eos_token_ids), "bos_token_id": c.bos_token_id},
    }
    if c.architecture == "qwen2":
        cfg["qwen_type"] = "qwen2"
    return cfg


def _scale(x: float | Tensor) -> Tensor:
    return torch.tensor([float(x)], dtype=torch.float32)


def _linear(out: dict, name: str, layer) -> None:
    """One linear (nn.Linear or Fp8Linear) under TensorRT-LLM's name."""
    if isinstance(layer, Fp8Linear):
        out[f"{name}.weight"] = layer.weight_fp8.clone()
        out[f"{name}.weights_scaling_factor"] = _scale(layer.weight_scale)
        out[f"{name}.activation_scaling_factor"] = _scale(layer.input_scale)
    else:
        out[f"{name}.weight"] = layer.weight.detach().clone()
    if getattr(layer, "bias", None) is not None:
        out[f"{name}.bias"] = layer.bias.detach().clone()


def _qkv(out: dict, name: str, q, k, v) -> None:
    parts = (q, k, v)
    if all(isinstance(p, Fp8Linear) for p in parts):
        shared = max(float(p.weight_scale) for p in parts)
        # each e4m3 part dequantised with its own scale, re-quantised with the shared one
        w = torch.cat([(p.weight_fp8.float() * p.weight_scale / shared).clamp(-FP8_MAX, FP8_MAX).to(FP8)
                       for p in parts])
        out[f"{name}.weight"] = w
        out[f"{name}.weights_scaling_factor"] = _scale(shared)
        out[f"{name}.activation_scaling_factor"] = _scale(max(float(p.input_scale) for p in parts))
    elif any(isinstance(p, Fp8Linear) for p in parts):
        raise ValueError(f"{name}: q, k and v must be quantised alike to be fused")
    else:
        out[f"{name}.weight"] = torch.cat([p.weight.detach() for p in parts])
    if q.bias is not None:
        out[f"{name}.bias"] = torch.cat([p.bias.detach() for p in parts])


def export_checkpoint(model: CausalLM, out, tokenizer=None, tp_size: int = 1) -> Path:
    """Write `model` (float, or FP8 per tensor from models/fp8.py) as a TensorRT-LLM checkpoint in `out`, split for
    `tp_size` ranks, with the tokenizer's files beside it when given (trtllm-build ignores them; runtimes take a
    tokenizer directory)."""
    from safetensors.torch import save_file

    layers = fp8_layers(model)
    if any(layer.scheme != "per_tensor" for layer in layers.values()):
        raise ValueError("only per-tensor FP8 exports to TensorRT-LLM's quant_algo FP8 (per-channel: not yet)")
    if model.dtype not in _DTYPES:
        raise ValueError(f"dtype {model.dtype} has no TensorRT-LLM checkpoint dtype")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    w: dict[str, Tensor] = {"transformer.vocab_embedding.weight": model.model.embed_tokens.weight.detach().clone()}
    for i, layer in enumerate(model.model.layers):
        p = f"transformer.layers.{i}"
        att, mlp = layer.self_attn, layer.mlp
        w[f"{p}.input_layernorm.weight"] = layer.input_layernorm.weight.detach().clone()
        w[f"{p}.post_layernorm.weight"] = layer.post_attention_layernorm.weight.detach().clone()
        _qkv(w, f"{p}.attention.qkv", att.q_proj, att.k_proj, att.v_proj)
        _linear(w, f"{p}.attention.dense", att.o_proj)
        for hf, trt in (("gate_proj", "mlp.fc"), ("up_proj", "mlp.gate"), ("down_proj", "mlp.proj")):
            _linear(w, f"{p}.{trt}", getattr(mlp, hf))
    w["transformer.ln_f.weight"] = model.model.norm.weight.detach().clone()
    w["lm_head.weight"] = model.lm_head.weight.detach().clone()
    if layers:
        excluded = ["lm_head"] + sorted({_trt_name(n) for n in ignored_layers(model)})
        quant = {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": excluded}
    else:
        quant = {"quant_algo": None, "kv_cache_quant_algo": None, "exclude_modules": None}
    c = model.config
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if tp_size > 1 and (c.num_attention_heads % tp_size or c.num_key_value_heads % tp_size
                        or c.intermediate_size % tp_size):
        raise ValueError(f"tp_size={tp_size}: TensorRT-LLM splits heads and the MLP evenly, but this model has "
                         f"{c.num_attention_heads} query heads, {c.num_key_value_heads} KV heads and intermediate size "
                         f"{c.intermediate_size}")
    for rank in range(tp_size):
        part = _rank_part(w, c, rank, tp_size)
        save_file({k: v.contiguous() for k, v in part.items()}, str(out / f"rank{rank}.safetensors"))
    cfg = _config(model, quant)
    cfg["mapping"] = {"world_size": tp_size, "tp_size": tp_size, "pp_size": 1}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.hf.save_pretrained(str(out))
    return out


def _qkv_sizes(c: ModelConfig, tp: int) -> list[int]:
    return [c.num_attention_heads * c.head_dim // tp, c.num_key_value_heads * c.head_dim // tp,
            c.num_key_value_heads * c.head_dim // tp]


def _rank_part(w: dict[str, Tensor], c: ModelConfig, rank: int, tp: int) -> dict[str, Tensor]:
    """Rank `rank`'s tensors of the whole checkpoint `w` (see the module docstring)."""
    if tp == 1:
        return w

    def chunk(t: Tensor, dim: int) -> Tensor:
        return t.chunk(tp, dim)[rank] if t.shape[dim] % tp == 0 else _bad(t)

    out = {}
    whole = [c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim,
             c.num_key_value_heads * c.head_dim]
    for name, t in w.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("weights_scaling_factor", "activation_scaling_factor") or "layernorm" in name or \
                name in ("transformer.ln_f.weight", "transformer.vocab_embedding.weight"):
            out[name] = t
        elif ".attention.qkv." in name:
            out[name] = torch.cat([chunk(p, 0) for p in t.split(whole)])
        elif name.endswith(("attention.dense.weight", "mlp.proj.weight")):
            out[name] = chunk(t, 1)
        elif name.startswith("lm_head"):
            pad = -t.shape[0] % tp
            out[name] = chunk(torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t, 0)
        else:  # mlp.fc / mlp.gate weights
            out[name] = chunk(t, 0)
    return out


def _bad(t: Tensor):
    raise ValueError(f"a tensor of shape {tuple(t.shape)} does not split evenly over the ranks")


def _merge_ranks(parts: list[dict[str, Tensor]], c: ModelConfig) -> dict[str, Tensor]:
    """The inverse of `_rank_part`: the whole checkpoint from every rank's tensors."""
    tp = len(parts)
    if tp == 1:
        return parts[0]
    out = {}
    for name, t in parts[0].items():
        if name.endswith(("weights_scaling_factor", "activation_scaling_factor")):
            out[name] = t
        elif ".attention.qkv." in name:
            split = [p[name].split(_qkv_sizes(c, tp)) for p in parts]
            out[name] = torch.cat([torch.cat([s[j] for s in split]) for j in range(3)])
        elif name.endswith(("attention.dense.weight", "mlp.proj.weight")):
            out[name] = torch.cat([p[name] for p in parts], 1)
        elif name.startswith("lm_head"):
            out[name] = torch.cat([p[name] for p in parts])[: c.vocab_size]
        elif name.endswith(("mlp.fc.weight", "mlp.gate.weight", "mlp.fc.bias", "mlp.gate.bias")):
            out[name] = torch.cat([p[name] for p in parts])
        else:
            out[name] = t
    return out


def _trt_name(hf_name: str) -> str:
    """model.layers.3.mlp.up_proj -> transformer.layers.3.mlp.gate (q/k/v -> the fused attention.qkv)."""
    parts = hf_name.split(".")
    i, leaf = parts[2], parts[-1]
    trt = "attention.qkv" if leaf in ("q_proj", "k_proj", "v_proj") else _LINEARS[leaf]
    return f"transformer.layers.{i}.{trt}"


def load_checkpoint(path, dtype: torch.dtype = torch.float32, device="cpu") -> CausalLM:
    """A TensorRT-LLM checkpoint (every tensor-parallel rank, merged; pp = 1) as this runtime's CausalLM; FP8 layers
    stay FP8."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    arch = {v: k for k, v in ARCHITECTURES.items()}.get(cfg.get("architecture"))
    if arch is None:
        raise ValueError(f"{path}: architecture {cfg.get('architecture')!r} is not one of {sorted(ARCHITECTURES.values())}")
    mapping = cfg.get("mapping") or {}
    tp = mapping.get("tp_size", 1)
    if mapping.get("pp_size", 1) != 1 or mapping.get("world_size", tp) != tp:
        raise ValueError(f"{path}: mapping {mapping} has pipeline ranks; this loader reads tensor-parallel ranks only")
    missing_ranks = [r for r in range(tp) if not (path / f"rank{r}.safetensors").is_file()]
    if missing_ranks:
        raise ValueError(f"{path}: mapping tp_size={tp} but rank files {missing_ranks} are missing")
    quant = (cfg.get("quantization") or {}).get("quant_algo")
    if quant not in (None, "FP8"):
        raise ValueError(f"{path}: quant_algo {quant!r} is not supported; supported: none, FP8")
    extra = cfg.get("echo_trtllm") or {}
    config = ModelConfig(
        architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_size"], rms_norm_eps=cfg["norm_epsilon"], rope_theta=float(cfg["rotary_base"]),
        max_position_embeddings=cfg["max_position_embeddings"], tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=cfg.get("attn_bias", False), rope_scaling=cfg.get("rotary_scaling"),
        eos_token_ids=tuple(extra.get("eos_token_ids", ())), bos_token_id=extra.get("bos_token_id"))
    w = _merge_ranks([load_file(str(path / f"rank{r}.safetensors")) for r in range(tp)], config)
    model = CausalLM(config)
    h, hk, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    sizes = [h * hd, hk * hd, hk * hd]
    state = {"model.embed_tokens.weight": w["transformer.vocab_embedding.weight"],
             "model.norm.weight": w["transformer.ln_f.weight"]}
    fp8: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
    for i in range(config.num_hidden_layers):
        p, hf = f"transformer.layers.{i}", f"model.layers.{i}"
        state[f"{hf}.input_layernorm.weight"] = w[f"{p}.input_layernorm.weight"]
        state[f"{hf}.post_attention_layernorm.weight"] = w[f"{p}.post_layernorm.weight"]
        qkv = w[f"{p}.attention.qkv.weight"]
        bias = w.get(f"{p}.attention.qkv.bias")
        for name, part, b in zip(("q_proj", "k_proj", "v_proj"), qkv.split(sizes),
                                 bias.split(sizes) if bias is not None else (None,) * 3):
            _place(state, fp8, f"{hf}.self_attn.{name}", part, w, f"{p}.attention.qkv", b)
        _place(state, fp8, f"{hf}.self_attn.o_proj", w[f"{p}.attention.dense.weight"], w, f"{p}.attention.dense")
        for hf_name, trt in (("gate_proj", "mlp.fc"), ("up_proj", "mlp.gate"), ("down_proj", "mlp.proj")):
            _place(state, fp8, f"{hf}.mlp.{hf_name}", w[f"{p}.{trt}.weight"], w, f"{p}.{trt}")
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = w["lm_head.weight"]
    _install_fp8(model, fp8)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith(("qweight", "weight_scale", "input_scale"))
               and not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{path}: tensors do not match; missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.to(dtype=dtype, device=device).eval()


def _place(state: dict, fp8: dict, hf: str, weight: Tensor, w: dict, trt: str, bias: Tensor | None = None) -> None:
    if bias is None:
        bias = w.get(f"{trt}.bias")
    if weight.dtype == FP8:
        fp8[hf] = (weight, w[f"{trt}.weights_scaling_factor"].reshape(()), w[f"{trt}.activation_scaling_factor"].reshape(()))
    else:
        state[f"{hf}.weight"] = weight
    if bias is not None:
        state[f"{hf}.bias"] = bias


def _install_fp8(model: CausalLM, fp8: dict) -> None:
    for name, (weight, w_scale, a_scale) in fp8.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, attr)
        layer = Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None, "per_tensor")
        layer.qweight.copy_(weight.view(torch.uint8))
        layer.weight_scale.copy_(w_scale.float())
        layer.input_scale.copy_(a_scale.float())
        setattr(parent, attr, layer)
