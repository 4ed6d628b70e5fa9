"""echo-trtllm command line: one module per command, each with `main(argv) -> int`, listed once in COMMANDS; the
flags they share are defined once in `options`. This module only dispatches."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module with main(argv), one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "build": ("echo_trtllm.cli.build", "build an engine directory from a target + draft pair"),
    "generate": ("echo_trtllm.cli.generate", "generate text with speculative decoding and print stats"),
    "serve": ("echo_trtllm.cli.serve", "serve the models over an OpenAI-compatible HTTP API (/v1/completions, ...)"),
    "calibrate": ("echo_trtllm.cli.calibrate", "measure the cost curve and calibrate the gate (writes calibration.json)"),
    "bench": ("echo_trtllm.cli.bench", "benchmark methods x batch sizes side by side (JSON, markdown, plots)"),
    "simulate": ("echo_trtllm.cli.simulate", "predict throughput vs batch size from recorded traces (simulation)"),
    "export": ("echo_trtllm.cli.export", "write the models as TensorRT-LLM checkpoints (for trtllm-build) or HF directories (vLLM)"),
    "triton-repo": ("echo_trtllm.cli.triton_repo", "write a Triton model repository (Python backend, TensorRT-LLM's tensors)"),
    "bench-serve": ("echo_trtllm.cli.bench_serve", "load an OpenAI-compatible server: throughput, TTFT, ITL p50/p99"),
    "bench-control": ("echo_trtllm.cli.bench_control", "time ECHO's control plane (gate + schedule + pack) per step"),
    "bench-kernels": ("echo_trtllm.cli.bench_kernels", "time the plugin's control kernels per step, by backend"),
    "bench-dtype": ("echo_trtllm.cli.bench_dtype", "time a model's forward by tokens in each dtype; what auto picks"),
    "bench-online": ("echo_trtllm.cli.bench_online", "the online prices' predicted vs measured steps under sustained load"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="echo-trtllm", description="ECHO elastic speculative decoding")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        parser.error(f"unknown command {argv[0]!r}; choose one of: {', '.join(COMMANDS)}")
    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])
