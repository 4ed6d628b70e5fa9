"""Sparse confidence gating and its calibration.

Confidence c_{i,d} is the draft's probability of request i's most likely path at depth d: the largest path
probability (product of draft probabilities from the root) among request i's depth-d candidates.

The gate decides only at the gate depths G: at d in G, a request still drafting deepens if c_{i,d} > tau_d and
is truncated otherwise (it stops drafting; its candidates stay available to the budget scheduler's width
phase). Between gate depths nothing is decided, so drafting costs no host decision per level.

Calibration rule (the paper does not publish one; this is the project's, measured in docs/calibration.md)
-------------------------------------------------------------------------------------------------------
Input: warm-up samples (d, c, a): at depth d a request had confidence c and the target accepted that best
path through depth d (a = 1) or not (a = 0).

1. Separation per depth: ROC-AUC of c for accepted vs rejected samples (Mann-Whitney U, ties counted 1/2),
   with a bootstrap 90 % interval (`AUC_BOOTSTRAP` resamples within the depth, seeded). A depth is ranked only
   with at least `min_class_samples` accepted and as many rejected samples (an AUC from three rejections ranks
   nothing); the others get AUC = nan and the reason in `GateCalibration.unranked` (also logged).
2. Gate depths: always depth 1 (the first decision, right after the root's draft) and the target depth D,
   plus the `num_sweet_spots` middle depths (1 < d < D) with the highest AUC ("sweet spots").
3. Threshold per gate depth: tau_d maximises the net gain  sum over samples with c > tau of (a - lambda),
   where lambda = `min_accept_prob` is the break-even acceptance probability of a verified token (a token
   is worth verifying when it is accepted with probability above lambda; the budget rule of the runtime
   derives lambda from the verification cost curve). The cut is placed midway between two distinct
   confidence values; if no prefix has positive gain, tau_d is the largest confidence seen (nobody passes).
4. `echo-fixed` (the paper's ablation) pools the samples of every depth into one threshold with the same
   objective; `echo-dense` gates at every depth with per-depth thresholds.

Where a step's gate comes from (`GateSchedule`, built once with the policy; the only way a calibration reaches
the gate), in this order:

1. the gate the user set in EchoConfig (gate_depths, gate_thresholds);
2. calibration samples: the rule above, re-run for each batch size with lambda(B) from the cost curve
   (`break_even_accept_prob`): verification is cheap at B = 1 and dear under load, so tau_d rises with load;
3. a cost curve without samples (an engine that was never calibrated): tau_d = the level's cost ratio at B
   (`level_cost_ratio`, capped at 1: closed) at the default gate depths, the draft's own path probability standing
   in for the acceptance probability;
4. neither: `default_gate`.

Each source yields the three variants: "sparse" (echo), "dense" (echo-dense: every depth) and "fixed"
(echo-fixed: one tau at the sparse depths).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from .config import EchoConfig, GateConfig
from .cost import CostModel, break_even_accept_prob, level_cost_ratio
from .tree import DraftLevel, per_request_max

log = logging.getLogger("echo_trtllm.calibration")

__all__ = [
    "GateConfig",
    "GateCalibration",
    "best_path_confidence",
    "gate",
    "roc_auc",
    "auc_bootstrap_interval",
    "choose_threshold",
    "calibrate_gate",
    "default_gate",
    "GATE_VARIANTS",
    "GateSamples",
    "GateSchedule",
]

GATE_VARIANTS = ("sparse", "dense", "fixed")
# steps the online estimates and prices learn between two derivations of a batch size's gate
GATE_REFRESH = 4


def default_gate(max_depth: int) -> GateConfig:
    """Uncalibrated defaults: gates at 1, ceil(D/2) and D with tau_d = 0.4 * 0.7^(d-1) (path probabilities
    shrink with depth). `echo-trtllm calibrate` replaces them with measured values."""
    depths = tuple(sorted({1, (max_depth + 1) // 2, max_depth}))
    return GateConfig(depths, tuple(round(0.4 * 0.7 ** (d - 1), 6) for d in depths))


def dense_from_sparse(sparse: GateConfig, max_depth: int) -> GateConfig:
    """A gate at every depth 1..D from a sparse one: thresholds between gate depths interpolated geometrically,
    beyond them the nearest gate's (echo-dense without per-depth calibration)."""
    known = dict(zip(sparse.depths, sparse.thresholds))
    xs = sorted(known)
    taus = []
    for d in range(1, max_depth + 1):
        lo = max((x for x in xs if x <= d), default=xs[0])
        hi = min((x for x in xs if x >= d), default=xs[-1])
        if lo == hi or known[lo] <= 0 or known[hi] <= 0:
            taus.append(known[lo] if lo == hi else min(known[lo], known[hi]))
        else:
            t = (d - lo) / (hi - lo)
            taus.append(float(known[lo] ** (1 - t) * known[hi] ** t))
    return GateConfig(tuple(range(1, max_depth + 1)), tuple(taus))


