"""echo-trtllm bench-control: time ECHO's control plane (gate + schedule + pack) per step on the host
(echo_trtllm.bench.control).

    echo-trtllm bench-control [--batch-sizes 1,16,64,256] [--k-max-values 64,512,2048] [--threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import asdict

from . import options

PROG = "echo-trtllm bench-control"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    options.add_microbench_options(ap, "1,16,64,256", "64,512,2048")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per cell")
    options.add_speculation_options(ap, policy=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    import torch

    from echo_trtllm.bench.control import time_control
    from echo_trtllm.bench.run import machine_info

    args = build_parser().parse_args(argv)
    try:
        batch_sizes, k_values = options.microbench_grid(args)
        base = options.echo_config(args, policy="echo")
    except options.USAGE_ERRORS as e:
        return options.fail(PROG, e)
    rows = []
    print(f"ECHO control plane per step (gate + schedule + pack), torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), D={base.max_depth} top_k={base.top_k} beam={base.beam_width}")
    print("median / p90 ms: the batched drafting loop (the runtime's path); levels: the level-by-level loop, timed "
          "alternately on the same inputs")
    print(f"{'B':>5} {'K_max':>6} {'drafted':>8} {'on device':>9} {'verified':>9} {'median ms':>10} {'p90 ms':>8} "
          f"{'levels med':>10} {'levels p90':>10}")
    for b in batch_sizes:
        for k in k_values:
            if k < b:
                print(f"{b:>5} {k:>6}   skipped: K_max below the batch size")
                continue
            t = time_control(b, k, dataclasses.replace(base, k_max=k), args.steps, args.warmup)
            rows.append(t)
            print(f"{b:>5} {k:>6} {t.candidates:>8} {t.device_nodes:>9} {t.verified:>9} {t.control_ms_median:>10.2f} "
                  f"{t.control_ms_p90:>8.2f} {t.levels_ms_median:>10.2f} {t.levels_ms_p90:>10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": [asdict(r) for r in rows], "machine": machine_info()}, f, indent=2)
    return 0
