"""Whether a step speculates: measured outcomes, learned prices, and a bounded exploration budget.

Before every step `SpeculationController.decide(B, C, catch_up)` compares the two modes at this batch size and
context, in tokens per second:

    plain         B / t_plain(B, C)                       t from the online cost model (`core/prices.py`)
    speculative   sum_j w_j e_j s_j / sum_j w_j t_j'      over the last speculative steps j

where step j (B_j requests, T_j verified tokens, draft forwards d_j, e_j tokens emitted) is rescaled to this batch:
s_j = B / B_j, T_j' = B + (T_j - B_j) s_j, d_j' = d_j s_j (its catch-up taken out: steady speculation), and t_j'
is what the cost model prices that shape at now, at this context. The weights
w_j = 2^(-rank_j / memory_half_life) * 2^(-age_j / half_life) * exp(-(log2 B - log2 B_j)^2 / 2): the newest
speculative steps count most (rank 0 is the last one; a workload that changes is followed within a few dozen
speculative steps), steps long past fade (age in steps: evidence goes stale while plain steps run), and steps at
nearby batch sizes count most, so a batch size never seen speculating is judged by its neighbours' trees priced at
its own size. A ratio of averages (tokens over
seconds), not an average of rates: a lucky step does not count for more than its time.

The estimate includes one prior pseudo-step at break-even (the plain rate), so a few steps move it only part of the
way. The ratio r = speculative / plain has an uncertainty (log scale): the sampling variance of the ratio estimate
(delta method, the prior step's relative deviation `prior_sd` included; with fewer than MIN_EVIDENCE effective
steps, (sum w)^2 / sum w^2, at least 1: three unlucky probes are not proof either way) and
the cost model's variance of log(t_spec / t_plain) (its covariance read along the two shapes' relative features;
within a phase a slowdown of the whole machine cancels in the ratio). With z = `z`:

    r * exp(-z s) > 1          speculate ("exploit": the gain is positive beyond its uncertainty)
    r > 1 otherwise            speculate as a probe: its expected loss is negative (free while credit >= 0)
    r <= 1 < r * exp(+z s)     plain, unless the exploration budget covers a probe's expected loss ("probe")
    r * exp(+z s) < 1          plain, unless the budget is more than half full after the probe's expected loss
                               (a check that the workload has not changed)
    no evidence near B         as the uncertain case, the probe's expected loss priced with no gain at all

Where the plain step's own price is uncertain (relative deviation above `PLAIN_KNOWN`) and most of the doubt (its
share of the variance at least half; with no evidence, whenever it is uncertain), a plain step is run instead of a
speculative probe: it is safe, and it is the measurement that resolves the doubt.

Exploration budget (`credit`, in step-equivalents: tokens / B, so one step of the batch's worth is 1): every step
adds `explore_share` x its tokens per request; a probe may run when the credit covers its expected loss (the
tokens it is expected to emit short of what the other mode would in the same time, plus the draft's catch-up
time, which steady speculation does not pay) and is charged its measured loss afterwards (a probe that gains
pays credit back; the credit is capped at `max_credit`). The credit is kept per batch-size bucket (log2 B
rounded, as the plain probes' spacing): each bucket starts with `initial_credit` the first time the engine runs at
that size, earns from its own steps and pays for its own probes, so exploring one row at a server's first request
does not leave the sixteen rows that follow without the credit to probe (it did: a one-row probe that lost put the
single credit below zero and sixteen rows ran plain until they had earned it back: 153 steps on the Qwen pair;
docs/performance.md). So exploration costs at most `explore_share` of the tokens in steady state, plus
`initial_credit` step-equivalents for each batch-size bucket the engine visits and one probe's overshoot of its
expected loss per bucket (in step-equivalents of the steps' own batch sizes, which within a bucket differ up to
1.8 x), and `stats` measures what it really cost.
A probe whose expected loss is negative (the estimate favours speculation but not beyond its uncertainty) is
free in expectation and runs while the credit is not negative: that is how speculation that pays gathers the
evidence to be exploited. While speculating, a plain step is run as a probe near this batch size (credit permitting)
8, 16, 32, ... and then every `plain_probe_every` steps, so the plain side of the comparison is measured too (a
plain price learnt from a cold start is corrected early).

Nothing here reads a clock or a model: the engine hands in `StepSample`s (`core/steps.py`) and token counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .prices import StepCostModel
from .steps import CONTEXT_SCALE, KNOTS, StepSample, hat, sample_features

__all__ = ["SpeculationController", "Decision", "ControllerStats"]

MAX_FORWARDS = 64  # draft forwards per step a record keeps (a deeper tree's further forwards are not priced)
# a plain step's price is taken as known when its relative deviation is below this (else it is measured first)
PLAIN_KNOWN = 0.1
# effective speculative steps (sum w)^2 / sum w^2 below which the estimate is never confident either way
MIN_EVIDENCE = 4.0
# records below which an estimate is read again at every new record (`SpeculationController.estimate`)
KEEP_RECORDS = 16


@dataclass(frozen=True)
class Decision:
    """One step's choice and what it expected."""

    speculate: bool
    # "exploit" | "probe" | "plain" | "plain-probe" | "forced"
    reason: str
    batch_size: int
    # speculative / plain tokens per second as estimated (nan: no evidence near this batch size) and its bounds
    ratio: float = math.nan
    low: float = 0.0
    high: float = math.inf
    # predicted seconds of a plain step and of a steady speculative step of this batch (nan: unknown)
    plain_seconds: float = math.nan
    spec_seconds: float = math.nan
    # step-equivalents the chosen mode is expected to lose against the other (exploration; 0 for exploits)
    expected_loss: float = 0.0

    @property
    def probe(self) -> bool:
        return self.reason in ("probe", "plain-probe")

    def min_tokens(self, rows: int | None = None) -> int:
        """The tokens the step verifies, roots included, for `rows` drafting requests (default: the batch), where
        the budget rule would verify the roots alone: a speculative probe verifies as many drafted tokens as rows
        (2 x rows, as a probe with no evidence is priced: the allocation's first drafted nodes, the batch's likeliest
        spine nodes, so a confident request may get two and another none), so the price of a verified token is
        measured where the rule, at the prices it has, would never look (a step that verifies its roots only cannot
        correct it); 0 for any other decision."""
        return 2 * (self.batch_size if rows is None else rows) if self.speculate and self.reason == "probe" else 0

    @property
    def expected_rate(self) -> float:
        """Tokens per second the choice expected (nan when unknown)."""
        plain = self.batch_size / self.plain_seconds if self.plain_seconds > 0 else math.nan
        return plain * self.ratio if self.speculate else plain