def best_path_confidence(level: DraftLevel, batch_size: int) -> Tensor:
    """c_{i,d} for the level's depth: (B,) max path probability per request (0 where it has no node)."""
    return per_request_max(level.path_probs, level.request_ids, batch_size, fill=0.0)


def gate(confidence: Tensor, threshold: float, active: Tensor) -> Tensor:
    """(B,) bool: requests still drafting whose confidence passes tau_d (strictly greater)."""
    if confidence.shape != active.shape:
        raise ValueError(f"confidence {tuple(confidence.shape)} and active {tuple(active.shape)} must match")
    return active & (confidence > threshold)


# --------------------------------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------------------------------


def roc_auc(scores: Tensor, labels: Tensor) -> float:
    """P(score of a random positive > score of a random negative), ties 1/2; nan with one class only."""
    scores = scores.double().reshape(-1)
    labels = labels.bool().reshape(-1)
    n_pos = int(labels.sum())
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    # Average ranks (1-based) with ties.
    sorted_scores, order = torch.sort(scores)
    uniq, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    avg_rank = ends - (counts.double() - 1) / 2  # (U,)
    ranks = torch.empty_like(scores)
    ranks[order] = avg_rank[inverse]
    u = float(ranks[labels].sum()) - n_pos * (n_pos + 1) / 2
    return u / (n_pos * n_neg)


def choose_threshold(confidence: Tensor, accepted: Tensor, min_accept_prob: float) -> float:
    """tau maximising sum_{c > tau} (a - lambda) (see the module docstring, rule 3)."""
    c = confidence.double().reshape(-1)
    a = accepted.double().reshape(-1)
    if c.numel() == 0:
        raise ValueError("choose_threshold needs at least one sample")
    c_sorted, order = torch.sort(c, descending=True)
    gain = torch.cumsum(a[order] - min_accept_prob, 0)  # (N,) gain of passing the first n+1 samples
    # Only cut between distinct values: the last sample of each run of equal confidences.
    last_of_run = torch.ones_like(c_sorted, dtype=torch.bool)
    last_of_run[:-1] = c_sorted[1:] != c_sorted[:-1]
    gain = torch.where(last_of_run, gain, torch.full_like(gain, -math.inf))
    best = int(torch.argmax(gain))
    if float(gain[best]) <= 0.0:
        return float(c_sorted[0])  # nobody passes (c > max c is false)
    if best + 1 == c_sorted.numel():
        return float(c_sorted[best]) / 2  # everybody seen passes
    return float(c_sorted[best] + c_sorted[best + 1]) / 2


