"""Engine directories: a target + draft pair, the EchoConfig and (later) calibration, self-contained.

    engines/NAME/
      engine.json   {"format_version", "backend": "torch", "dtype", "target", "draft", "echo_config", "provenance"}
      target/       the target model (HF directory contents, or one .gguf file; with --quantization fp8 an HF-style
                    FP8 checkpoint, models/fp8.py, and engine.json's "quantization" says how it was calibrated)
      draft/        the draft model, same forms
      calibration.json   written by `echo-trtllm calibrate --engine-dir` (cost curve, gate); named in engine.json

`build_engine` copies the models in, so the directory needs nothing else; `read_engine` returns what `LLM` loads.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import shutil
from pathlib import Path
from typing import NamedTuple

from echo_trtllm.core.config import EchoConfig
from echo_trtllm.jsonfile import read_json_object
from echo_trtllm.models.loader import DTYPE_CHOICES

__all__ = ["FORMAT_VERSION", "QUANTIZATIONS", "EngineSpec", "build_engine", "read_engine", "attach_calibration"]

FORMAT_VERSION = 1


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
    from echo_trtllm.models.eagle3 import is_eagle3_dir
    from echo_trtllm.models.fp8 import quantize_eagle3_source, quantize_source

    if not src.exists():
        raise FileNotFoundError(f"model path {str(src)!r} does not exist")
    if is_eagle3_dir(src):
        return dst.name, {"kind": "eagle3", **quantize_eagle3_source(src, target, dst, scheme, prompts)}
    return dst.name, quantize_source(src, dst, scheme, prompts)


def build_engine(output: str | Path, model: str | Path, draft_model: str | Path | None, config: EchoConfig,
                 dtype: str = "float32", quantization: str = "none", fp8_scheme: str = "per_tensor",
                 calibration_prompts: list[str] | None = None) -> Path:
    """Copy the pair into a new engine directory; with quantization "fp8" the models are calibrated on
    `calibration_prompts`, quantised (models/fp8.py) and written in the FP8 checkpoint layout instead."""
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


class EngineSpec(NamedTuple):
    target: Path
    draft: Path | None
    config: EchoConfig
    dtype: str
    # calibration file (echo-trtllm calibrate), or None when the engine is uncalibrated
    calibration: Path | None = None


def _read_meta(path: Path) -> dict:
    meta_file = path / "engine.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path} is not an engine directory: engine.json is missing")
    return read_json_object(meta_file)


def attach_calibration(path: str | Path, calibration) -> Path:
    """Write a `Calibration` into the engine directory and name it in engine.json; returns the file."""
    from echo_trtllm.runtime.calibrate import CALIBRATION_FILE

    path = Path(path)
    meta = _read_meta(path)
    calibration.save(path / CALIBRATION_FILE)
    meta["calibration"] = CALIBRATION_FILE
    (path / "engine.json").write_text(json.dumps(meta, indent=2) + "\n")
    return path / CALIBRATION_FILE


def read_engine(path: str | Path) -> EngineSpec:
    """Target path, draft path or None, EchoConfig, dtype and calibration file of an engine directory. Every
    problem with engine.json is a ValueError naming the file and the field."""
    path = Path(path)
    meta = _read_meta(path)
    where = path / "engine.json"
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{where}: format_version {meta.get('format_version')!r}; this build reads {FORMAT_VERSION}")
    if meta.get("backend") != "torch":
        raise ValueError(f"{where}: backend {meta.get('backend')!r}; this runtime runs backend 'torch'")
    for key, kind in (("target", str), ("echo_config", dict)):
        if not isinstance(meta.get(key), kind):
            raise ValueError(f"{where}: field {key!r} must be a {kind.__name__}, got {meta.get(key)!r}")
    for key in ("draft", "calibration"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            raise ValueError(f"{where}: field {key!r} must be a path inside the engine or null, got {meta[key]!r}")
    dtype = meta.get("dtype", "float32")
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"{where}: dtype {dtype!r} is not one of {', '.join(DTYPE_CHOICES)}")
    cfg = dict(meta["echo_config"])
    try:
        if "static_choices" in cfg:
            cfg["static_choices"] = tuple(tuple(c) for c in cfg["static_choices"])
        for key in ("gate_depths", "gate_thresholds"):
            if cfg.get(key) is not None:
                cfg[key] = tuple(cfg[key])
        config = EchoConfig(**cfg)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: echo_config is invalid ({e})") from None
    draft = path / meta["draft"] if meta.get("draft") else None
    calibration = path / meta["calibration"] if meta.get("calibration") else None
    if calibration is not None and not calibration.is_file():
        raise FileNotFoundError(f"engine {path} names calibration {meta['calibration']!r}, which is missing")
    return EngineSpec(path / meta["target"], draft, config, dtype, calibration)
