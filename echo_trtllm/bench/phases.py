"""Where a decode step's time goes, phase by phase (`echo-trtllm bench --profile-phases`).

Per method and batch size, one engine (the same one `bench` builds) steps a closed batch of B greedy requests
directly (the executor's own `step`, the path `LLM` and the servers run, on the calling thread): after the prefill
step and a few warm steps, each of the next steps is recorded. The batch stays full (every request's max_tokens
is far beyond the profiled steps), so no step admits or prefills.

Two passes over the same prompts:

- plain: the step's phases from its `StepTimings` (control, the draft's forwards, the tree's inputs, the target's
  forward, acceptance, finishing, commit) and the rest of the call (its wall time outside those: admission, the
  step's own tensors, learning from it, its report), no instrumentation;
- layers: the same steps again with a timer on every module of the target (`LayerTimer`), which splits the target's
  forward into linears, the LM head, attention (apart from its linears: RoPE, the KV write and gather, the kernel),
  norms, the MLP's activation, embedding, the residual adds and the model's own code around the layers. The
  hooks cost a few microseconds per module: the layers pass's forward is reported beside the plain pass's.

Rounds (`--rounds N`): every method's engine is built first and profiled N times, the methods' order alternating
between rounds (ABBA), the layers pass in the last round only (after that round's plain pass: the engine learns its
prices and estimates from every step it runs, and steps slowed by the hooks must not feed a later measurement);
each round goes on from the engine's state after the previous one, as a server's engine would. Each number is
reported as its median over the rounds with its (min, max) beside and every round's summary kept
(`combine_rounds`), so a comparison between two methods can be read round by round, each beside the other's same
round.

Steps are split into plain and speculative ones (`StepReport.speculated`) and each phase's mean is reported in
milliseconds per step, with tokens emitted and verified per step and the draft's forwards. The first step (the
batch's prompts prefilled, then one decode step) is reported apart: its time per prompt token and, from the layers
pass, by layer kind.
"""

from __future__ import annotations

import statistics
import time

from torch import nn

from ..models.eagle3 import Eagle3Head
from ..models.fp8 import Fp8Linear
from ..models.llama import MLP, Attention, CausalLM, DecoderLayer, RMSNorm
from ..runtime.request import SamplingParams

__all__ = ["LAYER_KINDS", "STEP_PHASES", "WARM_STEPS", "LayerTimer", "combine_rounds", "profile_steps", "phase_table",
           "submit_closed_batch"]

# the target forward's parts, in the order the tables show them
LAYER_KINDS = ("linears", "lm_head", "attention", "norms", "activation", "embedding", "residual", "model code")
# a step's phases (StepTimings fields; "inputs" = verify - forward; "rest" = the step call's wall time outside
# StepTimings.total: admission, building the step's tensors, learning from it, its report)
STEP_PHASES = ("control", "draft_model", "inputs", "forward", "accept", "finish", "commit", "rest")
# steps run after the first one and before any is recorded
WARM_STEPS = 3


def _kind(name: str, module: nn.Module) -> str | None:
    if isinstance(module, (nn.Linear, Fp8Linear)):
        return "lm_head" if name == "lm_head" else "linears"
    if isinstance(module, nn.Embedding):
        return "embedding"
    kinds = ((RMSNorm, "norms"), (Attention, "attention"), (MLP, "activation"), (DecoderLayer, "residual"),
             (CausalLM, "model code"))
    return next((k for cls, k in kinds if isinstance(module, cls)), None)


