"""The verification cost model measured at load, and the budget rule that picks each step's K from a cost model.
Nothing here reads a clock: the runtime measures and hands seconds in.

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
yet, by `core.controller.SpeculationController` (measured steps, the +fallback mode). n = 0 verifies roots only.
Because the whole curve is evaluated, a flat region (verification nearly free) is filled and a steep one
(compute-bound, or a CPU kernel whose cost is linear in T) is left alone.

Example: B = 1, estimates [0.9, 0.5, 0.1], t_verify(T) = 0.1 + 0.01·T, t_spent = 0.02:
n = 0: 1.0/0.13 = 7.69; n = 1: 1.9/0.14 = 13.57; n = 2: 2.4/0.15 = 16.0; n = 3: 2.5/0.16 = 15.63  -> K = 3.

`break_even_accept_prob` turns the curve into the gate's lambda for a batch size.

The rules read any object with this interface (`verify_time`, `draft_time`, `draft_level_time`, `drafting_time`,
`control_seconds`, `draft_tokens`): at run time that is `core.prices.StepPrices`, the whole-step model learned
online from the engine's own steps, whose prior is the `CostModel` measured at load.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

__all__ = ["CostModel", "budget_rates", "choose_budget", "fit_draft_overhead", "fit_step_overhead", "interpolate",
           "level_cost_ratio", "break_even_accept_prob"]


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

    def verify_time(self, tokens: Tensor | int, context: float | None = None,
                    batch_size: int | None = None) -> Tensor:
        """Seconds of a target forward over `tokens` tokens; with `context` (cached tokens per request as the step's
        attention reads them) and a grid, read from the grid (bilinear in tokens and context, extrapolated along
        its edges). batch_size: not read here (forwards are measured by tokens); `core.prices.StepPrices` prices a
        per-request term with it."""
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
                 context: float | None = None) -> Tensor:
    """Expected emitted tokens per second of the step for n = 0, 1, ..., len(estimates) candidates verified
    (the module docstring's rate; n = 0 verifies the roots only)."""
    if estimates.ndim != 1:
        raise ValueError(f"estimates must be 1-D, got shape {tuple(estimates.shape)}")
    gain = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(estimates.double(), 0)])
    return (batch_size + gain) / budget_seconds(estimates.numel(), batch_size, cost, spent_seconds, context)


def budget_seconds(count: int, batch_size: int, cost: CostModel, spent_seconds: float = 0.0,
                   context: float | None = None) -> Tensor:
    """Seconds of the step for n = 0, 1, ..., count candidates verified beyond the roots (`budget_rates`'s
    denominator), float64. Summed in NumPy: the rule reads a few hundred numbers a step, where each tensor
    operation's dispatch costs more than its arithmetic."""
    n = np.arange(count + 1, dtype=np.float64)  # tokens taken
    verify = cost.verify_time(torch.from_numpy(batch_size + n), context, batch_size)
    return torch.from_numpy(spent_seconds + cost.control_seconds * (n > 0) + verify.double().numpy())


def choose_budget(estimates: Tensor, batch_size: int, cost: CostModel, spent_seconds: float = 0.0,
                  context: float | None = None) -> int:
    """K (>= B) maximising expected emitted tokens per second for this step (see the module docstring).

    estimates (n,): acceptance estimates of the candidates in the order they would be taken. context: cached
    tokens per request as the step's attention reads them (the grid's second axis; None: the curve).
    Drafting time is already spent whatever is chosen now (whether to draft was decided before drafting)."""
    rate = budget_rates(estimates, batch_size, cost, spent_seconds, context)
    return batch_size + int(torch.argmax(rate))  # first maximum: the smaller K on ties


def marginal_token_time(cost: CostModel, batch_size: int, context: float | None = None) -> float:
    """What one more verified token costs a step of `batch_size` requests at `context`, in seconds:
    t_verify(B + 1) - t_verify(B). The budget rule verifies a drafted token when its acceptance pays this; a
    learnt curve whose knots are not non-decreasing can read it negative."""
    b = max(1, batch_size)
    return float(cost.verify_time(b + 1, context, b)) - float(cost.verify_time(b, context, b))


def level_cost_ratio(cost: CostModel, batch_size: int, draft_width: int = 0) -> float:
    """What one more draft level costs, as a fraction of a plain step, when every request of a batch of B gets
    it: one draft level over B * draft_width tokens (forward and host work) plus the verification of B more
    tokens, (t_level(B * draft_width) + t_verify(2B) - t_verify(B)) / t_verify(B). A level yields p tokens per request
    where a step yields one, so it pays when p exceeds this ratio; at 1 or more it cannot pay at all."""
    b = max(1, batch_size)
    base = float(cost.verify_time(b, None, b))
    extra = float(cost.verify_time(2 * b, None, b)) - base
    if draft_width > 0 and cost.draft_tokens:
        extra += float(cost.draft_level_time(b * draft_width))
    return extra / base


def break_even_accept_prob(cost: CostModel, batch_size: int, draft_width: int = 0) -> float:
    """lambda: the acceptance probability above which drafting and verifying one more level pays,
    `level_cost_ratio` clamped to [0.02, 0.95] (the gate calibration's range). Verification is nearly free at
    B = 1 on a GPU (small lambda) and dear under load."""
    return min(0.95, max(0.02, level_cost_ratio(cost, batch_size, draft_width)))