@dataclass
class GateCalibration:
    """Result of `calibrate_gate`: the gate plus the evidence it came from. Saved as JSON."""

    gate_depths: list[int]
    thresholds: list[float]
    fixed_threshold: float
    dense_thresholds: list[float]  # one per depth 1..D, for echo-dense
    auc: dict[int, float]
    num_samples: dict[int, int]
    acceptance_rate: dict[int, float]
    max_depth: int
    min_accept_prob: float
    num_sweet_spots: int
    rule: str = field(default="auc-sweet-spots/net-gain-threshold/v1")
    # evidence added later (absent from older files): rejected samples per depth, the AUC's bootstrap 90 %
    # interval, and why a depth was not ranked
    num_rejected: dict[int, int] = field(default_factory=dict)
    auc_interval: dict[int, tuple[float, float]] = field(default_factory=dict)
    unranked: dict[int, str] = field(default_factory=dict)

    def gate_config(self) -> GateConfig:
        return GateConfig(tuple(self.gate_depths), tuple(self.thresholds))

    def dense_gate_config(self) -> GateConfig:
        return GateConfig(tuple(range(1, self.max_depth + 1)), tuple(self.dense_thresholds))

    def fixed_gate_config(self) -> GateConfig:
        return GateConfig(tuple(self.gate_depths), tuple(self.fixed_threshold for _ in self.gate_depths))

    def variant(self, variant: str) -> GateConfig:
        """The gate of one variant ("sparse", "dense" or "fixed")."""
        return {"sparse": self.gate_config, "dense": self.dense_gate_config, "fixed": self.fixed_gate_config}[variant]()

    def to_json(self) -> str:
        d = asdict(self)
        d["auc"] = {str(k): (None if math.isnan(v) else v) for k, v in self.auc.items()}
        d["num_samples"] = {str(k): v for k, v in self.num_samples.items()}
        d["acceptance_rate"] = {str(k): (None if math.isnan(v) else v) for k, v in self.acceptance_rate.items()}
        d["num_rejected"] = {str(k): v for k, v in self.num_rejected.items()}
        d["auc_interval"] = {str(k): list(v) for k, v in self.auc_interval.items()}
        d["unranked"] = {str(k): v for k, v in self.unranked.items()}
        return json.dumps(d, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "GateCalibration":
        d = json.loads(text)
        optional = {"rule", "num_rejected", "auc_interval", "unranked"}
        missing = {f for f in cls.__dataclass_fields__ if f not in optional} - d.keys()
        if missing:
            raise ValueError(f"gate calibration JSON lacks fields {sorted(missing)}")

        def num_map(m: dict) -> dict:
            return {int(k): (float("nan") if v is None else v) for k, v in m.items()}

        d["auc"] = num_map(d["auc"])
        d["acceptance_rate"] = num_map(d["acceptance_rate"])
        d["num_samples"] = {int(k): int(v) for k, v in d["num_samples"].items()}
        d["num_rejected"] = {int(k): int(v) for k, v in d.get("num_rejected", {}).items()}
        d["auc_interval"] = {int(k): (float(v[0]), float(v[1])) for k, v in d.get("auc_interval", {}).items()}
        d["unranked"] = {int(k): str(v) for k, v in d.get("unranked", {}).items()}
        cal = cls(**d)
        cal.gate_config()  # validates depths and thresholds
        return cal

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "GateCalibration":
        return cls.from_json(Path(path).read_text())


def _check_samples(depths: Tensor, confidences: Tensor, accepted: Tensor, max_depth: int, min_accept_prob: float,
                   num_sweet_spots: int) -> None:
    if not (depths.shape == confidences.shape == accepted.shape) or depths.ndim != 1:
        raise ValueError(
            "depths, confidences and accepted must be 1-D of equal length, got "
            f"{tuple(depths.shape)}, {tuple(confidences.shape)}, {tuple(accepted.shape)}"
        )
    if max_depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    if not 0.0 < min_accept_prob < 1.0:
        raise ValueError(f"min_accept_prob must be in (0, 1), got {min_accept_prob}")
    if num_sweet_spots < 0:
        raise ValueError(f"num_sweet_spots must be >= 0, got {num_sweet_spots}")
    if depths.numel() and (int(depths.min()) < 1 or int(depths.max()) > max_depth):
        raise ValueError(f"sample depths must lie in [1, {max_depth}]")


def calibrate_gate(
    depths: Tensor,
    confidences: Tensor,
    accepted: Tensor,
    max_depth: int,
    num_sweet_spots: int = 2,
    min_accept_prob: float = 0.3,
    min_class_samples: int = 10,
    evidence: bool = True,
) -> GateCalibration:
    """Calibrate the sparse gate from warm-up samples (see the module docstring for the rule).

    depths (S,) int in [1, D]; confidences (S,) float; accepted (S,) bool. evidence: also compute the AUC
    intervals and log unranked depths (a calibration run does; re-deriving the gate per batch size does not:
    ranking does not depend on the batch size)."""
    _check_samples(depths, confidences, accepted, max_depth, min_accept_prob, num_sweet_spots)
    auc: dict[int, float] = {}
    count: dict[int, int] = {}  # samples per depth, and how many of them were rejected
    rejected: dict[int, int] = {}
    rate: dict[int, float] = {}
    interval: dict[int, tuple[float, float]] = {}
    unranked: dict[int, str] = {}
    dense: list[float] = []
    for d in range(1, max_depth + 1):
        sel = depths == d
        n = int(sel.sum())
        count[d] = n
        rejected[d] = n - int(accepted[sel].sum())
        rate[d] = float(accepted[sel].double().mean()) if n else float("nan")
        fewest = min(n - rejected[d], rejected[d])
        if fewest >= min_class_samples:
            auc[d] = roc_auc(confidences[sel], accepted[sel])
            if evidence:
                interval[d] = auc_bootstrap_interval(confidences[sel], accepted[sel], seed=d)
        else:
            auc[d] = float("nan")
            unranked[d] = (f"{n - rejected[d]} accepted and {rejected[d]} rejected samples; ranking a depth needs "
                           f"{min_class_samples} of each")
            if evidence and 1 < d < max_depth and num_sweet_spots:
                log.warning("gate calibration: depth %d not ranked as a sweet spot: %s (more warm-up prompts "
                            "give more)", d, unranked[d])
        dense.append(choose_threshold(confidences[sel], accepted[sel], min_accept_prob) if n else 1.0)
    middle = [d for d in range(2, max_depth) if not math.isnan(auc[d])]
    sweet = sorted(middle, key=lambda d: (-auc[d], d))[:num_sweet_spots]
    gate_depths = sorted({1, max_depth, *sweet})
    fixed = choose_threshold(confidences, accepted, min_accept_prob) if depths.numel() else 1.0
    return GateCalibration(
        gate_depths=gate_depths,
        thresholds=[dense[d - 1] for d in gate_depths],
        fixed_threshold=fixed,
        dense_thresholds=dense,
        auc=auc,
        num_samples=count,
        acceptance_rate=rate,
        max_depth=max_depth,
        min_accept_prob=min_accept_prob,
        num_sweet_spots=num_sweet_spots,
        num_rejected=rejected, auc_interval=interval, unranked=unranked,
    )


AUC_BOOTSTRAP = 200


def auc_bootstrap_interval(scores: Tensor, labels: Tensor, seed: int = 0, resamples: int = AUC_BOOTSTRAP,
                           level: float = 0.9) -> tuple[float, float]:
    """The central `level` interval of the AUC over bootstrap resamples (with replacement, seeded); resamples
    that draw one class only are skipped."""
    gen = torch.Generator().manual_seed(seed)
    n = scores.numel()
    values = []
    for _ in range(resamples):
        idx = torch.randint(0, n, (n,), generator=gen)
        a = roc_auc(scores[idx], labels[idx])
        if not math.isnan(a):
            values.append(a)
    if not values:
        return (float("nan"), float("nan"))
    v = torch.tensor(values, dtype=torch.float64)
    lo, hi = torch.quantile(v, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)).tolist()
    return (lo, hi)


