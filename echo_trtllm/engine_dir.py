"""Engine directories: a target + draft pair, the EchoConfig and (later) calibration, self-contained.

    engines/NAME/
      engine.json   {"format_version", "backend": "torch", "dtype", "target", "draft", "echo_config", "provenance"}
      target/       the target model (HF directory contents, or one .gguf file)
      draft/        the draft model, same forms

`build_engine` copies the models in, so the directory needs nothing else; `read_engine` returns what `LLM` loads.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import shutil
from pathlib import Path

from echo_trtllm.core.config import EchoConfig

__all__ = ["FORMAT_VERSION", "build_engine", "read_engine", "main"]

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


def read_engine(path: str | Path) -> tuple[Path, Path | None, EchoConfig, str]:
    """(target path, draft path or None, EchoConfig, dtype) of an engine directory."""
    path = Path(path)
    meta_file = path / "engine.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path} is not an engine directory: engine.json is missing")
    meta = json.loads(meta_file.read_text())
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
    return path / meta["target"], draft, EchoConfig(**cfg), meta.get("dtype", "float32")


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
