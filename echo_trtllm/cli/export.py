"""echo-trtllm export: write an engine's (or a pair's) models as TensorRT-LLM checkpoints for `trtllm-build`.

    echo-trtllm export --format trtllm --engine-dir engines/NAME --output ckpt/NAME
    echo-trtllm export --format trtllm --model M [--draft-model D] --output ckpt/NAME

Writes OUTPUT/target/ and OUTPUT/draft/ (when there is a separate draft model) and OUTPUT/trtllm_build.sh (the
`trtllm-build` command lines, written against TensorRT-LLM 1.2.x, not run here), each model `config.json` +
`rank{N}.safetensors` per tensor-parallel rank (--tp-size, default 1; + the tokenizer's files): TensorRT-LLM 1.2's layout for LLaMA / Qwen2, bf16/fp16/fp32 or FP8
per tensor (an FP8 engine from `build --quantization fp8`). docs/trtllm.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from . import options

PROG = "echo-trtllm export"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--format", required=True, choices=["trtllm"], help="trtllm: a TensorRT-LLM checkpoint")
    options.add_model_options(ap)
    ap.add_argument("--output", required=True, help="directory to create (target/ and draft/ inside)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="the checkpoint's dtype for everything not FP8 (default: bfloat16)")
    ap.add_argument("--plugin-lib", default="plugins/build/libecho_plugin.so",
                    help="the ECHO plugin library the generated trtllm_build.sh loads (default: %(default)s)")
    ap.add_argument("--max-batch-size", type=int, default=64, help="for trtllm_build.sh (default: 64)")
    ap.add_argument("--tp-size", type=int, default=1,
                    help="tensor-parallel ranks: rank{N}.safetensors per rank, split as TensorRT-LLM splits them "
                         "(default: 1)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from echo_trtllm.engine_dir import read_engine
    from echo_trtllm.models.eagle3 import is_eagle3_dir
    from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET
    from echo_trtllm.models.loader import load_model
    from echo_trtllm.core.config import EchoConfig
    from echo_trtllm.models.fp8 import fp8_layers
    from echo_trtllm.models.trtllm_checkpoint import export_checkpoint
    from echo_trtllm.trtllm_build import build_script

    try:
        if args.engine_dir and (args.model or args.draft_model):
            raise ValueError("--engine-dir names its own models; do not also give --model/--draft-model")
        out = Path(args.output)
        if out.exists() and any(out.iterdir()):
            raise FileExistsError(f"{out} exists and is not empty; choose a new directory")
        config = EchoConfig()
        if args.engine_dir:
            spec = read_engine(args.engine_dir)
            sources = {"target": spec.target, "draft": spec.draft}
            config = spec.config
        else:
            target = args.model or DEFAULT_TARGET
            sources = {"target": target, "draft": args.draft_model or (DEFAULT_DRAFT if args.model is None else None)}
        written, fp8 = [], False
        for name, src in sources.items():
            if src is None:
                continue
            if is_eagle3_dir(src):
                print(f"{PROG}: {name} is an EAGLE-3 head: not exported (TensorRT-LLM loads EAGLE-3 heads as they are)")
                continue
            model, tok = load_model(src, dtype=args.dtype)
            written.append(export_checkpoint(model, out / name, tok, tp_size=args.tp_size))
            fp8 = fp8 or bool(fp8_layers(model))
        script = out / "trtllm_build.sh"
        script.write_text(build_script(config, str(Path(args.plugin_lib).resolve()), args.max_batch_size,
                                       dtype=args.dtype, fp8=fp8,
                                       has_draft=(out / "draft").is_dir()))
        script.chmod(0o755)
        written.append(script)
    except options.USAGE_ERRORS as e:
        return options.fail(PROG, e)
    for w in written:
        print(w)
    return 0
