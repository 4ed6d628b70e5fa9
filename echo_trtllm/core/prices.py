"""Prices learned from the engine's own steps: a whole-step cost model fitted online, read by every decision.

`StepCostModel` prices a step as the sum of its two phases (`core/steps.py`: drafting, verification), each a
linear function of the step's features whose coefficients are tracked by a Kalman filter (`KalmanLinear`):

    seconds of a phase = features(step) . theta + noise
    theta               a random walk: theta_next = theta + drift

- **One model for every batch size.** The token axis is a piecewise-linear curve through fixed knots shared by all
  batch sizes, so a batch size never seen is priced from its neighbours; the prior correlates neighbouring knots,
  so a step at 16 tokens also moves the price at 8 and 32.
- **Forgetting.** The drift has a common part (every coefficient scaled together: the machine got slower or faster;
  `drift_common`, relative per step) and an independent part (`drift_each`): the filter follows a machine whose
  speed changes, and what a stretch of steps never touches grows uncertain rather than stale. The variance of a
  coefficient is capped at its prior's, so nothing grows without bound in a long run.
- **Warm start.** `from_cost_model` turns what the runtime measured at load (forward times by tokens; with a grid,
  by context too) into the prior mean; the runtime then runs a few real steps, speculative and plain, through the
  same update (`Executor.warm_up`), so drafting and host work are priced before the first request.
- **Noise.** The measurement noise is relative (a step of 1 s varies more than one of 10 ms), its scale the running
  mean of the absolute relative residuals; an innovation beyond `huber` standard deviations is clipped, so one step
  slowed by another process (a shared machine only ever adds time) moves the prices by a bounded amount.
- **Costs are not negative.** After each update the mean is projected onto theta >= 0 in the covariance's metric
  (the coefficients that went negative held at zero, the others moved as their correlation with them says), not
  clipped alone: a clipped coefficient moves nothing else, and a step measured cheaper than predicted could raise
  its own price (`KalmanLinear._project`).
- **Uncertainty.** `predict` returns each prediction's variance (the coefficients' covariance read along the
  features); the speculation controller reads the covariance along the difference of two step shapes' relative
  features, the variance of log(t_a / t_b), which is what a decision between them needs: within a phase a slowdown
  of the whole machine changes both and not their ratio (the common drift cancels; across the phases, below).

`StepPrices` is the read interface the policies' rules use (`verify_time`, `draft_level_time`, `drafting_time`,
`control_seconds`, as `core.cost.CostModel` offers them), always reading the current coefficients.

The two phases are separate filters: a phase whose time did not change (a plain step's tiny drafting phase, say)
must not hold the other back when the machine slows. Within a phase the common drift cancels in the ratio of two
step shapes' predictions; across the phases it does not, so the controller's variance of such a ratio counts the
phases' drifts as independent (it overstates the uncertainty a little where two shapes split their time between
the phases differently: the conservative side).

Example (`tests/core/test_prices.py`): the truth t = 2 ms + 0.1 ms per token; a prior that believes 4 ms + 0.1 ms per
token; after 30 steps at 8, 16 and 64 tokens the prices at 8-64 tokens are within 3 % and the price at 32 tokens,
never measured, follows from its neighbours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .steps import (CONTEXT_SCALE, DRAFTING_FEATURES, KNOTS, VERIFICATION_FEATURES, StepSample, drafting_features,
                    hat_at, sample_features, verification_features)

__all__ = ["KalmanLinear", "StepCostModel", "StepPrices", "StepPrediction"]

# a prediction is never below this many seconds (a relative noise needs a positive scale)
MIN_SECONDS = 1e-6
# the prior deviation of attention's cost where no grid measured it, in 64-token steps at 1,024 cached tokens
ATTENTION_PRIOR = 16.0
# measurements per application of the drift (KalmanLinear.update)
DRIFT_EVERY = 4


class KalmanLinear:
    """y = phi . theta + e, theta a random walk (module docstring); numpy float64, host-side, small (n ~ 32).

    Measurements come on `channels` (the step's phases): each channel has its own relative noise scale, and every
    channel's features index the one joint coefficient vector, so the common drift correlates them (a slower machine
    slows both phases together)."""

    def __init__(self, mean: np.ndarray, cov: np.ndarray, drift_common: float = 0.02, drift_each: float = 0.002,
                 noise: float = 0.1, noise_floor: float = 0.02, noise_rate: float = 0.05, huber: float = 2.5,
                 channels: int = 1) -> None:
        mean = np.asarray(mean, dtype=np.float64).copy()
        cov = np.asarray(cov, dtype=np.float64).copy()
        if mean.ndim != 1 or cov.shape != (mean.size, mean.size):
            raise ValueError(f"KalmanLinear: mean must be (n,) and cov (n, n), got {mean.shape} and {cov.shape}")
        if not np.all(np.isfinite(mean)) or not np.all(np.isfinite(cov)):
            raise ValueError("KalmanLinear: mean and cov must be finite")
        for name, v in (("drift_common", drift_common), ("drift_each", drift_each), ("noise", noise),
                        ("noise_floor", noise_floor), ("noise_rate", noise_rate), ("huber", huber)):
            if not v >= 0:
                raise ValueError(f"KalmanLinear.{name} must be >= 0, got {v}")
        if channels < 1:
            raise ValueError(f"KalmanLinear.channels must be >= 1, got {channels}")
        self.theta, self.cov = np.maximum(mean, 0.0), (cov + cov.T) / 2  # float64, updated in place
        self.prior_sd = np.sqrt(np.diag(self.cov)).copy()
        self._cap = self.prior_sd ** 2  # no coefficient becomes more uncertain than its prior
        self.drift_common, self.drift_each = drift_common, drift_each
        self.noise = [noise] * channels
        self.noise_floor, self.noise_rate, self.huber = noise_floor, noise_rate, huber
        self.updates = self.steps = 0
        self.last_noise_var = 0.0
        # for the drift (`advance`): a view of the covariance's diagonal (the matrix is only updated in place) and
        # the floor of each coefficient's drift
        self._diagonal = self.cov.reshape(-1)[:: mean.size + 1]
        self._floor = 0.05 * self.prior_sd
        # `step` on the plugin's host library (`kernels.host_kalman_stepper`, installed by the runtime): one call
        # where `advance` and `update` make a few dozen NumPy operations; None: this class's NumPy code, its oracle
        self.stepper = None

    def _project(self, moving: np.ndarray | None = None) -> None:
        """No coefficient below zero (a cost): the mean is projected onto theta >= 0 in the covariance's metric,
        the coefficients that went negative held at zero and the others moved as their correlation with them says
        (the covariance is kept). Clipping them alone would move the others nowhere: after a step cheaper than
        predicted, a coefficient pushed below zero and clipped back can leave the prediction higher than before
        (a plain step measured 3 x cheaper raised its own price by 17 %: tests/core/test_prices.py). moving: a
        boolean mask of the coefficients the projection may move (the others are neither moved nor pinned, as
        `_update_held` needs); None: all."""
        theta, pinned = self.theta, np.zeros(self.theta.size, dtype=bool)
        # every coefficient: a slice (views, as every step's plain update needs); a mask: the indices it names
        idx = slice(None) if moving is None else np.flatnonzero(moving)
        for _ in range(theta.size):
            below = theta < 0
            if moving is not None:
                below &= moving
            if not below.any():
                break
            pinned |= below
            a = np.flatnonzero(pinned)
            p_aa = self.cov[np.ix_(a, a)]
            jitter = 1e-12 * max(float(np.trace(p_aa)) / a.size, 1e-30)
            theta[idx] -= self.cov[idx][:, a] @ np.linalg.solve(p_aa + jitter * np.eye(a.size), theta[a])
            theta[a] = 0.0
        np.maximum(theta, 0.0, out=theta, where=True if moving is None else moving)  # rounding

    def _update_held(self, phi: np.ndarray, residual: float, noise_var: float, free: np.ndarray) -> None:
        """An update that moves the free coefficients only, reading the held ones as known: the measurement less
        the held coefficients' part is a measurement of the free ones along phi's free part (phi_f), and the
        update is that measurement's, the gain P phi_f / (phi_f' P phi_f + R) with its held rows zero and the
        covariance that gain leaves under that reading (Joseph form with phi_f: P - K phi_f'P - P phi_f K'
        + (phi_f' P phi_f + R) K K', never above P). The held coefficients keep their means and their block of the
        covariance, and the projection onto costs >= 0 moves the free ones only. A step with no free feature
        (phi_f = 0) teaches nothing."""
        phi_f = np.where(free, phi, 0.0)
        p_f = self.cov @ phi_f
        s_f = float(phi_f @ p_f) + noise_var
        if not float(phi_f @ phi_f) > 0 or not s_f > 0:
            return
        gain = np.where(free, p_f / s_f, 0.0)
        self.theta += gain * residual
        self.cov += s_f * np.multiply.outer(gain, gain) - np.multiply.outer(gain, p_f) - np.multiply.outer(p_f, gain)
        self._project(free)

    def predict(self, phi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mean, variance of the mean) of phi . theta for phi (n, features)."""
        phi = np.atleast_2d(phi)
        mean = phi @ self.theta
        var = np.einsum("ij,jk,ik->i", phi, self.cov, phi)
        return np.maximum(mean, MIN_SECONDS), np.maximum(var, 0.0)

    def advance(self) -> None:
        """One step of the random walk (every DRIFT_EVERY-th call adds DRIFT_EVERY steps' drift at once: the
        covariance grows by the same amount, a step costs less): common (scale) and independent parts, each
        relative to the coefficient (with a floor of 5 % of its prior's deviation, so a coefficient at zero can
        still move)."""
        self.steps += 1
        if self.steps % DRIFT_EVERY:
            return
        theta, diagonal = self.theta, self._diagonal
        self.cov += (DRIFT_EVERY * self.drift_common ** 2) * np.multiply.outer(theta, theta)
        level = np.maximum(theta, self._floor)
        diagonal += (DRIFT_EVERY * self.drift_each ** 2) * (level * level)
        over = diagonal > self._cap
        if over.any():  # a congruence D P D keeps the matrix positive semi-definite
            d = np.ones_like(self.theta)
            d[over] = np.sqrt(self._cap[over] / diagonal[over])
            self.cov *= np.outer(d, d)
        self.cov[...] = (self.cov + self.cov.T) * 0.5  # rounding leaves the updates' symmetry slowly: restore it

    def step(self, phi: np.ndarray, y: float, channel: int = 0, free: np.ndarray | None = None) -> float:
        """One step: the drift (`advance`), then the measurement y at features phi (`update`); returns the
        prediction before the update. A measurement that is not finite is refused before anything moves. free:
        `update`'s (a held update runs this class's NumPy code)."""
        if not math.isfinite(y):
            raise ValueError(f"KalmanLinear.update: the measurement must be finite, got {y}")
        if self.stepper is not None and free is None:
            return self.stepper(self, phi, y, channel)
        self.advance()
        return self.update(phi, y, channel, free)

    def update(self, phi: np.ndarray, y: float, channel: int = 0, free: np.ndarray | None = None) -> float:
        """One measured y at features phi (features,) on a channel (no drift: `advance` once per step). Returns
        the prediction before the update. A measurement that is not finite is refused (it would poison theta).
        free: a boolean mask (features,) of the coefficients this measurement may move (`_update_held`); None: all."""
        if not math.isfinite(y):
            raise ValueError(f"KalmanLinear.update: the measurement must be finite, got {y}")
        if free is not None:
            free = np.asarray(free, dtype=bool)
            if free.shape != self.theta.shape:
                raise ValueError(f"KalmanLinear.update: free must be a ({self.theta.size},) mask, got {free.shape}")
        predicted = max(float(phi @ self.theta), MIN_SECONDS)
        r = y - predicted
        scale = max(predicted, y, MIN_SECONDS)  # relative to the larger: a tiny prediction is no yardstick
        noise_var = self.last_noise_var = (self.noise[channel] * scale) ** 2
        p_phi = self.cov @ phi
        s = float(phi @ p_phi) + noise_var
        if not s > 0:  # no noise and no uncertainty along phi: the gain is undefined (the host library refuses too)
            raise ValueError(f"KalmanLinear.update: the innovation's variance must be > 0, got {s}")
        bound = self.huber * math.sqrt(s)
        clipped = max(-bound, min(bound, r))
        if free is None:
            gain = p_phi / s
            self.theta += gain * clipped
            self.cov -= np.multiply.outer(gain, p_phi)  # symmetric: (P phi)(P phi)^T / s
            self._project()
        else:
            self._update_held(phi, clipped, noise_var, free)
        # the noise scale: running mean absolute relative residual (x 1.25: the normal's sd from its mean |x|)
        rel = abs(clipped) / scale
        self.noise[channel] = max(self.noise_floor, (1 - self.noise_rate) * self.noise[channel]
                                  + self.noise_rate * 1.2533 * rel)
        self.updates += 1
        return predicted


@dataclass(frozen=True)
class StepPrediction:
    """What the model predicted for a step (before it learned from it) and what was measured."""

    drafting: float
    verification: float
    measured_drafting: float
    measured_verification: float

    @property
    def seconds(self) -> float:
        return self.drafting + self.verification

    @property
    def measured(self) -> float:
        return self.measured_drafting + self.measured_verification

    @property
    def relative_error(self) -> float:
        """(predicted - measured) / measured of the whole step."""
        return (self.seconds - self.measured) / max(self.measured, MIN_SECONDS)


def _knot_cov(values: np.ndarray, relative: float, correlation: float) -> np.ndarray:
    """Prior covariance of a curve's knot values: sd = relative x value (at least 5 % of the largest value, so a
    knot measured at zero can still learn), correlation**|i - j| between knots i and j."""
    sd = np.maximum(relative * values, 0.05 * max(values.max(), MIN_SECONDS))
    i = np.arange(values.size)
    return np.outer(sd, sd) * correlation ** np.abs(i[:, None] - i[None, :])


class StepCostModel:
    """Whole-step seconds = drafting phase + verification phase, each a `KalmanLinear` (module docstring)."""

    ND, NV = len(DRAFTING_FEATURES), len(VERIFICATION_FEATURES)

    def __init__(self, drafting: KalmanLinear, verification: KalmanLinear) -> None:
        if drafting.theta.size != self.ND or verification.theta.size != self.NV:
            raise ValueError(f"StepCostModel needs {self.ND} drafting and {self.NV} verification coefficients "
                             "(core/steps.py)")
        self.drafting, self.verification = drafting, verification
        self.version = 0  # bumped by every observation; readers cache per version
        self.default_context = 64.0  # the last step's context: what a reader that does not know the context gets
        self.prices = StepPrices(self)
        self.history: list[StepPrediction] = []  # the last `HISTORY` predictions, for reports

    @property
    def theta_drafting(self) -> np.ndarray:
        return self.drafting.theta

    @property
    def theta_verification(self) -> np.ndarray:
        return self.verification.theta

    def joint(self, phi_d: np.ndarray, phi_v: np.ndarray) -> np.ndarray:
        """Features of one phase pair as one row (drafting's ND first)."""
        return np.concatenate([phi_d, phi_v])

    def variance(self, g: np.ndarray) -> float:
        """g' P g for a joint row g (`joint`): the two phases' filters are independent."""
        gd, gv = g[: self.ND], g[self.ND:]
        return float(gd @ self.drafting.cov @ gd + gv @ self.verification.cov @ gv)

    HISTORY = 4096

    @classmethod
    def from_cost_model(cls, cost, relative: float = 0.5, correlation: float = 0.8, **kalman) -> "StepCostModel":
        """The prior from forward times measured at load (`core.cost.CostModel`): each verification knot at the
        curve's forward time (context 64; its attention part taken out when a grid gives the context slope) plus the
        fitted per-step overhead, each draft knot at the draft forward plus the per-level overhead; `relative`
        standard deviation, `correlation` between neighbouring knots. The terms the load does not measure (per
        request, the speculative constants, attention without a grid) start at zero (or the fitted control time)
        with deviations on the scale of a one-token step."""
        knots = torch.tensor(KNOTS, dtype=torch.float64)
        att_v = _context_slope(cost, "grid")
        verify = cost.verify_time(knots).double().numpy() - att_v * np.asarray(KNOTS) * 64 / CONTEXT_SCALE
        verify = np.maximum(verify, MIN_SECONDS)
        one = float(verify[0])
        if cost.draft_tokens:
            att_d = _context_slope(cost, "draft_grid")
            draft = np.maximum(cost.draft_level_time(knots).double().numpy()
                               - att_d * np.asarray(KNOTS) * 64 / CONTEXT_SCALE, MIN_SECONDS)
        else:  # no draft measured: a draft forward as dear as a target forward, very uncertain
            att_d, draft = att_v, verify.copy()
        # attention with no grid to say: up to ATTENTION_PRIOR steps of 64 tokens at 1,024 cached tokens each (a CPU
        # measured 10 x on the embedded target, 1.5 x on Qwen2.5-Coder-1.5B)
        scale_v = ATTENTION_PRIOR * float(verify[KNOTS.index(64)]) / 64 * CONTEXT_SCALE / 1024
        scale_d = ATTENTION_PRIOR * float(draft[KNOTS.index(64)]) / 64 * CONTEXT_SCALE / 1024
        v_mean = np.concatenate([verify, [att_v, 0.0, 0.0, 0.0]])
        v_cov = np.zeros((v_mean.size,) * 2)
        n = len(KNOTS)
        v_cov[:n, :n] = _knot_cov(verify, relative, correlation)
        v_cov[n, n] = max(att_v * relative, scale_v) ** 2
        v_cov[n + 1, n + 1] = (one / 8) ** 2  # per request
        v_cov[n + 2, n + 2] = (one / 2) ** 2  # the draft's commit after a step that drafted
        v_cov[n + 3, n + 3] = one ** 2  # a tree's inputs and acceptance beyond a plain step's
        d_mean = np.concatenate([[0.0, float(cost.control_seconds)], draft, [att_d]])
        d_cov = np.zeros((d_mean.size,) * 2)
        d_cov[0, 0] = (one / 4) ** 2  # every step's tree and packing
        d_cov[1, 1] = (one + float(cost.control_seconds)) ** 2  # a speculative step's host work
        d_cov[2:2 + n, 2:2 + n] = _knot_cov(draft, relative if cost.draft_tokens else 2.0, correlation)
        d_cov[-1, -1] = max(att_d * relative, scale_d) ** 2
        return cls(KalmanLinear(d_mean, d_cov, **kalman), KalmanLinear(v_mean, v_cov, **kalman))

    # ------------------------------------------------------------------ learning

    def observe(self, sample: StepSample, forwards: bool = True) -> StepPrediction:
        """Learn from one measured step; returns what was predicted for it before. forwards=False: the step
        teaches each phase's constants only (drafting's per-step and speculative host work, verification's draft
        commit and tree), read with the rest as known; the forward curves (both phases' knots and attention) and
        the per-request term are held. The engine's warm-up learns so: its few steps at one context and one and
        four rows cannot tell knots, attention and a per-request term apart: left free, four builds on the Qwen pair
        priced the 16-row plain step at 217-330 ms and one more token at 6.3-16.7 ms, where the load alone priced
        them at 182-209 and 7.1-7.8 (docs/performance.md)."""
        phi_d, phi_v = sample_features(sample)
        free_d, free_v = (None, None) if forwards else _CONSTANTS
        pred_d = self.drafting.step(phi_d, sample.drafting_seconds, free=free_d)
        pred_v = self.verification.step(phi_v, sample.verification_seconds, free=free_v)
        self.default_context = float(sample.context)
        self.version += 1
        out = StepPrediction(pred_d, pred_v, sample.drafting_seconds, sample.verification_seconds)
        self.history.append(out)
        if len(self.history) > 2 * self.HISTORY:
            del self.history[: self.HISTORY]
        return out

    # ------------------------------------------------------------------ reading

    def predict(self, batch_size, verified, context, draft_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(seconds, variance) of n step shapes: batch_size, verified, context (n,) or scalars, draft_tokens (n, L)
        tokens of each draft forward (0: none; L = 0 for plain steps)."""
        draft_tokens = np.atleast_2d(np.asarray(draft_tokens, dtype=np.float64))
        n = max(draft_tokens.shape[0], np.size(verified))
        if draft_tokens.shape[0] != n:
            draft_tokens = np.broadcast_to(draft_tokens, (n, draft_tokens.shape[1]))
        ctx = np.broadcast_to(np.asarray(context, dtype=np.float64), (n,))
        drafted = (draft_tokens.sum(axis=1) > 0).astype(np.float64)
        phi = np.column_stack([drafting_features(draft_tokens, ctx),
                               verification_features(batch_size, verified, ctx, drafted)])
        md, vd = self.drafting.predict(phi[:, : self.ND])
        mv, vv = self.verification.predict(phi[:, self.ND:])
        return md + mv, vd + vv

    def predict_phases(self, sample: StepSample) -> tuple[float, float]:
        """(drafting, verification) seconds predicted for the sample's step, without learning from it."""
        phi_d, phi_v = sample_features(sample)
        return (max(float(phi_d @ self.theta_drafting), MIN_SECONDS),
                max(float(phi_v @ self.theta_verification), MIN_SECONDS))

    def predict_sample(self, sample: StepSample) -> float:
        return sum(self.predict_phases(sample))

    def plain_seconds(self, batch_size: int, context: float) -> float:
        """Predicted seconds of a plain (AR) step of `batch_size` requests at `context`."""
        return self.predict_sample(StepSample(batch_size, batch_size, context))

    def median_relative_error(self, last: int | None = None) -> float:
        """Median |predicted - measured| / measured over the last `last` observed steps (all kept if None)."""
        hist = self.history[-last:] if last else self.history
        if not hist:
            return float("nan")
        return float(np.median([abs(p.relative_error) for p in hist]))

    def describe(self) -> dict:
        """The current coefficients by name (seconds), and each filter's noise scale."""
        return {"drafting": dict(zip(DRAFTING_FEATURES, self.theta_drafting.round(9).tolist())),
                "verification": dict(zip(VERIFICATION_FEATURES, self.theta_verification.round(9).tolist())),
                "noise": {"drafting": self.drafting.noise[0], "verification": self.verification.noise[0]},
                "steps": self.version}


# each phase's constants (`StepCostModel.observe` with forwards=False): drafting's "step" and "speculative",
# verification's "drafted" and "tree"; held: the forward curves (knots, attention) and the per-request term
_CONSTANTS = (np.isin(DRAFTING_FEATURES, ("step", "speculative")), np.isin(VERIFICATION_FEATURES, ("drafted", "tree")))


def _context_slope(cost, grid: str) -> float:
    """Seconds per CONTEXT_SCALE token-context pairs from a measured grid (least squares of the differences from
    the first context column, through zero), 0 without one."""
    rows = getattr(cost, f"{grid}_seconds", ())
    if not rows:
        return 0.0
    seconds = np.asarray(rows, dtype=np.float64)  # (tokens, contexts)
    tokens = np.asarray(cost.grid_tokens, dtype=np.float64)[:, None]
    contexts = np.asarray(cost.grid_contexts, dtype=np.float64)[None, :]
    x = (tokens * (contexts - contexts[:, :1]) / CONTEXT_SCALE).ravel()
    y = (seconds - seconds[:, :1]).ravel()
    return max(0.0, float(x @ y / max(x @ x, 1e-12)))


class StepPrices:
    """`StepCostModel` read the way the policies' rules read `core.cost.CostModel` (module docstring): every call
    sees the current coefficients. Knot tables are rebuilt once per model version; a scalar argument is priced
    in plain floats and gets a float back (the rules ask dozens of times a step), a tensor a float64 tensor."""

    has_grid = True

    def __init__(self, model: StepCostModel) -> None:
        self.model = model
        self._version = -1
        self._t: dict = {}

    @property
    def version(self) -> int:
        """Changes whenever the prices do (readers cache per version)."""
        return self.model.version

    def _tables(self) -> dict:
        m = self.model
        if self._version != m.version:
            n = len(KNOTS)
            v, d = m.theta_verification.tolist(), m.theta_drafting.tolist()
            self._t = {"verify": v[:n], "verify_att": v[n], "per_request": v[n + 1], "drafted": v[n + 2],
                       "tree": v[n + 3], "step": d[0], "speculative": d[1], "draft": d[2:2 + n], "draft_att": d[2 + n],
                       "knots_t": torch.tensor(KNOTS, dtype=torch.float64),
                       "verify_t": torch.tensor(v[:n], dtype=torch.float64),
                       "draft_t": torch.tensor(d[2:2 + n], dtype=torch.float64),
                       "knots_np": np.array(KNOTS, dtype=np.float64), "verify_np": np.array(v[:n], dtype=np.float64),
                       "draft_np": np.array(d[2:2 + n], dtype=np.float64)}
            self._version = m.version
        return self._t

    @property
    def draft_tokens(self) -> tuple[int, ...]:
        """Truthy: the model prices draft forwards (the rules test `cost.draft_tokens` for a draft curve)."""
        return KNOTS

    @property
    def control_seconds(self) -> float:
        """What verifying drafted tokens costs beyond a plain step's verification (the tree's inputs, acceptance),
        charged when drafts are verified (`cost.budget_rates`)."""
        return self._tables()["tree"]

    def _context(self, context: float | None) -> float:
        return self.model.default_context if context is None else float(context)

    @staticmethod
    def _curve(values: list[float], values_t: Tensor, knots_t: Tensor, x):
        """The knot curve at x: a float for a scalar x, a float64 tensor for a tensor."""
        if isinstance(x, Tensor) and x.ndim:
            x = x.double()
            i = torch.searchsorted(knots_t, x, right=True).clamp(1, len(KNOTS) - 1)
            x0, x1, y0, y1 = knots_t[i - 1], knots_t[i], values_t[i - 1], values_t[i]
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        i, u = hat_at(float(x))
        return values[i] + (values[i + 1] - values[i]) * u

    @staticmethod
    def _curve_np(values: np.ndarray, knots: np.ndarray, x: np.ndarray) -> np.ndarray:
        """`_curve` of a float64 array in NumPy, the same operations in the same order (bit-equal to the tensor
        branch, tests/core/test_prices.py): the budget rule reads the curve at every K of a step, where a dozen
        tensor operations over a few hundred numbers cost more in dispatch than in arithmetic."""
        i = np.clip(np.searchsorted(knots, x, side="right"), 1, len(KNOTS) - 1)
        x0, x1, y0, y1 = knots[i - 1], knots[i], values[i - 1], values[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    @staticmethod
    def _host_array(tokens) -> np.ndarray | None:
        """A CPU tensor of tokens as a float64 array (None: a scalar or a tensor on another device)."""
        if isinstance(tokens, Tensor) and tokens.ndim and tokens.device.type == "cpu":
            return tokens.detach().double().numpy()
        return None

    @staticmethod
    def _out(x, scalar_input):
        return max(x, MIN_SECONDS) if scalar_input else x.clamp(min=MIN_SECONDS)

    def verify_time(self, tokens: Tensor | int, context: float | None = None,
                    batch_size: int | None = None) -> Tensor:
        """Seconds of the verification phase over `tokens` tokens (a plain step's when tokens = batch size; the
        speculative part is `control_seconds`). batch_size None: a plain step of `tokens` requests."""
        t = self._tables()
        c = self._context(context)
        xs = self._host_array(tokens)
        if xs is not None:
            b = xs if batch_size is None else float(batch_size)
            y = (self._curve_np(t["verify_np"], t["knots_np"], xs) + t["verify_att"] * xs * c / CONTEXT_SCALE
                 + t["per_request"] * b)
            return torch.from_numpy(np.maximum(y, MIN_SECONDS))
        scalar = not (isinstance(tokens, Tensor) and tokens.ndim)
        x = float(tokens) if scalar else tokens.double()
        b = x if batch_size is None else float(batch_size)
        y = (self._curve(t["verify"], t["verify_t"], t["knots_t"], x) + t["verify_att"] * x * c / CONTEXT_SCALE
             + t["per_request"] * b)
        return self._out(y, scalar)

    def draft_time(self, tokens: Tensor | int, context: float | None = None) -> Tensor:
        """Seconds of one draft forward over `tokens` tokens (its knot curve and attention)."""
        t = self._tables()
        c = self._context(context)
        xs = self._host_array(tokens)
        if xs is not None:
            y = self._curve_np(t["draft_np"], t["knots_np"], xs) + t["draft_att"] * xs * c / CONTEXT_SCALE
            return torch.from_numpy(np.maximum(y, MIN_SECONDS))
        scalar = not (isinstance(tokens, Tensor) and tokens.ndim)
        x = float(tokens) if scalar else tokens.double()
        y = self._curve(t["draft"], t["draft_t"], t["knots_t"], x) + t["draft_att"] * x * c / CONTEXT_SCALE
        return self._out(y, scalar)

    def draft_level_time(self, frontier: Tensor | int, context: float | None = None) -> Tensor:
        """One draft level over `frontier` tokens: its forward (the host work per forward is in the knots)."""
        return self.draft_time(frontier, context)

    def drafting_time(self, frontier_sizes: list[int], context: float | None = None) -> float:
        """What drafting with forwards of these sizes commits a step to, whatever it then verifies: the drafting
        phase (every forward, its constants) and the draft's commit after verification."""
        t = self._tables()
        forwards = sum(float(self.draft_time(f, context)) for f in frontier_sizes if f > 0)
        return t["step"] + (t["speculative"] + t["drafted"] + forwards if frontier_sizes else 0.0)
