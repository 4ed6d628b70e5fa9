"""Requests, their sampling parameters and per-request statistics."""

from __future__ import annotations

import math
import numbers
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["SamplingParams", "RequestStats", "Request", "FINISH_REASONS", "check_prompt", "MAX_SEED", "MAX_TOP_K",
           "MAX_STOP_STRINGS", "MAX_STOP_CHARS", "MAX_STOP_TOKEN_IDS", "STOP_LIMITS", "stop_strings_fit",
           "stops_described"]

# "abort": cancelled by the caller (handle.abort(), LLM.abort(), an abandoned stream, shutdown)
FINISH_REASONS = ("stop", "length", "abort", "error")
MAX_SEED = 2**63 - 1
MAX_TOP_K = 2**31 - 1  # anything larger keeps the whole vocabulary anyway
# limits every front end shares (the LLM API, the OpenAI server, Triton): the engine thread checks stop strings and
# stop ids at every step, so their count and size bound what one request can cost the others
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 4096  # characters of one request's stop strings together
MAX_STOP_TOKEN_IDS = 256
STOP_LIMITS = f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters together, without U+FFFD"


def stop_strings_fit(stops: list[str]) -> bool:
    """The shared limits on one request's stop strings (STOP_LIMITS): U+FFFD stands for an undecodable byte, which
    text never matches reliably."""
    return len(stops) <= MAX_STOP_STRINGS and sum(map(len, stops)) <= MAX_STOP_CHARS and \
        not any("\ufffd" in s for s in stops)


def stops_described(stops: list[str]) -> str:
    """What a refused set of stop strings held (never the strings themselves: they may be megabytes)."""
    return f"{len(stops)} strings of {sum(map(len, stops))} characters" + (
        ", one with U+FFFD" if any("\ufffd" in s for s in stops) else "")


def _is_int(value) -> bool:
    """An integer, numpy's included (a token id read from an array); not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def check_prompt(prompt) -> None:
    """A prompt is a non-empty string of valid Unicode or a non-empty list/tuple of int token ids; raises
    TypeError / ValueError naming what is wrong (the vocabulary range is checked where it is known)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty: give a non-empty string or a non-empty list of token ids")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"prompt is not valid Unicode text ({e.reason} at character {e.start}): "
                             "remove lone surrogates or give token ids") from None
        return
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise ValueError("prompt is empty: give a non-empty string or a non-empty list of token ids")
        bad = [t for t in prompt if not _is_int(t)]
        if bad:
            raise TypeError(f"prompt token ids must be integers, got {type(bad[0]).__name__} ({bad[0]!r})")
        return
    raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (names as in TensorRT-LLM's and vLLM's LLM APIs).

    max_tokens: tokens to generate at most (>= 1). temperature: 0 = greedy. top_k: 0 = off. top_p: in (0, 1].
    seed: makes sampling reproducible. stop: strings that end generation (not included in the text).
    stop_token_ids: token ids that end generation. ignore_eos: keep going past the end-of-sequence token.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def fail(name: str, accepted: str) -> None:
            raise ValueError(f"SamplingParams.{name} must be {accepted}, got {getattr(self, name)!r}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            fail("max_tokens", "an integer >= 1")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            fail("temperature", "a finite number >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            fail("top_k", f"an integer in [0, {MAX_TOP_K}] (0 = off)")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            fail("top_p", "a number in (0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            fail("seed", f"an integer in [0, 2**63 - 1] or None")
        if not (self.stop is None or (isinstance(self.stop, str) and self.stop) or (
                isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop))):
            fail("stop", "a non-empty string, a list of non-empty strings, or None")
        if not stop_strings_fit(self.stop_strings):
            raise ValueError(f"SamplingParams.stop must be {STOP_LIMITS}, got {stops_described(self.stop_strings)}")
        if not (self.stop_token_ids is None or (isinstance(self.stop_token_ids, (list, tuple)) and all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids))):
            fail("stop_token_ids", "a list of non-negative integer token ids or None")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"SamplingParams.stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} token ids, got "
                             f"{len(self.stop_token_ids)}")
        if not isinstance(self.ignore_eos, bool):
            fail("ignore_eos", "True or False")

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RequestStats:
    """What speculation did for one request."""

    # verification steps the request took part in
    steps: int = 0
    # tokens emitted per step (accepted drafts + the bonus token), truncated at the end of generation
    emitted_per_step: list[int] = field(default_factory=list)
    # nodes the target verified for this request, summed over steps (root included)
    verified_tokens: int = 0
    # perf_counter seconds: submitted, first output token published, finished (None until then)
    arrival_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens per verification step (1.0 = plain autoregressive)."""
        return sum(self.emitted_per_step) / self.steps if self.steps else 0.0

    @property
    def time_to_first_token(self) -> float | None:
        if self.arrival_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        """Seconds from submission to the final output."""
        if self.arrival_time is None or self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def accepted_length_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.emitted_per_step).items()))

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "accepted_length_histogram": self.accepted_length_histogram,
            "verified_tokens": self.verified_tokens,
            "time_to_first_token": self.time_to_first_token,
            "latency": self.latency,
        }


@dataclass
class Request:
    """A request inside the executor."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    # seeded by make_request (the request's own sampling randomness)
    generator: torch.Generator | None = None
    # runtime state
    slot: int = -1
    target_ctx: int = 0  # tokens in the target's KV cache (all tokens but the last)
    draft_ctx: int = 0  # tokens in the draft's KV cache
    draft_offset: int = 0  # leading tokens the draft no longer sees (re-primed after a long AR stretch)
    # an EAGLE-3 drafter's window of kept target features (runtime.drafter.FeatureSpan; the rows in its FeatureStore)
    features: object | None = None
    # where the stop strings stand in `text` (runtime.stops.StopMatcher; None without stop strings)
    stop_matcher: object | None = None
    # the output's text kept as it grows (runtime.detok.IncrementalText; the executor makes it at the first step)
    detok: object | None = field(default=None, repr=False)
    _uniforms: list[float] = field(default_factory=list, repr=False)

    def position_uniforms(self, start: int, count: int) -> list[float]:
        """Uniforms of output positions start .. start+count-1: the request's sampling stream, drawn from its
        generator in order and keyed by position, so a position gets the same uniform however the steps that
        reach it are drafted (verify.verify_sampling)."""
        buf = self._uniforms
        if len(buf) < start + count:
            more = max(start + count - len(buf), 64)
            buf.extend(torch.rand(more, generator=self.generator, dtype=torch.float64).tolist())
        return buf[start : start + count]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    # The hot path reads the sequence's length, its last token or a short tail of it every step and request:
    # these do it without building all_token_ids (a copy of the whole prompt and output each time)

    @property
    def num_tokens(self) -> int:
        """len(all_token_ids)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        """all_token_ids[-1]."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_ids(self, start: int, stop: int | None = None) -> list[int]:
        """all_token_ids[start:stop] for 0 <= start (and stop, when given)."""
        if start < 0 or (stop is not None and stop < 0):
            raise ValueError(f"token_ids takes non-negative bounds, got start={start}, stop={stop}")
        p, out = len(self.prompt_token_ids), self.output_token_ids
        stop = p + len(out) if stop is None else min(stop, p + len(out))
        if start >= p:
            return out[start - p:max(stop - p, 0)]
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + out[:stop - p]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
