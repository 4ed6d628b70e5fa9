"""The verification cost model, the budget rule that picks each step's K from it, and the tracker that decides
whether a step drafts at all. Nothing here reads a clock: the runtime measures and hands seconds in.

A `CostModel` holds measured points of t_verify(T) (seconds of one target forward over T tokens in total) and of
t_draft(T) (one draft forward over T tokens), interpolated piecewise-linearly and extrapolated along the last
segment. Under load the KV reads are part of a step: with a measured grid (`grid_tokens` x `grid_contexts`, seconds
of a verification over T tokens whose requests hold C cached tokens each), `verify_time(T, context=C)`
interpolates bilinearly in (T, C); without a grid, or without a context, it is the curve t_verify(T). The runtime
passes the context its attention reads per request: its padded layout attends the batch's longest context for
every request (a paged-attention engine would pass the mean). Real steps spend host time around the forwards: a
fitted overhead per step (tree inputs, acceptance, commit) is part of every `verify_time`, and one per draft level
(top-k, gate, bookkeeping) of every `draft_level_time`. `choose_budget` picks how many candidates to verify:

    K = B + n,  n maximising  (B + sum of the n best candidates' acceptance estimates) / (t_spent + t_verify(B + n))

where the candidates come in the scheduler's order (P1 depth, then P2 width; any prefix is ancestor-closed), B
counts the bonus token every request gets, and t_spent is the drafting time already spent this step (sunk: it is
charged to every choice). Whether to draft at all is decided before drafting, where the draft's time is not sunk
yet: `drafting_pays` (the echo family's rule, from the acceptance its calibration expects at the first level) and
the executor's `SpeculationTracker` (measured throughput, the +fallback mode). n = 0 verifies roots only.
Because the whole curve is evaluated, a flat region (verification nearly free) is filled and a steep one
(compute-bound, or a CPU kernel whose cost is linear in T) is left alone.

Example: B = 1, estimates [0.9, 0.5, 0.1], t_verify(T) = 0.1 + 0.01·T, t_spent = 0.02:
n = 0: 1.0/0.13 = 7.69; n = 1: 1.9/0.14 = 13.57; n = 2: 2.4/0.15 = 16.0; n = 3: 2.5/0.16 = 15.63  -> K = 3.

`break_even_accept_prob` turns the curve into the gate's lambda for a batch size, and `SpeculationTracker`
completes the rule across steps: it compares the measured throughput of speculative and plain AR steps, per
batch-size bucket, and probes the mode it is not using.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

__all__ = ["CostModel", "budget_rates", "choose_budget", "drafting_pays", "fit_draft_overhead", "fit_step_overhead",
           "interpolate", "level_cost_ratio", "break_even_accept_prob", "batch_bucket", "SpeculationTracker"]


def interpolate(xs: tuple[float, ...], ys: tuple[float, ...], x: Tensor) -> Tensor:
    """Piecewise-linear y(x) through the points, extrapolated along the first/last segment."""
    return _interpolate(torch.tensor(xs, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64), x)


def _interpolate(px: Tensor, py: Tensor, x: Tensor) -> Tensor:
    """`interpolate` on float64 tensors; py may carry trailing dimensions (n, ...): every column at once, at one
    point x (0-d)."""
    x = x.double()
    if py.ndim > 1 and x.ndim:
        raise ValueError(f"_interpolate reads columns at one point: x must be 0-d with py of shape {tuple(py.shape)}")
    if px.numel() == 1:
        return py[0] * (x / px[0])  # one point: proportional
    i = torch.searchsorted(px, x).clamp(1, px.numel() - 1)
    x0, x1, y0, y1 = px[i - 1], px[i], py[i - 1], py[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _check_axis(name: str, xs: tuple[int, ...]) -> None:
    if list(xs) != sorted(set(xs)) or any(x < 1 for x in xs):
        raise ValueError(f"CostModel.{name} must be strictly increasing integers >= 1, got {xs}")


@dataclass(frozen=True)
class CostModel:
    """Measured forward times (seconds) by tokens per forward."""

    verify_tokens: tuple[int, ...]
    verify_seconds: tuple[float, ...]
    draft_tokens: tuple[int, ...] = ()
    draft_seconds: tuple[float, ...] = ()
    # seconds of host control per step (gate, schedule, pack), charged to every speculative step
    control_seconds: float = 0.0
    device: str = ""
    # verification by tokens and cached context per request: grid_seconds[i][j] at grid_tokens[i] tokens,
    # grid_contexts[j] cached tokens per request (runtime.calibrate.measure_grid)
    grid_tokens: tuple[int, ...] = ()
    grid_contexts: tuple[int, ...] = ()
    grid_seconds: tuple[tuple[float, ...], ...] = ()
    # host seconds a real step spends beyond the target's forward (building the tree's inputs, acceptance,
    # commit), added to every verify_time; fitted from real steps (`fit_step_overhead`)
    step_overhead_seconds: float = 0.0
    # host seconds a real draft level spends beyond the draft's forward (the drafting loop's top-k, gate and
    # bookkeeping, the selection and packing it leads to), added to every draft_level_time; fitted from real
    # steps (`fit_draft_overhead`)
    draft_level_overhead_seconds: float = 0.0
    # one draft forward by tokens and cached context per request, on the verification grid's axes
    # (draft_grid_seconds[i][j] at grid_tokens[i], grid_contexts[j]; runtime.calibrate.measure_grid): under load a
    # draft level reads B requests' contexts, which the one-request curve above does not see
    draft_grid_seconds: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self) -> None:
        for name in ("verify", "draft"):
            xs, ys = getattr(self, f"{name}_tokens"), getattr(self, f"{name}_seconds")
            if len(xs) != len(ys):
                raise ValueError(f"CostModel.{name}_tokens and {name}_seconds must have equal length")
            _check_axis(f"{name}_tokens", xs)
            if any(y <= 0 for y in ys):
                raise ValueError(f"CostModel.{name}_seconds must be positive, got {ys}")
        if not self.verify_tokens:
            raise ValueError("CostModel needs at least one verify point")
        for name in ("step_overhead_seconds", "draft_level_overhead_seconds"):
            if not (getattr(self, name) >= 0.0):
                raise ValueError(f"CostModel.{name} must be >= 0, got {getattr(self, name)}")
        if self.grid_tokens or self.grid_contexts or self.grid_seconds:
            for name in ("grid_tokens", "grid_contexts"):
                if not getattr(self, name):
                    raise ValueError(f"CostModel.{name} must be strictly increasing integers >= 1, got ()")
                _check_axis(name, getattr(self, name))
            for name in ("grid_seconds", "draft_grid_seconds"):
                rows = getattr(self, name)
                if (name == "grid_seconds" or rows) and (len(rows) != len(self.grid_tokens) or any(
                        len(row) != len(self.grid_contexts) or any(y <= 0 for y in row) for row in rows)):
                    raise ValueError(f"CostModel.{name} must be len(grid_tokens) rows of len(grid_contexts) "
                                     "positive seconds")
        elif self.draft_grid_seconds:
            raise ValueError("CostModel.draft_grid_seconds needs the grid's axes (grid_tokens, grid_contexts)")

    @property
    def has_grid(self) -> bool:
        return bool(self.grid_seconds)

    def verify_time(self, tokens: Tensor | int, context: float | None = None) -> Tensor:
        """Seconds of a target forward over `tokens` tokens; with `context` (cached tokens per request as the step's
        attention reads them) and a grid, read from the grid (bilinear in tokens and context, extrapolated along
        its edges)."""
        tokens = torch.as_tensor(tokens)
        if context is None or not self.grid_seconds:
            return _interpolate(*self._tables["verify"], tokens) + self.step_overhead_seconds
        return self._read_grid("grid", tokens, context) + self.step_overhead_seconds

    @functools.cached_property
    def _tables(self) -> dict:
        """The curves and grids as float64 tensors, built once (the budget rule reads them dozens of times a step),
        and the grids' token curves at the contexts read so far (`_read_grid`)."""
        t = functools.partial(torch.tensor, dtype=torch.float64)
        return {"verify": (t(self.verify_tokens), t(self.verify_seconds)),
                "draft": (t(self.draft_tokens), t(self.draft_seconds)) if self.draft_tokens else None,
                "axes": (t(self.grid_tokens), t(self.grid_contexts)),
                "grid": t(self.grid_seconds).T if self.grid_seconds else None,  # (contexts, tokens)
                "draft_grid": t(self.draft_grid_seconds).T if self.draft_grid_seconds else None,
                "at_context": {}}

    def _read_grid(self, name: str, tokens: Tensor, context: float) -> Tensor:
        """Bilinear in tokens and context on the grid's axes, extrapolated along its edges: the grid's token curve
        at `context` (interpolated along the context axis, kept per context: a step reads one context many
        times), then read at `tokens`."""
        tables = self._tables
        px, pc = tables["axes"]
        key = (name, float(context))
        curve = tables["at_context"].get(key)
        if curve is None:
            if len(tables["at_context"]) >= 256:
                tables["at_context"].clear()
            curve = tables["at_context"][key] = _interpolate(pc, tables[name], torch.tensor(float(context)))
        return _interpolate(px, curve, tokens).clamp(min=1e-9)

    def draft_time(self, tokens: Tensor | int, context: float | None = None) -> Tensor:
        """Seconds of one draft forward over `tokens` tokens (0 without a draft curve); with `context` and a draft
        grid, read from the grid like `verify_time`."""
        if not self.draft_tokens:
            return torch.zeros_like(torch.as_tensor(tokens, dtype=torch.float64))
        if context is not None and self.draft_grid_seconds:
            return self._read_grid("draft_grid", torch.as_tensor(tokens), context)
        return _interpolate(*self._tables["draft"], torch.as_tensor(tokens))

    def draft_level_time(self, frontier: Tensor | int, context: float | None = None) -> Tensor:
        """Seconds of one level of tree drafting over a frontier of `frontier` tokens: its draft forward (at
        `context`, see `draft_time`) plus the fitted host work of a level (0 without a draft curve)."""
        if not self.draft_tokens:
            return self.draft_time(frontier)
        return self.draft_time(frontier, context) + self.draft_level_overhead_seconds

    def drafting_time(self, frontier_sizes: list[int], context: float | None = None) -> float:
        """Seconds of a step's drafting over levels with these frontier sizes: `draft_level_time` summed."""
        return sum(float(self.draft_level_time(f, context)) for f in frontier_sizes)

    @classmethod
    def linear(cls, fixed: float, per_token: float, max_tokens: int = 4096) -> "CostModel":
        """t(T) = fixed + per_token · T (a synthetic curve for tests and what-ifs)."""
        return cls((1, max_tokens), (fixed + per_token, fixed + per_token * max_tokens))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "CostModel":
        d = json.loads(text)
        for key in ("verify_tokens", "verify_seconds", "draft_tokens", "draft_seconds", "grid_tokens",
                    "grid_contexts"):
            d[key] = tuple(d.get(key, ()))
        for key in ("grid_seconds", "draft_grid_seconds"):
            d[key] = tuple(tuple(row) for row in d.get(key, ()))
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        return cls.from_json(Path(path).read_text())


