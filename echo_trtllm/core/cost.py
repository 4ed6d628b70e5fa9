"""The verification cost model and the budget rule that picks each step's K from it.

A `CostModel` holds measured points of t_verify(T) (seconds of one target forward over T tokens in total) and of
t_draft(T) (one draft forward over T tokens), interpolated piecewise-linearly and extrapolated along the last
segment. `choose_budget` picks how many candidates to verify:

    K = B + n,  n maximising  (B + sum of the n best candidates' acceptance estimates) / (t_spent + t_verify(B + n))

where the candidates come in the scheduler's order (P1 depth, then P2 width; any prefix is ancestor-closed), B
counts the bonus token every request gets, and t_spent is the drafting time already spent this step (sunk: it is
charged to every choice; whether to draft at all is decided before drafting, by the executor's
`SpeculationTracker`). n = 0 verifies roots only. Because the whole curve is evaluated, a flat region (verification nearly free) is filled and a steep one
(compute-bound, or a CPU kernel whose cost is linear in T) is left alone.

Example: B = 1, estimates [0.9, 0.5, 0.1], t_verify(T) = 0.1 + 0.01·T, t_spent = 0.02:
n = 0: 1.0/0.13 = 7.69; n = 1: 1.9/0.14 = 13.57; n = 2: 2.4/0.15 = 16.0; n = 3: 2.5/0.16 = 15.63  -> K = 3.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["CostModel", "choose_budget", "interpolate"]


def interpolate(xs: tuple[float, ...], ys: tuple[float, ...], x: Tensor) -> Tensor:
    """Piecewise-linear y(x) through the points, extrapolated along the first/last segment."""
    px = torch.tensor(xs, dtype=torch.float64)
    py = torch.tensor(ys, dtype=torch.float64)
    x = x.double()
    if px.numel() == 1:
        return py.expand_as(x) * (x / px[0])  # one point: proportional
    i = torch.searchsorted(px, x).clamp(1, px.numel() - 1)
    x0, x1, y0, y1 = px[i - 1], px[i], py[i - 1], py[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


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

    def __post_init__(self) -> None:
        for name in ("verify", "draft"):
            xs, ys = getattr(self, f"{name}_tokens"), getattr(self, f"{name}_seconds")
            if len(xs) != len(ys):
                raise ValueError(f"CostModel.{name}_tokens and {name}_seconds must have equal length")
            if list(xs) != sorted(set(xs)) or any(x < 1 for x in xs):
                raise ValueError(f"CostModel.{name}_tokens must be strictly increasing integers >= 1, got {xs}")
            if any(y <= 0 for y in ys):
                raise ValueError(f"CostModel.{name}_seconds must be positive, got {ys}")
        if not self.verify_tokens:
            raise ValueError("CostModel needs at least one verify point")

    def verify_time(self, tokens: Tensor | int) -> Tensor:
        return interpolate(self.verify_tokens, self.verify_seconds, torch.as_tensor(tokens))

    def draft_time(self, tokens: Tensor | int) -> Tensor:
        if not self.draft_tokens:
            return torch.zeros_like(torch.as_tensor(tokens, dtype=torch.float64))
        return interpolate(self.draft_tokens, self.draft_seconds, torch.as_tensor(tokens))

    @classmethod
    def linear(cls, fixed: float, per_token: float, max_tokens: int = 4096) -> "CostModel":
        """t(T) = fixed + per_token · T (a synthetic curve for tests and what-ifs)."""
        return cls((1, max_tokens), (fixed + per_token, fixed + per_token * max_tokens))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "CostModel":
        d = json.loads(text)
        for key in ("verify_tokens", "verify_seconds", "draft_tokens", "draft_seconds"):
            d[key] = tuple(d.get(key, ()))
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        return cls.from_json(Path(path).read_text())


def choose_budget(estimates: Tensor, batch_size: int, cost: CostModel, spent_seconds: float = 0.0) -> int:
    """K (>= B) maximising expected emitted tokens per second for this step (see the module docstring).

    estimates (n,): acceptance estimates of the candidates in the order they would be taken."""
    if estimates.ndim != 1:
        raise ValueError(f"estimates must be 1-D, got shape {tuple(estimates.shape)}")
    n = torch.arange(estimates.numel() + 1, dtype=torch.float64)  # candidates taken
    gain = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(estimates.double(), 0)])
    speculative = n > 0
    # Drafting time is already spent whatever is chosen now (whether to draft at all is decided before drafting).
    seconds = spent_seconds + cost.control_seconds * speculative + cost.verify_time(batch_size + n)
    rate = (batch_size + gain) / seconds
    return batch_size + int(torch.argmax(rate))  # first maximum: the smaller K on ties
