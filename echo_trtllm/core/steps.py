"""One engine step as it was measured: the contract between an engine (this project's runtime, or another engine's
speculative-decoding hook) and ECHO's online models, which learn prices and acceptance from these samples alone.

A step verifies T tokens for B requests whose attention reads C cached tokens each, after 0 or more draft forwards
of t_1, t_2, ... tokens (the first one also reads the tokens the draft has not seen yet: the previous step's
accepted tokens, or after plain steps everything since the draft last ran). Its two measured phases:

    drafting       from the step's start to its verification forward: draft forwards, the tree's host work
                   (gate, budget, selection), packing. A plain step has a small one (the root-only tree, packing).
    verification   from there to the step's end: the tree's inputs and mask, the target's forward, acceptance,
                   finishing, KV commit (and the draft's own commit after a speculative step).

Each phase is priced as a linear function of features of the step (`drafting_features`, `verification_features`):
a piecewise-linear curve in tokens through fixed knots (1, 2, 4, ..., 4096; `hat`: the hat-function basis, so a
coefficient is the phase's cost at its knot and a batch size between knots is priced from its two neighbours),
tokens x context for attention, a term per request, and constants for what a speculative step does that a plain
one does not: drafting's host work, and on the verification side the draft's commit after any step that drafted
and a tree's inputs and acceptance after a step that verified drafted tokens.

    hat(3) over knots (1, 2, 4, 8, ...) = (0, 0.5, 0.5, 0, ...)      3 tokens: halfway between 2 and 4
    a step with draft forwards of 16 and 64 tokens: hat(16) + hat(64) in the drafting features
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

__all__ = ["StepSample", "KNOTS", "hat", "hat_at", "drafting_features", "verification_features", "DRAFTING_FEATURES",
           "VERIFICATION_FEATURES", "CONTEXT_SCALE", "sample_features"]

# tokens at which each phase's cost curve has a coefficient (a forward's cost is piecewise linear between them)
KNOTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_KNOTS = np.asarray(KNOTS, dtype=np.float64)
# tokens x cached context is counted in units of this many token-context pairs (keeps coefficients near 1e-3 s)
CONTEXT_SCALE = 1024.0

DRAFTING_FEATURES = ("step", "speculative", *(f"draft@{k}" for k in KNOTS), "draft tokens x context")
VERIFICATION_FEATURES = (*(f"verify@{k}" for k in KNOTS), "verify tokens x context", "requests", "drafted", "tree")


@dataclass(frozen=True)
class StepSample:
    """One measured step (module docstring)."""

    batch_size: int  # B: requests in the step
    verified_tokens: int  # T: tokens of the verification forward (B for a plain step)
    context: float  # cached tokens per request as the step's attention reads them
    # tokens of each draft forward of the step, in order; () for a plain step
    draft_tokens: tuple[int, ...] = ()
    drafting_seconds: float = 0.0  # measured: start of the step to its verification
    verification_seconds: float = 0.0  # measured: verification to the end of the step
    # tokens of draft_tokens that steady speculation would not process (the draft catching up after plain steps)
    catch_up_tokens: int = 0

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"StepSample.batch_size must be >= 1, got {self.batch_size}")
        if self.verified_tokens < self.batch_size:
            raise ValueError(f"StepSample.verified_tokens ({self.verified_tokens}) must be >= batch_size "
                             f"({self.batch_size}): every request verifies at least its root")
        if not (math.isfinite(self.context) and self.context >= 0):
            raise ValueError(f"StepSample.context must be finite and >= 0, got {self.context}")
        if any(t < 1 for t in self.draft_tokens):
            raise ValueError(f"StepSample.draft_tokens must be positive token counts, got {self.draft_tokens}")
        if not all(math.isfinite(s) and s >= 0 for s in (self.drafting_seconds, self.verification_seconds)):
            raise ValueError("StepSample.drafting_seconds and verification_seconds must be finite and >= 0, got "
                             f"{self.drafting_seconds}, {self.verification_seconds}")
        first = self.draft_tokens[0] if self.draft_tokens else 0
        if not 0 <= self.catch_up_tokens <= first:
            raise ValueError(f"StepSample.catch_up_tokens ({self.catch_up_tokens}) must lie in [0, the first draft "
                             f"forward's tokens {first}]: catch-up is what that forward reads beyond steady")

    @property
    def speculated(self) -> bool:
        """The step drafted."""
        return bool(self.draft_tokens)

    @property
    def verified_drafts(self) -> bool:
        """The step verified drafted tokens (a step may draft and verify its roots only)."""
        return self.verified_tokens > self.batch_size

    @property
    def seconds(self) -> float:
        return self.drafting_seconds + self.verification_seconds


def hat(x: np.ndarray) -> np.ndarray:
    """The hat-function basis over KNOTS at x (any shape, x >= 1): (*x.shape, len(KNOTS)) weights, two non-zero
    and summing to 1, linear in x between knots; beyond the last knot linear extrapolation along the last segment.
    Zeros of x (no forward) give zero rows."""
    x = np.asarray(x, dtype=np.float64)
    flat = x.reshape(-1)
    i = np.clip(np.searchsorted(_KNOTS, flat, side="right") - 1, 0, len(KNOTS) - 2)
    u = (flat - _KNOTS[i]) / (_KNOTS[i + 1] - _KNOTS[i])
    out = np.zeros((flat.size, len(KNOTS)))
    rows = np.arange(flat.size)
    out[rows, i] = 1.0 - u
    out[rows, i + 1] = u
    out[flat <= 0] = 0.0
    return out.reshape(*x.shape, len(KNOTS))


def hat_at(x: float) -> tuple[int, float]:
    """The hat basis at one x >= 1 as (i, u): weight 1 - u on knot i and u on knot i + 1 (`hat` for scalars)."""
    i = min(max(bisect.bisect_right(KNOTS, x) - 1, 0), len(KNOTS) - 2)
    return i, (x - KNOTS[i]) / (KNOTS[i + 1] - KNOTS[i])


def sample_features(sample: StepSample) -> tuple[np.ndarray, np.ndarray]:
    """(drafting features, verification features) of one sample: `drafting_features` and
    `verification_features` of a batch of one, built without the batch machinery (once per engine step)."""
    n = len(KNOTS)
    d = np.zeros(n + 3)
    d[0] = 1.0
    tokens = 0
    for t in sample.draft_tokens:
        i, u = hat_at(t)
        d[2 + i] += 1.0 - u
        d[3 + i] += u
        tokens += t
    if tokens:
        d[1] = 1.0
        d[-1] = tokens * sample.context / CONTEXT_SCALE
    v = np.zeros(n + 4)
    i, u = hat_at(sample.verified_tokens)
    v[i], v[i + 1] = 1.0 - u, u
    v[n] = sample.verified_tokens * sample.context / CONTEXT_SCALE
    v[n + 1] = sample.batch_size
    v[n + 2] = float(bool(tokens))
    v[n + 3] = float(sample.verified_drafts)
    return d, v


def drafting_features(draft_tokens: np.ndarray, context: np.ndarray) -> np.ndarray:
    """Drafting features of n steps: draft_tokens (n, L) tokens of each draft forward (0: none), context (n,).
    Returns (n, len(DRAFTING_FEATURES)): 1 (every step's host work), 1 if the step drafted, the forwards' hats
    summed, the forwards' tokens x context."""
    draft_tokens = np.atleast_2d(np.asarray(draft_tokens, dtype=np.float64))
    context = np.broadcast_to(np.asarray(context, dtype=np.float64), draft_tokens.shape[:1])
    n = draft_tokens.shape[0]
    spec = (draft_tokens.sum(axis=1) > 0).astype(np.float64)
    hats = hat(draft_tokens).sum(axis=1) if draft_tokens.shape[1] else np.zeros((n, len(KNOTS)))
    attention = draft_tokens.sum(axis=1) * context / CONTEXT_SCALE
    return np.column_stack([np.ones(n), spec, hats, attention])


def verification_features(batch_size: np.ndarray, verified: np.ndarray, context: np.ndarray,
                          drafted: np.ndarray) -> np.ndarray:
    """Verification features of n steps (each argument (n,) or a scalar): the hats of T, T x context, B, 1 if the
    step drafted, 1 if it verified drafted tokens (T > B). Returns (n, len(VERIFICATION_FEATURES))."""
    b, t, c, s = np.broadcast_arrays(*(np.atleast_1d(np.asarray(a, dtype=np.float64))
                                       for a in (batch_size, verified, context, drafted)))
    return np.column_stack([hat(t), t * c / CONTEXT_SCALE, b, s, (t > b).astype(np.float64)])
