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

__all__ = ["isotonic_fit", "smoothed_blocks", "AcceptanceModel", "MIN_SAMPLES", "OnlineAcceptance", "BIN_EDGES"]

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


# confidence bins of the online estimate: finer near 0 and 1, where path probabilities crowd
BIN_EDGES = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 1.0)
# confidences at which `OnlineAcceptance.threshold` reads the estimate: geometric below 0.01 (deep path
# probabilities are tiny), linear above
_GRID = torch.cat([torch.zeros(1, dtype=torch.float64), torch.logspace(-6, -2, 64, dtype=torch.float64)[:-1],
                   torch.linspace(0.01, 1.0, 199, dtype=torch.float64)])


class OnlineAcceptance:
    """Per-depth acceptance estimates re-learned from every verified draft node as traffic goes.

    Per depth d and confidence bin b (`BIN_EDGES`), decayed counts of verified nodes n[d, b] and of accepted ones
    k[d, b], and the confidences summed (each bin's centre is the mean confidence seen in it). Every step the
    counts are multiplied by 2^(-1/half_life) (a workload that changes, code then prose, is followed within a few
    half-lives of steps). The estimate of a bin is (k + w0 * p0) / (n + w0): a prior p0 of `prior_weight` pseudo-
    nodes, the calibration's isotonic map at the bin's centre when there is one (`AcceptanceModel`), otherwise the
    draft's own path probability (the bin's centre). Across bins of a depth the estimates are made non-decreasing
    in confidence (pool adjacent violators weighted by n + w0) and read piecewise-linearly between bin centres.

    Within a bin the prior's own shape is kept in proportion to its weight: the estimate at c is the fitted curve
    plus w0 / (n + w0) times (p(c) - the curve the prior alone gives at c), so with no traffic the estimate is the
    prior exactly (the calibration's map, steps included; the draft's own probability), and traffic takes over bin
    by bin.

    `threshold(depth, lam)` is the smallest confidence whose estimate reaches lam: the gate's tau_d at the
    break-even acceptance lam. On an isotonic fit that is the calibration rule's threshold (the upper set of
    confidences with sum (a - lam) largest is where the fit exceeds lam), now kept current.

    A node deeper than `max_depth` is counted at max_depth.
    """

    def __init__(self, max_depth: int, prior: "AcceptanceModel | None" = None, prior_weight: float = 4.0,
                 half_life: float = 256.0) -> None:
        if max_depth < 1:
            raise ValueError(f"OnlineAcceptance.max_depth must be >= 1, got {max_depth}")
        if not prior_weight > 0 or not half_life > 0:
            raise ValueError("OnlineAcceptance.prior_weight and half_life must be > 0")
        self.max_depth, self.prior_weight = max_depth, prior_weight
        self.decay = 0.5 ** (1.0 / half_life)
        self.edges = torch.tensor(BIN_EDGES, dtype=torch.float64)
        bins = len(BIN_EDGES) - 1
        self.mid = ((self.edges[1:] + self.edges[:-1]) / 2).expand(max_depth, bins).clone()
        depth = torch.arange(1, max_depth + 1).repeat_interleave(bins)
        self.prior = prior
        self.p0 = (self.mid.clone() if prior is None
                   else prior.estimate(self.mid.reshape(-1), depth).reshape(max_depth, bins))
        self.n = torch.zeros(max_depth, bins, dtype=torch.float64)
        self.k = torch.zeros_like(self.n)
        self.csum = torch.zeros_like(self.n)
        self.version = 0
        self._grid: dict = {}  # the last depth's estimates on _GRID (`threshold`)
        self._fit_version = -1
        self._centres = self._values = None

    def observe(self, depths: Tensor, confidences: Tensor, accepted: Tensor) -> None:
        """One step's verified draft nodes (roots excluded): their depths (>= 1), path probabilities and whether
        the target accepted them; then the step's decay."""
        self.n *= self.decay
        self.k *= self.decay
        self.csum *= self.decay
        if depths.numel():
            d = depths.long().cpu().clamp(1, self.max_depth) - 1
            c = confidences.double().cpu().clamp(0.0, 1.0)
            b = (torch.searchsorted(self.edges, c, right=True) - 1).clamp(0, len(BIN_EDGES) - 2)
            flat = d * (len(BIN_EDGES) - 1) + b
            self.n.view(-1).index_add_(0, flat, torch.ones_like(c))
            self.k.view(-1).index_add_(0, flat, accepted.double().cpu())
            self.csum.view(-1).index_add_(0, flat, c)
        self.version += 1

    def samples(self, depth: int) -> float:
        """Decayed count of verified nodes at this depth."""
        return float(self.n[min(max(depth, 1), self.max_depth) - 1].sum())

    def _fit(self) -> tuple[Tensor, Tensor]:
        """(centres, values), each (max_depth, bins): the bins' mean confidences and isotonic estimates."""
        if self._fit_version == self.version:
            return self._centres, self._values
        w0 = self.prior_weight
        weight = self.n + w0
        centres = torch.where(self.n > 1e-9, self.csum / self.n.clamp(min=1e-12), self.mid)
        raw = (self.k + w0 * self.p0) / weight
        values = torch.stack([_weighted_isotonic(raw[d], weight[d]) for d in range(self.max_depth)])
        # centres made increasing (a bin's mean lies inside the bin, so they are)
        self._centres, self._values, self._fit_version = centres, values, self.version
        return centres, values

    def estimate(self, confidences: Tensor, depths: Tensor | int) -> Tensor:
        """Acceptance estimates (float64) of nodes with these path probabilities at these depths."""
        centres, values = self._fit()
        c = confidences.double().cpu()
        d = (torch.as_tensor(depths).cpu().long().clamp(1, self.max_depth) - 1).expand_as(c)
        out = torch.empty_like(c)
        for depth in torch.unique(d).tolist():
            sel = d == depth
            x = c[sel]
            fitted = _piecewise(centres[depth], values[depth], x)
            # the prior's own shape within the bin, in proportion to its weight there
            b = (torch.searchsorted(self.edges, x.clamp(0.0, 1.0), right=True) - 1).clamp(0, len(BIN_EDGES) - 2)
            share = self.prior_weight / (self.n[depth, b] + self.prior_weight)
            exact = x if self.prior is None else self.prior.estimate(x, depth + 1)
            fitted = fitted + share * (exact - _piecewise(centres[depth], self.p0[depth], x))
            out[sel] = fitted.clamp(0.0, 1.0)
        return out.to(confidences.device)

    def threshold(self, depth: int, lam: float) -> float:
        """The smallest confidence at this depth whose estimate reaches lam (1.0: none does; 0.0: all do), read
        on a grid of confidences (`_GRID`; linear between the two around the crossing)."""
        i = min(max(depth, 1), self.max_depth)
        key = (i, self.version)
        if self._grid.get("key") != key:
            self._grid = {"key": key, "y": self.estimate(_GRID, i)}
        y = self._grid["y"]
        if float(y[0]) >= lam:
            return 0.0
        above = torch.nonzero(y >= lam)
        if above.numel() == 0:
            return 1.0
        j = int(above[0])
        x0, x1, y0, y1 = float(_GRID[j - 1]), float(_GRID[j]), float(y[j - 1]), float(y[j])
        return min(1.0, max(0.0, x0 + (lam - y0) * (x1 - x0) / max(y1 - y0, 1e-12)))

    def table(self) -> list[dict]:
        """Per depth: samples, and the estimate at confidences 0.1, 0.5, 0.9 (for reports)."""
        probe = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
        return [{"depth": d, "samples": round(self.samples(d), 1),
                 "estimate@0.1/0.5/0.9": [round(v, 3) for v in self.estimate(probe, d).tolist()]}
                for d in range(1, self.max_depth + 1)]


def _weighted_isotonic(y: Tensor, w: Tensor) -> Tensor:
    """Non-decreasing fit of y with weights w (pool adjacent violators); same length as y."""
    means: list[float] = []
    weights: list[float] = []
    sizes: list[int] = []
    for yi, wi in zip(y.tolist(), w.tolist()):
        means.append(yi)
        weights.append(wi)
        sizes.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            m1, w1, s1 = means.pop(), weights.pop(), sizes.pop()
            means[-1] = (means[-1] * weights[-1] + m1 * w1) / (weights[-1] + w1)
            weights[-1] += w1
            sizes[-1] += s1
    return torch.tensor([m for m, s in zip(means, sizes) for _ in range(s)], dtype=torch.float64)


def _piecewise(xs: Tensor, ys: Tensor, x: Tensor) -> Tensor:
    """Linear between the points (xs ascending), constant beyond the first and last."""
    i = torch.searchsorted(xs.contiguous(), x, right=True).clamp(1, xs.numel() - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    u = ((x - x0) / (x1 - x0).clamp(min=1e-12)).clamp(0.0, 1.0)
    return y0 + (y1 - y0) * u
