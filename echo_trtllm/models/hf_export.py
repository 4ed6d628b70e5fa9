"""Hugging Face model directories (`echo-trtllm export --format hf`): what `transformers` and vLLM load.

    save_hf(model, tokenizer, "out/target", "bfloat16")

Writes, in a new directory:

    config.json          ModelConfig.to_hf() (architectures LlamaForCausalLM | Qwen2ForCausalLM, model_type, sizes,
                         rope, tie_word_embeddings, eos / bos ids) + hidden_act, torch_dtype / dtype
    model.safetensors    HF tensor names (the runtime's module names are HF's); lm_head.weight left out when it is
                         the tied embedding; no rotary inv_freq (recomputed from the config by every loader)
    tokenizer files      the transformers tokenizer's save_pretrained (tokenizer.json, tokenizer_config.json, the
                         chat template): for a .gguf source the vocabulary transformers converted from its metadata

A GGUF source is dequantised when it is loaded, so the directory holds float weights in the dtype asked for (vLLM
has no loader for the quantised GGUF pairs this project benchmarks). `write_hf_dir` is the writer this module and
the FP8 checkpoint (`models/fp8.py`) share.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from .llama import CausalLM

__all__ = ["hf_config", "hf_state_dict", "save_hf", "tokenizer_saver", "write_hf_dir", "write_fp8_checkpoint"]

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def tokenizer_saver(tokenizer):
    """The object whose `save_pretrained` writes the tokenizer's files: the transformers tokenizer a loaded
    `Tokenizer` wraps (`.hf`), or a transformers tokenizer itself. ValueError naming it when there is none."""
    hf = getattr(tokenizer, "hf", tokenizer)
    if tokenizer is None or not callable(getattr(hf, "save_pretrained", None)):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} cannot be saved: an HF model directory needs the "
                         "tokenizer's files, and only a transformers tokenizer (what load_model / load_tokenizer "
                         "return, for .gguf files too) can write them")
    return hf


def hf_config(model: CausalLM, dtype: torch.dtype | None = None) -> dict:
    """The model's config.json for HF loaders: ModelConfig.to_hf() with the activation and the weights' dtype
    (both spellings: transformers < 4.56 reads torch_dtype, later ones dtype)."""
    name = _DTYPE_NAMES.get(dtype or model.dtype, str(dtype or model.dtype).removeprefix("torch."))
    return {**model.config.to_hf(), "hidden_act": "silu", "torch_dtype": name, "dtype": name}


def hf_state_dict(model: CausalLM, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The model's tensors under HF's names, as `dtype`: no lm_head.weight when tied (HF ties it back from the
    embedding), no rotary buffers. A Qwen2 model without q/k/v biases gets zero ones (HF's Qwen2 always has them)."""
    c = model.config
    state = {k: v.detach() for k, v in model.state_dict().items() if not k.endswith("inv_freq")}
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if c.architecture == "qwen2" and not c.attention_bias:
        for i in range(c.num_hidden_layers):
            for proj in ("q_proj", "k_proj", "v_proj"):
                w = state[f"model.layers.{i}.self_attn.{proj}.weight"]
                state[f"model.layers.{i}.self_attn.{proj}.bias"] = torch.zeros(w.shape[0], dtype=w.dtype)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    return state


def write_hf_dir(out, config: dict, state: dict[str, Tensor], tokenizer) -> Path:
    """config.json, model.safetensors (`state`, made contiguous, on the CPU) and the tokenizer's files in `out`
    (created). The tokenizer is checked before anything is written."""
    from safetensors.torch import save_file

    saver = tokenizer_saver(tokenizer)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    try:
        saver.save_pretrained(str(out))
    except Exception as e:  # noqa: BLE001 - whatever a tokenizer's save_pretrained raises, named
        raise ValueError(f"{out}: cannot save the tokenizer {type(saver).__name__} ({type(e).__name__}: {e})") from None
    return out


def save_hf(model: CausalLM, tokenizer, out, dtype: str | torch.dtype | None = None) -> Path:
    """Write `model` (float, whole: not an FP8 or tensor-parallel one) and its tokenizer as an HF model directory
    `out` in `dtype` (float32 / bfloat16 / float16; default: the model's). Returns `out`."""
    from .fp8 import fp8_layers
    from .loader import resolve_dtype

    dt = None if dtype is None or dtype == "auto" else resolve_dtype(dtype)  # "auto": refused below, named
    if (dt is None and dtype is not None) or (dt is not None and dt not in _DTYPE_NAMES):
        raise ValueError(f"dtype {dtype!r} is not one an HF directory is written in; choose float32, bfloat16 or "
                         "float16")
    if fp8_layers(model):
        raise ValueError("the model is FP8-quantised: the hf format writes float weights (an FP8 engine's "
                         "checkpoint directory is already in the HF `quant_method: fp8` layout; export its float "
                         "source instead)")
    if getattr(model, "tp", None) is not None:
        raise ValueError("the model is one tensor-parallel rank's shard: export the whole model")
    tokenizer_saver(tokenizer)
    dt = dt or model.dtype
    return write_hf_dir(out, hf_config(model, dt), hf_state_dict(model, dt), tokenizer)


def write_fp8_checkpoint(model: CausalLM, tokenizer, out, scheme: str) -> None:
    """An FP8 model as an HF-style directory: config.json (with quantization_config), model.safetensors in the
    checkpoint layout of models/fp8.py, and the tokenizer's files (also for a model that came from a .gguf file)."""
    from .fp8 import ignored_layers, quant_config, quantized_state_dict

    cfg = {**hf_config(model), "quantization_config": quant_config(scheme, ignored_layers(model))}
    state = quantized_state_dict(model)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    write_hf_dir(out, cfg, state, tokenizer)
