"""echo-trtllm command line. Each subcommand is a module with its own `main(argv) -> int`, listed once in
COMMANDS; the CLI only dispatches (so every subcommand is importable and testable on its own)."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module with main(argv), one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "build": ("echo_trtllm.engine_dir", "build an engine directory from a target + draft pair"),
    "generate": ("echo_trtllm.generate_cli", "generate text with speculative decoding and print stats"),
    "calibrate": ("echo_trtllm.calibrate_cli", "measure the cost curve and calibrate the gate (writes calibration.json)"),
    "bench": ("echo_trtllm.bench.run", "benchmark methods x batch sizes side by side (JSON, markdown, plots)"),
    "simulate": ("echo_trtllm.bench.simulate", "predict throughput vs batch size from recorded traces (simulation)"),
    "bench-control": ("echo_trtllm.bench.control", "time ECHO's control plane (gate + schedule + pack) per step"),
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


if __name__ == "__main__":
    raise SystemExit(main())
