"""The runtime's clocks: where every second the executor, its online prices and the speculation controller see
comes from.

The core reads no clock; the executor measures its steps through one `Clock` and hands the seconds on. Two
clocks, one interface:

    WallClock       time.perf_counter(); a forward is timed as it runs (CUDA work synchronised first)
    ModelledClock   virtual time that moves only by modelled costs: a target forward over T tokens advances it by
                    cost.verify_time(T), a draft forward by cost.draft_time(T), and nothing else takes time

    with clock.forward("target", tokens):     # times one model forward
        logits = model(batch, cache)
    elapsed = clock.now() - t0

With a `ModelledClock` every decision that depends on time (AR fallback, probe spacing, K per step) is a pure
function of the tokens processed, so tests and what-if runs do not depend on how fast or busy the machine is.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, Protocol

import torch

from echo_trtllm.core.cost import CostModel

__all__ = ["Clock", "WallClock", "ModelledClock", "FORWARD_KINDS"]

FORWARD_KINDS = ("target", "draft")


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since an arbitrary origin."""

    def forward(self, kind: str, tokens: int):
        """Context manager around one model forward of `kind` ("target" or "draft") over `tokens` tokens."""


class WallClock:
    """Real time. On CUDA a forward is synchronised before it counts as done, so it is charged its device time."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.sync = torch.device(device).type == "cuda" if device is not None else False

    def now(self) -> float:
        return time.perf_counter()

    @contextmanager
    def forward(self, kind: str, tokens: int) -> Iterator[None]:
        yield
        if self.sync:
            torch.cuda.synchronize()


class ModelledClock:
    """Virtual time advanced only by the cost model (module docstring)."""

    def __init__(self, cost: CostModel, start: float = 0.0) -> None:
        if not cost.draft_tokens:
            raise ValueError("ModelledClock needs a cost model with draft points (draft_tokens/draft_seconds)")
        self.cost = cost
        self.time = start

    def now(self) -> float:
        return self.time

    @contextmanager
    def forward(self, kind: str, tokens: int) -> Iterator[None]:
        if kind not in FORWARD_KINDS:
            raise ValueError(f"forward kind must be one of {FORWARD_KINDS}, got {kind!r}")
        yield
        model = self.cost.verify_time if kind == "target" else self.cost.draft_time
        self.time += float(model(max(int(tokens), 1)))
