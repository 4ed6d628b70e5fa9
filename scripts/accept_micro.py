"""Greedy verification's acceptance timed warm, one call at a time: the torch oracle (`core.verify._accept_predicted`,
which computes the batch's flat parents on first use) against the host library's one call
(`kernels.host_greedy_acceptor`), on packed chains of the shapes a decode step verifies. Each call gets a fresh
packed batch (its cached flat parents not reused), as a step does. Prints and writes the medians (us).

    python scripts/accept_micro.py [--calls 300] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from echo_trtllm import kernels
from echo_trtllm.core.tree import SuperTree
from echo_trtllm.core.verify import _accept_predicted

SHAPES = ((1, 6), (16, 2), (64, 1))  # (requests, nodes each: a chain)


def _batch(requests: int, nodes: int):
    parents = [torch.tensor([-1] + list(range(nodes - 1)))] * requests
    tree = SuperTree.from_parents(parents, [torch.arange(nodes) + 7] * requests)
    return kernels.pack(tree, torch.full((requests,), 100), backend="host")


def _median_us(fn, requests: int, nodes: int, calls: int) -> float:
    pred = torch.arange(requests * nodes) % 9 + 7  # some drafts accepted
    times = []
    for i in range(calls + 50):
        batch = _batch(requests, nodes)
        t0 = time.perf_counter()
        fn(batch, pred, nodes - 1)
        if i >= 50:  # the first 50: warm-up
            times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e6, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.calls < 1:
        ap.error(f"--calls must be >= 1, got {args.calls}")
    host = kernels.host_greedy_acceptor()
    if host is None:
        ap.error("the host library is not built (scripts/setup.sh builds it)")
    rows = []
    for requests, nodes in SHAPES:
        torch_us = _median_us(_accept_predicted, requests, nodes, args.calls)
        host_us = _median_us(host, requests, nodes, args.calls)
        rows.append({"requests": requests, "nodes_each": nodes, "torch_us": torch_us, "host_us": host_us})
        print(f"{requests:3d} requests x {nodes} nodes: torch {torch_us:7.1f} us, host library {host_us:6.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python scripts/accept_micro.py --calls " + str(args.calls),
                       "threads": torch.get_num_threads(), "calls": args.calls, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
