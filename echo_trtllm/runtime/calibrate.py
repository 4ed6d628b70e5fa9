"""Measure the cost model on the current device: one target forward over T tokens (t_verify) and one draft
forward over T tokens (t_draft), each the median of `repeats` timed runs after a warm-up, at a fixed context.
The `echo-trtllm calibrate` command (gate calibration from warm-up traffic, writing into an engine directory)
builds on this; it is not written yet."""

from __future__ import annotations

import statistics
import time

import torch

from echo_trtllm.core.cost import CostModel
from echo_trtllm.models.llama import CausalLM

from .inputs import chain_batch

__all__ = ["measure_forward_seconds", "measure_cost_model"]

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)


@torch.inference_mode()
def measure_forward_seconds(model: CausalLM, tokens: int, context: int = 64, repeats: int = 5) -> float:
    """Median seconds of one forward writing `tokens` new tokens after `context` cached ones (logits for all)."""
    cache = model.allocate_cache(1, context + tokens)
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, model.config.vocab_size, (context + tokens,), generator=gen)
    model(chain_batch([ids[:context]], torch.tensor([0]), torch.tensor([0]), logits="none"), cache)
    batch = chain_batch([ids[context:]], torch.tensor([context]), torch.tensor([0]), logits="all")
    model(batch, cache)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(batch, cache)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_cost_model(target: CausalLM, draft: CausalLM | None, tokens: tuple[int, ...] = DEFAULT_TOKENS,
                       context: int = 64, repeats: int = 5) -> CostModel:
    verify = tuple(measure_forward_seconds(target, t, context, repeats) for t in tokens)
    draft_times = tuple(measure_forward_seconds(draft, t, context, repeats) for t in tokens) if draft else ()
    return CostModel(tuple(tokens), verify, tuple(tokens) if draft else (), draft_times, 0.0, str(target.device))