@dataclass
class ControllerStats:
    """What the controller did and what exploration cost, measured."""

    steps: int = 0
    speculative_steps: int = 0
    probes: int = 0  # speculative probes
    plain_probes: int = 0
    tokens: float = 0.0  # tokens emitted
    exploration_loss: float = 0.0  # tokens the probes emitted short of the other mode in the same time (>= 0 each)
    exploration_gain: float = 0.0  # tokens probes emitted beyond it (a probe that paid)

    @property
    def exploration_share(self) -> float:
        """Tokens lost to probes, net of what probes gained, over tokens emitted (what the budget bounds)."""
        return max(self.exploration_loss - self.exploration_gain, 0.0) / self.tokens if self.tokens else 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "speculative_steps": self.speculative_steps, "probes": self.probes,
                "plain_probes": self.plain_probes, "tokens": self.tokens,
                "exploration_loss_tokens": round(self.exploration_loss, 2),
                "exploration_gain_tokens": round(self.exploration_gain, 2),
                "exploration_share": round(self.exploration_share, 5)}


class _Records:
    """The last `capacity` speculative steps (a ring buffer of arrays), and per batch size B the features of each
    step rescaled to B, built once per record and B (`at`), so a decision costs a few products of small matrices.
    Features are kept without the context (its two columns are the tokens, multiplied by the context when read)."""

    KEEP_SIZES = 8  # batch sizes whose rescaled features are kept at once

    def __init__(self, capacity: int) -> None:
        c = self.capacity = capacity
        self.size = self.head = 0
        self.added = 0  # records ever added (never wraps: which evidence an estimate read)
        self.step, self.batch, self.verified = np.zeros(c), np.ones(c), np.ones(c)
        self.emitted, self.catch_up, self.drafts = np.zeros(c), np.zeros(c), np.zeros((c, MAX_FORWARDS))
        self._scaled: dict[int, dict] = {}  # B -> rescaled features and which rows are current

    def add(self, step: int, sample: StepSample, emitted: float) -> None:
        i = self.head
        self.step[i], self.batch[i], self.verified[i] = step, sample.batch_size, sample.verified_tokens
        self.emitted[i], self.catch_up[i] = emitted, sample.catch_up_tokens
        self.drafts[i] = 0.0
        tokens = sample.draft_tokens[:MAX_FORWARDS]
        self.drafts[i, : len(tokens)] = tokens
        for cache in self._scaled.values():
            cache["valid"][i] = False
        self.head = (self.head + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)
        self.added += 1

    def at(self, b: int) -> dict:
        """Every kept step rescaled to batch size b (the controller's docstring): its drafting features without
        the context column and its draft tokens (d, dt), its verification features likewise and verified tokens
        (v, vt), and its tokens (e), each over the first `size` rows."""
        cache = self._scaled.get(b)
        if cache is None:
            if len(self._scaled) >= self.KEEP_SIZES:
                self._scaled.pop(next(iter(self._scaled)))
            c = self.capacity
            cache = self._scaled[b] = {"valid": np.zeros(c, dtype=bool), "d": np.zeros((c, len(KNOTS) + 2)),
                                       "dt": np.zeros(c), "v": np.zeros((c, len(KNOTS) + 3)), "vt": np.zeros(c),
                                       "e": np.zeros(c)}
        stale = np.flatnonzero(~cache["valid"][: self.size])
        if stale.size:
            s = b / self.batch[stale]
            verified = b + (self.verified[stale] - self.batch[stale]) * s
            drafts = self.drafts[stale] * s[:, None]
            drafts[:, 0] -= self.catch_up[stale] * s  # steady speculation: no catch-up
            drafts = np.where(self.drafts[stale] > 0, np.maximum(drafts, 1.0), 0.0)  # a forward reads >= 1 token
            spec = (drafts.sum(axis=1) > 0).astype(np.float64)
            cache["d"][stale] = np.column_stack([np.ones(stale.size), spec, hat(drafts).sum(axis=1)])
            cache["dt"][stale] = drafts.sum(axis=1)
            cache["v"][stale] = np.column_stack([hat(verified), np.full(stale.size, float(b)), spec,
                                                 (verified > b).astype(np.float64)])
            cache["vt"][stale] = verified
            cache["e"][stale] = self.emitted[stale] * s
            cache["valid"][stale] = True
        n = self.size
        return {k: v[:n] for k, v in cache.items() if k != "valid"}