class LayerTimer:
    """Seconds spent in each LAYER_KINDS part of a model's forwards, each module's own time only (a module's
    time less its timed children's): hooks around every module of a known kind while attached."""

    def __init__(self, model: nn.Module, clock=time.perf_counter) -> None:
        if isinstance(model, Eagle3Head):
            raise ValueError("LayerTimer splits a target CausalLM's forward; the draft is timed as a whole")
        self.model, self.clock = model, clock
        self.seconds = dict.fromkeys(LAYER_KINDS, 0.0)
        self._stack: list[list] = []  # [kind, start, children's seconds]
        self._handles: list = []

    def _pre(self, kind: str):
        def hook(module, args):
            self._stack.append([kind, self.clock(), 0.0])
        return hook

    def _post(self, module, args, output):
        kind, start, children = self._stack.pop()
        spent = self.clock() - start
        self.seconds[kind] += spent - children
        if self._stack:
            self._stack[-1][2] += spent

    def __enter__(self) -> "LayerTimer":
        for name, module in self.model.named_modules():
            kind = _kind(name, module)
            if kind is not None:
                self._handles.append(module.register_forward_pre_hook(self._pre(kind)))
                self._handles.append(module.register_forward_hook(self._post))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._stack.clear()

    def take(self) -> dict[str, float]:
        """The seconds since the last take (or since attached), by kind; resets them."""
        out, self.seconds = self.seconds, dict.fromkeys(LAYER_KINDS, 0.0)
        return out


def _phases(timings, wall: float) -> dict[str, float]:
    t = timings
    return {"control": t.control, "draft_model": t.draft_model, "inputs": t.verify - t.forward,
            "forward": t.forward, "accept": t.accept, "finish": t.finish, "commit": t.commit, "rest": wall - t.total}


def submit_closed_batch(executor, prompts: list[str], batch_size: int, steps: int, warm: int) -> list:
    """Submit `batch_size` greedy requests (prompts taken in turn) whose max_tokens keeps each in the batch for the
    first step, `warm` and `steps` more (room for 8 tokens a step); returns them (abort them after). ValueError
    naming the prompt whose context is too short."""
    limit = executor.max_seq_len
    tok = executor.tokenizer
    reqs = []
    for i in range(batch_size):
        prompt = prompts[i % len(prompts)]
        room = limit - len(tok.encode(prompt)) - executor.policy.max_tree_nodes
        if room < 8 * (steps + warm):
            raise ValueError(f"profile: prompt {i % len(prompts)} leaves {room} tokens of max_seq_len {limit}; "
                             f"{8 * (steps + warm)} are needed for {steps} + {warm} steps (raise --max-seq-len)")
        reqs.append(executor.make_request(prompt, SamplingParams(max_tokens=room, temperature=0.0, ignore_eos=True)))
    for r in reqs:
        executor.submit(r)
    return reqs


def _steps(executor, prompts: list[str], batch_size: int, steps: int, warm: int, timer: LayerTimer | None):
    """Closed batch stepped directly: ([(report, layer seconds or None, the draft's forwards, the step call's wall
    seconds) of each recorded full-batch step], the first step's prefill {tokens, seconds, layers})."""
    reqs = submit_closed_batch(executor, prompts, batch_size, steps, warm)
    out = []
    try:
        if timer is not None:
            timer.take()
        t0 = time.perf_counter()
        executor.step()  # admission, prefill and the first decode step
        prefill = {"tokens": sum(len(r.prompt_token_ids) - 1 for r in reqs), "seconds": time.perf_counter() - t0,
                   "layers": timer.take() if timer is not None else None}
        for k in range(warm + steps):
            if timer is not None:
                timer.take()
            t0 = time.perf_counter()
            report = executor.step()
            wall = time.perf_counter() - t0
            if report.batch_size != batch_size:
                raise RuntimeError(f"profile: a step ran {report.batch_size} rows instead of {batch_size}")
            if k >= warm:
                forwards = sum(t > 0 for t in executor.drafter.forward_tokens) if report.speculated else 0
                out.append((report, timer.take() if timer is not None else None, forwards, wall))
    finally:
        for r in reqs:
            executor.abort(r)
    return out, prefill


def _mean_ms(values) -> float | None:
    values = list(values)
    return round(statistics.mean(values) * 1e3, 2) if values else None


