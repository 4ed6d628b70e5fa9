"""Microbenchmark of ECHO's control plane on the host: gate + schedule + pack per decode step.

Timed per step: the drafting loop's bookkeeping (frontier choice, level expansion from the draft's top-k,
gating, budget-aware stop), building the Super-Tree, the elastic budget allocation, selection and flatten & pack
(allocation and packing on the backend the runtime uses for host trees: `kernels.backend_for("cpu")`).
Not timed: the draft model itself; its top-k come from a precomputed Markov table over a small vocabulary, and
the time spent fetching them is measured and subtracted.

Two drafting loops are timed side by side, alternating step by step on the same inputs:
    batched   `draft_tree_batched`, what the runtime runs for beam policies (frontiers chosen in fixed shapes,
              the host replays the levels at sync points)
    levels    `draft_tree`, the level-by-level loop (its oracle; the static tree's path)

    echo-trtllm bench-control [--batch-sizes 1,16,64,256] [--k-max-values 64,512,2048] [--threads 1]
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from echo_trtllm import kernels
from echo_trtllm.core import DraftTopK, EchoConfig, draft_tree, make_policy
from echo_trtllm.core.policies import draft_tree_batched


@dataclass
class ControlTiming:
    batch_size: int
    k_max: int
    candidates: int  # drafted nodes per step (all requests)
    verified: int  # nodes sent to verification
    control_ms_median: float  # the batched loop (the runtime's path)
    control_ms_p90: float
    levels_ms_median: float = 0.0  # the level-by-level loop
    levels_ms_p90: float = 0.0
    device_nodes: int = 0  # nodes the batched loop drafted on the device (the candidates plus work dropped later)


class MarkovDraft:
    """A synthetic draft over a fixed random Markov table (each node's next-token distribution is its token's row),
    for both loops: `draft_fn` (level by level) and the `LevelDrafter` methods (batched). `spent` accumulates the
    seconds spent producing top-k, which the benchmark subtracts."""

    def __init__(self, vocab: int, k: int, seed: int, sharpness: float = 2.5) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.softmax(torch.randn(vocab, vocab, generator=gen) * sharpness, dim=-1)
        self.k, self.spent, self.nodes = k, 0.0, 0
        self.roots = torch.zeros(0, dtype=torch.long)

    def _top(self, tokens: Tensor) -> DraftTopK:
        t0 = time.perf_counter()
        top = DraftTopK.of(self.table[tokens.reshape(-1)], self.k)
        self.spent += time.perf_counter() - t0
        self.nodes += tokens.numel() * self.k
        return top

    def draft_fn(self, level, frontier: Tensor) -> DraftTopK:
        return self._top(level.token_ids[frontier])

    def expand_roots(self, rows: Tensor) -> DraftTopK:
        return self._top(self.roots[rows])

    def expand_level(self, depth: int, tokens: Tensor, parents: Tensor) -> DraftTopK:
        r, w = tokens.shape
        top = self._top(tokens)
        return DraftTopK(top.probs.reshape(r, w, -1), top.tokens.reshape(r, w, -1))

    def keep_rows(self, index: Tensor) -> None:
        pass


def time_control(batch_size: int, k_max: int, config: EchoConfig, steps: int, warmup: int, vocab: int = 64) -> ControlTiming:
    policy = make_policy(config)
    kernels.install_host(policy)  # as the runtime's executor installs it
    draft = MarkovDraft(vocab, policy.max_children, seed=batch_size)
    gen = torch.Generator().manual_seed(k_max)
    samples: dict[str, list[float]] = {"batched": [], "levels": []}
    cand = verified = device_nodes = 0
    for step in range(warmup + steps):
        roots = torch.randint(0, vocab, (batch_size,), generator=gen)
        context = torch.randint(16, 2048, (batch_size,), generator=gen)
        draft.roots = roots
        for loop in ("batched", "levels") if step % 2 else ("levels", "batched"):
            draft.spent, draft.nodes = 0.0, 0
            t0 = time.perf_counter()
            if loop == "batched":
                result = draft_tree_batched(policy, roots, draft, budget=k_max)
            else:
                result = draft_tree(policy, roots, draft.draft_fn, budget=k_max)
            batch = kernels.pack(result.selected, context)  # the runtime's backend for CPU trees
            elapsed = time.perf_counter() - t0 - draft.spent
            if step >= warmup:
                samples[loop].append(elapsed * 1e3)
                if loop == "batched":
                    cand, verified, device_nodes = result.candidates.total_nodes, batch.total_nodes, draft.nodes + batch_size

    def median_p90(xs: list[float]) -> tuple[float, float]:
        xs = sorted(xs)
        return statistics.median(xs), xs[int(0.9 * (len(xs) - 1))]

    b_med, b_p90 = median_p90(samples["batched"])
    l_med, l_p90 = median_p90(samples["levels"])
    return ControlTiming(batch_size, k_max, cand, verified, b_med, b_p90, l_med, l_p90, device_nodes)