class SpeculationController:
    """Decides, before drafting, whether a step speculates (module docstring)."""

    def __init__(self, cost: StepCostModel, explore_share: float = 0.01, z: float = 1.0, prior_sd: float = 0.5,
                 half_life: float = 1024.0, memory_half_life: float = 16.0, bandwidth: float = 1.0, memory: int = 96,
                 initial_credit: float = 2.0, max_credit: float = 8.0, plain_probe_every: int = 64,
                 min_weight: float = 0.05, refresh_every: int = 4) -> None:
        if not 0 <= explore_share < 1:
            raise ValueError(f"explore_share must lie in [0, 1), got {explore_share}")
        for name, v in (("z", z), ("prior_sd", prior_sd), ("half_life", half_life),
                        ("memory_half_life", memory_half_life), ("bandwidth", bandwidth), ("min_weight", min_weight)):
            if not v > 0:
                raise ValueError(f"SpeculationController.{name} must be > 0, got {v}")
        if memory < 1 or plain_probe_every < 1:
            raise ValueError("SpeculationController.memory and plain_probe_every must be >= 1")
        if not 0 <= initial_credit <= max_credit:
            raise ValueError("SpeculationController needs 0 <= initial_credit <= max_credit")
        self.cost = cost
        self.explore_share, self.z, self.prior_sd = explore_share, z, prior_sd
        self.decay = 0.5 ** (1.0 / half_life)
        self.rank_decay = 0.5 ** (1.0 / memory_half_life)
        self.bandwidth, self.min_weight = bandwidth, min_weight
        self.records = _Records(memory)
        self.initial_credit, self.max_credit = initial_credit, max_credit
        self.credits: dict[int, float] = {}  # log2 batch bucket -> its exploration credit (module docstring)
        self._credit_bucket: int | None = None  # the bucket of the last decision or step (`credit`)
        self.plain_probe_every = plain_probe_every
        self.step = 0
        # log2 batch bucket -> step of its last plain step (or of its first decision, before any), plain probes
        self.last_plain: dict[int, int] = {}
        self.plain_probes: dict[int, int] = {}
        self.stats = ControllerStats()
        self.refresh_every = refresh_every
        self._estimate: dict = {}  # the last estimate: its key, step and records' head (`estimate`)

    # ------------------------------------------------------------------ estimate

    def estimate(self, batch_size: int, context: float) -> tuple[float, float, float, float, float]:
        """(ratio, log-scale deviation, plain seconds, steady speculative seconds, the plain price's own relative
        variance) at this batch size and context; ratio nan when the recent speculative steps say nothing about
        it. Kept for up to `refresh_every` steps while the batch size and the context (within 10 %) stay, even as
        speculative steps add up to `refresh_every` records (the estimate weighs up to `memory` of them, the newest
        about a sixteenth once there are a few dozen: a few move a decision little, and re-reading every record cost
        a step about half a millisecond of host time inside the engine; docs/performance.md). An estimate read from
        fewer than KEEP_RECORDS records, or without a ratio (nan), is read again at the next record, where each moves
        it most. A confident loss without new evidence is kept 4 x `refresh_every` steps."""
        last = self._estimate
        if last.get("batch") == batch_size and abs(context - last["context"]) <= 0.1 * context:
            new = self.records.added - last["added"]  # records since (warm-up records advance no step)
            # a confident loss is kept 4x as long: steady plain steps then pay for no estimate they do not need
            keep = self.refresh_every * (4 if new == 0 and self._confident_loss(last["value"]) else 1)
            settled = (last["records"] >= KEEP_RECORDS and new <= self.refresh_every
                       and not math.isnan(last["value"][0]))
            if self.step - last["step"] < keep and (new == 0 or settled):
                return last["value"]
        value = self._estimate_now(batch_size, context)
        self._estimate = {"batch": batch_size, "added": self.records.added, "records": self.records.size,
                          "step": self.step, "context": context, "value": value}
        return value

    def _estimate_now(self, batch_size: int, context: float) -> tuple[float, float, float, float, float]:
        cost = self.cost
        plain = cost.joint(*sample_features(StepSample(batch_size, batch_size, context)))
        theta_d, theta_v = cost.theta_drafting, cost.theta_verification
        nd = cost.ND
        t_plain = max(float(plain[:nd] @ theta_d), 1e-6) + max(float(plain[nd:] @ theta_v), 1e-6)
        g = plain / t_plain
        plain_var = cost.variance(g)
        if not self.records.size:
            return math.nan, math.inf, t_plain, math.nan, plain_var
        b = float(batch_size)
        rec = self.records
        n = rec.size
        rank = (rec.head - 1 - np.arange(n)) % rec.capacity  # 0: the newest
        w = self.rank_decay ** rank * self.decay ** (self.step - rec.step[:n]) * np.exp(
            -((np.log2(b) - np.log2(rec.batch[:n])) ** 2) / (2 * self.bandwidth ** 2))
        total = float(w.sum())
        if total < self.min_weight:
            return math.nan, math.inf, t_plain, math.nan, plain_var
        f = rec.at(batch_size)
        k = len(KNOTS)
        ctx = context / CONTEXT_SCALE
        # seconds of each rescaled step at this context: the features without the context, then its columns
        seconds = (np.maximum(f["d"] @ theta_d[:-1] + f["dt"] * ctx * theta_d[-1], 1e-6)
                   + np.maximum(f["v"] @ theta_v[[*range(k), k + 1, k + 2, k + 3]] + f["vt"] * ctx * theta_v[k], 1e-6))
        tokens = f["e"]
        ws = float(w @ seconds)
        t_spec = ws / total
        # one prior pseudo-step at break-even (the plain rate for t_spec seconds): a few steps move the estimate
        # only part of the way from "no better, no worse"
        rate = (float(w @ tokens) + b / t_plain * t_spec) / (ws + t_spec)
        # the ratio estimator's sampling variance (delta method), the prior step's deviation prior_sd included;
        # below MIN_EVIDENCE effective steps the evidence is too thin to call either way
        resid = tokens - rate * seconds
        den = ws + t_spec
        var = (float((w * w) @ (resid * resid)) + (self.prior_sd * rate * t_spec) ** 2) / den ** 2
        rel_sampling = var / rate ** 2 if rate > 0 else math.inf
        if total * total / float(w @ w) < MIN_EVIDENCE:
            rel_sampling = max(rel_sampling, 1.0)
        # the prices' uncertainty about t_spec / t_plain: the mean speculative step's features against the plain's
        mean_d = np.concatenate([(w @ f["d"]) / total, [float(w @ f["dt"]) / total * ctx]])
        v = (w @ f["v"]) / total
        mean_v = np.concatenate([v[:k], [float(w @ f["vt"]) / total * ctx], v[k:]])
        g = cost.joint(mean_d, mean_v) / t_spec - plain / t_plain
        rel_model = cost.variance(g)
        ratio = rate * t_plain / b
        return ratio, math.sqrt(rel_sampling + rel_model), t_plain, t_spec, plain_var

    def last_estimate(self) -> dict | None:
        """The last estimate made, as a decision reads it: batch size, speculative / plain tokens a second and its
        band (low, high at z deviations); None before any, or while it had no evidence near that batch (nan)."""
        last = self._estimate
        if not last or math.isnan(last["value"][0]):
            return None
        ratio = last["value"][0]
        low, high = self._band(ratio, last["value"][1])
        return {"batch_size": last["batch"], "ratio": ratio, "low": low, "high": high}

    def _band(self, ratio: float, dev: float) -> tuple[float, float]:
        """An estimate's (low, high) at z log-scale deviations: what a decision weighs and reports."""
        return ratio * math.exp(-self.z * dev), ratio * math.exp(self.z * dev)

    def expects_plain(self, batch_size: int) -> bool:
        """Whether the last estimate, made at this batch size within the last 64 steps, was a confident loss (its
        upper bound below 1): the engine need not prepare speculation there (a draft's prompt prefill). False when
        none was made."""
        last = self._estimate
        return last.get("batch") == batch_size and self.step - last["step"] < 64 and self._confident_loss(last["value"])

    def _confident_loss(self, estimate: tuple) -> bool:
        """Whether an `estimate` is a loss beyond its uncertainty (its upper bound below 1; False when nan)."""
        return estimate[0] * math.exp(self.z * estimate[1]) < 1.0

    # ------------------------------------------------------------------ decide

    def decide(self, batch_size: int, context: float, catch_up_tokens: int | Callable[[], int] = 0) -> Decision:
        """The choice for a step of `batch_size` requests at `context`; catch_up_tokens: what the draft would have
        to read first beyond steady speculation (after plain steps), charged to a probe; a callable is called only
        where a probe is weighed (counting it reads every request)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        ratio, dev, t_plain, t_spec, plain_var = self.estimate(batch_size, context)
        bucket = self._credit_bucket = self._bucket(batch_size)
        credit = self.credits.get(bucket, self.initial_credit)  # this batch size's own (module docstring)
        tokens = catch_up_tokens

        def catch_up() -> tuple[int, float]:  # (tokens, seconds of the draft reading them), read once
            nonlocal tokens
            if callable(tokens):
                tokens = int(tokens())
            return tokens, float(self.cost.prices.draft_time(tokens, context)) if tokens > 0 else 0.0

        common = dict(batch_size=batch_size, plain_seconds=t_plain)
        if math.isnan(ratio):  # nothing known near this batch: a probe that gains nothing, one draft level deep
            if plain_var > PLAIN_KNOWN ** 2:  # the plain price itself is a guess: measure it first (safe)
                return Decision(False, "plain", **common)
            probe = float(self.cost.predict(batch_size, 2 * batch_size, context,
                                            np.array([[2 * batch_size + catch_up()[0]]]))[0][0])
            loss = probe / t_plain - 1.0
            if credit >= loss:
                return Decision(True, "probe", expected_loss=loss, spec_seconds=probe, **common)
            return Decision(False, "plain", **common)
        low, high = self._band(ratio, dev)
        common.update(ratio=ratio, low=low, high=high, spec_seconds=t_spec)
        # where the plain step's price is uncertain and most of the doubt, a plain step is what resolves it
        plain_doubt = plain_var > PLAIN_KNOWN ** 2 and plain_var >= 0.5 * dev ** 2
        if ratio > 1.0:  # speculation is expected to pay: exploit it, or probe it for free where it is uncertain
            waited = self.step - self.last_plain.setdefault(bucket, self.step)
            # plain probes come early while the plain price is young (8, 16, 32, ... steps apart), then every
            # plain_probe_every: a price fitted at a cold start must not carry a long stretch of speculation
            spacing = min(self.plain_probe_every, 8 << self.plain_probes.get(bucket, 0))
            loss = ratio - 1.0  # a plain step instead: its tokens short of speculation's, per request
            if (waited >= spacing or (plain_doubt and low <= 1.0)) and credit >= loss:
                return Decision(False, "plain-probe", expected_loss=loss, **common)
            if low > 1.0:
                return Decision(True, "exploit", **common)
            loss = (1.0 - ratio) * t_spec / t_plain + catch_up()[1] / t_plain
            return Decision(credit >= max(loss, 0.0), "probe" if credit >= max(loss, 0.0) else "plain",
                            expected_loss=loss, **common)
        # a loss within the uncertainty may be probed whenever the credit covers it; a confident loss only from the
        # upper half of the budget (a check that the workload has not changed; a probe that pays funds the next).
        # The draft's catch-up only adds to the loss: it is read where the rest leaves the probe affordable
        reserve = 0.0 if high >= 1.0 else self.max_credit / 2
        loss = (1.0 - ratio) * t_spec / t_plain
        if plain_doubt or credit - loss < reserve:
            return Decision(False, "plain", **common)
        loss += catch_up()[1] / t_plain
        if credit - loss >= reserve:
            return Decision(True, "probe", expected_loss=loss, **common)
        return Decision(False, "plain", **common)

    @staticmethod
    def _bucket(batch_size: int) -> int:
        return int(round(math.log2(batch_size)))

    def credit_at(self, batch_size: int) -> float:
        """The exploration credit of this batch size's bucket (`initial_credit` before its first step)."""
        return self.credits.get(self._bucket(batch_size), self.initial_credit)

    @property
    def credit(self) -> float:
        """The credit of the bucket the last decision or step was at (`initial_credit` before any)."""
        if self._credit_bucket is None:
            return self.initial_credit
        return self.credits.get(self._credit_bucket, self.initial_credit)

    # ------------------------------------------------------------------ learn

    def record(self, sample: StepSample, produced: float) -> None:
        """Evidence without a decision (the engine's warm-up at load): a speculative step joins the records as the
        oldest evidence there is; no step, credit or statistic is counted."""
        if sample.speculated:
            self.records.add(self.step, sample, produced)

    def observe(self, sample: StepSample, produced: float, decision: Decision | None = None) -> None:
        """A step's outcome: its sample (already given to the cost model or not: the controller reads the model's
        current prices) and the tokens it produced (before stop conditions cut any). decision: what `decide` said
        (None: the engine chose the mode itself, e.g. pure speculation; nothing is charged to exploration)."""
        b = sample.batch_size
        bucket = self._credit_bucket = self._bucket(b)
        self.step += 1
        st = self.stats
        st.steps += 1
        st.tokens += produced
        if sample.speculated:
            st.speculative_steps += 1
            self.records.add(self.step, sample, produced)
        else:
            self.last_plain[bucket] = self.step
        credit = self.credits[bucket] = min(self.max_credit, self.credits.get(bucket, self.initial_credit)
                                            + self.explore_share * produced / b)
        if decision is None or not decision.probe:
            return
        t_plain = decision.plain_seconds
        if decision.speculate:  # tokens short of what plain steps would have emitted in the same time
            st.probes += 1
            lost = sample.seconds / t_plain * b - produced
        else:
            st.plain_probes += 1
            self.plain_probes[bucket] = self.plain_probes.get(bucket, 0) + 1
            lost = decision.ratio * sample.seconds / t_plain * b - produced
        if lost >= 0:
            st.exploration_loss += lost
        else:
            st.exploration_gain -= lost
        self.credits[bucket] = min(self.max_credit, credit - lost / b)
