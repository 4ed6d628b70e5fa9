"""Microbenchmark of ECHO's control plane on the host: gate + schedule + pack per decode step.

Timed per step: the drafting loop's bookkeeping (frontier choice, level expansion from the draft's
distributions, gating, budget-aware stop), building the Super-Tree, the elastic budget allocation, selection
and flatten & pack. Not timed: the draft model itself; its distributions come from a precomputed Markov
table over a small vocabulary, and the time spent fetching them is measured and subtracted.

    python -m echo_trtllm.bench.control [--batch-sizes 1,16,64,256] [--k-max 64,512,2048] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from echo_trtllm.core import EchoConfig, draft_tree, make_policy, pack


@dataclass
class ControlTiming:
    batch_size: int
    k_max: int
    candidates: int  # drafted nodes per step (all requests)
    verified: int  # nodes sent to verification
    control_ms_median: float
    control_ms_p90: float


def _markov_draft(vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    table = torch.softmax(torch.randn(vocab, vocab, generator=gen) * 2.5, dim=-1)
    spent = [0.0]

    def draft_fn(level, frontier):
        t0 = time.perf_counter()
        out = table[level.token_ids[frontier]]
        spent[0] += time.perf_counter() - t0
        return out

    return draft_fn, spent


def time_control(batch_size: int, k_max: int, config: EchoConfig, steps: int, warmup: int, vocab: int = 64) -> ControlTiming:
    policy = make_policy(config)
    draft_fn, spent = _markov_draft(vocab, seed=batch_size)
    gen = torch.Generator().manual_seed(k_max)
    samples = []
    cand = verified = 0
    for step in range(warmup + steps):
        roots = torch.randint(0, vocab, (batch_size,), generator=gen)
        context = torch.randint(16, 2048, (batch_size,), generator=gen)
        spent[0] = 0.0
        t0 = time.perf_counter()
        result = draft_tree(policy, roots, draft_fn, budget=k_max)
        batch = pack(result.selected, context)
        elapsed = time.perf_counter() - t0 - spent[0]
        if step >= warmup:
            samples.append(elapsed * 1e3)
            cand, verified = result.candidates.total_nodes, batch.total_nodes
    samples.sort()
    return ControlTiming(
        batch_size, k_max, cand, verified, statistics.median(samples), samples[int(0.9 * (len(samples) - 1))]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,16,64,256")
    ap.add_argument("--k-max", default="64,512,2048")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: one core)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-depth", type=int, default=6)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    print(f"ECHO control plane per step (gate + schedule + pack), torch {torch.__version__}, {args.threads} thread(s), "
          f"D={args.max_depth} top_k={args.top_k} beam={args.beam_width}")
    print(f"{'B':>5} {'K_max':>6} {'drafted':>8} {'verified':>9} {'median ms':>10} {'p90 ms':>8}")
    for b in (int(x) for x in args.batch_sizes.split(",")):
        for k in (int(x) for x in args.k_max.split(",")):
            if k < b:
                print(f"{b:>5} {k:>6}   skipped: K_max below the batch size")
                continue
            cfg = EchoConfig(policy="echo", max_depth=args.max_depth, top_k=args.top_k, beam_width=args.beam_width,
                             k_max=k, max_nodes_per_request=64)
            t = time_control(b, k, cfg, args.steps, args.warmup)
            rows.append(t)
            print(f"{b:>5} {k:>6} {t.candidates:>8} {t.verified:>9} {t.control_ms_median:>10.2f} {t.control_ms_p90:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": [asdict(r) for r in rows], "machine": platform.platform(),
                       "processor": platform.processor(), "threads": args.threads}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
