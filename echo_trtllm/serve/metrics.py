"""Prometheus metrics of a server (`GET /metrics`), in its own registry so two servers in one process never mix.

Counters are fed from two places: the engine thread's step listener (steps, verified / drafted / accepted tokens)
and the HTTP side (requests by finish reason, prompt and generated tokens). The ratios users ask for (acceptance
rate, mean accepted tokens, share of speculative steps, mean verified tokens per step K, tokens/s over the last
window) are gauges computed from the counters at scrape time, so they are exact over the server's lifetime.

Definitions (per step of the engine, summed over the server's lifetime):
    acceptance rate          accepted draft tokens / draft tokens verified (the root of each request not counted)
    mean accepted tokens     tokens emitted / request-steps (1.0 = plain autoregressive)
    speculative step share   steps that verified a draft / steps
    mean verified tokens     tokens the target verified / steps (the step's K)

The online prices and the speculation controller (`core/prices.py`, `core/controller.py`) are measured too: the
steps' measured and predicted seconds (the model's prediction before it learned from the step) and their absolute
difference, summed; the controller's decisions by reason (exploit, probe, plain, plain-probe, forced); the tokens
its decisions expected (the expected rate times the step's measured seconds) against those the steps emitted; and,
from `LLM.speculation_stats()`, the exploration's measured loss in tokens and the prices' median relative error.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]

PREFIX = "echo_trtllm"
disable_created_metrics()  # no `_created` series beside every counter (as vLLM's server does)


class ServerMetrics:
    def __init__(self, load, window_s: float = 10.0, clock=time.monotonic, speculation=lambda: None,
                 info: dict[str, str] | None = None) -> None:
        """load() -> (running, waiting) now; window_s: the tokens/s gauge's window; clock: seconds (tests inject);
        speculation() -> `LLM.speculation_stats()` (None without the controller); info: labels of the constant
        `echo_trtllm_model_info` gauge (the served model, its dtypes)."""
        self.registry = r = CollectorRegistry()
        if info:
            Gauge(f"{PREFIX}_model_info", "the served model (value 1; labels: name, dtypes)", list(info),
                  registry=r).labels(**info).set(1)
        self._load, self._window, self._clock = load, window_s, clock
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens emitted by a step)
        self.requests = Counter(f"{PREFIX}_requests", "requests that ended, by finish reason", ["finish_reason"],
                                registry=r)
        self.rejected = Counter(f"{PREFIX}_rejected_requests", "requests refused before submission, by HTTP status",
                                ["status"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens of submitted requests", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "tokens generated (sent to clients)", registry=r)
        self.steps = Counter(f"{PREFIX}_steps", "engine steps that ran a batch", registry=r)
        self.speculative_steps = Counter(f"{PREFIX}_speculative_steps", "steps that verified a draft", registry=r)
        self.request_steps = Counter(f"{PREFIX}_request_steps", "requests summed over steps", registry=r)
        self.verified_tokens = Counter(f"{PREFIX}_verified_tokens", "tokens the target verified", registry=r)
        self.draft_tokens = Counter(f"{PREFIX}_draft_tokens_verified", "draft tokens verified (roots excluded)",
                                    registry=r)
        self.accepted_tokens = Counter(f"{PREFIX}_accepted_draft_tokens", "draft tokens accepted", registry=r)
        self.emitted_tokens = Counter(f"{PREFIX}_emitted_tokens", "tokens the engine emitted", registry=r)
        self.step_seconds = Counter(f"{PREFIX}_step_seconds", "measured seconds of the engine's steps", registry=r)
        self.predicted_seconds = Counter(f"{PREFIX}_predicted_step_seconds",
                                         "the online cost model's prediction of each step, before learning from it",
                                         registry=r)
        self.prediction_error = Counter(f"{PREFIX}_step_prediction_abs_error_seconds",
                                        "|predicted - measured| seconds, summed over steps", registry=r)
        self.decisions = Counter(f"{PREFIX}_speculation_decisions", "the speculation controller's choices, by "
                                 "reason", ["reason"], registry=r)
        self.expected_tokens = Counter(f"{PREFIX}_expected_tokens", "tokens the controller's decisions expected in "
                                       "the seconds their steps took", registry=r)
        self.decided_tokens = Counter(f"{PREFIX}_decided_tokens", "tokens emitted by steps the controller decided",
                                      registry=r)
        gauges = {
            "tokens_per_second": ("tokens emitted per second over the last window", self._tokens_per_second),
            "acceptance_rate": ("accepted / verified draft tokens", lambda: self._ratio(self.accepted_tokens,
                                                                                        self.draft_tokens)),
            "mean_accepted_tokens": ("tokens emitted per request-step", lambda: self._ratio(self.emitted_tokens,
                                                                                            self.request_steps)),
            "speculative_step_share": ("steps that verified a draft / steps", lambda: self._ratio(
                self.speculative_steps, self.steps)),
            "mean_verified_tokens_per_step": ("tokens verified per step (K)", lambda: self._ratio(
                self.verified_tokens, self.steps)),
            "requests_running": ("requests in the engine's batch", lambda: self._load()[0]),
            "requests_waiting": ("requests accepted and not yet in the batch", lambda: self._load()[1]),
            "exploration_loss_tokens": ("tokens the controller's probes emitted short of the other mode, since load",
                                        lambda: self._speculation("exploration_loss_tokens")),
            "exploration_gain_tokens": ("tokens probes emitted beyond the other mode, since load",
                                        lambda: self._speculation("exploration_gain_tokens")),
            "step_prediction_error": ("median |predicted - measured| / measured of the last 256 steps",
                                      lambda: self._speculation("step_prediction_error")),
        }
        self._speculation_stats = speculation
        for name, (doc, fn) in gauges.items():
            Gauge(f"{PREFIX}_{name}", doc, registry=r).set_function(fn)

    def _speculation(self, key: str) -> float:
        """A value of `LLM.speculation_stats()`; NaN where the engine has none (no prices, no controller, no step
        yet): an unknown is not a zero."""
        stats = self._speculation_stats()
        value = None if stats is None else stats.get(key)
        return float("nan") if value is None else float(value)

    @staticmethod
    def _ratio(num: Counter, den: Counter) -> float:
        d = den._value.get()
        return num._value.get() / d if d else 0.0

    def _tokens_per_second(self) -> float:
        now = self._clock()
        with self._lock:
            while self._recent and self._recent[0][0] < now - self._window:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / self._window

    def on_step(self, report) -> None:
        """The engine thread's listener: one call per step (a StepReport of the runtime's executor)."""
        self.steps.inc()
        self.request_steps.inc(report.batch_size)
        self.verified_tokens.inc(report.verified_tokens)
        self.emitted_tokens.inc(report.emitted_tokens)
        self.step_seconds.inc(report.timings.total)
        if report.prediction is not None:
            self.predicted_seconds.inc(report.prediction.seconds)
            self.prediction_error.inc(abs(report.prediction.seconds - report.prediction.measured))
        d = report.decision
        if d is not None:
            self.decisions.labels(d.reason).inc()
            rate = d.expected_rate
            if rate == rate and rate != float("inf"):  # known
                self.expected_tokens.inc(rate * report.timings.total)
                self.decided_tokens.inc(report.emitted_tokens)
        if report.speculated:
            self.speculative_steps.inc()
            self.draft_tokens.inc(max(report.verified_tokens - report.batch_size, 0))
            self.accepted_tokens.inc(max(report.emitted_tokens - report.batch_size, 0))
        with self._lock:
            self._recent.append((self._clock(), report.emitted_tokens))

    def render(self) -> bytes:
        return generate_latest(self.registry)
