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

import numpy as np
import torch
from torch import Tensor

__all__ = ["BIN_EDGES", "MIN_SAMPLES", "AcceptanceModel", "OnlineAcceptance", "isotonic_fit", "smoothed_blocks"]

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
                     min_samples: int = MIN_SAMPLES) -> AcceptanceModel:
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
_GRID_NP = _GRID.numpy()


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

    A node deeper than `max_depth` is counted at max_depth. The fit is redone once every `refit_every` observed
    steps (estimates in between read the last fit: with a half-life of hundreds of steps, a few steps move them by
    a fraction of a percent, and refitting every step cost the embedded pair's B = 1 step ~1 ms of its ~20).

    Two tables, each as above: nodes on the draft's greedy path (every rank from the root 0, `tree.greedy_path`)
    and the others. The same path probability means different odds on and off it: on the embedded pair at B = 1
    (EAGLE-2 trees, 8 prompts; scripts/greedy_acceptance.py) greedy nodes of path probability 0.02-0.1 were
    accepted at 0.23 / 0.62 / 0.58 at depths 1 / 2 / 3 and the others at 0.05 / 0.04 / 0.06; a small draft's flat
    distribution puts a likely token at a low probability, and one table mixing both priced the greedy continuation
    like a sibling, so ECHO drafted wide at depth 1 and stopped. The gate's threshold and the drafting stop read a request's best node, which is
    almost always the greedy one: they read the greedy table (`greedy=True`, the default).

    Without a calibration, the greedy table's prior at depth d >= 2 is read off its depth-1 estimate e1 as if each
    of the path's d tokens were a depth-1 draft of the path's per-token probability: p0_d(c) = e1(c^(1/d))^d. The
    deeper levels are drafted only when they are expected to pay, so their own evidence is scarce, and a small
    draft's path probabilities shrink with depth far faster than its acceptance (above: 0.62 at depth 2 for path
    probabilities 0.02-0.1); depth 1, drafted every speculative step, says how much the draft's probabilities
    understate it. With no traffic e1(c) = c, so p0_d(c) = c, the draft's own probability, as before.
    """

    def __init__(self, max_depth: int, prior: AcceptanceModel | None = None, prior_weight: float = 4.0,
                 half_life: float = 256.0, refit_every: int = 1) -> None:
        if max_depth < 1:
            raise ValueError(f"OnlineAcceptance.max_depth must be >= 1, got {max_depth}")
        if not prior_weight > 0 or not half_life > 0:
            raise ValueError("OnlineAcceptance.prior_weight and half_life must be > 0")
        self.max_depth, self.prior_weight = max_depth, prior_weight
        self.decay = 0.5 ** (1.0 / half_life)
        self.refit_every = max(1, int(refit_every))
        self.edges = torch.tensor(BIN_EDGES, dtype=torch.float64)
        self._edges = self.edges.numpy()
        bins = len(BIN_EDGES) - 1
        rows = 2 * max_depth  # row d - 1: greedy nodes at depth d; row max_depth + d - 1: the others
        self.mid = ((self.edges[1:] + self.edges[:-1]) / 2).expand(rows, bins).clone()
        depth = torch.arange(1, max_depth + 1).repeat(2).repeat_interleave(bins)
        self.prior = prior
        self._steps: np.ndarray | None = None  # the calibration's steps per row (`_calibration_steps`)
        self.p0 = (self.mid.clone() if prior is None
                   else prior.estimate(self.mid.reshape(-1), depth).reshape(rows, bins))
        self.n = torch.zeros(rows, bins, dtype=torch.float64)
        self.k = torch.zeros_like(self.n)
        self.csum = torch.zeros_like(self.n)
        self.version = 0
        self._grid: dict = {}  # the fit's estimates on _GRID per depth (`threshold`)
        self._fit_version = -1
        self._arrays = None  # the last fit (`_fit`)
        self._table: dict | None = None  # the last fit as linear segments (`_segments_table`)
        # the estimates' read over those segments in the plugin's host library (`kernels.host_estimate_reader`,
        # installed by the runtime); None: NumPy (the same results)
        self.reader = None
        # the counts' update over a verified tree in the host library (`kernels.host_acceptance_counter`, installed
        # by the runtime); None: `observe` with NumPy (the same results)
        self.counter = None
        # the refit's isotonic fits of every row in the host library (`kernels.host_isotonic`, installed by the
        # runtime); None: in Python (the same numbers)
        self.isotonic = None
        # without a calibration, the refit, its segments and the gate's grids in one call of the host library
        # (`kernels.host_acceptance_refitter`, installed by the runtime with `reader`); None: `_fit`,
        # `_segments_table` and `threshold` with NumPy (the same fit to rounding; the grids are read as `reader`
        # reads, which differs from NumPy's read at a grid point exactly on a step)
        self.refitter = None

    def _rows(self, depths: Tensor | int, greedy: Tensor | bool, shape) -> np.ndarray:
        """Each node's table row (class docstring), flat, for nodes of this shape."""
        d = _clip(_host(depths).astype(np.int64), 1, self.max_depth) - 1
        off = ~_host(greedy).astype(bool)
        return np.broadcast_to(d + self.max_depth * off, shape).reshape(-1)

    def _node_rows(self, depths: Tensor | int, greedy: Tensor | bool, shape, size: int) -> np.ndarray:
        """Each of `size` nodes' table row: per node, or one row for every node (the gate's and the drafting
        stop's reads)."""
        if isinstance(depths, Tensor) or isinstance(greedy, Tensor):
            return self._rows(depths, greedy, tuple(shape))
        return np.full(size, self.row(int(depths), bool(greedy)))

    def row(self, depth: int, greedy: bool = True) -> int:
        """The table row of nodes at this depth (clamped to 1 .. max_depth), on the draft's greedy path or not."""
        return min(max(depth, 1), self.max_depth) - 1 + (0 if greedy else self.max_depth)

    def observe(self, depths: Tensor, confidences: Tensor, accepted: Tensor, greedy: Tensor | bool = True) -> None:
        """One step's verified draft nodes (roots excluded): their depths (>= 1), path probabilities, whether
        the target accepted them and whether each is on the draft's greedy path; then the step's decay."""
        n, k, csum = self.n.numpy(), self.k.numpy(), self.csum.numpy()  # the counts' own memory, in place
        n *= self.decay
        k *= self.decay
        csum *= self.decay
        if depths.numel():
            c = _clip(_host(confidences).astype(np.float64).reshape(-1), 0.0, 1.0)
            flat = self._rows(depths, greedy, tuple(confidences.shape)) * (len(BIN_EDGES) - 1) + self._bins(c)
            size = n.size
            n.reshape(-1)[:] += np.bincount(flat, minlength=size)
            k.reshape(-1)[:] += np.bincount(flat, _host(accepted).astype(np.float64).reshape(-1), minlength=size)
            csum.reshape(-1)[:] += np.bincount(flat, c, minlength=size)
        self.version += 1

    def observe_nodes(self, depths: Tensor, confidences: Tensor, greedy: Tensor, accepted_node_ids: Tensor) -> None:
        """`observe` over one verified tree's nodes (depths, path probabilities, on the greedy path or not, roots
        included: they are skipped) and the ids of the accepted ones: on the host library when installed
        (`counter`), else through `observe`."""
        if self.counter is not None:
            self.counter(self, depths, confidences, greedy, accepted_node_ids)
            self.version += 1
            return
        drafts = depths > 0
        accepted = torch.zeros(depths.numel(), dtype=torch.bool)
        accepted[accepted_node_ids.cpu()] = True
        self.observe(depths[drafts].cpu(), confidences[drafts].cpu(), accepted[drafts], greedy[drafts].cpu())

    def samples(self, depth: int) -> float:
        """Decayed count of verified nodes at this depth (both tables)."""
        d = self.row(depth)
        n = self.n.numpy()
        return float(n[d].sum() + n[d + self.max_depth].sum())

    def _fit(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(centres, values, n, p0), each (2 * max_depth, bins) float64 arrays: the bins' mean confidences,
        isotonic estimates, counts and priors, refitted once every `refit_every` observed steps. Host arrays: an
        estimate reads a few dozen numbers, where a tensor operation's own overhead would dominate."""
        if self._fit_version >= 0 and self.version - self._fit_version < self.refit_every:
            return self._arrays
        if self.refitter is not None and self.prior is None:
            return self._refit_on_host()
        w0 = self.prior_weight
        n_ = self.n.numpy().copy()
        weight = n_ + w0
        centres = np.where(n_ > 1e-9, self.csum.numpy() / np.maximum(n_, 1e-12), self.mid.numpy())
        p0 = self.p0.numpy().copy()
        k = self.k.numpy()
        iso = self._isotonic_rows
        first = iso(((k[0] + w0 * p0[0]) / weight[0])[None], weight[0][None])[0]
        if self.prior is None and self.max_depth > 1:  # the greedy rows' priors from depth 1 (class docstring)
            depth = np.arange(2, self.max_depth + 1, dtype=np.float64)[:, None]
            mid = self.mid.numpy()[1:self.max_depth]
            p0[1:self.max_depth] = self._from_first(mid.reshape(-1), np.broadcast_to(depth, mid.shape).reshape(-1),
                                                    centres[0], first, n_[0], p0[0]).reshape(mid.shape)
        raw = (k + w0 * p0) / weight
        values = np.concatenate([first[None], iso(raw[1:], weight[1:])])
        # centres made increasing (a bin's mean lies inside the bin, so they are)
        self._arrays = (centres, values, n_, p0)
        self._fit_version = self.version
        return self._arrays

    def _refit_on_host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`_fit`, `_segments_table` and the gate's grids (`threshold`) in one call of `refitter`."""
        n_ = self.n.numpy().copy()
        fit, seg, grid = self.refitter(n_, self.k.numpy(), self.csum.numpy(), self.mid.numpy(), self.p0.numpy(),
                                       self._edges, self.prior_weight, _GRID_NP)
        self._arrays = (fit[0], fit[1], n_, fit[2])
        self._fit_version = v = self.version
        rows = 2 * self.max_depth
        self._table = {"version": v, "keys": seg[0], "start": seg[1], "l0": seg[2], "l1": seg[3], "share": seg[4],
                       "e0": seg[5], "e1": seg[6], "deep": self._deep_rows(), "rows": rows, "host": None}
        self._grid = {"version": v, **{d + 1: grid[d] for d in range(self.max_depth)}}
        return self._arrays

    def _deep_rows(self) -> np.ndarray | None:
        """Rows read off depth 1's fit (the greedy rows below depth 1 without a calibration), or None."""
        if self.prior is not None or self.max_depth == 1:
            return None
        deep = np.zeros(2 * self.max_depth, dtype=bool)
        deep[1:self.max_depth] = True
        return deep

    def _isotonic_rows(self, y: np.ndarray, w: np.ndarray) -> np.ndarray:
        """`_weighted_isotonic` of each row: on the host library when installed (`isotonic`), else in Python."""
        if self.isotonic is not None:
            return self.isotonic(y, w)
        return np.stack([_weighted_isotonic(y[i], w[i]) for i in range(y.shape[0])]).reshape(y.shape)

    def _bins(self, x: np.ndarray) -> np.ndarray:
        return _clip(np.searchsorted(self._edges, _clip(x, 0.0, 1.0), side="right") - 1, 0, len(BIN_EDGES) - 2)

    def _from_first(self, c: np.ndarray, depth: np.ndarray, centres: np.ndarray, values: np.ndarray, n: np.ndarray,
                    p0: np.ndarray) -> np.ndarray:
        """e1(c^(1/depth))^depth: the depth-1 greedy estimate (its fit: centres, values, n, p0 of row 0) of each
        path's per-token probability, to the path's length (class docstring)."""
        c = _clip(c, 0.0, 1.0)
        x = c ** (1.0 / depth)
        share = self.prior_weight / (n[self._bins(x)] + self.prior_weight)
        at = _segments(centres, x)  # one search for both curves read on these centres
        # ordered so that with no traffic (values = p0, share = 1) e1 is x and the result c, exactly
        e1 = _clip((_lerp(values, *at) - share * _lerp(p0, *at)) + share * x, 0.0, 1.0)
        ratio = np.divide(e1, x, out=np.zeros_like(x), where=x > 0)
        return np.where(x > 0, c * ratio ** depth, e1 ** depth)

    def estimate(self, confidences: Tensor, depths: Tensor | int, greedy: Tensor | bool = True) -> Tensor:
        """Acceptance estimates (float64) of nodes with these path probabilities at these depths, on the draft's
        greedy path or not (class docstring). All nodes at once: each reads its own row of the fit.

        The runtime's read (every drafted level's cost stop and every selection call it): the fit compiled into
        linear segments (`_segments_table`), so a call is one search and a few gathers; `reference_estimate`, the
        fit read as the class docstring says it, is its oracle (tests: equal to rounding)."""
        table = self._segments_table()
        c = _clip(confidences.detach().double().cpu().numpy().reshape(-1), 0.0, 1.0)
        if c.size == 0:
            return confidences.double()
        rows = self._node_rows(depths, greedy, confidences.shape, c.size)
        if self.reader is not None:  # the host library's loop over the same segments
            out = self.reader(table, c, rows)
            return torch.from_numpy(out).reshape(confidences.shape).to(confidences.device)
        k = np.searchsorted(table["keys"], rows * 2.0 + c, side="right") - 1
        linear = _segment_line(table, k, c)
        exact = table["e0"][k] + table["e1"][k] * c
        if table["deep"] is not None:  # greedy rows below depth 1 without a calibration: the prior from depth 1
            deep = table["deep"][rows]
            if deep.any():
                exact[deep] = self._first_power(table, c[deep], rows[deep] + 1.0)
        out = _clip(linear + table["share"][k] * exact, 0.0, 1.0)
        return torch.from_numpy(out).reshape(confidences.shape).to(confidences.device)

    def _first_power(self, table: dict, c: np.ndarray, depth: np.ndarray) -> np.ndarray:
        """`_from_first` read off the compiled depth-1 greedy row (row 0)."""
        x = c ** (1.0 / depth)
        k = np.searchsorted(table["keys"], x, side="right") - 1  # row 0's keys are its starts
        e1 = _clip(_segment_line(table, k, x) + table["share"][k] * x, 0.0, 1.0)
        ratio = np.divide(e1, x, out=np.zeros_like(x), where=x > 0)
        return np.where(x > 0, c * ratio ** depth, e1 ** depth)

    def fitted_segments(self) -> dict | None:
        """The compiled fit (`_segments_table`) when no refit is due, else None (reading it would refit now: the
        host library's paths then read as their oracles do, so the refits happen at the same reads)."""
        if self._fit_version < 0 or self.version - self._fit_version >= self.refit_every:
            return None
        return self._segments_table()

    def _segments_table(self) -> dict:
        """The fit (`_fit`) as linear segments, rebuilt with it: the estimate at c on row r is
        clip(l(c) + share * prior(c)), l linear and share constant on each segment, prior(c) = e0 + e1 * c (the draft's
        own probability, or a calibration's step), or on the greedy rows below depth 1 without a calibration the
        depth-1 reading (`_from_first`, row 0's segments). A row's segments start at 0, at the bin edges, at its
        bins' centres (where the fit's interpolation bends) and at its calibration's steps; row r's start s has the
        key 2 r + s, so one sorted search finds every node's segment."""
        centres, values, n, p0 = self._fit()
        if self._table is not None and self._table["version"] == self._fit_version:
            return self._table
        rows = 2 * self.max_depth
        depth = np.arange(rows) % self.max_depth + 1
        fits = self.prior.fits if self.prior is not None else {}
        # each row's starts, sorted (a start repeated makes an empty segment, which no search lands in)
        parts = [np.broadcast_to(self._edges[:-1], (rows, self._edges.size - 1)), centres]
        if fits:
            parts.append(self._calibration_steps(depth, fits))
        starts = np.sort(np.concatenate(parts, axis=1), axis=1)
        a = starts.reshape(-1)
        b = np.concatenate([starts[:, 1:], np.ones((rows, 1))], axis=1).reshape(-1)
        row = np.repeat(np.arange(rows), starts.shape[1])
        mid = (a + b) / 2
        share = self.prior_weight / (n[row, self._bins(mid)] + self.prior_weight)

        def lin(x):  # the fit's interpolation minus the share of the prior's: linear between starts
            at = _segments_rows(centres[row], x)
            return _lerp_rows(values[row], *at) - share * _lerp_rows(p0[row], *at)

        la, lb = lin(a), lin(b)
        slope = np.divide(lb - la, b - a, out=np.zeros_like(a), where=b > a)
        if self.prior is None:
            e0, e1 = np.zeros_like(a), np.ones_like(a)
        else:
            step = self.prior.estimate(torch.from_numpy(mid), torch.from_numpy(depth[row])).numpy()
            fitted = np.isin(depth[row], list(fits))
            e0, e1 = np.where(fitted, step, 0.0), np.where(fitted, 0.0, 1.0)
        self._table = {"version": self._fit_version, "keys": row * 2.0 + a, "start": a, "l0": la, "l1": slope,
                       "share": share, "e0": e0, "e1": e1, "deep": self._deep_rows(), "rows": rows,
                       "host": None}  # the host library's copy of the arrays (`kernels.host_estimate_reader`)
        return self._table

    def _calibration_steps(self, depth: np.ndarray, fits: dict) -> np.ndarray:
        """Each row's calibration steps (clipped to [0, 1]), zeros in front to one width: the same at every refit,
        made once."""
        if self._steps is None:
            steps = [_clip(_host(fits[d][0]), 0.0, 1.0) if d in fits else np.zeros(0) for d in depth]
            out = np.zeros((len(steps), max(x.size for x in steps)))
            for i, x in enumerate(steps):
                out[i, out.shape[1] - x.size:] = x
            self._steps = out
        return self._steps

    def reference_estimate(self, confidences: Tensor, depths: Tensor | int, greedy: Tensor | bool = True) -> Tensor:
        """`estimate` read straight off the fit, as the class docstring says (the oracle of the compiled read)."""
        centres, values, n, p0 = self._fit()
        c = _clip(confidences.detach().double().cpu().numpy().reshape(-1), 0.0, 1.0)  # probabilities, as observed
        if c.size == 0:
            return confidences.double()
        rows = self._node_rows(depths, greedy, confidences.shape, c.size)
        at = _segments_rows(centres[rows], c)  # (N, bins): one search for the fit and the prior
        fitted, prior = _lerp_rows(values[rows], *at), _lerp_rows(p0[rows], *at)
        share = self.prior_weight / (n[rows, self._bins(c)] + self.prior_weight)
        # the prior's own shape within the bin, in proportion to its weight there
        if self.prior is None:
            exact = c.copy()
            deep = (rows > 0) & (rows < self.max_depth)  # greedy rows below depth 1
            if deep.any():
                exact[deep] = self._from_first(c[deep], rows[deep] + 1.0, centres[0], values[0], n[0], p0[0])
        else:
            exact = self.prior.estimate(torch.from_numpy(c), torch.from_numpy(rows % self.max_depth + 1)).numpy()
        fitted = _clip((fitted - share * prior) + share * exact, 0.0, 1.0)
        return torch.from_numpy(fitted).reshape(confidences.shape).to(confidences.device)

    def threshold(self, depth: int, lam: float) -> float:
        """The smallest confidence at this depth whose estimate reaches lam (1.0: none does; 0.0: all do), read
        on a grid of confidences (`_GRID`; linear between the two around the crossing), for the greedy path's
        nodes (the best node of a level, which the gate reads)."""
        i = min(max(depth, 1), self.max_depth)
        self._fit()
        if self._grid.get("version") != self._fit_version:
            self._grid = {"version": self._fit_version}
        if i not in self._grid:
            self._grid[i] = self.estimate(_GRID, i).numpy()
        y = self._grid[i]
        if y[0] >= lam:
            return 0.0
        above = y >= lam
        j = int(above.argmax())
        if not above[j]:
            return 1.0
        x0, x1, y0, y1 = _GRID_NP[j - 1], _GRID_NP[j], y[j - 1], y[j]
        return float(min(1.0, max(0.0, x0 + (lam - y0) * (x1 - x0) / max(y1 - y0, 1e-12))))

    def table(self) -> list[dict]:
        """Per depth: samples, and the estimates at confidences 0.1, 0.5, 0.9 on and off the greedy path (for
        reports)."""
        probe = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
        return [{"depth": d, "samples": round(self.samples(d), 1),
                 "estimate@0.1/0.5/0.9": [round(v, 3) for v in self.estimate(probe, d).tolist()],
                 "off greedy path": [round(v, 3) for v in self.estimate(probe, d, False).tolist()]}
                for d in range(1, self.max_depth + 1)]


def _segment_line(table: dict, k: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The linear part of a compiled fit's segments k at x (`OnlineAcceptance._segments_table`)."""
    return table["l0"][k] + table["l1"][k] * (x - table["start"][k])


def _host(x) -> np.ndarray:
    """A tensor, number or bool as a host array."""
    return x.detach().cpu().numpy() if isinstance(x, Tensor) else np.asarray(x)


def _clip(x, lo, hi):
    """np.clip without its dispatch overhead (a few microseconds a call: this runs a dozen times per estimate)."""
    return np.minimum(np.maximum(x, lo), hi)


def _weighted_isotonic(y: np.ndarray, w: np.ndarray) -> np.ndarray:
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
    return np.repeat(np.asarray(means, dtype=np.float64), sizes)


def _segments(xs: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each x falls on the points xs (ascending): the segment i and the position u in it, so that
    `_lerp(ys, i, u)` is the curve through (xs, ys), linear between the points and constant beyond the first and
    last, for any ys on xs (one search for several curves)."""
    i = _clip(np.searchsorted(xs, x, side="right"), 1, xs.size - 1)
    x0, x1 = xs[i - 1], xs[i]
    return i, _clip((x - x0) / np.maximum(x1 - x0, 1e-12), 0.0, 1.0)


def _lerp(ys: np.ndarray, i: np.ndarray, u: np.ndarray) -> np.ndarray:
    y0, y1 = ys[i - 1], ys[i]
    return y0 + (y1 - y0) * u


def _segments_rows(xs: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_segments` per element, x (N,) on its own row of points xs (N, P), each row ascending: (i, u) for
    `_lerp_rows`."""
    i = _clip((xs <= x[:, None]).sum(axis=1), 1, xs.shape[1] - 1)
    r = np.arange(x.size)
    x0, x1 = xs[r, i - 1], xs[r, i]
    return i, _clip((x - x0) / np.maximum(x1 - x0, 1e-12), 0.0, 1.0)


def _lerp_rows(ys: np.ndarray, i: np.ndarray, u: np.ndarray) -> np.ndarray:
    r = np.arange(i.size)
    y0, y1 = ys[r, i - 1], ys[r, i]
    return y0 + (y1 - y0) * u
