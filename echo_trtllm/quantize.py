"""FP8 quantisation of a model or an EAGLE-3 head, calibrated end to end: the calibration prompts run through the
engine (`LLM`) while the layers record their inputs' amax, then the model is quantised and written in the FP8
checkpoint layout (`echo-trtllm build --quantization fp8`, engine_dir.py; docs/fp8.md). The FP8 layers, the amax
recorder and the checkpoint layout are in models/fp8.py; this module sits above the engine it drives.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from echo_trtllm.api import LLM
from echo_trtllm.core.config import EchoConfig
from echo_trtllm.jsonfile import read_json_object
from echo_trtllm.models.eagle3 import load_eagle3
from echo_trtllm.models.fp8 import (SCHEMES, calibrate_amax, fp8_layers, ignored_layers, quant_config,
                                    quantize_model, quantized_state_dict, weight_bytes)
from echo_trtllm.models.hf_export import write_fp8_checkpoint
from echo_trtllm.models.loader import load_model
from echo_trtllm.runtime.request import SamplingParams

__all__ = ["quantize_source", "quantize_eagle3_source"]


def _calibrated(model: nn.Module, scheme: str, run) -> nn.Module:
    """Quantise `model` in place: per tensor after `run()` has pushed calibration data through it."""
    quantize_model(model, scheme, calibrate_amax(model, run) if scheme == "per_tensor" else None)
    return model


def _check_calibration(scheme: str, prompts: list[str]) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"FP8 scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    if not prompts:
        raise ValueError("FP8 calibration needs at least one prompt")


def quantize_source(source, out, scheme: str, prompts: list[str], max_tokens: int = 16) -> dict:
    """Load a model (HF directory or .gguf), calibrate the inputs' amax on `prompts` (each prompt and `max_tokens`
    greedy tokens through the runtime, plain AR), quantise and write the checkpoint to `out`. Returns a summary:
    scheme, calibration prompts, weight bytes before and after."""
    _check_calibration(scheme, prompts)
    model, tok = load_model(source, dtype="float32")
    before = weight_bytes(model)

    def run() -> None:
        with LLM(model, None, tokenizer=tok, speculative_config=EchoConfig(policy="ar"),
                 max_batch_size=min(len(prompts), 16), cost_model=None) as llm:
            llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)

    write_fp8_checkpoint(_calibrated(model, scheme, run), tok, out, scheme)
    return _summary(model, scheme, prompts, max_tokens, before)


def _summary(model: nn.Module, scheme: str, prompts: list[str], max_tokens: int, before: int) -> dict:
    return {"scheme": scheme, "calibration_prompts": len(prompts), "calibration_tokens_per_prompt": max_tokens,
            "weight_bytes_float32": before, "weight_bytes_fp8": weight_bytes(model),
            "quantized_layers": len(fp8_layers(model)), "ignored_layers": ignored_layers(model)}


def quantize_eagle3_source(head_dir, target_source, out, scheme: str, prompts: list[str],
                           max_tokens: int = 16) -> dict:
    """An EAGLE-3 head quantised like a model: its decoder layer's projections become FP8, calibrated (per tensor)
    on the head's inputs while the float32 target drafts `prompts` with it (EAGLE-2 trees, so the head sees the
    tree inputs it serves). `fc` (the fusion of three feature layers whose magnitudes differ by orders: one
    per-tensor scale would flush the small ones) and the LM head stay in the model's dtype. Writes the head's
    config.json (+ quantization_config) and model.safetensors (EAGLE layout, `midlayer.` names, d2t) to `out`."""
    _check_calibration(scheme, prompts)
    target, tok = load_model(target_source, dtype="float32")
    head = load_eagle3(head_dir, target, dtype=torch.float32)
    before = weight_bytes(head)

    def run() -> None:
        with LLM(target, head, tokenizer=tok, speculative_config=EchoConfig(policy="eagle2"),
                 max_batch_size=min(len(prompts), 16), cost_model=None, fallback=False) as llm:
            llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)

    _calibrated(head, scheme, run)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {**read_json_object(Path(head_dir) / "config.json"), "torch_dtype": "float32",
           "quantization_config": quant_config(scheme, ignored_layers(head))}
    save_file({k: v.contiguous() for k, v in quantized_state_dict(head).items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return _summary(head, scheme, prompts, max_tokens, before)
