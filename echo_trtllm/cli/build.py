"""echo-trtllm build: an engine directory (backend torch) from a target + draft pair.

    echo-trtllm build --model M --draft-model D --output engines/NAME [--policy echo --k-max 512 ...]
"""

from __future__ import annotations

import argparse

from . import options

PROG = "echo-trtllm build"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    options.add_model_options(ap, engine_dir=False)
    ap.add_argument("--output", required=True, help="engine directory to create, e.g. engines/tiny")
    options.add_dtype_option(ap, "recorded in engine.json and resolved when the engine is loaded")
    g = ap.add_argument_group("quantization")
    g.add_argument("--quantization", default="none", choices=["none", "fp8"],
                   help="fp8: e4m3 weights + calibrated activation scales for every decoder projection (default: none)")
    g.add_argument("--fp8-scheme", default="per_tensor", choices=["per_tensor", "per_channel"],
                   help="per_tensor: static activation scales; per_channel: per-row weights, per-token activations")
    g.add_argument("--calibration-prompts", default="humaneval",
                   help="prompt set whose calibration split calibrates the FP8 scales (default: humaneval; its "
                        "evaluation split is never used here)")
    options.add_speculation_options(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    from echo_trtllm.engine_build import build_engine
    from echo_trtllm.models import DEFAULT_TARGET, default_drafter

    args = build_parser().parse_args(argv)
    try:
        model = args.model or DEFAULT_TARGET
        draft = args.draft_model or (default_drafter() if args.model is None else None)
        prompts = None
        if args.quantization == "fp8":
            from echo_trtllm.bench.prompts import load_prompts

            prompts = load_prompts(args.calibration_prompts, split="calibration")
        out = build_engine(args.output, model, draft, options.echo_config(args), args.dtype, args.quantization,
                           args.fp8_scheme, prompts)
    except options.USAGE_ERRORS as e:
        return options.fail(PROG, e)
    print(out)
    return 0