@dataclass(frozen=True)
class GateSamples:
    """Warm-up evidence for the gate: one (depth, confidence, accepted) sample per request, verified depth and
    step (runtime.calibrate.gate_samples), with the rule's settings.

    accept_prob: the break-even probability used when no cost curve is known (the calibration's own)."""

    # (S,) int64 in [1, max_depth]
    depths: Tensor
    # (S,) float
    confidences: Tensor
    # (S,) bool
    accepted: Tensor
    max_depth: int
    num_sweet_spots: int = 2
    accept_prob: float = 0.3

    def __post_init__(self) -> None:
        if not (self.depths.shape == self.confidences.shape == self.accepted.shape) or self.depths.ndim != 1:
            raise ValueError("GateSamples.depths, confidences and accepted must be 1-D of equal length")

    def calibrate(self, min_accept_prob: float) -> GateCalibration:
        return calibrate_gate(self.depths, self.confidences, self.accepted, self.max_depth, self.num_sweet_spots,
                              min_accept_prob, evidence=False)


class GateSchedule:
    """The gate of each step, by batch size and variant (module docstring: config gate, calibration samples, cost
    curve, default).

    With an online acceptance model (`core.acceptance.OnlineAcceptance`, the echo family's) and a cost model or
    calibration samples, the thresholds are re-derived at every step from the current estimates: tau_d = the
    confidence at which depth d's acceptance estimate reaches lambda(B) (`OnlineAcceptance.threshold`), at the
    calibration's sweet-spot depths (chosen once by AUC: they do not depend on lambda) or the default gate depths;
    "dense" gates every depth, "fixed" uses one tau, the thresholds' mean weighted by each depth's samples; a batch
    size's gate is derived again after every GATE_REFRESH steps the estimates or the prices learn. Without one,
    results are cached per batch size."""

    def __init__(self, config: EchoConfig, cost: CostModel | None = None, samples: GateSamples | None = None,
                 acceptance=None) -> None:
        if samples is not None and samples.max_depth != config.max_depth:
            raise ValueError(
                f"the calibration was made for max_depth={samples.max_depth} but the config has "
                f"max_depth={config.max_depth}: recalibrate (echo-trtllm calibrate --max-depth {config.max_depth})"
            )
        self.config, self.cost, self.samples = config, cost, samples
        if config.gate_depths is not None:
            self.source = "config"
        elif samples is not None:
            self.source = "calibration"
        elif cost is not None:
            self.source = "cost-curve"
        else:
            self.source = "default"
        # the online estimates apply wherever a calibration or a cost curve would have set the thresholds
        self.acceptance = acceptance if self.source in ("calibration", "cost-curve") else None
        self._cache: dict[tuple, GateConfig] = {}
        self._calibrations: dict[float, GateCalibration] = {}
        self._sweet_spots: tuple[int, ...] | None = None

    def break_even(self, batch_size: int) -> float:
        """lambda at this batch size (the samples' own when no cost curve is known)."""
        if self.cost is None:
            return self.samples.accept_prob if self.samples is not None else 0.3
        return break_even_accept_prob(self.cost, batch_size, self.config.beam_width)

    def calibration_for(self, batch_size: int) -> GateCalibration | None:
        """The calibration rule's result at this batch size (None unless the source is calibration samples)."""
        if self.source != "calibration":
            return None
        lam = self.break_even(batch_size)
        if lam not in self._calibrations:
            self._calibrations[lam] = self.samples.calibrate(lam)
        return self._calibrations[lam]

    def sweet_spots(self) -> tuple[int, ...]:
        """The sparse gate's depths: the calibration's (AUC-ranked, independent of lambda) or the default gate's."""
        if self._sweet_spots is None:
            if self.source == "calibration":
                self._sweet_spots = self.samples.calibrate(self.samples.accept_prob).gate_config().depths
            else:
                self._sweet_spots = default_gate(self.config.max_depth).depths
        return self._sweet_spots

    def gate_for(self, batch_size: int, variant: str = "sparse") -> GateConfig:
        if variant not in GATE_VARIANTS:
            raise ValueError(f"gate variant {variant!r} is unknown; choose one of {', '.join(GATE_VARIANTS)}")
        key = (batch_size, variant)
        if self.acceptance is not None:  # re-derived as the estimates and prices learn, every few steps
            key += (self.acceptance.version // GATE_REFRESH, getattr(self.cost, "version", 0) // GATE_REFRESH)
            if len(self._cache) > 1024:
                self._cache.clear()
        if key not in self._cache:
            self._cache[key] = self._online(batch_size, variant) if self.acceptance is not None else self._make(
                batch_size, variant)
        return self._cache[key]

    def _online(self, batch_size: int, variant: str) -> GateConfig:
        lam = self.break_even(batch_size)
        acc = self.acceptance
        depths = tuple(range(1, self.config.max_depth + 1)) if variant == "dense" else self.sweet_spots()
        taus = [acc.threshold(d, lam) for d in depths]
        if variant == "fixed":
            weights = [max(acc.samples(d), 1e-9) for d in depths]
            tau = sum(t * w for t, w in zip(taus, weights)) / sum(weights)
            taus = [tau] * len(depths)
        return GateConfig(depths, tuple(taus))

    def _make(self, batch_size: int, variant: str) -> GateConfig:
        cfg = self.config
        if self.source == "calibration":
            return self.calibration_for(batch_size).variant(variant)
        if self.source == "cost-curve":
            lam = min(1.0, level_cost_ratio(self.cost, batch_size, cfg.beam_width))
            depths = default_gate(cfg.max_depth).depths
            sparse = GateConfig(depths, tuple(lam for _ in depths))
            return dense_from_sparse(sparse, cfg.max_depth) if variant == "dense" else sparse
        if self.source == "config":
            sparse = GateConfig(tuple(cfg.gate_depths), tuple(cfg.gate_thresholds or ()))
        else:
            sparse = default_gate(cfg.max_depth)
        if variant == "dense":
            return dense_from_sparse(sparse, cfg.max_depth)
        if variant == "fixed":
            return GateConfig(sparse.depths, tuple(cfg.fixed_threshold for _ in sparse.depths))
        return sparse
