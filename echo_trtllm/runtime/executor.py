"""The executor: in-flight batching around one ECHO decode step.

    step():  admit waiting requests (free slot, prefill budget)  -> prefill their prompts into the target cache
             draft (policy: gate + budget)                        -> Super-Tree
             pack                                                 -> one target forward over every request's tree
             verify (greedy or lossless sampling)                 -> accepted tokens + bonus
             finish (EOS, stop ids/strings, max_tokens, context)  -> finished requests leave at once
             commit                                               -> compact target and draft KV caches

Every request owns one KV slot (target and draft) from admission to finish; the slot holds max_seq_len tokens plus
scratch room for its largest tree. A request's K/V lives at its sequence positions, so the target cache holds
all tokens but the last (the root of the next tree).
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from echo_trtllm import kernels
from echo_trtllm.core import EchoConfig, SamplingTensors, draft_tree, make_policy, pack, verify
from echo_trtllm.core.policies import DraftResult
from echo_trtllm.core.verify import VerifyResult
from echo_trtllm.core.cost import CostModel
from echo_trtllm.models.llama import CausalLM
from echo_trtllm.models.loader import Tokenizer

from .drafter import Drafter
from .inputs import chain_batch, tree_batch
from .request import Request, SamplingParams

__all__ = ["Executor", "StepReport", "StepTimings", "SpeculationTracker", "check_limits"]


def check_limits(config: EchoConfig, max_batch_size: int, has_draft: bool) -> None:
    """Reject configurations that cannot run, before anything heavy is loaded."""
    policy = make_policy(config)
    if policy.needs_draft_model and not has_draft:
        raise ValueError(
            f"policy {config.policy!r} needs a draft model: pass draft_model=..., or use EchoConfig(policy='ar')"
        )
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    if policy.shares_budget and config.k_max < max_batch_size:
        raise ValueError(
            f"EchoConfig.k_max ({config.k_max}) must be >= max_batch_size ({max_batch_size}): every request in a "
            "step needs at least its root verified"
        )


@dataclass
class SpeculationTracker:
    """Decides before drafting whether a step should speculate at all (echo family with a cost model).

    An explore/exploit rule on measured throughput, tokens per second per request for speculative steps and for
    plain AR steps: the ratio of exponential moving averages of tokens and of seconds (wall time of the whole
    step: drafting, control, verification, bookkeeping). A ratio of averages, not an average of per-step rates:
    speculative steps take about the same time but emit very different numbers of tokens, and averaging their
    rates would favour lucky steps. The better mode runs; the other is re-measured by a probe every `probe_every` steps so the
    choice follows the traffic. A speculative step right after AR steps also makes the draft model catch up on
    the tokens it skipped; that one-off cost is charged to exploration, not to the speculative rate
    (`update(..., one_off_seconds=...)`).

    Probe spacing: a probe that confirms the choice costs `loss` tokens per request against running the better
    mode for the same time (loss = probe seconds x better rate - tokens the probe produced). The next probe waits
    until that is at most `explore_share` of the tokens produced meanwhile (at least twice the last interval, at
    most `max_probe_every`). A probe that overturns the choice resets the interval. Within a speculative step
    the cost model picks K (`choose_budget`).
    """

    probe_every: int = 8
    min_probe_every: int = 8
    max_probe_every: int = 1024
    explore_share: float = 0.02
    smoothing: float = 0.1
    # EMAs per mode: tokens per request and seconds per step (None until the mode has run)
    spec_tokens: float | None = None
    spec_seconds: float | None = None
    ar_tokens: float | None = None
    ar_seconds: float | None = None
    steps_since_probe: int = 0

    @property
    def spec_rate(self) -> float | None:
        return None if self.spec_tokens is None else self.spec_tokens / max(self.spec_seconds, 1e-9)

    @property
    def ar_rate(self) -> float | None:
        return None if self.ar_tokens is None else self.ar_tokens / max(self.ar_seconds, 1e-9)

    def should_speculate(self) -> bool:
        if self.spec_rate is None:
            return True
        if self.ar_rate is None:
            return False
        better = self.spec_rate > self.ar_rate
        if self.steps_since_probe + 1 >= self.probe_every:
            return not better
        return better

    def _spec_better(self) -> bool | None:
        if self.spec_rate is None or self.ar_rate is None:
            return None
        return self.spec_rate > self.ar_rate

    def update(self, speculated: bool, batch_size: int, emitted: int, seconds: float,
               one_off_seconds: float = 0.0) -> None:
        """One step's outcome. one_off_seconds: part of `seconds` that steady speculation would not pay (the
        draft's catch-up after AR steps); excluded from the rate, counted in the probe's cost."""
        per_request = emitted / batch_size
        steady = max(seconds - one_off_seconds, 1e-9)
        before = self._spec_better()
        was_probe = before is not None and speculated != before
        mode = "spec" if speculated else "ar"

        def ema(old: float | None, x: float) -> float:
            return x if old is None else (1 - self.smoothing) * old + self.smoothing * x

        setattr(self, f"{mode}_tokens", ema(getattr(self, f"{mode}_tokens"), per_request))
        setattr(self, f"{mode}_seconds", ema(getattr(self, f"{mode}_seconds"), steady))
        if was_probe:
            self.steps_since_probe = 0
            if self._spec_better() == before:
                better = max(self.spec_rate, self.ar_rate)
                loss = max(seconds * better - per_request, 0.0)  # tokens per request the probe cost
                per_step = (self.spec_tokens if before else self.ar_tokens) or 1.0  # per chosen-mode step
                stretched = math.ceil(loss / (self.explore_share * per_step))
                self.probe_every = min(max(2 * self.probe_every, stretched), self.max_probe_every)
            else:
                self.probe_every = self.min_probe_every
        else:
            self.steps_since_probe += 1


@dataclass
class StepTimings:
    """Wall seconds of one decode step by phase (prefill of newly admitted requests excluded).

    control: ECHO's gate + schedule + pack (drafting loop and selection minus the draft model's forwards, plus
    packing); draft_model: the draft's forwards; verify: the target's forward over the packed trees."""

    total: float = 0.0
    draft_model: float = 0.0
    control: float = 0.0
    verify: float = 0.0


@dataclass
class StepReport:
    """What one step did (for benchmarks, traces and the progress bar)."""

    batch_size: int
    verified_tokens: int
    emitted_tokens: int
    drafted_tokens: int
    finished: list[Request]
    updated: list[Request]
    speculated: bool = True
    timings: StepTimings = field(default_factory=StepTimings)
    # what was drafted and what the target accepted (None on an empty step)
    draft: DraftResult | None = None
    result: VerifyResult | None = None


class Executor:
    def __init__(
        self,
        target: CausalLM,
        draft: CausalLM | None,
        tokenizer: Tokenizer,
        config: EchoConfig,
        max_batch_size: int = 16,
        max_seq_len: int | None = None,
        max_num_tokens: int | None = None,
        cost_model: CostModel | None = None,
        gate_provider=None,
    ) -> None:
        """gate_provider: batch size -> GateCalibration (a Calibration's gate_for) for the echo family's gate."""
        self.policy = make_policy(config, cost_model)
        if gate_provider is not None and hasattr(self.policy, "gate_provider"):
            self.policy.gate_provider = gate_provider
        self.cost_model = cost_model
        self.tracker = SpeculationTracker() if cost_model is not None and self.policy.shares_budget else None
        self._ar_policy = make_policy(EchoConfig(policy="ar"))  # the tracker's plain AR steps
        check_limits(config, max_batch_size, has_draft=draft is not None)
        if draft is not None and draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"the draft's vocabulary size ({draft.config.vocab_size}) differs from the target's "
                f"({target.config.vocab_size}): speculative decoding needs one tokenizer"
            )
        self.target, self.tokenizer, self.config = target, tokenizer, config
        self.max_batch_size = max_batch_size
        self.max_seq_len = min(max_seq_len or target.config.max_position_embeddings, target.config.max_position_embeddings)
        tree_room = self.policy.max_tree_nodes
        self.max_num_tokens = max_num_tokens or max(config.k_max, 2048)
        if self.max_num_tokens < max_batch_size * (1 if self.policy.shares_budget else tree_room):
            raise ValueError(
                f"max_num_tokens ({self.max_num_tokens}) cannot hold a step of {max_batch_size} requests with "
                f"{'1' if self.policy.shares_budget else tree_room} verified tokens each"
            )
        self.target_cache = target.allocate_cache(max_batch_size, self.max_seq_len + tree_room)
        self.drafter = None
        if self.policy.needs_draft_model:
            cache = draft.allocate_cache(max_batch_size, self.max_seq_len + self.policy.max_expanded_nodes + 1)
            self.drafter = Drafter(draft, cache)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(max_batch_size))
        self._ids = itertools.count()

    # ---------------------------------------------------------------- requests

    def make_request(self, prompt: str | list[int], params: SamplingParams) -> Request:
        """Validate and tokenise; raises ValueError with what was wrong and what is accepted."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give a non-empty string or a non-empty list of token ids")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids, text = list(prompt), None
            bad = [t for t in ids if not 0 <= t < self.target.config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.target.config.vocab_size})")
        else:
            raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty: give a non-empty string or a non-empty list of token ids")
        if len(ids) >= self.max_seq_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens but the context holds {self.max_seq_len}: it must leave room for at "
                "least one generated token"
            )
        return Request(next(self._ids), ids, params, text)

    def submit(self, request: Request) -> None:
        seed = request.params.seed if request.params.seed is not None else random.getrandbits(63)
        request.generator = torch.Generator().manual_seed(seed)
        self.waiting.append(request)

    def abort(self, request: Request, reason: str = "error", error: str | None = None) -> None:
        request.finish_reason, request.error = reason, error
        if request in self.running:
            self.running.remove(request)
            self.free_slots.append(request.slot)
        elif request in self.waiting:
            self.waiting.remove(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- phases

    def admit(self) -> list[Request]:
        """Move waiting requests into free slots and prefill their prompts (all but the last token) into the
        target's cache and, when there is a draft model, into the draft's (as serving engines do: decode steps
        then feed the draft only the tokens each step adds)."""
        admitted = []
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            req.slot = self.free_slots.pop(0)
            admitted.append(req)
        pending = [r for r in admitted if len(r.prompt_token_ids) > 1]
        # Prefill in chunks of at most max_num_tokens tokens per forward (target_ctx starts at 0).
        todo = deque(pending)
        while todo:
            group, budget = [], self.max_num_tokens
            while todo and budget > 0:
                r = todo[0]
                left = len(r.prompt_token_ids) - 1 - r.target_ctx
                take = min(left, budget)
                group.append((r, take))
                budget -= take
                if take == left:
                    todo.popleft()
                else:
                    break
            chains = [torch.tensor(r.prompt_token_ids[r.target_ctx : r.target_ctx + n]) for r, n in group]
            starts = torch.tensor([r.target_ctx for r, _ in group])
            slots = torch.tensor([r.slot for r, _ in group])
            batch = chain_batch(chains, starts, slots, logits="none")
            self.target(batch, self.target_cache)
            if self.drafter is not None:  # the draft model's prefill belongs to the prefill phase too
                self.drafter.model(batch, self.drafter.cache)
            for r, n in group:
                r.target_ctx += n
                if self.drafter is not None:
                    r.draft_ctx += n
        self.running.extend(admitted)
        return admitted

    def _sampling(self, requests: list[Request]) -> SamplingTensors:
        return SamplingTensors(
            torch.tensor([float(r.params.temperature) for r in requests]),
            torch.tensor([r.params.top_k for r in requests], dtype=torch.long),
            torch.tensor([float(r.params.top_p) for r in requests]),
        )

    def _finish(self, req: Request, tokens: list[int]) -> int:
        """Append emitted tokens until a stop condition; returns how many were kept."""
        eos = set() if req.params.ignore_eos else set(self.tokenizer.eos_token_ids)
        stop_ids = set(req.params.stop_token_ids or [])
        stops = req.params.stop_strings
        kept = 0
        for tok in tokens:
            req.output_token_ids.append(tok)
            kept += 1
            if tok in eos or tok in stop_ids:
                req.finish_reason = "stop"
            elif stops:
                text = self.tokenizer.decode(req.output_token_ids)
                hits = [text.find(s) for s in stops if s in text]
                if hits:
                    req.text = text[: min(hits)]
                    req.finish_reason = "stop"
                    return kept
            if req.finish_reason is None and (
                len(req.output_token_ids) >= req.params.max_tokens or len(req.all_token_ids) >= self.max_seq_len
            ):
                req.finish_reason = "length"
            if req.finish_reason is not None:
                break
        req.text = self.tokenizer.decode(req.output_token_ids)
        return kept

    # ---------------------------------------------------------------- one step

    @torch.inference_mode()
    def step(self) -> StepReport:
        self.admit()
        reqs = list(self.running)
        if not reqs:
            return StepReport(0, 0, 0, 0, [], [])
        b = len(reqs)
        roots = torch.tensor([r.all_token_ids[-1] for r in reqs])
        ctx = torch.tensor([r.target_ctx for r in reqs])
        slots = torch.tensor([r.slot for r in reqs])
        t_step = time.perf_counter()
        speculate = self.tracker is None or self.tracker.should_speculate()
        drafter = self.drafter if speculate else None  # a plain AR step leaves the draft model alone
        policy = self.policy if speculate else self._ar_policy
        if drafter is not None:
            drafter.begin(reqs)
        budget = min(self.config.k_max, self.max_num_tokens) if policy.shares_budget else None
        t_draft = time.perf_counter()
        drafted = draft_tree(policy, roots, drafter.draft_fn if drafter else None, budget)
        selected = drafted.selected
        packed = self._pack(selected, ctx)
        t_verify = time.perf_counter()
        logits = self.target(tree_batch(packed, ctx, slots), self.target_cache).cpu()  # (N_tot, V)
        t_verified = time.perf_counter()
        draft_model = drafter.model_seconds if drafter is not None else 0.0
        timings = StepTimings(0.0, draft_model, t_verify - t_draft - draft_model, t_verified - t_verify)
        sampling = self._sampling(reqs)
        result = verify(packed, logits, sampling, [r.generator for r in reqs])

        finished, keep, emitted = [], [], 0
        verified = selected.num_nodes.tolist()
        for i, (req, tokens) in enumerate(zip(reqs, result.token_lists())):
            kept = self._finish(req, tokens)
            emitted += kept
            req.stats.steps += 1
            req.stats.emitted_per_step.append(kept)
            req.stats.verified_tokens += verified[i]
            keep.append(not req.finished)
            if req.finished:
                finished.append(req)
        self._commit(reqs, result, keep)
        if drafter is not None:
            drafter.commit(selected, drafted.candidates.total_nodes, result, keep)
        for req in finished:
            self.running.remove(req)
            self.free_slots.append(req.slot)
        timings.total = time.perf_counter() - t_step
        if self.tracker is not None:
            produced = int(result.cu_accepted[-1])  # before stop conditions cut anything
            catch_up = drafter.catch_up_seconds if drafter is not None else 0.0
            self.tracker.update(speculate, b, produced, timings.total, catch_up)
        return StepReport(b, int(packed.total_nodes), emitted, int(drafted.candidates.total_nodes) - b, finished, reqs,
                          speculate, timings, drafted, result)

    def _pack(self, selected, ctx: torch.Tensor):
        """Flatten & pack. With CUDA models and the plugin built, the packing runs in the plugin's CUDA kernel
        (echo_trtllm.kernels) and its small result comes back to the host control plane; otherwise the core."""
        dev = self.target.device
        if dev.type == "cuda" and kernels.backend_for(dev) == "cuda":
            return kernels.pack(selected.to(dev), ctx.to(dev)).to("cpu")
        return pack(selected, ctx)

    def _commit(self, reqs: list[Request], result, keep: list[bool]) -> None:
        """Target KV: move the accepted path (root, accepted drafts) to ctx, ctx+1, ...; drop the rest."""
        src, dst, slots = [], [], []
        cu = result.cu_accepted.tolist()
        nodes = result.accepted_node_ids.tolist()
        for i, req in enumerate(reqs):
            if not keep[i]:
                continue
            path = nodes[cu[i] : cu[i + 1]]
            start = path[0]  # the root's flat index; node j of the request sits at target_ctx + (j - start)
            for t, node in enumerate(path):
                if node - start != t:
                    src.append(req.target_ctx + node - start)
                    dst.append(req.target_ctx + t)
                    slots.append(req.slot)
            req.target_ctx += len(path)
        if src:
            self.target_cache.compact(torch.tensor(slots), torch.tensor(src), torch.tensor(dst))
