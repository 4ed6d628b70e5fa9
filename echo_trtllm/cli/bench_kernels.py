"""echo-trtllm bench-kernels: the plugin's control kernels per decode step, every available backend side by side
(echo_trtllm.bench.kernels).

    echo-trtllm bench-kernels [--batch-sizes 16,64,256] [--k-max-values 512,2048] [--backends torch,host,cuda]
"""

from __future__ import annotations

import argparse
import json

from . import options

PROG = "echo-trtllm bench-kernels"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    options.add_microbench_options(ap, "16,64,256", "512,2048")
    ap.add_argument("--backends", default="torch,host,cuda", help="unavailable ones are skipped with a note")
    ap.add_argument("--iters", type=int, default=50, help="timed steps per cell")
    return ap


def main(argv: list[str] | None = None) -> int:
    import torch

    from echo_trtllm import kernels
    from echo_trtllm.bench.kernels import make_step, time_backend
    from echo_trtllm.bench.run import machine_info
    from echo_trtllm.core.budget import allocate_budget

    args = build_parser().parse_args(argv)
    try:
        batch_sizes, k_values = options.microbench_grid(args)
    except options.USAGE_ERRORS as e:
        return options.fail(PROG, e)
    backends = []
    for b in args.backends.split(","):
        if b == "cuda" and not (torch.cuda.is_available() and kernels.load_library("cuda")):
            print("cuda backend skipped: no CUDA device or libecho_plugin.so not built")
        elif b == "host" and kernels.load_library("host") is None:
            print("host backend skipped: libecho_host.so not built (cmake -S plugins -B plugins/build)")
        else:
            backends.append(b)
    rows = []
    print(f"{'B':>5} {'K_max':>6} {'nodes':>7} {'verified':>8} " + " ".join(f"{b + ' µs':>12}" for b in backends))
    for bs in batch_sizes:
        for k in k_values:
            if k < bs:
                continue
            tree, spine, ctx = make_step(bs, k)
            verified = int(allocate_budget(tree, spine, k, 64).num_nodes.sum())
            us = {b: time_backend(tree, spine, ctx, k, b, args.iters, args.warmup) for b in backends}
            rows.append({"batch_size": bs, "k_max": k, "candidates": tree.total_nodes, "verified": verified,
                         **{f"{b}_us_per_step": v for b, v in us.items()}})
            print(f"{bs:>5} {k:>6} {tree.total_nodes:>7} {verified:>8} " + " ".join(f"{us[b]:>12.1f}" for b in backends),
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": rows, "machine": machine_info(),
                       "device": torch.cuda.get_device_name() if "cuda" in backends else "cpu"}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