def _summary(plain, layers) -> dict:
    """Means over one kind of step (plain or speculative) of both passes."""
    out = {"steps": len(plain)}
    if not plain:
        return out
    reports = [r for r, _, _, _ in plain]
    phases = [_phases(r.timings, w) for r, _, _, w in plain]
    out["total_ms"] = _mean_ms(w for _, _, _, w in plain)  # the step call's wall time: every phase and the rest
    out["phases_ms"] = {p: _mean_ms(x[p] for x in phases) for p in STEP_PHASES}
    out["emitted_per_step"] = round(statistics.mean(r.emitted_tokens for r in reports), 3)
    out["verified_per_step"] = round(statistics.mean(r.verified_tokens for r in reports), 3)
    forwards = statistics.mean(f for _, _, f, _ in plain)
    out["draft_forwards_per_step"] = round(forwards, 3)
    if forwards:  # the draft's forwards (levels, and a separate re-read of accepted tokens where there is one)
        out["draft_ms_per_forward"] = round(out["phases_ms"]["draft_model"] / forwards, 3)
    seconds = sum(w for _, _, _, w in plain)
    out["tokens_per_s"] = round(sum(r.emitted_tokens for r in reports) / seconds, 3) if seconds else None
    if layers:
        out["layers_pass"] = {"steps": len(layers), "forward_ms": _mean_ms(r.timings.forward for r, _, _, _ in layers),
                              "total_ms": _mean_ms(w for _, _, _, w in layers),
                              "forward_by_kind_ms": {k: _mean_ms(s[k] for _, s, _, _ in layers) for k in LAYER_KINDS}}
    return out


def profile_steps(llm, prompts: list[str], batch_size: int, steps: int = 16, warm: int = WARM_STEPS,
                  layers: bool = True) -> dict:
    """Profile `llm`'s decode steps at `batch_size` (module docstring). `llm` is stepped directly: its engine loop
    is shut down first, so give it an engine of its own (it can be profiled again: every request of a pass is
    aborted at its end). Returns {"prefill_step": ..., "plain": ..., "speculative": ...}; layers=False: the plain
    pass only (no layer split, no "prefill_step" layer times)."""
    if steps < 1 or warm < 0:
        raise ValueError(f"profile: steps must be >= 1 and warm >= 0, got steps={steps}, warm={warm}")
    llm.shutdown()  # the executor is stepped on this thread
    executor = llm.executor
    plain, prefill = _steps(executor, prompts, batch_size, steps, warm, None)
    layered, prefill_layers = [], None
    if layers:
        with LayerTimer(executor.target) as timer:
            layered, prefill_layers = _steps(executor, prompts, batch_size, steps, warm, timer)
    # the first step: the batch's prompts prefilled, then its first decode step (a closed batch's start)
    first = {"prompt_tokens": prefill["tokens"], "ms": round(prefill["seconds"] * 1e3, 1),
             "ms_per_prompt_token": round(prefill["seconds"] * 1e3 / max(prefill["tokens"], 1), 3)}
    if prefill_layers is not None:
        first["layers_pass_ms"] = round(prefill_layers["seconds"] * 1e3, 1)
        first["layers_pass_by_kind_ms"] = {k: round(v * 1e3, 1) for k, v in prefill_layers["layers"].items()}
    out = {"prefill_step": first}
    for kind, speculated in (("plain", False), ("speculative", True)):
        out[kind] = _summary([x for x in plain if x[0].speculated == speculated],
                             [x for x in layered if x[0].speculated == speculated])
    return out


