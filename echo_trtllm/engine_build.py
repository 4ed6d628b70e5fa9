"""Building an engine directory (`echo-trtllm build`; the layout and its reader are in engine_dir.py): the pair
copied in, or calibrated and quantised to FP8 through the engine itself (quantize.py), with engine.json beside it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import shutil
from pathlib import Path

from echo_trtllm.core.config import EchoConfig
from echo_trtllm.engine_dir import FORMAT_VERSION
from echo_trtllm.models.eagle3 import is_eagle3_dir
from echo_trtllm.quantize import quantize_eagle3_source, quantize_source

__all__ = ["QUANTIZATIONS", "build_engine"]


def _copy_model(src: Path, dst: Path) -> str:
    if not src.exists():
        raise FileNotFoundError(f"model path {str(src)!r} does not exist")
    dst.mkdir(parents=True, exist_ok=True)
    if src.is_file():
        if src.suffix != ".gguf":
            raise ValueError(f"{src} is not a .gguf file or an HF model directory")
        shutil.copy2(src, dst / src.name)
        return f"{dst.name}/{src.name}"
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} is not an HF model directory: config.json is missing")
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, dst / f.name)
    return dst.name


QUANTIZATIONS = ("none", "fp8")


def _quantize_model(src: Path, dst: Path, scheme: str, prompts: list[str], target: Path | None = None) -> tuple[str, dict]:
    """Quantise one model of the pair into `dst`; an EAGLE-3 head is calibrated while drafting for `target`."""
    if not src.exists():
        raise FileNotFoundError(f"model path {str(src)!r} does not exist")
    if is_eagle3_dir(src):
        return dst.name, {"kind": "eagle3", **quantize_eagle3_source(src, target, dst, scheme, prompts)}
    return dst.name, quantize_source(src, dst, scheme, prompts)


def build_engine(output: str | Path, model: str | Path, draft_model: str | Path | None, config: EchoConfig,
                 dtype: str = "float32", quantization: str = "none", fp8_scheme: str = "per_tensor",
                 calibration_prompts: list[str] | None = None) -> Path:
    """Copy the pair into a new engine directory; with quantization "fp8" the models are calibrated on
    `calibration_prompts`, quantised (quantize.py, models/fp8.py) and written in the FP8 checkpoint layout instead."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "fp8" and not calibration_prompts:
        raise ValueError("quantization 'fp8' needs calibration prompts")
    out = Path(output)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new engine directory")
    out.mkdir(parents=True, exist_ok=True)
    quant = None
    try:
        if quantization == "fp8":
            target, t_summary = _quantize_model(Path(model), out / "target", fp8_scheme, calibration_prompts)
            draft, d_summary = _quantize_model(Path(draft_model), out / "draft", fp8_scheme, calibration_prompts,
                                               target=Path(model)) \
                if draft_model else (None, None)
            quant = {"algo": "fp8", "scheme": fp8_scheme, "target": t_summary, "draft": d_summary}
        else:
            target = _copy_model(Path(model), out / "target")
            draft = _copy_model(Path(draft_model), out / "draft") if draft_model else None
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # no half-built engine left behind
        raise
    meta = {
        "format_version": FORMAT_VERSION,
        "backend": "torch",
        "dtype": dtype,
        "quantization": quant,
        "target": target,
        "draft": draft,
        "echo_config": dataclasses.asdict(config),
        "calibration": None,
        "provenance": {"built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "target_source": Path(model).name, "draft_source": Path(draft_model).name if draft_model else None},
    }
    (out / "engine.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out
