"""Acceptance estimates: a draft node's chance of being accepted, from its path probability and depth.

The budget rule (`cost.choose_budget`) and the cost-aware drafting stop weigh each candidate by its chance of
being accepted. A draft's path probability is that chance only if the draft is calibrated; small drafts are
overconfident at depth (and an EAGLE-3 head's reduced vocabulary makes its probabilities larger still). The
calibration's warm-up samples say how often a node of confidence c at depth d was accepted, so the estimate is
fitted per depth by isotonic regression (pool adjacent violators: the non-decreasing step function of c closest to
the accepted flags in least squares), which assumes only that a more confident node is not less likely to be
accepted.

    samples at depth 2, sorted by confidence:  c = 0.1  0.2  0.4  0.5  0.8     accepted = 0  1  0  1  1
    pooled:                                     [0.1] [0.2, 0.4] [0.5] [0.8] -> 0, 0.5, 1, 1

A depth with fewer than `min_samples` samples keeps the raw path probability (no evidence to correct it with).
Every fitted block is valued (k + 1/2) / (n + 1) for its k accepted of n samples (the Krichevsky-Trofimov
estimate: 0 of 60 gives 0.008, not 0), and blocks whose smoothed values would fall are pooled again, so the map
stays non-decreasing (`smoothed_blocks`). A finite warm-up never shows a probability of exactly 0 or 1: with the
raw block means, a low-confidence block of 0 of 7 made the budget rule refuse nodes that verification at B = 1
would have taken almost for free (the Qwen EAGLE-3 head's second calibration: ECHO verified nothing beyond the
root in half of its B = 1 steps). A depth with one outcome only (every node rejected, or every node accepted)
is one such block: until 2026-12-01 it kept the raw probability, so a depth the warm-up had never seen accepted
(the Qwen head's first version at depths 4-6, 0 of 60) was priced at the head's own confidence and ECHO drafted on
into it. Between fitted blocks the estimate is the value of the block at or left of c (below the first block: the
first block's value).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["isotonic_fit", "smoothed_blocks", "AcceptanceModel", "MIN_SAMPLES"]

MIN_SAMPLES = 20  # samples a depth needs before its estimate replaces the raw path probability


def _pool(starts: list[float], sums: list[float], counts: list[int], falls) -> None:
    """Pool the last two blocks while `falls(k_prev, n_prev, k_last, n_last)` (pool adjacent violators)."""
    while len(sums) > 1 and falls(sums[-2], counts[-2], sums[-1], counts[-1]):
        s_last, c_last = sums.pop(), counts.pop()
        sums[-1] += s_last
        counts[-1] += c_last
        starts.pop()


def _mean_falls(k0: float, n0: int, k1: float, n1: int) -> bool:
    return k0 / n0 > k1 / n1


def _isotonic_blocks(x: Tensor, y: Tensor) -> tuple[list[float], list[float], list[int]]:
    """Pool adjacent violators on (x, y): each block's start in x, sum of y and count, ascending; equal x pool."""
    order = torch.argsort(x.double(), stable=True)
    xs, ys = x.double()[order].tolist(), y.double()[order].tolist()
    starts: list[float] = []
    sums: list[float] = []
    counts: list[int] = []
    prev = None
    for xi, yi in zip(xs, ys):
        if xi == prev:  # equal x: the previous point's block, which is the last one (a step function of x)
            sums[-1] += yi
            counts[-1] += 1
        else:
            starts.append(xi)
            sums.append(yi)
            counts.append(1)
        prev = xi
        _pool(starts, sums, counts, _mean_falls)
    return starts, sums, counts


def isotonic_fit(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Pool adjacent violators on (x, y): returns (block starts in x, block values), both ascending; equal x pool."""
    starts, sums, counts = _isotonic_blocks(x, y)
    return torch.tensor(starts, dtype=torch.float64), torch.tensor([s / c for s, c in zip(sums, counts)],
                                                                   dtype=torch.float64)


def _smoothed(k: float, n: int) -> float:
    return (k + 0.5) / (n + 1)


def _smoothed_falls(k0: float, n0: int, k1: float, n1: int) -> bool:
    # equal raw means pool too: blocks the fit could not tell apart are one block of evidence
    return k0 * n1 >= k1 * n0 or _smoothed(k0, n0) >= _smoothed(k1, n1)


def smoothed_blocks(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """The isotonic fit of 0/1 outcomes y at x with every block valued (k + 1/2) / (n + 1), adjacent blocks
    pooled while their raw or smoothed values do not rise (the module docstring): (block starts,
    block values), both ascending, values strictly rising."""
    fitted_starts, fitted_sums, fitted_counts = _isotonic_blocks(x, y)
    starts: list[float] = []
    sums: list[float] = []
    counts: list[int] = []
    for start, k, n in zip(fitted_starts, fitted_sums, fitted_counts):
        starts.append(start)
        sums.append(k)
        counts.append(n)
        _pool(starts, sums, counts, _smoothed_falls)
    return (torch.tensor(starts, dtype=torch.float64),
            torch.tensor([_smoothed(k, n) for k, n in zip(sums, counts)], dtype=torch.float64))


@dataclass(frozen=True)
class AcceptanceModel:
    """Per depth, an isotonic map from path probability to acceptance probability (module docstring)."""

    # depth -> (block starts, block values); depths without a fit keep the raw path probability
    fits: dict[int, tuple[Tensor, Tensor]]

    @classmethod
    def from_samples(cls, depths: Tensor, confidences: Tensor, accepted: Tensor,
                     min_samples: int = MIN_SAMPLES) -> "AcceptanceModel":
        fits = {}
        for d in sorted(set(depths.tolist())):
            sel = depths == d
            acc = accepted[sel].double()
            n = int(sel.sum())
            if n < min_samples:
                continue
            fits[int(d)] = smoothed_blocks(confidences[sel], acc)
        return cls(fits)

    def estimate(self, confidences: Tensor, depths: Tensor | int) -> Tensor:
        """Acceptance estimates (float64) of nodes with these path probabilities at these depths."""
        c = confidences.double().cpu()
        d = torch.as_tensor(depths).cpu().expand_as(c)
        out = c.clone()
        for depth, (starts, values) in self.fits.items():
            sel = d == depth
            if bool(sel.any()):
                i = (torch.searchsorted(starts, c[sel], right=True) - 1).clamp(min=0)
                out[sel] = values[i]
        return out.to(confidences.device)