# a summary's per-step numbers that rounds are combined over (median, with min and max beside)
_ROUND_KEYS = ("total_ms", "emitted_per_step", "verified_per_step", "draft_forwards_per_step", "draft_ms_per_forward",
               "tokens_per_s")


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def combine_rounds(profiles: list[dict]) -> dict:
    """One method's profiles at one batch size over several rounds (`profile_steps` results, one of them with its
    layers pass): per step kind, the median of every number over the rounds where that kind of step ran, with
    "spread" (min, max) beside and each round's summary under "rounds" (every round, in order, also those without
    that kind of step); the first step and the layers pass from the round that has the layers pass (else the
    first). One profile is returned as it is."""
    if len(profiles) == 1:
        return profiles[0]
    layered = next((p for p in profiles if "layers_pass_ms" in p["prefill_step"]), profiles[0])
    out = {"prefill_step": layered["prefill_step"]}
    for kind in ("plain", "speculative"):
        runs = [p[kind] for p in profiles if p[kind]["steps"]]
        if not runs:
            out[kind] = {"steps": 0}
            continue
        merged: dict = {"steps": sum(r["steps"] for r in runs)}
        spread: dict = {}
        for key in _ROUND_KEYS:
            values = [r[key] for r in runs if r.get(key) is not None]
            if values:
                merged[key], spread[key] = _median(values), [min(values), max(values)]
        merged["phases_ms"] = {p: _median([r["phases_ms"][p] for r in runs]) for p in STEP_PHASES}
        spread["phases_ms"] = {p: [min(r["phases_ms"][p] for r in runs), max(r["phases_ms"][p] for r in runs)]
                               for p in STEP_PHASES}
        if "layers_pass" in layered[kind]:
            merged["layers_pass"] = layered[kind]["layers_pass"]
        merged["spread"] = spread
        merged["rounds"] = [{k: v for k, v in p[kind].items() if k != "layers_pass"} for p in profiles]
        out[kind] = merged
    return out


def phase_table(rows: list[dict]) -> str:
    """Markdown: one line per (method, batch size, step kind) with steps recorded; ms per step by phase, then the
    target forward by layer kind (from the layers pass)."""
    head = ["method", "B", "step", "n", "tok/step", "draft fwds", "total", *STEP_PHASES, "fwd (layers pass)",
            *LAYER_KINDS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        for kind in ("plain", "speculative"):
            s = row[kind]
            if not s["steps"]:
                continue
            lp = s.get("layers_pass") or {}
            by_kind = lp.get("forward_by_kind_ms") or {}
            cells = [row["method"], str(row["batch_size"]), kind, str(s["steps"]), f"{s['emitted_per_step']:.2f}",
                     f"{s.get('draft_forwards_per_step', 0):.1f}", f"{s['total_ms']:.1f}", *(f"{s['phases_ms'][p]:.1f}" for p in STEP_PHASES),
                     f"{lp['forward_ms']:.1f}" if lp else "-",
                     *(f"{by_kind[k]:.1f}" if by_kind.get(k) is not None else "-" for k in LAYER_KINDS)]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| method | B | first step: prompt tokens | ms | ms / prompt token | (layers pass) | "
              + " | ".join(LAYER_KINDS) + " |", "|" + "---|" * (6 + len(LAYER_KINDS))]
    for row in rows:
        p = row.get("prefill_step")
        if p:
            by_kind = p.get("layers_pass_by_kind_ms") or {}
            lines.append(f"| {row['method']} | {row['batch_size']} | {p['prompt_tokens']} | {p['ms']:.0f} | "
                         f"{p['ms_per_prompt_token']:.2f} | "
                         + (f"{p['layers_pass_ms']:.0f}" if "layers_pass_ms" in p else "-") + " | "
                         + " | ".join(f"{by_kind[k]:.0f}" if k in by_kind else "-" for k in LAYER_KINDS) + " |")
    return "\n".join(lines) + "\n\nms per step (means; with several rounds the median of the rounds' means); phases from the plain pass (rest: the step call's time " \
                              "outside them), layer kinds from the layers pass (hooks on every module: its forward is " \
                              "shown beside). The first step prefills the batch's prompts, then decodes once.\n"
