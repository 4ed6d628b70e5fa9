"""echo-trtllm triton-repo: write a Triton model repository that serves an engine directory through Triton's Python
backend, with tensorrtllm_backend's ensemble interface (the model is named `ensemble` by default).

    echo-trtllm triton-repo --engine-dir engines/NAME --output model_repo [--model-name ensemble]
    tritonserver --model-repository model_repo      # in an image whose Python has echo-trtllm installed

docs/serving.md has the layout and the tensors.
"""

from __future__ import annotations

import argparse

from . import options

PROG = "echo-trtllm triton-repo"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--engine-dir", help="an engine directory built by `echo-trtllm build` (default: the embedded "
                                         "target with its EAGLE-3 head, as LLM())")
    ap.add_argument("--output", required=True, help="the model repository to write (created if missing)")
    ap.add_argument("--model-name", default="ensemble", help="the Triton model's name (default: ensemble)")
    options.add_max_batch_size_option(ap)
    options.add_max_seq_len_option(ap)
    ap.add_argument("--python-path", action="append",
                    help="a directory the model puts on sys.path (repeat; Triton's Python stub ignores PYTHONPATH). "
                         "Default: this environment's echo-trtllm and site-packages; 'none' for none (echo-trtllm "
                         "installed in Triton's own Python)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from echo_trtllm.serve.triton_repo import write_model_repository

    try:
        if (args.max_batch_size is not None and args.max_batch_size < 1) or args.max_seq_len < 2:
            raise ValueError("--max-batch-size must be >= 1 and --max-seq-len >= 2")
        if not args.model_name.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise ValueError(f"--model-name may hold letters, digits, '-', '_' and '.', got {args.model_name!r}")
        paths = None if not args.python_path else [p for p in args.python_path if p != "none"]
        model = write_model_repository(args.output, args.engine_dir, args.model_name, args.max_batch_size,
                                       args.max_seq_len, paths)
    except options.USAGE_ERRORS as e:
        return options.fail(PROG, e)
    print(f"wrote {model}/config.pbtxt and {model}/1/model.py")
    return 0
