"""Throughput simulator: replay recorded acceptance traces through a verification cost model. SIMULATION.

    echo-trtllm simulate --trace trace.json --target 235b --gpu H100 --gpu-dtype fp8 --batch-sizes 1,16,64,256

A trace (from `echo-trtllm bench --trace`) holds, per method, one record per request and step: the drafted
candidates' path probabilities in priority order with hindsight acceptance flags, and the tokens the method
verified and emitted. The simulator builds steps of B records (taken cyclically, so runs are deterministic) and
charges each step

    t_step = t_verify(T) + levels * t_draft_level(drafted per level) + control

  ar            T = B, emitted = B, no drafting
  fixed methods T = sum of recorded verified, emitted = sum of recorded emitted (their trees do not react to load)
  echo family   the B records' drafted trees replayed through the runtime's own drafting loop (`draft_tree`
                with the policy's gate, budget-aware and cost-aware stops, `allocate_budget` and `choose_budget`
                on the simulated cost; `replay_step`): a frontier node's children are those its source method
                drafted; emitted = B + the hindsight-accepted nodes among those verified; the draft cost is
                charged per replayed level by its frontier size. Traces written before the trees were recorded
                fall back to merging the candidates in probability order (the row's "allocation" says which).
                The gate is the uncalibrated default unless gate samples are given (a calibration's).
  oracle        the hindsight ceiling of any allocation over the same drafts (`oracle_step`): each request's
                accepted chain (its deepest accepted node) is known; a step verifies the roots and n accepted
                tokens, drafting only accepted nodes in the cheapest way, with n chosen per step so that the
                run's tokens over its seconds (a ratio of sums) is the highest any choice gives. A method
                replayed on these trees verifies at least what it emits and drafts at least the parents of
                what it accepts, so with verification and level times that do not fall as tokens grow it
                emits no more per second (the ceiling pays no control time either, and ignores --k-max, so it
                stays a bound for a capped method).

Cost models: either the measured curve of a calibration file (`--calibration`; then the simulation can be
checked against the real benchmark on the same machine), or an analytic roofline for a model class on a GPU:

    t_verify(T) = max(t_memory, a + b * T)
    t_memory    = (weight bytes + B * context * KV bytes per token) / (num_gpus * bandwidth * bw_efficiency)
    b           = 2 * active parameters / (num_gpus * peak FLOP/s * mfu)
    a           = fixed per-forward overhead (launches, all-reduce)

The draft level costs the same roofline for the draft head's parameters. Every number this module prints is a
prediction from recorded acceptance and a cost model, not a measurement of the named hardware or model; the
paper's reported figures are printed beside it for orientation only.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from echo_trtllm.core.config import EchoConfig
from echo_trtllm.core.cost import CostModel, choose_budget
from echo_trtllm.core.gating import GateSamples, roc_auc
from echo_trtllm.core.policies import POLICIES, TreePolicy, draft_tree, make_policy
from echo_trtllm.core.tree import DraftLevel

__all__ = ["GPUSpec", "ModelSpec", "GPUS", "MODELS", "PAPER", "ORACLE", "roofline_cost", "min_drafting_seconds",
           "oracle_step", "best_ratio", "shift_confidence", "records_gate_samples", "depth_aucs", "simulate_method",
           "simulate", "load_traces"]


@dataclass(frozen=True)
class GPUSpec:
    name: str
    bf16_flops: float  # dense peak FLOP/s
    fp8_flops: float
    bandwidth: float  # bytes/s


@dataclass(frozen=True)
class ModelSpec:
    name: str
    total_params: float
    active_params: float  # per token (MoE: the routed experts' share)
    kv_bytes_per_token: float  # bf16 K and V over all layers
    num_gpus: int
    draft_params: float  # the draft head (one decoder layer plus its LM head, EAGLE-3 style)


# Public datasheet peaks (dense, no sparsity).
GPUS = {
    "H100": GPUSpec("H100 SXM", 989e12, 1979e12, 3.35e12),
    "H200": GPUSpec("H200 SXM", 989e12, 1979e12, 4.8e12),
}
# Model classes: parameter counts and KV sizes of the public architectures (layers x KV heads x head dim x 2 x 2 B).
MODELS = {
    "8b": ModelSpec("8B dense (Llama-3.1-8B class)", 8.0e9, 8.0e9, 32 * 8 * 128 * 4, 1, 0.75e9),
    "70b": ModelSpec("70B dense (Llama-3.3-70B class)", 70.6e9, 70.6e9, 80 * 8 * 128 * 4, 8, 1.9e9),
    "235b": ModelSpec("235B MoE, 22B active (Qwen3-235B-A22B class)", 235e9, 22e9, 94 * 4 * 128 * 4, 8, 0.9e9),
}
# The paper's reported numbers (8xH100), printed beside simulations for orientation.
PAPER = {
    "235b": "paper, Qwen3-235B-A22B, BS=256, 8xH100: EAGLE-3 2,803 -> ECHO 3,207 tok/s (+14.4 %); "
            "BS=1 mean 2.02x over AR",
    "70b": "paper, LLaMA-3.3-70B: up to 5.35x at BS=1; +12.96 % over EAGLE-3 at high load",
    "8b": "paper, LLaMA-3.1-8B: +7.92 % over EAGLE-3 at high load",
}

ORACLE = "oracle"  # simulate's hindsight ceiling (module docstring)
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def roofline_cost(model: ModelSpec, gpu: GPUSpec, dtype: str, batch_size: int, context: int,
                  mfu: float = 0.5, bw_efficiency: float = 0.8, fixed_overhead: float = 1e-3,
                  draft_overhead: float = 2e-4) -> CostModel:
    """The analytic cost model of one batch size (the KV read grows with B) as a CostModel over TOKENS."""
    if dtype not in ("bf16", "fp8"):
        raise ValueError(f"dtype must be 'bf16' or 'fp8', got {dtype!r}")
    weight_bytes = model.total_params * (1 if dtype == "fp8" else 2)
    flops = (gpu.fp8_flops if dtype == "fp8" else gpu.bf16_flops) * model.num_gpus * mfu
    bandwidth = gpu.bandwidth * model.num_gpus * bw_efficiency
    t_mem = (weight_bytes + batch_size * context * model.kv_bytes_per_token) / bandwidth
    verify = tuple(max(t_mem, fixed_overhead + 2 * model.active_params * t / flops) for t in TOKENS)
    d_bytes = model.draft_params * (1 if dtype == "fp8" else 2)
    draft = tuple(max(d_bytes / bandwidth, draft_overhead + 2 * model.draft_params * t / flops) for t in TOKENS)
    return CostModel(TOKENS, verify, TOKENS, draft, 0.0, f"{gpu.name} x{model.num_gpus} {dtype} (roofline)")


def has_trees(records: list[dict]) -> bool:
    """Whether the records carry their drafted trees (depths and parents; traces written since the replay)."""
    return all("parents" in r and "depths" in r for r in records)


def replay_step(policy: TreePolicy, batch: list[dict], budget: int | None, context: float | None = None
                ) -> tuple[list[int], list[int], list[int]]:
    """One step of a drafting policy on recorded trees, through the runtime's own drafting loop (`draft_tree`:
    frontier choice, and for the echo family the gate, budget-aware and cost-aware stops, `allocate_budget`,
    `choose_budget`). The draft model is replaced by the records: a frontier node's children are the ones its
    source method drafted, with their recorded conditional probabilities, as local token ids 0, 1, ... best
    first (a child the source never drafted has probability 0 and is never accepted). Returns, per request, the
    nodes verified (root included) and the tokens emitted (accepted + bonus), and every drafted level's frontier
    size."""
    children: list[dict[int, list[tuple[float, int]]]] = []  # per request: record parent -> (cond. prob, node)
    for r in batch:
        kids: dict[int, list[tuple[float, int]]] = {}
        for j, (p, parent) in enumerate(zip(r["probs"], r["parents"])):
            base = 1.0 if parent < 0 else r["probs"][parent]
            kids.setdefault(parent, []).append((p / base if base > 0 else 0.0, j))
        for lst in kids.values():
            lst.sort(key=lambda c: -c[0])
        children.append(kids)
    width = max(policy.config.top_k, policy.config.beam_width,
                max((len(lst) for kids in children for lst in kids.values()), default=1))

    def child(req: int, up: int | None, tok: int) -> int | None:
        """The record node drafted as local token `tok` under record node `up` (-1: the root)."""
        kids = children[req].get(up, []) if up is not None else []
        return kids[tok][1] if tok < len(kids) else None

    levels: list[list[int | None]] = [[-1] * len(batch)]  # the record node of every node, level by level

    def draft_fn(level: DraftLevel, frontier: Tensor) -> Tensor:
        if len(levels) == level.depth:  # draft_tree asks level by level: map the newest one
            levels.append([child(q, levels[-1][p], t) for q, p, t in zip(
                level.request_ids.tolist(), level.parent_ids.tolist(), level.token_ids.tolist())])
        here = levels[level.depth]
        probs = torch.zeros(frontier.numel(), width)
        for row, f in enumerate(frontier.tolist()):
            up, req = here[f], int(level.request_ids[f])
            for col, (p, _) in enumerate(children[req].get(up, []) if up is not None else []):
                probs[row, col] = p
        return probs

    result = draft_tree(policy, torch.zeros(len(batch), dtype=torch.long), draft_fn, budget=budget, context=context)
    # every verified candidate's record node, request by request (parents come before children)
    tree, sel = result.candidates, result.mask.tolist()
    parents, tokens, cu = tree.parents.tolist(), tree.token_ids.tolist(), tree.cu_num_nodes.tolist()
    verified = torch.bincount(tree.request_ids[result.mask], minlength=len(batch)).tolist()
    emitted = [1] * len(batch)
    for req, r in enumerate(batch):
        rec: list[int | None] = [-1]
        for k in range(cu[req] + 1, cu[req + 1]):
            rec.append(child(req, rec[parents[k]], tokens[k]))
            if sel[k] and rec[-1] is not None:
                emitted[req] += r["accepted"][rec[-1]]
    return verified, emitted, list(result.state.frontier_sizes)


def shift_confidence(records: list[dict], shift: float) -> list[dict]:
    """WHAT-IF: the records with every drafted node's path probability moved toward its hindsight outcome by `shift`
    in logit space (accepted nodes up, rejected down; math.inf: the outcome itself, perfect knowledge). An accepted
    node's parent is accepted, so path probabilities stay non-increasing along every path; two nodes with the same
    outcome keep their order, so at every depth the AUC of accepted against rejected does not fall as `shift` grows
    (0: the head's own confidence)."""
    if not shift >= 0:
        raise ValueError(f"confidence shift must be >= 0 (math.inf: perfect knowledge), got {shift}")
    out = []
    for r in records:
        acc = torch.tensor(r["accepted"], dtype=torch.float64)
        if math.isinf(shift):
            probs = acc
        else:
            logit = torch.logit(torch.tensor(r["probs"], dtype=torch.float64), eps=1e-9)
            probs = torch.sigmoid(logit + shift * (2 * acc - 1))
        out.append({**r, "probs": probs.tolist()})
    return out


def records_gate_samples(records: list[dict], max_depth: int) -> GateSamples:
    """Gate samples from trace records (depths up to max_depth), one per request-step and depth as a calibration
    takes them: the most probable node there and whether the target accepted it. A calibration keeps a sample only
    where that node was verified; a trace knows every drafted node's outcome, so here every one counts. The
    break-even probability is GateSamples' default: simulate always has a cost curve, which sets it per step."""
    depths, confidences, accepted = [], [], []
    for r in records:
        best: dict[int, tuple[float, int]] = {}
        for p, a, d in zip(r["probs"], r["accepted"], r["depths"]):
            if d <= max_depth and (d not in best or p > best[d][0]):
                best[d] = (p, a)
        for d in sorted(best):
            depths.append(d)
            confidences.append(best[d][0])
            accepted.append(bool(best[d][1]))
    return GateSamples(torch.tensor(depths, dtype=torch.long), torch.tensor(confidences, dtype=torch.float32),
                       torch.tensor(accepted, dtype=torch.bool), max_depth)


def depth_aucs(records: list[dict], max_depth: int) -> list[float]:
    """Per depth 1..max_depth, how well the records' path probability ranks the target's verdict: the AUC of
    accepted against rejected over every drafted node there (nan where one outcome is missing)."""
    out = []
    for d in range(1, max_depth + 1):
        probs = [p for r in records for p, e in zip(r["probs"], r["depths"]) if e == d]
        flags = [a for r in records for a, e in zip(r["accepted"], r["depths"]) if e == d]
        out.append(roc_auc(torch.tensor(probs, dtype=torch.float64), torch.tensor(flags, dtype=torch.bool)))
    return out


def accepted_chain(record: dict) -> int:
    """Depth of a record's deepest accepted node: its accepted chain (the flags are closed under parents)."""
    return max((d for d, a in zip(record["depths"], record["accepted"]) if a), default=0)


def min_drafting_seconds(widths: list[int], level_seconds: Tensor) -> Tensor:
    """Least drafting seconds of a step that drafts n = 0 .. sum(widths) nodes along accepted chains, for every n.
    widths[d - 1]: requests whose chain reaches depth d. A level's frontier f_d is the nodes it adds (each needs a
    parent at depth d - 1), so the profiles are f_1 >= f_2 >= ... with f_d <= widths[d - 1]; a profile costs
    sum(level_seconds[f_d]) (level_seconds[0] = 0). Exact for any level cost, by dynamic programming from the
    deepest level up (shallowest-first is cheapest only where a level's cost is concave in its frontier)."""
    total = sum(widths)
    # below[g, m]: least seconds of the levels below this one with m nodes in them, their first frontier <= g
    below = torch.full((1, total + 1), math.inf, dtype=torch.float64)
    below[0, 0] = 0.0
    for width in reversed(widths):
        here = torch.full((width + 1, total + 1), math.inf, dtype=torch.float64)
        for f in range(width + 1):
            here[f, f:] = level_seconds[f] + below[min(f, below.shape[0] - 1), :total + 1 - f]
        below = torch.cummin(here, dim=0).values
    return below[-1]


def oracle_step(chains: list[int], cost: CostModel, context: float | None = None) -> list[tuple[int, float]]:
    """(emitted, seconds) of every choice a clairvoyant allocator has in one step whose requests' accepted chains
    are `chains`: verify the roots and n = 0 .. sum(chains) accepted tokens, drafting only accepted nodes, in the
    cheapest way (`min_drafting_seconds`). Costs are read from `cost` as the replay reads them."""
    b = len(chains)
    widths = [sum(c >= d for c in chains) for d in range(1, max(chains, default=0) + 1)]
    level = torch.zeros(b + 1, dtype=torch.float64)
    if b:
        level[1:] = torch.as_tensor(cost.draft_level_time(torch.arange(1, b + 1), context), dtype=torch.float64)
    drafting = min_drafting_seconds(widths, level)
    verify = torch.as_tensor(cost.verify_time(torch.arange(b, b + drafting.numel()), context), dtype=torch.float64)
    return [(b + n, float(v + d)) for n, (v, d) in enumerate(zip(verify.tolist(), drafting.tolist()))]


def best_ratio(steps: list[list[tuple[int, float]]]) -> tuple[float, list[int]]:
    """The highest sum(emitted) / sum(seconds) over one (emitted, seconds) choice per step, and the choices that
    reach it (Dinkelbach's iteration: at rate r each step takes its choice maximising emitted - r * seconds; the
    rate of those choices is >= r, with equality only at the optimum)."""
    rate, picks = 0.0, None
    while True:
        new_picks = [max(range(len(c)), key=lambda k, c=c: c[k][0] - rate * c[k][1]) for c in steps]
        new = sum(c[k][0] for c, k in zip(steps, new_picks)) / sum(c[k][1] for c, k in zip(steps, new_picks))
        if picks is not None and new <= rate * (1 + 1e-12):
            return rate, picks
        rate, picks = new, new_picks


def simulate_oracle(records: list[dict], batch_size: int, cost: CostModel, steps: int = 200,
                    context: float | None = None) -> dict:
    """The hindsight ceiling's row (module docstring), steps built as `simulate_method` builds them."""
    if not records:
        raise ValueError("no trace records for the oracle")
    if not has_trees(records):
        raise ValueError("the oracle needs records with their drafted trees (depths and parents; traces written "
                         "since the replay)")
    chains = [accepted_chain(r) for r in records]
    choices = [oracle_step([chains[(s * batch_size + j) % len(records)] for j in range(batch_size)], cost, context)
               for s in range(steps)]
    rate, picks = best_ratio(choices)
    emitted = sum(c[k][0] for c, k in zip(choices, picks))
    return {"method": ORACLE, "batch_size": batch_size, "tokens_per_s": rate, "mat": emitted / (steps * batch_size),
            "verified_per_step": emitted / steps, "records": len(records), "allocation": "hindsight ceiling"}


def simulate_method(method: str, records: list[dict], batch_size: int, cost: CostModel, steps: int = 200,
                    k_max: int = 1 << 30, control_seconds: float = 0.0, config: EchoConfig | None = None,
                    gate_samples: GateSamples | None = None, context: float | None = None) -> dict:
    """Simulated tokens/s of one method at one batch size (module docstring). method: a policy name, or a bench
    entry with shape options ("chain:num_draft_tokens=2"). config / gate_samples / context: the echo family's
    tree options (default EchoConfig()), its gate's calibration evidence, and the context the cost is read at."""
    if method == ORACLE:
        return simulate_oracle(records, batch_size, cost, steps, context)
    if not records:
        raise ValueError(f"no trace records for method {method!r}")
    from .run import parse_method

    name, shape = parse_method(method)
    policy = POLICIES[name]
    replay = policy.needs_draft_model and has_trees(records)
    if replay:
        runner = make_policy(dataclasses.replace(config or EchoConfig(), policy=name, **shape), cost, gate_samples)
        budget = (max(batch_size, min(k_max, runner.config.k_max, batch_size * runner.config.max_nodes_per_request))
                  if policy.shares_budget else None)
    emitted_total = 0
    seconds = 0.0
    verified_total = 0
    for s in range(steps):
        batch = [records[(s * batch_size + j) % len(records)] for j in range(batch_size)]
        if not policy.needs_draft_model:
            emitted, verified, draft_time = batch_size, batch_size, 0.0
        elif replay:
            per_verified, per_emitted, frontiers = replay_step(runner, batch, budget, context)
            verified, emitted = sum(per_verified), sum(per_emitted)
            draft_time = cost.drafting_time(frontiers, context)
        else:
            levels = max(r["levels"] for r in batch)
            drafted = sum(len(r["probs"]) for r in batch)
            per_level = max(1, -(-drafted // max(levels, 1)))
            draft_time = levels * float(cost.draft_level_time(per_level, context)) if levels else 0.0
            if policy.shares_budget:  # a trace without its trees: the candidates merged in probability order
                cands = sorted(((-p, rank, j, a) for j, r in enumerate(batch)
                                for rank, (p, a) in enumerate(zip(r["probs"], r["accepted"]))))
                est = torch.tensor([-c[0] for c in cands], dtype=torch.float64)
                k = min(choose_budget(est, batch_size, cost, draft_time), k_max)
                taken = k - batch_size
                emitted = batch_size + sum(c[3] for c in cands[:taken])
                verified = k
            else:
                emitted = sum(r["emitted"] for r in batch)
                verified = sum(r["verified"] for r in batch)
        emitted_total += emitted
        verified_total += verified
        seconds += (float(cost.verify_time(verified, context)) + draft_time
                    + (control_seconds if policy.needs_draft_model else 0.0))
    return {"method": method, "batch_size": batch_size, "tokens_per_s": emitted_total / seconds,
            "mat": emitted_total / (steps * batch_size), "verified_per_step": verified_total / steps,
            "records": len(records), "allocation": ("replayed" if replay else
                                                    "probability merge (trace without trees)"
                                                    if policy.shares_budget else "as recorded")}


def simulate(traces: dict[str, list[dict]], batch_sizes: list[int], cost_for_batch, steps: int = 200,
             k_max: int = 1 << 30, control_seconds: float = 0.0, config: EchoConfig | None = None,
             gate_samples: GateSamples | None = None, context: float | None = None,
             methods: list[str] | None = None, tree_source: str | None = None,
             confidence_shift: float | None = None) -> list[dict]:
    """traces: method -> records. cost_for_batch(B) -> CostModel. methods: what to simulate (bench --methods
    entries, shape options included; default: the traced methods, each on its own records). tree_source: replay
    every method on this traced method's trees (e.g. a wide eagle2 run, to compare shapes no run drafted). Rows
    carry speedup_vs_ar when 'ar' is among them, and how many recorded request-steps each rests on ("records").
    confidence_shift: WHAT-IF, every replayed method reads the records' confidence moved toward the outcome
    (`shift_confidence`), and the echo family's gate and acceptance estimates are calibrated in-sample from those
    records (`records_gate_samples`; gate_samples is then unused); methods run as recorded do not change."""
    if tree_source is not None and tree_source not in traces:
        raise ValueError(f"tree source {tree_source!r} is not traced; traced: {', '.join(traces)}")
    methods = list(methods or traces)
    if ORACLE in methods and tree_source is None:
        raise ValueError(f"method {ORACLE!r} (the hindsight ceiling) needs a tree source: the traced method whose "
                         f"drafts it allocates; traced: {', '.join(traces)}")
    missing = [m for m in methods if tree_source is None and m not in traces]
    if missing:
        raise ValueError(f"methods {missing} are not traced (traced: {', '.join(traces)}); give a tree source")
    if confidence_shift is not None:
        replayed = {tree_source or m for m in methods}  # the tree source, or each method's own records
        traces = {src: shift_confidence(traces[src], confidence_shift) for src in replayed}
        # one in-sample calibration per replayed record set
        samples = {m: records_gate_samples(recs, (config or EchoConfig()).max_depth) if has_trees(recs) else None
                   for m, recs in traces.items()}
    rows = []
    for b in batch_sizes:
        cost = cost_for_batch(b)
        cells = {m: simulate_method(m, traces[tree_source or m], b, cost, steps, k_max, control_seconds, config,
                                    gate_samples if confidence_shift is None else samples[tree_source or m], context)
                 for m in methods}
        ar = cells.get("ar")
        for m, cell in cells.items():
            cell["speedup_vs_ar"] = cell["tokens_per_s"] / ar["tokens_per_s"] if ar else None
            if confidence_shift is not None and cell["allocation"] not in ("as recorded", "hindsight ceiling"):
                cell["allocation"] += f", confidence shifted by {confidence_shift:g} (what-if)"
            rows.append(cell)
    return rows


def load_traces(path: str, source_batch_size: int | None = None) -> dict[str, list[dict]]:
    """method -> records from a bench trace file (records of every batch size pooled unless one is chosen)."""
    with open(path) as f:
        data = json.load(f)
    out: dict[str, list[dict]] = {}
    for key, recs in data["traces"].items():
        method, b = key.rsplit("/", 1)
        if source_batch_size is None or int(b) == source_batch_size:
            out.setdefault(method, []).extend(recs)
    if not out:
        raise ValueError(f"{path} holds no traces" + (f" for batch size {source_batch_size}" if source_batch_size else ""))
    return out
