"""EchoConfig: the speculative-decoding configuration shared by every tree policy (TensorRT-LLM's
`speculative_config=` argument). Validation happens here, once, with messages that name the field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["EchoConfig", "GateConfig", "POLICY_NAMES", "DEFAULT_STATIC_CHOICES"]

POLICY_NAMES = ("ar", "chain", "static", "eagle2", "ddd", "echo", "echo-dense", "echo-fixed", "echo-no-budget-stop")

# A 16-node tree in Medusa/EAGLE-1 "choices" form: each tuple is the path of sibling ranks from the root.
DEFAULT_STATIC_CHOICES: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0),
)  # fmt: skip


@dataclass(frozen=True)
class EchoConfig:
    """Tree policy and its parameters.

    policy: one of POLICY_NAMES.
    max_depth: D, the deepest draft level (echo family, eagle2, ddd).
    top_k: children drafted per expanded node (eagle2, ddd, echo family).
    beam_width: frontier nodes expanded per request and level (echo family; eagle2/ddd use top_k, as EAGLE-2).
    total_tokens: nodes verified per request, root included (eagle2, ddd): their per-request budget.
    num_draft_tokens: chain length (chain).
    static_choices: the static tree's rank paths (static).
    k_max: global verification budget per step in tokens (echo family); must be >= the batch size at run time.
    max_nodes_per_request: cap on K_i for the echo family (TensorRT-LLM's max_draft_len + 1).
    gate_depths / gate_thresholds: the sparse gate; None = uncalibrated defaults (see gating.default_gate).
    fixed_threshold: the single tau of echo-fixed.
    ddd_threshold: DDD's stop rule: keep drafting while log(sum of the beam's path probabilities) > threshold.
    ddd_check_every: DDD checks its rule every this many levels.
    probe_floor: with the AR fallback, a speculative probe whose budget rule would verify its roots alone verifies
        as many drafted tokens as requests (`core.controller.Decision.min_tokens`); False: the rule alone (an
        ablation).
    """

    policy: str = "echo"
    max_depth: int = 6
    top_k: int = 4
    beam_width: int = 4
    total_tokens: int = 32
    num_draft_tokens: int = 4
    static_choices: tuple[tuple[int, ...], ...] = field(default=DEFAULT_STATIC_CHOICES)
    k_max: int = 512
    max_nodes_per_request: int = 64
    gate_depths: tuple[int, ...] | None = None
    gate_thresholds: tuple[float, ...] | None = None
    fixed_threshold: float = 0.3
    ddd_threshold: float = -1.2
    ddd_check_every: int = 1
    probe_floor: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"EchoConfig.policy = {self.policy!r} is unknown; choose one of {', '.join(POLICY_NAMES)}")
        for name in ("max_depth", "top_k", "beam_width", "num_draft_tokens", "k_max", "ddd_check_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EchoConfig.{name} must be an integer >= 1, got {value!r}")
        for name in ("total_tokens", "max_nodes_per_request"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EchoConfig.{name} must be an integer >= 1 (root included), got {value!r}")
        if not isinstance(self.probe_floor, bool):
            raise ValueError(f"EchoConfig.probe_floor must be True or False, got {self.probe_floor!r}")
        if not 0.0 <= self.fixed_threshold <= 1.0:
            raise ValueError(f"EchoConfig.fixed_threshold must be in [0, 1], got {self.fixed_threshold}")
        if math.isnan(self.ddd_threshold) or self.ddd_threshold > 0:
            raise ValueError(f"EchoConfig.ddd_threshold is a log-probability and must be <= 0, got {self.ddd_threshold}")
        if (self.gate_depths is None) != (self.gate_thresholds is None):
            raise ValueError("EchoConfig.gate_depths and gate_thresholds must be given together (or both None)")
        if self.gate_depths is not None:
            if any(d > self.max_depth for d in self.gate_depths):
                raise ValueError(f"EchoConfig.gate_depths {self.gate_depths} must not exceed max_depth={self.max_depth}")
            GateConfig(tuple(self.gate_depths), tuple(self.gate_thresholds or ()))
        if not self.static_choices:
            raise ValueError("EchoConfig.static_choices must hold at least one path")
        seen = set()
        for path in self.static_choices:
            if not path or any((not isinstance(r, int)) or r < 0 for r in path):
                raise ValueError(f"EchoConfig.static_choices: {path!r} must be a non-empty tuple of ranks >= 0")
            if len(path) > 1 and tuple(path[:-1]) not in set(map(tuple, self.static_choices)):
                raise ValueError(f"EchoConfig.static_choices: {path!r} needs its prefix {tuple(path[:-1])!r} too")
            if tuple(path) in seen:
                raise ValueError(f"EchoConfig.static_choices: {path!r} appears twice")
            seen.add(tuple(path))


@dataclass(frozen=True)
class GateConfig:
    """Gate depths (ascending, >= 1) and the threshold tau_d at each."""

    depths: tuple[int, ...]
    thresholds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.depths) != len(self.thresholds):
            raise ValueError(
                f"GateConfig.depths ({len(self.depths)}) and thresholds ({len(self.thresholds)}) must have equal length"
            )
        if any(d < 1 for d in self.depths) or list(self.depths) != sorted(set(self.depths)):
            raise ValueError(f"GateConfig.depths must be strictly increasing integers >= 1, got {self.depths}")
        if any(not (0.0 <= t <= 1.0) or math.isnan(t) for t in self.thresholds):
            raise ValueError(f"GateConfig.thresholds must lie in [0, 1], got {self.thresholds}")

    def threshold_at(self, depth: int) -> float | None:
        """tau_d, or None when depth is not a gate depth."""
        try:
            return self.thresholds[self.depths.index(depth)]
        except ValueError:
            return None
