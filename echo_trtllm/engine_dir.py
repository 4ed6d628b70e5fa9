"""Engine directories: a target + draft pair, the EchoConfig and (later) calibration, self-contained.

    engines/NAME/
      engine.json   {"format_version", "backend": "torch", "dtype", "target", "draft", "echo_config", "provenance"}
      target/       the target model (HF directory contents, or one .gguf file; with --quantization fp8 an HF-style
                    FP8 checkpoint, models/fp8.py, and engine.json's "quantization" says how it was calibrated)
      draft/        the draft model, same forms
      calibration.json   written by `echo-trtllm calibrate --engine-dir` (cost curve, gate); named in engine.json

`engine_build.build_engine` copies the models in, so the directory needs nothing else; `read_engine` returns what
`LLM` loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from echo_trtllm.core.config import EchoConfig
from echo_trtllm.jsonfile import read_json_object
from echo_trtllm.models.loader import DTYPE_CHOICES

__all__ = ["FORMAT_VERSION", "EngineSpec", "read_engine", "attach_calibration"]

FORMAT_VERSION = 1


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
