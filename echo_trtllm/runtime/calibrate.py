"""Calibration on the current device: the cost curve, warm-up gate samples, and the file that holds both.

    measure_cost_model   t_verify(T) and t_draft(T): one target / draft forward over T new tokens at a fixed
                         context, median of `repeats` timed runs after a warm-up
    gate_samples         (depth, confidence, accepted) samples from one executed step (see below)
    collect_gate_samples warm-up traffic through an executor with the gate wide open
    calibrate            all of it -> `Calibration` (cost model + gate calibration + break-even probability)

Gate samples. For request i and drafted depth d, the sample is the draft's best depth-d node: confidence c =
its path probability (the gate's c_{i,d}), accepted = the target accepted that node. A sample counts only when
the node was verified; the warm-up opens every gate (tau = 0 at every depth) with a budget that verifies every
request's best spine, so the deepest levels are observed too.

Break-even acceptance probability (the gate's lambda). Drafting and verifying one more level for every request
at batch size B costs one draft forward over B * beam_width tokens plus the verification of B more tokens,
(t_draft(B * w) + t_verify(2B) - t_verify(B)) / t_verify(B) of a step, and yields p tokens per request where
a step yields one; it pays when p exceeds that ratio. It is clamped to [0.02, 0.95].
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from echo_trtllm.core.config import EchoConfig
from echo_trtllm.core.cost import CostModel
from echo_trtllm.core.gating import GateCalibration, calibrate_gate
from echo_trtllm.models.llama import CausalLM

from .inputs import chain_batch

__all__ = [
    "Calibration",
    "CALIBRATION_FILE",
    "measure_forward_seconds",
    "measure_cost_model",
    "break_even_accept_prob",
    "gate_samples",
    "collect_gate_samples",
    "calibrate",
]

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)
CALIBRATION_FILE = "calibration.json"
FORMAT_VERSION = 1


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


def break_even_accept_prob(cost: CostModel, batch_size: int, draft_width: int = 0) -> float:
    """lambda: the acceptance probability above which drafting and verifying one more level pays (module doc).

    Deepening every request of a batch of B by one level costs one draft forward over B * draft_width tokens
    (the level's expanded nodes) and the verification of B more tokens, against a step that yields one token
    per request: lambda = (t_draft(B * draft_width) + t_verify(2B) - t_verify(B)) / t_verify(B)."""
    b = max(1, batch_size)
    base = float(cost.verify_time(b))
    extra = float(cost.verify_time(2 * b)) - base
    if draft_width > 0 and cost.draft_tokens:
        extra += float(cost.draft_time(b * draft_width))
    return min(0.95, max(0.02, extra / base))


@dataclass
class Calibration:
    """What `echo-trtllm calibrate` measured; the runtime applies it (`apply`) and uses its cost model."""

    cost_model: CostModel
    gate: GateCalibration
    break_even_accept_prob: float
    operating_batch_size: int
    warmup: dict
    device: str = ""
    created: str = ""
    format_version: int = FORMAT_VERSION
    # the warm-up's gate samples {"depths": [...], "confidences": [...], "accepted": [...]}; they let the gate
    # be re-derived for any batch size (gate_for)
    samples: dict | None = None

    def gate_for(self, batch_size: int) -> GateCalibration:
        """The gate calibrated for `batch_size`: same samples, break-even probability from the cost curve at that
        batch size (verification is nearly free at B = 1 and dear under load, so tau_d rises with load)."""
        if self.samples is None:
            return self.gate
        lam = break_even_accept_prob(self.cost_model, batch_size, int(self.warmup.get("draft_width", 0)))
        cached = self._gates.get(lam)
        if cached is None:
            cached = calibrate_gate(torch.tensor(self.samples["depths"], dtype=torch.long),
                                    torch.tensor(self.samples["confidences"], dtype=torch.float32),
                                    torch.tensor(self.samples["accepted"], dtype=torch.bool), self.gate.max_depth,
                                    self.gate.num_sweet_spots, lam)
            self._gates[lam] = cached
        return cached

    def __post_init__(self) -> None:
        self._gates: dict[float, GateCalibration] = {}

    def apply(self, config: EchoConfig) -> EchoConfig:
        """The config with the calibrated gate (sparse depths and tau_d; echo-fixed's single tau)."""
        if self.gate.max_depth != config.max_depth:
            raise ValueError(
                f"the calibration was made for max_depth={self.gate.max_depth} but the config has "
                f"max_depth={config.max_depth}: recalibrate (echo-trtllm calibrate --max-depth {config.max_depth})"
            )
        return dataclasses.replace(config, gate_depths=tuple(self.gate.gate_depths),
                                   gate_thresholds=tuple(float(t) for t in self.gate.thresholds),
                                   fixed_threshold=float(self.gate.fixed_threshold))

    def to_json(self) -> str:
        return json.dumps({
            "format_version": self.format_version,
            "created": self.created,
            "device": self.device,
            "operating_batch_size": self.operating_batch_size,
            "break_even_accept_prob": self.break_even_accept_prob,
            "warmup": self.warmup,
            "cost_model": json.loads(self.cost_model.to_json()),
            "gate": json.loads(self.gate.to_json()),
            "samples": self.samples,
        }, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Calibration":
        d = json.loads(text)
        if d.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"calibration format_version {d.get('format_version')!r}; this build reads {FORMAT_VERSION}")
        missing = {"cost_model", "gate", "break_even_accept_prob", "operating_batch_size", "warmup"} - d.keys()
        if missing:
            raise ValueError(f"calibration JSON lacks fields {sorted(missing)}")
        return cls(CostModel.from_json(json.dumps(d["cost_model"])), GateCalibration.from_json(json.dumps(d["gate"])),
                   float(d["break_even_accept_prob"]), int(d["operating_batch_size"]), dict(d["warmup"]),
                   d.get("device", ""), d.get("created", ""), d["format_version"], d.get("samples"))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        return cls.from_json(Path(path).read_text())


def gate_samples(draft, result) -> tuple[Tensor, Tensor, Tensor]:
    """(depths, confidences, accepted) of one step: each request's best node per drafted depth, if verified.

    draft: the step's `DraftResult`; result: its `VerifyResult` (accepted ids index the verified nodes)."""
    cand = draft.candidates
    verified = torch.nonzero(draft.mask.cpu()).squeeze(1)  # candidate index of each verified node, in order
    accepted = torch.zeros(cand.total_nodes, dtype=torch.bool)
    accepted[verified[result.accepted_node_ids.cpu()]] = True
    is_verified = torch.zeros(cand.total_nodes, dtype=torch.bool)
    is_verified[verified] = True
    depths, probs, req = cand.depths.cpu(), cand.path_probs.cpu().float(), cand.request_ids.cpu()
    stride = int(depths.max()) + 1
    key = req * stride + depths
    best = torch.full((cand.batch_size * stride,), -1.0).scatter_reduce(0, key, probs, "amax", include_self=True)
    is_best = (depths > 0) & (probs == best[key])
    # one node per (request, depth): the first of any tie
    idx = torch.nonzero(is_best).squeeze(1)
    idx = idx[torch.sort(key[idx], stable=True).indices]
    first = torch.ones(idx.numel(), dtype=torch.bool)
    first[1:] = key[idx][1:] != key[idx][:-1]
    idx = idx[first]
    idx = idx[is_verified[idx]]
    return depths[idx], probs[idx], accepted[idx]


def collect_gate_samples(executor, prompts: list[str], params, progress=None) -> tuple[Tensor, Tensor, Tensor, int]:
    """Run the prompts to completion through `executor`; returns (depths, confidences, accepted, steps)."""
    for p in prompts:
        executor.submit(executor.make_request(p, params))
    parts: list[tuple[Tensor, Tensor, Tensor]] = []
    steps = 0
    while executor.has_work:
        report = executor.step()
        steps += 1
        if report.draft is not None and report.batch_size:
            parts.append(gate_samples(report.draft, report.result))
        if progress is not None:
            progress(report)
    if not parts:
        empty = torch.zeros(0)
        return empty.long(), empty, empty.bool(), steps
    d, c, a = (torch.cat(x) for x in zip(*parts))
    return d, c, a, steps


def warmup_config(config: EchoConfig, batch_size: int) -> EchoConfig:
    """The echo config of the warm-up: every gate open (tau = 0 at every depth), room for every spine."""
    depths = tuple(range(1, config.max_depth + 1))
    return dataclasses.replace(config, policy="echo", gate_depths=depths, gate_thresholds=tuple(0.0 for _ in depths),
                               k_max=max(config.k_max, batch_size * config.max_nodes_per_request))


def calibrate(target: CausalLM, draft: CausalLM, tokenizer, config: EchoConfig, prompts: list[str],
              batch_size: int = 4, max_tokens: int = 32, max_seq_len: int = 1024,
              cost_tokens: tuple[int, ...] = DEFAULT_TOKENS, repeats: int = 5, num_sweet_spots: int = 2,
              progress=None) -> Calibration:
    """Measure the cost model, run warm-up traffic, calibrate the gate; nothing is written (see Calibration.save)."""
    from .executor import Executor
    from .request import SamplingParams

    if not prompts:
        raise ValueError("calibration needs at least one warm-up prompt")
    cost = measure_cost_model(target, draft, cost_tokens, repeats=repeats)
    lam = break_even_accept_prob(cost, batch_size, config.beam_width)
    warm = warmup_config(config, batch_size)
    ex = Executor(target, draft, tokenizer, warm, max_batch_size=batch_size, max_seq_len=max_seq_len)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    depths, conf, acc, steps = collect_gate_samples(ex, prompts, params, progress)
    gate = calibrate_gate(depths, conf, acc, config.max_depth, num_sweet_spots=num_sweet_spots, min_accept_prob=lam)
    warmup = {"prompts": len(prompts), "batch_size": batch_size, "max_tokens": max_tokens, "steps": steps,
              "draft_width": config.beam_width,
              "samples": int(depths.numel()), "seconds": round(time.perf_counter() - t0, 3)}
    samples = {"depths": depths.tolist(), "confidences": conf.tolist(), "accepted":
               [int(x) for x in acc]}
    return Calibration(cost, gate, lam, batch_size, warmup, str(target.device),
                       datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), FORMAT_VERSION,
                       samples)
