"""Calibration on the current device: the cost curve, warm-up gate samples, and the file that holds both.

    measure_cost_model   t_verify(T) and t_draft(T): one target / draft forward over T new tokens at a fixed
                         context, fastest of `repeats` timed runs (noise only ever adds time), made non-decreasing
    gate_samples         (depth, confidence, accepted) samples from one executed step (see below)
    collect_gate_samples warm-up traffic through an executor with the gate wide open
    calibrate            all of it -> `Calibration` (cost model + gate calibration + break-even probability)

Gate samples. For request i and drafted depth d, the sample is the draft's best depth-d node: confidence c =
its path probability (the gate's c_{i,d}), accepted = the target accepted that node. A sample counts only when
the node was verified; the warm-up opens every gate (tau = 0 at every depth) with a budget that verifies every
request's best spine, so the deepest levels are observed too.

The gate's break-even probability lambda comes from the cost curve (core.cost.break_even_accept_prob); the file
keeps the warm-up samples, so the runtime re-derives the gate for each batch size (core.gating.GateSchedule).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from echo_trtllm.core.config import EchoConfig
from echo_trtllm.jsonfile import read_json_object
from echo_trtllm.core.cost import CostModel, break_even_accept_prob, fit_draft_overhead, fit_step_overhead
from echo_trtllm.core.gating import GateCalibration, GateSamples, calibrate_gate
from echo_trtllm.models.eagle3 import Eagle3Head
from echo_trtllm.models.llama import CausalLM
from echo_trtllm.models.packed import prepack_linears

from .inputs import chain_batch

__all__ = [
    "Calibration",
    "CALIBRATION_FILE",
    "fastest_seconds",
    "measure_forward_seconds",
    "measure_cost_model",
    "measure_grid",
    "LOAD_REPEATS",
    "gate_samples",
    "collect_gate_samples",
    "fit_overheads",
    "calibrate",
]

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)
# the verification grid (`measure_grid`): tokens per forward x cached tokens per request
# tokens per verification on the grid: dense where decisions are made, a batch's B roots up to about 2B tokens
# (verification is convex between 64 and 256 tokens on a CPU, docs/calibration.md); above 64, multiples of 64
# (64 requests x n tokens each)
GRID_TOKENS = (1, 4, 16, 32, 64, 128, 192, 256)
GRID_CONTEXTS = (64, 256, 1024)
# Timed runs per point of the quick curve an uncalibrated engine measures at load (~10 s for the Qwen2.5-Coder
# 1.5B + 0.5B pair in bfloat16 on a 2-core CPU; milliseconds for the embedded pair)
LOAD_REPEATS = 2
CALIBRATION_FILE = "calibration.json"
FORMAT_VERSION = 1


def fastest_seconds(fn, repeats: int, device: torch.device | str = "cpu") -> float:
    """The fastest of `repeats` timed calls of fn() (CUDA work synchronised before the clock stops). The fastest,
    not the median: on a shared machine noise only ever adds time."""
    cuda = torch.device(device).type == "cuda"
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.inference_mode()
def measure_forward_seconds(model: CausalLM | Eagle3Head, tokens: tuple[int, ...], context: int = 64,
                            repeats: int = 5) -> tuple[float, ...]:
    """For each T in `tokens`: the fastest of `repeats` timed forwards writing T new tokens after `context` cached
    ones (logits for all). The context is prefilled once; every forward overwrites the same positions. The
    fastest, not the median: on a shared machine noise only ever adds time (the first run of a shape, which may
    set up kernels, is one of the repeats). An EAGLE-3 head reads features of zeros (its cost does not depend on
    their values)."""
    cache = model.allocate_cache(1, context + max(tokens))
    gen = torch.Generator().manual_seed(0)
    vocab, run = _forward_fn(model)
    ids = torch.randint(0, vocab, (context + max(tokens),), generator=gen)
    run(chain_batch([ids[:context]], torch.tensor([0]), torch.tensor([0]), logits="none"), cache)
    out = []
    for t in tokens:
        batch = chain_batch([ids[context : context + t]], torch.tensor([context]), torch.tensor([0]), logits="all")
        out.append(fastest_seconds(lambda: run(batch, cache), repeats, model.device))
    return tuple(out)


def nondecreasing(seconds: tuple[float, ...]) -> tuple[float, ...]:
    """The curve made non-decreasing from the right: t(T) <- min over T' >= T of t(T'). A forward over more tokens
    never takes less time, and noise only ever adds time, so a point above a later one was inflated (a burst of
    other work during its runs) and is lowered; raising the later points instead would spread the burst over them.
    Example: (400, 265, 270, 453) ms -> (265, 265, 270, 453)."""
    out, low = [], float("inf")
    for s in reversed(seconds):
        low = min(low, s)
        out.append(low)
    return tuple(reversed(out))


def _forward_fn(model: CausalLM | Eagle3Head):
    """(vocabulary size, run(batch, cache) -> logits) for a target or draft model or an EAGLE-3 head; a head reads
    features of zeros (its cost does not depend on their values)."""
    if isinstance(model, Eagle3Head):
        width = 3 * model.config.target_hidden_size

        def run(batch, cache):
            return model(batch, cache, torch.zeros(batch.input_ids.numel(), width))[0]

        return model.config.layer.vocab_size, run
    # as the runtime's verification forward runs: its logits in the model's dtype (runtime/inputs.tree_batch)
    return model.config.vocab_size, lambda batch, cache: model(dataclasses.replace(batch, float_logits=False), cache)


@torch.inference_mode()
def measure_grid(model: CausalLM | Eagle3Head, tokens: tuple[int, ...] = GRID_TOKENS,
                 contexts: tuple[int, ...] = GRID_CONTEXTS, max_requests: int = 64,
                 repeats: int = 3) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[float, ...], ...]]:
    """Seconds of a forward over T tokens whose requests each hold C cached tokens, for T x C on the grid:
    min(T, max_requests) requests with T / requests new tokens each (one per request up to max_requests, as a
    decode step or a draft level of that batch), fastest of `repeats`. Timed as the runtime's phases are: building
    the batch (its attention mask), the forward, the logits to the host. The cached entries are left as allocated
    (zeros): what a forward costs does not depend on their values, so no prefill is needed. Made non-decreasing
    in T per C. The target's grid prices verification, a draft model's or head's a draft level."""
    tokens, contexts = tuple(sorted(set(tokens))), tuple(sorted(set(contexts)))
    vocab, run = _forward_fn(model)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for t in tokens:
        r = min(t, max_requests)
        n = -(-t // r)
        cache = model.allocate_cache(r, max(contexts) + n)
        row = []
        for c in contexts:
            chains = list(torch.randint(0, vocab, (r, n), generator=gen))
            row.append(fastest_seconds(
                lambda: run(chain_batch(chains, torch.full((r,), c), torch.arange(r), logits="all"), cache).cpu(),
                repeats, model.device))
        rows.append(row)
        del cache
    columns = [nondecreasing(tuple(rows[i][j] for i in range(len(tokens)))) for j in range(len(contexts))]
    grid = tuple(tuple(columns[j][i] for j in range(len(contexts))) for i in range(len(tokens)))
    return tokens, contexts, grid


def measure_cost_model(target: CausalLM, draft: CausalLM | Eagle3Head | None, tokens: tuple[int, ...] = DEFAULT_TOKENS,
                       context: int = 64, repeats: int = 5, grid: bool = False) -> CostModel:
    """t_verify(T) (and t_draft(T) with a draft) at each T in `tokens`, made non-decreasing; with grid=True also
    the verification grid by tokens and context (`measure_grid`), and the draft's on the same axes. With
    `repeats=LOAD_REPEATS` and no grid this is what an uncalibrated engine measures at load.

    The models are measured as the engine runs them: bfloat16 linears are prepacked first (models/packed.py; the
    engine does it at start, and a curve of the unpacked forwards priced a one-token step at twice its cost)."""
    for model in (target, draft):
        if model is not None:
            prepack_linears(model)
    tokens = tuple(sorted(set(tokens)))
    verify = nondecreasing(measure_forward_seconds(target, tokens, context, repeats))
    draft_times = nondecreasing(measure_forward_seconds(draft, tokens, context, repeats)) if draft else ()
    g = measure_grid(target, repeats=min(repeats, 3)) if grid else ((), (), ())
    draft_grid = measure_grid(draft, g[0], g[1], repeats=min(repeats, 3))[2] if grid and draft else ()
    return CostModel(tokens, verify, tokens if draft else (), draft_times, 0.0, str(target.device), *g,
                     draft_grid_seconds=draft_grid)


@dataclass
class Calibration:
    """What `echo-trtllm calibrate` measured: the cost curve and the gate's warm-up samples. The runtime hands both
    to the policy at construction (`make_policy(config, cost_model, gate_samples)`); `gate` is the rule's result
    at the warm-up's batch size, kept for the record."""

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

    def gate_samples(self) -> GateSamples:
        """The warm-up evidence the runtime's gate is calibrated from (per batch size, see GateSchedule)."""
        if self.samples is None:
            raise ValueError("this calibration carries no gate samples: recalibrate with echo-trtllm calibrate")
        return GateSamples(torch.tensor(self.samples["depths"], dtype=torch.long),
                           torch.tensor(self.samples["confidences"], dtype=torch.float32),
                           torch.tensor(self.samples["accepted"], dtype=torch.bool), self.gate.max_depth,
                           self.gate.num_sweet_spots, self.break_even_accept_prob)

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
        """Errors name the file."""
        if not Path(path).is_file():
            raise FileNotFoundError(f"calibration file {str(path)!r} does not exist")
        data = read_json_object(path)
        try:
            return cls.from_json(json.dumps(data))
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{path}: {e}") from None


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


def fit_overheads(cost: CostModel, reports) -> CostModel:
    """`cost` with the host work of real steps (executor step reports) fitted: the step overhead from the
    verification side of every step that verified something (its seconds outside drafting: the tree's inputs, the
    target's forward, acceptance, commit) and the per-level draft overhead from every speculative step's drafting
    (draft forwards and the host work around them) over its levels' frontier sizes. A term without steps to fit
    it keeps its value."""
    verify = [(r.verified_tokens, r.context, r.timings.verify_side)
              for r in reports if r.batch_size and r.verified_tokens]
    drafting = [(list(r.draft.state.frontier_sizes), r.timings.drafting, r.context)
                for r in reports if r.batch_size and r.speculated and r.draft is not None]
    if verify:
        cost = dataclasses.replace(cost, step_overhead_seconds=fit_step_overhead(cost, verify))
    if cost.draft_tokens and any(frontiers for frontiers, _, _ in drafting):
        cost = dataclasses.replace(cost, draft_level_overhead_seconds=fit_draft_overhead(cost, drafting))
    return cost


def warmup_config(config: EchoConfig, batch_size: int) -> EchoConfig:
    """The echo config of the warm-up: every gate open (tau = 0 at every depth), room for every spine."""
    depths = tuple(range(1, config.max_depth + 1))
    return dataclasses.replace(config, policy="echo", gate_depths=depths, gate_thresholds=tuple(0.0 for _ in depths),
                               k_max=max(config.k_max, batch_size * config.max_nodes_per_request))


def calibrate(target: CausalLM, draft: CausalLM, tokenizer, config: EchoConfig, prompts: list[str],
              batch_size: int = 4, max_tokens: int = 32, max_seq_len: int = 1024,
              cost_tokens: tuple[int, ...] = DEFAULT_TOKENS, repeats: int = 5, num_sweet_spots: int = 2,
              progress=None, cost_model: CostModel | None = None, grid: bool = False) -> Calibration:
    """Measure the cost model (unless `cost_model` is given), run warm-up traffic, calibrate the gate; nothing is
    written (see Calibration.save). grid: also measure the verification grid by tokens and context."""
    from .executor import Executor
    from .request import SamplingParams

    if not prompts:
        raise ValueError("calibration needs at least one warm-up prompt")
    cost = cost_model or measure_cost_model(target, draft, cost_tokens, repeats=repeats, grid=grid)
    warm = warmup_config(config, batch_size)
    ex = Executor(target, draft, tokenizer, warm, max_batch_size=batch_size, max_seq_len=max_seq_len)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    reports = []

    def observe(report) -> None:
        reports.append(report)
        if progress is not None:
            progress(report)

    depths, conf, acc, steps = collect_gate_samples(ex, prompts, params, observe)
    cost = fit_overheads(cost, reports)  # what the forward timings miss of a real step (the warm-up's own steps)
    lam = break_even_accept_prob(cost, batch_size, config.beam_width)
    gate = calibrate_gate(depths, conf, acc, config.max_depth, num_sweet_spots=num_sweet_spots, min_accept_prob=lam)
    warmup = {"prompts": len(prompts), "batch_size": batch_size, "max_tokens": max_tokens, "steps": steps,
              "step_overhead_seconds": round(cost.step_overhead_seconds, 6),
              "draft_level_overhead_seconds": round(cost.draft_level_overhead_seconds, 6),
              "draft_width": config.beam_width,
              "samples": int(depths.numel()), "seconds": round(time.perf_counter() - t0, 3)}
    samples = {"depths": depths.tolist(), "confidences": conf.tolist(), "accepted":
               [int(x) for x in acc]}
    return Calibration(cost, gate, lam, batch_size, warmup, str(target.device),
                       datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), FORMAT_VERSION,
                       samples)
