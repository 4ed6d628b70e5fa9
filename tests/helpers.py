"""Shared test helpers: random trees, synthetic drafts, naive (loop-based) references, a greedy executor run, a
script loaded as a module."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

from echo_trtllm.core import EchoConfig
from echo_trtllm.core.tree import DraftLevel
from echo_trtllm.runtime.executor import Executor
from echo_trtllm.runtime.request import SamplingParams


def random_parents(n: int, gen: torch.Generator, max_branch: float = 0.5) -> torch.Tensor:
    """A random tree of n nodes: parent of node j uniform in [max(0, j - span), j - 1], root at 0."""
    parents = [-1]
    for j in range(1, n):
        lo = 0 if torch.rand(1, generator=gen).item() < max_branch else max(0, j - 3)
        parents.append(int(torch.randint(lo, j, (1,), generator=gen)))
    return torch.tensor(parents, dtype=torch.int32)


def naive_ancestors(parents: list[int], j: int) -> list[int]:
    """Root path of node j, root first."""
    path = [j]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def naive_dense_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for j in range(n):
        for a in naive_ancestors(parents, j):
            mask[j, a] = True
    return mask


def markov_draft_fn(vocab: int, seed: int = 0, sharpness: float = 3.0):
    """A draft whose next-token distribution depends on the last token: a fixed random Markov table."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.softmax(torch.randn(vocab, vocab, generator=gen) * sharpness, dim=-1)

    def draft_fn(level: DraftLevel, frontier: torch.Tensor) -> torch.Tensor:
        return table[level.token_ids[frontier]]

    draft_fn.table = table
    return draft_fn


def chi2_critical(dof: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    k = float(dof)
    return k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3


def chi2_statistic(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson chi-square of observed counts against probabilities; cells with small expectation are pooled."""
    counts = counts.double().reshape(-1)
    probs = probs.double().reshape(-1)
    total = counts.sum()
    expected = probs * total
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    return stat, int(keep.sum()) - 1


def run_greedy(target, draft, tok, policy, prompts, batch_size, max_tokens, ignore_eos=True, **config):
    """Greedy requests through one executor, submitted at once; the executor admits as slots free up, so requests
    join and leave mid-flight. Returns (outputs, requests, batch size of every step); no step may fail."""
    ex = Executor(target, draft, tok, EchoConfig(policy=policy, **config), max_batch_size=batch_size, max_seq_len=256)
    reqs = [ex.make_request(p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=ignore_eos))
            for p, m in zip(prompts, max_tokens)]
    for r in reqs:
        ex.submit(r)
    sizes = []
    while ex.has_work:
        sizes.append(ex.step().batch_size)
    assert not ex.failures, ex.last_error
    return [r.output_token_ids for r in reqs], reqs, sizes


def run_seeded_sampling(target, draft, tok, policy, prompts):
    """Seeded sampling requests (temperature 0.8, top-p 0.9, top-k 50, seed 7 + i, 20 tokens each) through one
    executor of 4 slots. Returns (outputs, request-steps): with the same seeds, a lossless policy emits exactly
    what plain AR sampling emits (each position's token is drawn from that position's uniform)."""
    ex = Executor(target, draft, tok, EchoConfig(policy=policy, k_max=64), max_batch_size=4, max_seq_len=256)
    reqs = [ex.make_request(p, SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=7 + i,
                                              ignore_eos=True)) for i, p in enumerate(prompts)]
    for r in reqs:
        ex.submit(r)
    while ex.has_work:
        ex.step()
    assert not ex.failures, ex.last_error
    return [r.output_token_ids for r in reqs], sum(r.stats.steps for r in reqs)


def random_online_acceptance(seed: int, depth: int, calibrated: bool, prior_weight: float, half_life: float,
                             refit_every: int):
    """An OnlineAcceptance of `depth` with, when calibrated, a prior fitted on 400 random samples (acceptance
    rising with confidence), and the generator that drew them (for the traffic that follows)."""
    import torch

    from echo_trtllm.core.acceptance import AcceptanceModel, OnlineAcceptance

    gen = torch.Generator().manual_seed(seed)
    prior = None
    if calibrated:
        d = torch.randint(1, depth + 1, (400,), generator=gen)
        c = torch.rand(400, generator=gen, dtype=torch.float64) ** 2
        prior = AcceptanceModel.from_samples(d, c, torch.rand(400, generator=gen, dtype=torch.float64) < c, 10)
    return OnlineAcceptance(depth, prior, prior_weight=prior_weight, half_life=half_life,
                            refit_every=refit_every), gen


def load_script(path: Path):
    """A script (scripts/, build_scripts/) loaded as a module, named by its file, without running its main."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