def fit_step_overhead(cost: CostModel, steps: list[tuple[int, float, float]]) -> float:
    """The host seconds per verification step the forward timings miss: the median of (measured - predicted)
    over real steps (tokens verified, context read, measured verify seconds), at least 0. The median, because a
    shared machine only ever adds time to single steps. `cost` is read without its own overhead."""
    if not steps:
        raise ValueError("fit_step_overhead needs at least one measured step")
    base = dataclasses.replace(cost, step_overhead_seconds=0.0)
    residuals = sorted(m - float(base.verify_time(t, c)) for t, c, m in steps)
    return max(0.0, residuals[len(residuals) // 2])


def fit_draft_overhead(cost: CostModel, steps: list[tuple[list[int], float, float | None]]) -> float:
    """The host seconds per draft level the draft forward timings miss: the median over real speculative steps
    (every level's frontier size, measured drafting seconds: draft forwards and the host work around them, the
    selection and packing included; the context the step read, None: unknown) of (measured - the draft forwards
    at that context summed over the levels) / levels, at least 0. Steps that drafted no level are skipped; a
    step's per-step host work is spread over its levels."""
    residuals = sorted((m - sum(float(cost.draft_time(f, context)) for f in frontiers)) / len(frontiers)
                       for frontiers, m, context in steps if frontiers)
    if not residuals:
        raise ValueError("fit_draft_overhead needs at least one measured step that drafted a level")
    return max(0.0, residuals[len(residuals) // 2])


def budget_rates(estimates: Tensor, batch_size: int, cost: CostModel, spent_seconds: float = 0.0,
                 context: float | None = None, weight: float = 1.0) -> Tensor:
    """Expected emitted tokens per second of the step for n = 0, 1, ..., len(estimates) candidates verified
    (the module docstring's rate; n = 0 verifies the roots only). weight: tokens each candidate stands for
    (1 for real candidates; B / M when M quantiles of a distribution stand for B requests, `drafting_pays`)."""
    if estimates.ndim != 1:
        raise ValueError(f"estimates must be 1-D, got shape {tuple(estimates.shape)}")
    n = torch.arange(estimates.numel() + 1, dtype=torch.float64) * weight  # tokens taken
    gain = weight * torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(estimates.double(), 0)])
    speculative = n > 0
    seconds = spent_seconds + cost.control_seconds * speculative + cost.verify_time(batch_size + n, context)
    return (batch_size + gain) / seconds


def choose_budget(estimates: Tensor, batch_size: int, cost: CostModel, spent_seconds: float = 0.0,
                  context: float | None = None) -> int:
    """K (>= B) maximising expected emitted tokens per second for this step (see the module docstring).

    estimates (n,): acceptance estimates of the candidates in the order they would be taken. context: cached
    tokens per request as the step's attention reads them (the grid's second axis; None: the curve).
    Drafting time is already spent whatever is chosen now (`drafting_pays` decides before drafting)."""
    rate = budget_rates(estimates, batch_size, cost, spent_seconds, context)
    return batch_size + int(torch.argmax(rate))  # first maximum: the smaller K on ties


def drafting_pays(estimates: Tensor, batch_size: int, cost: CostModel, draft_seconds: float,
                  context: float | None = None, weight: float = 1.0) -> bool:
    """The budget rule before drafting, when nothing is sunk yet: whether a step that drafts (paying
    `draft_seconds`) and then verifies the best prefix of `estimates` is expected to emit more tokens per second
    than a plain step, B / t_verify(B). estimates: the expected candidates' acceptance estimates, best first, each
    standing for `weight` requests (a ratio of expected tokens to expected seconds: with M quantiles of the
    acceptance distribution at weight B / M, verifying the best k is "verify when the estimate beats the k-th",
    and t_verify is linear between its measured points)."""
    rates = budget_rates(estimates, batch_size, cost, draft_seconds, context, weight)
    plain = batch_size / float(cost.verify_time(batch_size, context))
    return rates.numel() > 1 and float(rates[1:].max()) > plain


def level_cost_ratio(cost: CostModel, batch_size: int, draft_width: int = 0) -> float:
    """What one more draft level costs, as a fraction of a plain step, when every request of a batch of B gets
    it: one draft level over B * draft_width tokens (forward and host work) plus the verification of B more
    tokens, (t_level(B * draft_width) + t_verify(2B) - t_verify(B)) / t_verify(B). A level yields p tokens per request
    where a step yields one, so it pays when p exceeds this ratio; at 1 or more it cannot pay at all."""
    b = max(1, batch_size)
    base = float(cost.verify_time(b))
    extra = float(cost.verify_time(2 * b)) - base
    if draft_width > 0 and cost.draft_tokens:
        extra += float(cost.draft_level_time(b * draft_width))
    return extra / base


def break_even_accept_prob(cost: CostModel, batch_size: int, draft_width: int = 0) -> float:
    """lambda: the acceptance probability above which drafting and verifying one more level pays,
    `level_cost_ratio` clamped to [0.02, 0.95] (the gate calibration's range). Verification is nearly free at
    B = 1 on a GPU (small lambda) and dear under load."""
    return min(0.95, max(0.02, level_cost_ratio(cost, batch_size, draft_width)))


def batch_bucket(batch_size: int) -> int:
    """The tracker's batch-size bucket: the next power of two (1, 2, 4, 8, ...; B = 5..8 share bucket 8)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return 1 << (batch_size - 1).bit_length()


@dataclass
class ModeRates:
    """Exponential moving averages of one bucket's speculative and AR steps (None until the mode has run)."""

    spec_tokens: float | None = None  # tokens per request per step
    spec_seconds: float | None = None  # seconds per step
    ar_tokens: float | None = None
    ar_seconds: float | None = None
    spec_steps: int = 0  # steps measured per mode (early averages are plain means, see SpeculationTracker)
    ar_steps: int = 0
    ar_start_seconds: list[float] = field(default_factory=list)  # the first AR steps, whose median seeds AR
    probe_every: int = 8
    steps_since_probe: int = 0
    # draft levels a speculative step may use: starts at 1 (the policy's deepest with a prior that expects
    # speculation to pay), doubles after a step that beat AR, halves after one that did not
    depth: int = 1
    # speculative steps run before AR is measured (SpeculationTracker.prior)
    prior_steps: int = 0

    @property
    def spec_rate(self) -> float | None:
        return None if self.spec_tokens is None else self.spec_tokens / max(self.spec_seconds, 1e-12)

    @property
    def ar_rate(self) -> float | None:
        return None if self.ar_tokens is None else self.ar_tokens / max(self.ar_seconds, 1e-12)

    def spec_better(self) -> bool | None:
        if self.spec_rate is None or self.ar_rate is None:
            return None
        return self.spec_rate > self.ar_rate


# the AR fallback's calibrated start applies only where a draft level costs less than this share of a plain step
PRIOR_MAX_LEVEL_COST = 0.10


@dataclass
class SpeculationTracker:
    """Decides before drafting whether a step should speculate at all (echo family with a cost model).

    An explore/exploit rule on measured throughput, kept per batch-size bucket (`batch_bucket`): speculation
    that pays at B = 1 may lose at B = 16, and one average over both would follow whichever ran last. Per bucket,
    tokens per second per request of speculative steps and of plain AR steps: the ratio of exponential moving
    averages of tokens and of seconds (wall time of the whole step, measured by the runtime). A ratio of
    averages, not an average of per-step rates: speculative steps take about the same time but emit very
    different numbers of tokens, and averaging their rates would favour lucky steps. AR's time starts as the
    median of its first `min_ar_steps` steps, and a mode's first 1/`smoothing` steps are averaged with equal
    weights: an EMA seeded by one step would let a single slow first AR step (a burst of other work on a shared
    machine) make a losing speculation look better for dozens of steps.

    Start safe: with a cost model, a batch size at which even a surely accepted draft level cannot pay
    (`level_cost_ratio` >= 1) never speculates. Otherwise a bucket's first `min_ar_steps` steps are plain AR
    (they cannot lose to AR), the next speculates once to measure speculation, with one draft level; the depth a speculative step
    may draft (`depth_limit`) doubles after each speculative step that beat the AR rate and halves after one that
    did not, up to `max_depth` (slow start: a probe costs about one draft forward until deeper trees have shown
    they pay, instead of a whole tree built on overconfident drafts). From then on the better mode runs and the
    other is re-measured by a probe every `probe_every` steps. With a calibrated `prior` (the policy's rule before
    drafting, which reads the calibration's first-level acceptance and the cost curve) that expects speculation to
    pay at a batch size, the order flips there: the bucket's first `min_probe_every` steps speculate with the
    policy's full depth (what the pure policy would do), then AR is measured for `min_ar_steps` steps, and the
    measured rates decide from then on; a server's first requests no longer pay an AR start and a slow start that a
    calibration already answered. Only in verification's flat region (`trusts_prior`): under load the AR-first
    start is kept. A speculative step right after AR steps also makes the draft model catch up on the
    tokens it skipped; that one-off cost is charged to exploration, not to the speculative rate
    (`update(..., one_off_seconds=...)`).

    Probe spacing: a probe that confirms the choice costs `loss` tokens per request against running the better
    mode for the same time (loss = probe seconds x better rate - tokens the probe produced). The next probe waits
    until that is at most `explore_share` of the tokens produced meanwhile (at least twice the last interval, at
    most `max_probe_every`). A probe that overturns the choice resets the interval. Within a speculative step
    the cost model picks K (`choose_budget`).
    """

    min_ar_steps: int = 3
    min_probe_every: int = 8
    max_probe_every: int = 1024
    explore_share: float = 0.02
    smoothing: float = 0.1
    # the engine's cost curve and draft width (nodes expanded per request and level); None: no prior
    cost: CostModel | None = None
    draft_width: int = 0
    # the policy's deepest draft level (the depth limit's ceiling)
    max_depth: int = 1 << 30
    # batch size -> whether a calibration expects a speculative step to beat a plain one (None: no prior)
    prior: Callable[[int], bool] | None = None
    buckets: dict[int, ModeRates] = field(default_factory=dict)

    def rates(self, batch_size: int) -> ModeRates:
        key = batch_bucket(batch_size)
        if key not in self.buckets:
            r = ModeRates(probe_every=self.min_probe_every)
            if self.prior is not None and self.trusts_prior(batch_size) and self.prior(batch_size):
                r.prior_steps, r.depth = self.min_probe_every, self.max_depth
            self.buckets[key] = r
        return self.buckets[key]

    def depth_limit(self, batch_size: int) -> int:
        """Draft levels the next speculative step at this batch size may use."""
        return min(self.rates(batch_size).depth, self.max_depth)

    def trusts_prior(self, batch_size: int) -> bool:
        """Whether the calibrated start may apply at this batch size: only where one more draft level costs less
        than PRIOR_MAX_LEVEL_COST of a plain step (verification's flat region), so that the cost model's own error
        cannot flip the sign of its prediction. Under load the prediction was wrong: on the Qwen EAGLE-3 pair at
        B = 16 (a level 14-16 % of a step) it expected a first level to gain 24-30 %, the calibrated start kept
        speculating, and ECHO +fallback ran 0.88 x AR against 0.98 with the AR-first start (docs/benchmarks.md)."""
        return self.cost is None or level_cost_ratio(self.cost, batch_size, self.draft_width) < PRIOR_MAX_LEVEL_COST

    def can_pay(self, batch_size: int) -> bool:
        """False when the cost curve says one more level cannot pay even if surely accepted."""
        return self.cost is None or level_cost_ratio(self.cost, batch_size, self.draft_width) < 1.0

    def should_speculate(self, batch_size: int) -> bool:
        if not self.can_pay(batch_size):
            return False
        r = self.rates(batch_size)
        if r.ar_steps < self.min_ar_steps:
            # the calibration's choice first where it expects speculation to pay, then AR's measurement: steps
            # that cannot lose
            return r.spec_steps < r.prior_steps
        if r.spec_rate is None:
            return True  # then speculation, once
        better = r.spec_better()
        if r.steps_since_probe + 1 >= r.probe_every:
            return not better
        return better

    def update(self, batch_size: int, speculated: bool, emitted: int, seconds: float,
               one_off_seconds: float = 0.0) -> None:
        """One step's outcome: `emitted` tokens over the batch in `seconds`. one_off_seconds: part of `seconds`
        that steady speculation would not pay (the draft's catch-up after AR steps); excluded from the rate,
        counted in the probe's cost. A step at a batch size where speculation cannot pay was not a choice and is
        not counted (B = 5..8 share a bucket; a forced AR step at B = 8 must not pass for a probe at B = 5)."""
        if not self.can_pay(batch_size):
            return
        r = self.rates(batch_size)
        per_request = emitted / batch_size
        steady = max(seconds - one_off_seconds, 1e-12)
        before = r.spec_better()
        was_probe = before is not None and speculated != before
        mode = "spec" if speculated else "ar"

        n = getattr(r, f"{mode}_steps") + 1
        setattr(r, f"{mode}_steps", n)
        weight = max(self.smoothing, 1.0 / n)  # the mean of the first 1/smoothing steps, then an EMA

        def ema(old: float | None, x: float) -> float:
            return x if old is None else (1 - weight) * old + weight * x

        if speculated and r.ar_rate is not None:
            paid = per_request / steady > r.ar_rate
            r.depth = min(2 * r.depth, self.max_depth) if paid else max(1, r.depth // 2)
        setattr(r, f"{mode}_tokens", ema(getattr(r, f"{mode}_tokens"), per_request))
        if not speculated and n <= self.min_ar_steps:
            r.ar_start_seconds.append(steady)
            r.ar_seconds = statistics.median(r.ar_start_seconds)
            if r.prior_steps and n == self.min_ar_steps:
                r.steps_since_probe = 0  # both modes measured now: the probe spacing starts here
        else:
            setattr(r, f"{mode}_seconds", ema(getattr(r, f"{mode}_seconds"), steady))
        if was_probe:
            r.steps_since_probe = 0
            if r.spec_better() == before:
                better = max(r.spec_rate, r.ar_rate)
                loss = max(seconds * better - per_request, 0.0)  # tokens per request the probe cost
                per_step = (r.spec_tokens if before else r.ar_tokens) or 1.0  # per chosen-mode step
                stretched = math.ceil(loss / (self.explore_share * per_step))
                r.probe_every = min(max(2 * r.probe_every, stretched), self.max_probe_every)
            else:
                r.probe_every = self.min_probe_every
        else:
            r.steps_since_probe += 1
