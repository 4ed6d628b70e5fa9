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
    ap.add_argument("--dtype", default="auto", choices=options.DTYPE_CHOICES,
                    help="recorded in engine.json; auto is resolved when the engine is loaded (default: auto)")
    options.add_speculation_options(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    from echo_trtllm.engine_dir import build_engine
    from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET

    args = build_parser().parse_args(argv)
    try:
        model = args.model or DEFAULT_TARGET
        draft = args.draft_model or (DEFAULT_DRAFT if args.model is None else None)
        out = build_engine(args.output, model, draft, options.echo_config(args), args.dtype)
    except options.USAGE_ERRORS as e:
        return options.fail(PROG, e)
    print(out)
    return 0
