"""Requests, their sampling parameters and per-request statistics."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch

__all__ = ["SamplingParams", "RequestStats", "Request", "FINISH_REASONS"]

FINISH_REASONS = ("stop", "length", "error")


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
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"SamplingParams.seed must be a non-negative integer or None, got {self.seed!r}")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"SamplingParams.stop must be a non-empty string or a list of them, got {self.stop!r}")
        if self.stop_token_ids is not None and any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

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

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens per verification step (1.0 = plain autoregressive)."""
        return sum(self.emitted_per_step) / self.steps if self.steps else 0.0

    @property
    def accepted_length_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.emitted_per_step).items()))

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "accepted_length_histogram": self.accepted_length_histogram,
            "verified_tokens": self.verified_tokens,
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
    # runtime state
    slot: int = -1
    target_ctx: int = 0  # tokens in the target's KV cache (all tokens but the last)
    draft_ctx: int = 0  # tokens in the draft's KV cache
    generator: torch.Generator | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
