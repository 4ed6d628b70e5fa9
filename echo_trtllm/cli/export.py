"""echo-trtllm export: write an engine's (or a pair's) models as TensorRT-LLM checkpoints or Hugging Face directories.

    echo-trtllm export --format trtllm --engine-dir engines/NAME --output ckpt/NAME
    echo-trtllm export --format trtllm --model M [--draft-model D] --output ckpt/NAME
    echo-trtllm export --format hf --model M [--draft-model D] --output hf/NAME [--dtype bfloat16]

Writes OUTPUT/target/ and OUTPUT/draft/ (when there is a separate draft model; an EAGLE-3 head is skipped with a
message: it is used as it is). docs/trtllm.md.

trtllm: OUTPUT/trtllm_build.sh too (the `trtllm-build` command lines, written against TensorRT-LLM 1.2.x, not run
here), each model `config.json` + `rank{N}.safetensors` per tensor-parallel rank (--tp-size, default 1; + the
tokenizer's files): TensorRT-LLM 1.2's layout for LLaMA / Qwen2, bf16/fp16/fp32 or FP8 per tensor (an FP8 engine
from `build --quantization fp8`).

hf: each model as a Hugging Face directory (`config.json`, `model.safetensors`, the tokenizer's files) in --dtype,
what `transformers` and vLLM load: a .gguf source (the Qwen2.5-Coder GGUF pairs) dequantised (vLLM's CPU build
has no GGUF loader). Float models only (an FP8 engine's checkpoint already is an HF directory).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from echo_trtllm.api import DEFAULT_MAX_BATCH_SIZE

from . import options

PROG = "echo-trtllm export"
TRTLLM_DEFAULTS = {"plugin_lib": "plugins/build/libecho_plugin.so", "max_batch_size": DEFAULT_MAX_BATCH_SIZE}
TRTLLM_ONLY = {"--plugin-lib": ("--plugin-lib",), "--max-batch-size": ("--max-batch-size",),
               "--tp-size": ("--tp-size", "--tensor-parallel-size")}  # flag -> its spellings


def build_parser() -> argparse.ArgumentParser:
    # no abbreviations: the --format trtllm only flags are recognised by their spellings
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--format", required=True, choices=["trtllm", "hf"],
                    help="trtllm: a TensorRT-LLM checkpoint (for trtllm-build); hf: a Hugging Face model directory "
                         "(for vLLM and transformers; a .gguf source dequantised)")
    options.add_model_options(ap)
    ap.add_argument("--output", required=True, help="directory to create, new or empty (target/ and draft/ inside)")
    options.add_dtype_option(ap, "the written weights' dtype (trtllm: everything not FP8; float32, bfloat16 or "
                                 "float16); auto here writes bfloat16, what the GPU engine it is for runs")
    g = ap.add_argument_group("--format trtllm only")
    g.add_argument("--plugin-lib",
                   help="the ECHO plugin library the generated trtllm_build.sh loads "
                        f"(default: {TRTLLM_DEFAULTS['plugin_lib']})")
    options.add_max_batch_size_option(g, " for trtllm_build.sh")
    options.add_tp_size_option(g, "of the TensorRT-LLM checkpoint: rank{N}.safetensors per rank, split as "
                                  "TensorRT-LLM splits them")
    return ap


def _sources(args) -> tuple[dict, object]:
    """{"target": path, "draft": path or None} and the EchoConfig, each path checked to exist (errors name the
    flag) before anything is loaded or written."""
    from echo_trtllm.core.config import EchoConfig
    from echo_trtllm.engine_dir import read_engine
    from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET
    from echo_trtllm.models.loader import check_model_path

    if args.engine_dir and (args.model or args.draft_model):
        raise ValueError("--engine-dir names its own models; do not also give --model/--draft-model")
    if args.engine_dir:
        spec = read_engine(args.engine_dir)
        sources, flags, config = {"target": spec.target, "draft": spec.draft}, {}, spec.config
    else:
        sources = {"target": args.model or DEFAULT_TARGET,
                   "draft": args.draft_model or (DEFAULT_DRAFT if args.model is None else None)}
        flags, config = {"target": "--model", "draft": "--draft-model"}, EchoConfig()
    for name, src in sources.items():
        if src is not None:
            check_model_path(src, flags.get(name, f"--engine-dir {name}"))
    return sources, config


def _given(argv: list[str], spellings: tuple[str, ...]) -> bool:
    return any(a == s or a.startswith(s + "=") for a in argv for s in spellings)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    from echo_trtllm.models.eagle3 import is_eagle3_dir
    from echo_trtllm.models.fp8 import fp8_layers
    from echo_trtllm.models.hf_export import save_hf
    from echo_trtllm.models.loader import load_model
    from echo_trtllm.models.trtllm_checkpoint import export_checkpoint
    from echo_trtllm.trtllm_build import build_script

    try:
        if args.format == "hf":
            given = [flag for flag, spellings in TRTLLM_ONLY.items() if _given(argv, spellings)]
            if given:
                raise ValueError(f"{', '.join(given)}: only for --format trtllm")
        for key, default in TRTLLM_DEFAULTS.items():
            if getattr(args, key) is None:
                setattr(args, key, default)
        if args.dtype == "auto":
            args.dtype = "bfloat16"
        if args.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype {args.dtype}: a checkpoint is written in float32, bfloat16 or float16")
        out = Path(args.output)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise FileExistsError(f"--output {out} exists and is not an empty directory; choose a new directory")
        sources, config = _sources(args)
        written, fp8 = [], False
        for name, src in sources.items():
            if src is None:
                continue
            if is_eagle3_dir(src):
                why = "TensorRT-LLM loads EAGLE-3 heads as they are" if args.format == "trtllm" else \
                    "its directory is used as it is"
                print(f"{PROG}: {name} is an EAGLE-3 head: not exported ({why})")
                continue
            model, tok = load_model(src, dtype=args.dtype)
            if args.format == "hf":
                written.append(save_hf(model, tok, out / name, args.dtype))
                continue
            written.append(export_checkpoint(model, out / name, tok, tp_size=args.tp_size))
            fp8 = fp8 or bool(fp8_layers(model))
        if args.format == "trtllm":
            script = out / "trtllm_build.sh"
            script.write_text(build_script(config, str(Path(args.plugin_lib).resolve()), args.max_batch_size,
                                           dtype=args.dtype, fp8=fp8, has_draft=(out / "draft").is_dir()))
            script.chmod(0o755)
            written.append(script)
    except options.USAGE_ERRORS as e:
        return options.fail(PROG, e)
    for w in written:
        print(w)
    return 0
