"""Engine directories: a target + draft pair, the EchoConfig and (later) calibration, self-contained.

    engines/NAME/
      engine.json   {"format_version", "backend": "torch", "dtype", "target", "draft", "echo_config", "provenance"}
      target/       the target model (HF directory contents, or one .gguf file)
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

__all__ = ["FORMAT_VERSION", "EngineSpec", "build_engine", "read_engine", "attach_calibration", "main"]

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


def build_engine(output: str | Path, model: str | Path, draft_model: str | Path | None, config: EchoConfig,
                 dtype: str = "float32") -> Path:
    out = Path(output)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new engine directory")
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "format_version": FORMAT_VERSION,
        "backend": "torch",
        "dtype": dtype,
        "target": _copy_model(Path(model), out / "target"),
        "draft": _copy_model(Path(draft_model), out / "draft") if draft_model else None,
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
    return json.loads(meta_file.read_text())


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
    """Target path, draft path or None, EchoConfig, dtype and calibration file of an engine directory."""
    path = Path(path)
    meta = _read_meta(path)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"engine {path} has format_version {meta.get('format_version')!r}; this build reads {FORMAT_VERSION}")
    if meta.get("backend") != "torch":
        raise ValueError(f"engine {path} has backend {meta.get('backend')!r}; this runtime runs backend 'torch'")
    cfg = dict(meta["echo_config"])
    cfg["static_choices"] = tuple(tuple(c) for c in cfg["static_choices"])
    for key in ("gate_depths", "gate_thresholds"):
        if cfg.get(key) is not None:
            cfg[key] = tuple(cfg[key])
    draft = path / meta["draft"] if meta.get("draft") else None
    calibration = path / meta["calibration"] if meta.get("calibration") else None
    if calibration is not None and not calibration.is_file():
        raise FileNotFoundError(f"engine {path} names calibration {meta['calibration']!r}, which is missing")
    return EngineSpec(path / meta["target"], draft, EchoConfig(**cfg), meta.get("dtype", "float32"), calibration)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    from echo_trtllm.core.config import POLICY_NAMES
    from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET

    ap = argparse.ArgumentParser(prog="echo-trtllm build", description="build an engine directory (backend torch)")
    ap.add_argument("--model", default=str(DEFAULT_TARGET))
    ap.add_argument("--draft-model", default=str(DEFAULT_DRAFT))
    ap.add_argument("--output", required=True, help="engine directory to create, e.g. engines/tiny")
    ap.add_argument("--policy", default="echo", choices=POLICY_NAMES)
    ap.add_argument("--k-max", type=int, default=512)
    ap.add_argument("--max-depth", type=int, default=6)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args(argv)
    try:
        out = build_engine(args.output, args.model, args.draft_model,
                           EchoConfig(policy=args.policy, k_max=args.k_max, max_depth=args.max_depth), args.dtype)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"echo-trtllm build: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
