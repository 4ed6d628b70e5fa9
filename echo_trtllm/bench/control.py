"""Microbenchmark of ECHO's control plane on the host: gate + schedule + pack per decode step.

Timed per step: the drafting loop's bookkeeping (frontier choice, level expansion from the draft's
distributions, gating, budget-aware stop), building the Super-Tree, the elastic budget allocation, selection
and flatten & pack. Not timed: the draft model itself; its distributions come from a precomputed Markov
table over a small vocabulary, and the time spent fetching them is measured and subtracted.

    echo-trtllm bench-control [--batch-sizes 1,16,64,256] [--k-max-values 64,512,2048] [--threads 1]
"""

from __future__ import annotations

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
