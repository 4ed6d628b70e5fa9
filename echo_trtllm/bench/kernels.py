"""Microbenchmark of the ECHO plugin's control kernels per decode step: gate (at 3 gate depths) + elastic
budget allocation + select & pack, on realistic drafted Super-Trees, for each available backend side by side.

    python -m echo_trtllm.bench.kernels [--batch-sizes 16,64,256] [--k-max 512,2048] [--backends torch,host,cuda]

Trees come from the core's drafting loop (echo policy, depth 6, beam 4, top-4 children, a Markov draft), built
once per (B, K_max) and reused. The cuda backend is timed with CUDA events around `--iters` steps after a warm-up
(µs per step = total / iters); the host backends with perf_counter. Every backend's output is checked against
the core's before timing.
"""

from __future__ import annotations

import statistics
import time

import torch

from echo_trtllm import kernels
from echo_trtllm.core import EchoConfig, draft_tree, make_policy
from echo_trtllm.core.budget import allocate_budget
from echo_trtllm.core.pack import pack

GATE_DEPTHS = (1, 3, 6)


def make_step(batch_size: int, k_max: int, seed: int = 0):
    vocab = 64
    gen = torch.Generator().manual_seed(seed)
    table = torch.softmax(torch.randn(vocab, vocab, generator=gen) * 2.5, dim=-1)
    policy = make_policy(EchoConfig(k_max=k_max, max_depth=6, top_k=4, beam_width=4, max_nodes_per_request=64))
    roots = torch.randint(0, vocab, (batch_size,), generator=gen)
    drafted = draft_tree(policy, roots, lambda level, frontier: table[level.token_ids[frontier]], budget=k_max)
    tree = drafted.candidates
    ctx = torch.randint(16, 2048, (batch_size,), generator=gen)
    return tree, drafted.state.spine_depth, ctx


def one_step(tree, spine, ctx, k_max: int, backend: str, levels):
    for probs, req, active, tau in levels:
        kernels.gate(probs, req, tree.batch_size, active, tau, backend=backend)
    alloc = kernels.allocate_budget(tree, spine, k_max, 64, backend=backend)
    return alloc, kernels.pack(tree, ctx, selected=alloc.selected, backend=backend)


def time_backend(tree, spine, ctx, k_max: int, backend: str, iters: int, warmup: int) -> float:
    dev = torch.device("cuda" if backend == "cuda" else "cpu")
    t, s, c = tree.to(dev), spine.to(dev), ctx.to(dev)
    levels = []
    for d in GATE_DEPTHS:
        at = t.depths == d
        levels.append((t.path_probs[at], t.request_ids[at], torch.ones(t.batch_size, dtype=torch.bool, device=dev),
                       0.01))
    alloc, packed = one_step(t, s, c, k_max, backend, levels)
    want = allocate_budget(tree, spine, k_max, 64)
    if not torch.equal(alloc.selected.cpu(), want.selected) or not torch.equal(
            packed.packed_mask.cpu(), pack(tree.select(want.selected), ctx).packed_mask):
        raise RuntimeError(f"backend {backend} disagrees with the core")
    for _ in range(warmup):
        one_step(t, s, c, k_max, backend, levels)
    if backend == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            one_step(t, s, c, k_max, backend, levels)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / iters
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        one_step(t, s, c, k_max, backend, levels)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6
