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

Failures are contained by phase, and a request that got a slot always ends running or finished, its slot back:

    prefill, target      the requests of that prefill chunk finish with an error
    prefill, draft       ignored: the draft catches up on the prompt at the request's first speculative step
                         (as it does when the cost curve says speculation cannot pay at the batch size and the
                         draft prefill is skipped)
    drafting / packing   the step falls back to plain AR (nobody fails)
    target forward,      every request of the step finishes with an error
      verification
    finishing one        that request finishes with an error
      (detokenising)
    target KV commit     the requests it was committing finish with an error
    draft KV commit      ignored: the draft keeps its previous context and catches up

Time: every second the executor hands to its online models comes from its `Clock` (wall time by default; a
`ModelledClock` makes every decision a function of the tokens processed).

Prices and decisions (with a cost model): every step becomes a `StepSample` (batch, tokens verified, context, the
draft forwards' sizes, the measured seconds of drafting and of verification) that the online whole-step cost
model learns from (`core.prices.StepCostModel`, its prior the curve measured at load, then a few real steps of
`warm_up`); the policy's rules (budget, gate, cost stop) read its prices. With the AR fallback a
`core.controller.SpeculationController` decides before each step whether it speculates, from the measured
speculative steps priced at the step's own batch size and context; without it ("pure") every step drafts.
"""

from __future__ import annotations

import itertools
import logging
import random
import traceback
from collections import deque
from dataclasses import dataclass, field, fields

import torch

from echo_trtllm import kernels
from echo_trtllm.cpu import heap_tokens, keep_freed_memory
from echo_trtllm.core import EchoConfig, SamplingTensors, draft_tree, make_policy, pack
from echo_trtllm.core.controller import Decision, SpeculationController
from echo_trtllm.core.cost import CostModel
from echo_trtllm.core.gating import GateSamples
from echo_trtllm.core.policies import DraftResult, draft_tree_batched, policy_class
from echo_trtllm.core.prices import StepCostModel, StepPrediction
from echo_trtllm.core.steps import StepSample
from echo_trtllm.core.verify import AcceptedPaths, VerifyResult, verify_paths
from echo_trtllm.models.eagle3 import Eagle3Head
from echo_trtllm.models.llama import CausalLM
from echo_trtllm.models.loader import Tokenizer

from .clock import Clock, WallClock
from .detok import IncrementalText
from .drafter import make_drafter
from .transfer import HostLink, Traffic
from .inputs import chain_batch, tree_batch
from .request import Request, SamplingParams, check_prompt
from .stops import StopMatcher

__all__ = ["Executor", "StepReport", "StepTimings", "check_limits", "default_max_num_tokens"]

log = logging.getLogger("echo_trtllm.executor")
# the shortest pending chain a re-primed draft starts from (tokens of context it keeps)
MIN_PENDING = 8

def default_max_num_tokens(config: EchoConfig) -> int:
    """Tokens a step verifies at most when the caller sets no max_num_tokens."""
    return max(config.k_max, 2048)


def check_limits(config: EchoConfig, max_batch_size: int, has_draft: bool) -> None:
    """Reject configurations that cannot run, before anything heavy is loaded."""
    policy = policy_class(config)
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

# plain steps of more rows than this take every row's argmax on the forward's threads rather than the host library's
# logits reader (one thread): inside the engine on the Qwen target, bf16, 2 cores, the reader was faster at 1 and 16
# plain rows and the two equal at 64 (docs/performance.md); more threads favour the argmax
READER_PLAIN_ROWS = 32

@dataclass
class StepTimings:
    """Seconds of one decode step by phase, from the executor's clock (prefill of newly admitted requests
    excluded).

    control: ECHO's gate + schedule + pack (drafting loop and selection minus the draft model's forwards, plus
    packing); draft_model: the draft's forwards; verify: the tree's inputs on the device and the target's forward
    over the packed trees. The finer phases after drafting (the per-phase profile, `bench --profile-phases`):
    forward, the target's forward alone (verify - forward: building and sending the inputs); accept, acceptance
    and the accepted path's read; finish, appending tokens and the stop checks; commit, the KV commits, the draft's
    observation of the new features and freeing finished requests."""

    total: float = 0.0
    draft_model: float = 0.0
    control: float = 0.0
    verify: float = 0.0
    forward: float = 0.0
    accept: float = 0.0
    finish: float = 0.0
    commit: float = 0.0

    @property
    def drafting(self) -> float:
        """The drafting side: the draft's forwards and the host work around them (selection, packing)."""
        return self.draft_model + self.control

    @property
    def verify_side(self) -> float:
        """Everything outside drafting: the tree's inputs, the target's forward, acceptance, commit."""
        return self.total - self.drafting


@dataclass
class StepReport:
    """What one step did (for benchmarks, traces, iteration statistics and the progress bar).

    Per-request lists follow the order of the step's batch (`updated[:batch_size]`, the draft's request order)."""

    batch_size: int
    verified_tokens: int
    emitted_tokens: int
    drafted_tokens: int
    # requests that ended this step (finished, or failed with finish_reason "error")
    finished: list[Request]
    # requests whose output changed or that ended: the step's batch first, then requests failed in admission
    updated: list[Request]
    speculated: bool = False
    timings: StepTimings = field(default_factory=StepTimings)
    # what was drafted and what the target accepted (None on an empty or failed step)
    draft: DraftResult | None = None
    result: VerifyResult | None = None
    # per request of the batch: id, output tokens before the step, tokens kept this step
    request_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    # the draft side failed and the step ran as plain AR
    draft_failed: bool = False
    # the step's context as its attention reads it: the longest cached target context of the batch (the padded
    # layout attends max-context keys for every request; the cost grid's context axis)
    context: float = 0.0
    # host <-> device traffic of the step (`transfer.HostLink`): syncs, bytes each way, largest single read
    traffic: Traffic | None = None
    # the step as the online cost model saw it, what it predicted for it before learning from it, and what the
    # speculation controller decided, when the step ran as it decided (None without a cost model, without the AR
    # fallback, or when a draft failure or the policy made the step plain)
    sample: StepSample | None = None
    prediction: StepPrediction | None = None
    decision: Decision | None = None



def _check_pair(target: CausalLM, draft) -> None:
    """A draft that can speculate for this target: one vocabulary; an EAGLE-3 head trained on its features."""
    draft_vocab = None if draft is None else (
        draft.config.layer.vocab_size if isinstance(draft, Eagle3Head) else draft.config.vocab_size)
    if draft is not None and draft_vocab != target.config.vocab_size:
        raise ValueError(
            f"the draft's vocabulary size ({draft_vocab}) differs from the target's "
            f"({target.config.vocab_size}): speculative decoding needs one tokenizer"
        )
    if isinstance(draft, Eagle3Head) and draft.config.target_hidden_size != target.config.hidden_size:
        raise ValueError(f"the EAGLE-3 head reads features of width {draft.config.target_hidden_size} but the "
                         f"target's hidden size is {target.config.hidden_size}: the head belongs to another target")


class Executor:
    def __init__(
        self,
        target: CausalLM,
        draft: CausalLM | Eagle3Head | None,
        tokenizer: Tokenizer,
        config: EchoConfig,
        max_batch_size: int = 16,
        max_seq_len: int | None = None,
        max_num_tokens: int | None = None,
        cost_model: CostModel | None = None,
        gate_samples: GateSamples | None = None,
        clock: Clock | None = None,
        fallback: bool | None = None,
        adapt: bool = True,
    ) -> None:
        """draft: a separate draft model sharing the target's tokenizer, or an EAGLE-3 head loaded for this target
        (`models.eagle3.load_eagle3`); the target's forwards then also capture the head's features.
        cost_model: forward times measured at load (or a calibration's): the prior of the online whole-step cost
        model (`core.prices.StepCostModel`), whose prices the echo family's rules read (K per step, the gate's
        lambda) and the speculation controller weighs; None: no prices, no controller.
        gate_samples: a calibration's warm-up evidence (the gate's depths and the acceptance estimates' prior).
        clock: where step times come from (default: wall time).
        fallback: the AR fallback (`core.controller.SpeculationController`) for this policy: True for any drafting
        policy, False never ("pure": every step speculates with the policy's own rules), None the default (the
        echo family with a cost model).
        adapt: learn prices and acceptance from the executor's own steps (the default). False is the ablation without
        it: the policy's rules read `cost_model` itself and the calibration's acceptance estimates, fixed (the
        controller, with the AR fallback, weighs measured steps at those fixed prices)."""
        check_limits(config, max_batch_size, has_draft=draft is not None)
        if fallback not in (None, True, False):
            raise ValueError(f"fallback must be True, False or None, got {fallback!r}")
        if adapt not in (True, False):
            raise ValueError(f"adapt must be True or False, got {adapt!r}")
        _check_pair(target, draft)
        # a forward's large activations reuse the heap, not fresh pages (echo_trtllm.cpu)
        self._heap_kept = target.device.type == "cpu" and keep_freed_memory()
        self.target, self.tokenizer, self.config = target, tokenizer, config
        self.clock = clock or WallClock(target.device)
        self.link = HostLink(target.device)  # every tensor crossing host <-> model device, counted per step
        self._pack_backend = kernels.backend_for(target.device)  # packing runs where the target is (`_pack`)
        # greedy acceptance where the logits are: the host library's on the CPU, torch's elsewhere (`_verify`)
        self._acceptor = kernels.host_greedy_acceptor() if self._pack_backend == "host" else None
        # and, on the CPU, the top-1 of a verified row read only where the walk needs it (`_verify`)
        self._logits_reader = kernels.host_greedy_logits_acceptor() if self._pack_backend == "host" else None
        self._init_pricing(config, cost_model, gate_samples, fallback, adapt)
        self._init_memory(target, draft, config, max_batch_size, max_seq_len, max_num_tokens)
        if self._pack_backend == "host" and hasattr(self.drafter, "row_copier"):  # the feature store's writes
            self.drafter.row_copier = kernels.host_row_copier()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(max_batch_size))
        self._ids = itertools.count()
        # the last contained failure (traceback text) and how many of each phase (for logs and stats)
        self.last_error: str | None = None
        self.failures: dict[str, int] = {}

    def _init_pricing(self, config, cost_model, gate_samples, fallback, adapt) -> None:
        """The policy, the prices its rules read and the speculation controller (the AR fallback)."""
        self.cost_model = cost_model
        self.adapt = adapt
        self.step_cost = StepCostModel.from_cost_model(cost_model) if cost_model is not None else None
        # what the rules read: the learned prices, or (adapt=False) the load-time cost model itself
        self.prices = self.step_cost.prices if self.step_cost is not None and adapt else cost_model
        self.policy = make_policy(config, self.prices, gate_samples)
        kernels.install_host(self.policy, self.step_cost)  # the drafted trees and the prices are on the host
        self.controller = None
        if fallback is True and cost_model is None and self.policy.needs_draft_model:
            raise ValueError("fallback=True needs a cost model (cost_model=...): the AR fallback weighs measured steps "
                             "at prices that start from it")
        default = cost_model is not None and self.policy.shares_budget
        if self.policy.needs_draft_model and self.step_cost is not None and (fallback or (fallback is None and default)):
            self.controller = SpeculationController(self.step_cost)
        self._forced: bool | None = None  # warm_up's choice for the next steps (None: the controller's)
        self._cold = False  # warm_up's first steps: run, not learnt from
        self._ar_policy = make_policy(EchoConfig(policy="ar"))  # plain AR steps (the controller's, a draft failure)

    def _init_memory(self, target, draft, config, max_batch_size, max_seq_len, max_num_tokens) -> None:
        """The limits, the target's KV cache and the drafter with its own."""
        self.max_batch_size = max_batch_size
        self.max_seq_len = min(max_seq_len or target.config.max_position_embeddings, target.config.max_position_embeddings)
        tree_room = self.policy.max_tree_nodes
        self.max_num_tokens = max_num_tokens or default_max_num_tokens(config)
        if self.max_num_tokens < max_batch_size * (1 if self.policy.shares_budget else tree_room):
            raise ValueError(
                f"max_num_tokens ({self.max_num_tokens}) cannot hold a step of {max_batch_size} requests with "
                f"{'1' if self.policy.shares_budget else tree_room} verified tokens each"
            )
        # prefill chunks of at most max_num_tokens; on the CPU, of no more tokens than keep the widest activation (the
        # MLP's intermediate rows) within the heap's largest block: a 2,048-token chunk of Qwen2.5-Coder-1.5B mapped
        # its 37 MB afresh in every layer (64 prompts prefilled at 326-441 tokens/s, against 451-463 in chunks of
        # 1,872: docs/bench/prefill-chunk-ab-qwen-b64.json)
        self.prefill_chunk = self.max_num_tokens
        if self._heap_kept:
            head = getattr(target, "lm_head", None)  # prefill makes no logits
            widest = max((m.out_features for m in target.modules()  # linears of any kind (FP8 ones too)
                          if isinstance(getattr(m, "out_features", None), int) and m is not head),
                         default=target.config.intermediate_size)
            self.prefill_chunk = heap_tokens(widest * target.dtype.itemsize, self.max_num_tokens)
        self.target_cache = target.allocate_cache(max_batch_size, self.max_seq_len + tree_room)
        self.drafter = None
        if self.policy.needs_draft_model:
            self.drafter = make_drafter(draft, target, max_batch_size, self.max_seq_len + self.policy.max_expanded_nodes + 1,
                                        self.clock, self.policy.max_depth, self.link)
        # target layers whose inputs every target forward returns for the drafter (an EAGLE-3 head's features)
        self._capture = self.drafter.capture_layers if self.drafter is not None else ()
        # the batched drafting loop decides after every level where a read costs nothing (the model on the CPU:
        # a level drafted for requests the policy has already stopped is a whole draft forward wasted there);
        # on an accelerator it reads at the policy's sync depths only
        self.sync_every_level = target.device.type == "cpu"

    # ---------------------------------------------------------------- requests

    def make_request(self, prompt: str | list[int], params: SamplingParams) -> Request:
        """Validate and tokenise; raises ValueError / TypeError with what was wrong and what is accepted."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        check_prompt(prompt)
        vocab = self.target.config.vocab_size
        if isinstance(prompt, str):
            ids, text = self.tokenizer.encode(prompt), prompt
        else:
            ids, text = [int(t) for t in prompt], None  # (numpy integers too)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad and text is not None:  # a tokenizer that does not belong to the model
            raise ValueError(f"the tokenizer encoded the prompt to ids {bad[:5]} outside the model's vocabulary "
                             f"[0, {vocab}): pass the model's own tokenizer")
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if not ids:
            raise ValueError("prompt is empty: give a non-empty string or a non-empty list of token ids")
        if len(ids) >= self.max_seq_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens but the context holds {self.max_seq_len}: it must leave room for at "
                "least one generated token"
            )
        if len(ids) + params.max_tokens > self.max_seq_len:  # as the servers refuse it (400), not cut short
            raise ValueError(f"SamplingParams.max_tokens: the context holds {self.max_seq_len} tokens, but the request "
                             f"needs {len(ids) + params.max_tokens} ({len(ids)} in the prompt, {params.max_tokens} in "
                             f"max_tokens)")
        bad = [t for t in params.stop_token_ids or () if t >= vocab]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        stops = params.stop_strings
        return Request(next(self._ids), ids, params, text, generator=torch.Generator().manual_seed(seed),
                       stop_matcher=StopMatcher(stops) if stops else None)

    def submit(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request: Request, reason: str = "abort", error: str | None = None) -> None:
        """End a request wherever it is (waiting, prefilling, running) and return its slot. Idempotent."""
        if request.finish_reason is None:
            request.finish_reason, request.error = reason, error
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)

    def _release(self, request: Request) -> None:
        request.features = None
        if request.slot >= 0:
            self.free_slots.append(request.slot)
            request.slot = -1

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _contain(self, phase: str, requests: list[Request] | None = None) -> None:
        """Record the exception being handled; fail `requests` with it (None: the step goes on without them)."""
        self.last_error = traceback.format_exc()
        self.failures[phase] = self.failures.get(phase, 0) + 1
        log.warning("%s failed (%s)%s", phase, self.last_error.strip().splitlines()[-1],
                    f": {len(requests)} request(s) end with an error" if requests else "")
        if requests:
            message = f"{phase} failed: {self.last_error.strip().splitlines()[-1]}"
            for req in requests:
                self.abort(req, "error", message)

    # ---------------------------------------------------------------- phases

    def admit(self) -> tuple[list[Request], list[Request]]:
        """Move waiting requests into free slots and prefill their prompts (all but the last token) into the
        target's cache and, when there is a draft model, into the draft's (as serving engines do: decode steps
        then feed the draft only the tokens each step adds). Returns (admitted, failed in prefill)."""
        admitted = []
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            req.slot = self.free_slots.pop(0)
            admitted.append(req)
        failed: list[Request] = []
        # Prefill in chunks of at most prefill_chunk tokens per forward (target_ctx starts at 0).
        todo = deque(r for r in admitted if len(r.prompt_token_ids) > 1)
        while todo:
            group, budget = [], self.prefill_chunk
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
            try:
                features = self._prefill_target(group)
            except Exception:  # noqa: BLE001 - the chunk's requests fail, the rest go on
                reqs = [r for r, _ in group]
                self._contain("prefill (target)", reqs)
                failed.extend(reqs)
                todo = deque(r for r in todo if r not in reqs)
                continue
            if self.drafter is not None:
                try:
                    if features is not None:
                        self.drafter.observe([r for r, _ in group], [r.target_ctx for r, _ in group],
                                             [n for _, n in group], features)
                    if self._draft_prefill(len(self.running) + len(admitted)):
                        self._prefill_draft(group)
                except Exception:  # noqa: BLE001 - the draft catches up at the first speculative step
                    self._contain("prefill (draft)")
            for r, n in group:
                r.target_ctx += n
        ok = [r for r in admitted if not r.finished]
        self.running.extend(ok)
        return ok, failed

    def _draft_prefill(self, batch_size: int) -> bool:
        """Prefill the draft with the prompts now (the prefill phase; decode steps then feed it 1-2 tokens per
        request) unless the controller's last estimate at this batch size is a confident loss: then the draft is
        left alone and catches up on its pending chain (bounded, `_max_pending`) only if a later step speculates."""
        if self.drafter is None:
            return False
        return self.controller is None or not self.controller.expects_plain(batch_size)

    def _prefill_target(self, group: list[tuple[Request, int]]) -> torch.Tensor | None:
        """Run a prefill chunk through the target; returns the drafter's features of its tokens (or None)."""
        batch = self._chunk_batch(group)
        with self.clock.forward("target", int(batch.input_ids.numel())):
            return self._target_forward(batch)[1]

    def _target_forward(self, batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, the drafter's features of every token or None)."""
        if not self._capture:
            return self.target(batch, self.target_cache), None
        return self.target(batch, self.target_cache, capture=self._capture)

    def _prefill_draft(self, group: list[tuple[Request, int]]) -> None:
        self.drafter.prefill(group)

    @staticmethod
    def _chunk_batch(group: list[tuple[Request, int]]):
        chains = [torch.tensor(r.prompt_token_ids[r.target_ctx : r.target_ctx + n]) for r, n in group]
        starts = torch.tensor([r.target_ctx for r, _ in group])
        slots = torch.tensor([r.slot for r, _ in group])
        return chain_batch(chains, starts, slots, logits="none")

    def _send(self, packed):
        """The packed batch on the model's device (already there when the plugin's kernel packed it)."""
        if packed.packed_mask.device == self.target.device:
            return packed
        return type(packed)(**{f.name: self.link.send("packed tree", getattr(packed, f.name)) for f in fields(packed)})

    def _verify(self, reqs: list[Request], packed, logits: torch.Tensor, depth: int) -> VerifyResult:
        """Greedy, or sampling with each request's uniforms of the positions this step covers. Runs where the
        logits are (the model's device) without reading it (the tree's levels are known here); one read brings
        the accepted paths back to the host, which flattens them. depth: levels of the tree (its deepest node's
        depth + 1)."""
        sampling = uniforms = None
        if any(r.params.temperature > 0 for r in reqs):
            send = self.link.send
            vocab = logits.shape[-1]
            sampling = SamplingTensors(
                send("sampling", torch.tensor([float(r.params.temperature) for r in reqs])),
                send("sampling", torch.tensor([min(r.params.top_k, vocab) for r in reqs], dtype=torch.long)),
                send("sampling", torch.tensor([float(r.params.top_p) for r in reqs])),
            )
            u = torch.tensor([r.position_uniforms(len(r.output_token_ids), depth) for r in reqs], dtype=torch.float64)
            uniforms = send("uniforms", u)
        # the reader reads the rows it needs on one thread; the argmax reads every row on the forward's threads, which
        # pays only where every row is needed and there are many (docs/performance.md: plain steps of 64 rows)
        wide_plain = packed.total_nodes == packed.batch_size > READER_PLAIN_ROWS
        reader = None if wide_plain else self._logits_reader
        paths = verify_paths(packed, logits, sampling, position_uniforms=uniforms, max_depth=depth - 1,
                             acceptor=self._acceptor, reader=reader)
        return AcceptedPaths(*self.link.read("accepted path", paths.nodes, paths.tokens, paths.counts)).flatten()

    def _finish(self, req: Request, tokens: list[int]) -> int:
        """Append emitted tokens until a stop condition; returns how many were kept."""
        eos = set() if req.params.ignore_eos else set(self.tokenizer.eos_token_ids)
        stop_ids = set(req.params.stop_token_ids or [])
        if req.detok is None:  # the output's text, decoded a few tokens at a time (runtime.detok)
            req.detok = IncrementalText(self.tokenizer.decode)
        kept = 0
        for tok in tokens:
            req.output_token_ids.append(tok)
            kept += 1
            if tok in eos or tok in stop_ids:
                req.finish_reason = "stop"
            elif req.stop_matcher is not None:
                # the stop strings are searched in the characters this token added (the text's end that is half a
                # multi-byte character excluded: it is completed, or stays U+FFFD, with the next tokens)
                text = req.detok.text(req.output_token_ids)
                hit = req.stop_matcher.feed(text.rstrip("\ufffd"))
                if hit is not None:
                    req.text = text[:hit]
                    req.finish_reason = "stop"
                    return kept
            if req.finish_reason is None and (
                len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= self.max_seq_len
            ):
                req.finish_reason = "length"
            if req.finish_reason is not None:
                break
        req.text = req.detok.text(req.output_token_ids)
        return kept

    # ---------------------------------------------------------------- one step

    @torch.inference_mode()
    def step(self) -> StepReport:
        """One engine step: admit, decide, draft, verify, finish, commit, learn (one method per phase)."""
        self.link.take()  # this step's traffic starts here (admission and prefill included)
        _, failed = self.admit()
        reqs = list(self.running)
        if not reqs:
            return StepReport(0, 0, 0, 0, list(failed), list(failed))
        b = len(reqs)
        roots = torch.tensor([r.last_token_id for r in reqs])
        ctx = torch.tensor([r.target_ctx for r in reqs])
        slots = torch.tensor([r.slot for r in reqs])
        positions = [len(r.output_token_ids) for r in reqs]
        t_step = self.clock.now()
        decision = self._decide(reqs, float(ctx.max()))
        wanted = decision.speculate if decision is not None else self._forced is not False
        # the policy's own rule before drafting (the echo family: no budget beyond the roots means no draft)
        planned = wanted and self.policy.drafts(b, self._budget(), float(ctx.max()))
        floor = decision.min_tokens() if decision is not None and self.config.probe_floor else 0
        drafted, packed, speculated = self._draft(reqs, roots, ctx, planned, floor)
        drafter = self.drafter if speculated else None
        t_verify = self.clock.now()
        try:
            result, features, t_inputs, t_verified = self._verify_step(reqs, drafted, packed, ctx, slots)
        except Exception:  # noqa: BLE001 - a failing target fails the requests of this step, the engine goes on
            self._contain("target forward", reqs)
            return StepReport(b, 0, 0, 0, reqs + failed, reqs + failed, positions=positions)
        t_accepted = self.clock.now()
        draft_model = drafter.model_seconds if drafter is not None else 0.0
        timings = StepTimings(0.0, draft_model, t_verify - t_step - draft_model, t_verified - t_verify,
                              forward=t_verified - t_inputs, accept=t_accepted - t_verified)
        finished, keep, kept_counts = self._finish_step(reqs, result, drafted.selected.num_nodes.tolist(), failed)
        t_finished = self.clock.now()
        timings.finish = t_finished - t_accepted
        keep = self._commit_step(reqs, ctx, result, keep, features, drafter, drafted, finished)
        t_end = self.clock.now()
        timings.commit, timings.total = t_end - t_finished, t_end - t_step
        produced = int(result.cu_accepted[-1])  # before stop conditions cut anything
        followed = decision if speculated == planned == wanted else None  # the controller's choice, as it ran
        sample, prediction = self._learn(b, packed, float(ctx.max()), drafter, drafted, result, timings, produced,
                                         followed)
        return StepReport(
            batch_size=b, verified_tokens=int(packed.total_nodes), emitted_tokens=sum(kept_counts),
            drafted_tokens=int(drafted.candidates.total_nodes) - b, finished=finished, updated=reqs + failed,
            speculated=speculated, timings=timings, draft=drafted, result=result,
            request_ids=[r.request_id for r in reqs], positions=positions, emitted=kept_counts,
            draft_failed=planned and not speculated and self.drafter is not None, context=float(ctx.max()),
            traffic=self.link.take(), sample=sample, prediction=prediction, decision=followed)

    def _verify_step(self, reqs, drafted, packed, ctx, slots):
        """The target's forward over the packed trees and the acceptance: (result, features, t_inputs, t_verified).
        The contract tensors go to the model's device, the mask is built there and the logits stay there:
        verification runs beside them and only the accepted path comes back."""
        max_tokens = int((ctx + drafted.selected.num_nodes.cpu()).max())  # host values: no device read
        on_device = self._send(packed)
        # logits in the model's dtype: verification converts what it needs (core.verify.row_argmax, process_logits)
        batch = tree_batch(on_device, self.link.send("context lengths", ctx), self.link.send("slots", slots),
                           max_tokens, float_logits=False)
        t_inputs = self.clock.now()
        with self.clock.forward("target", int(packed.total_nodes)):
            logits, features = self._target_forward(batch)  # (N_tot, V) on the device
        t_verified = self.clock.now()
        result = self._verify(reqs, on_device, logits, int(drafted.selected.depths.max()) + 1)
        return result, features, t_inputs, t_verified

    def _finish_step(self, reqs, result, verified: list[int], failed: list[Request]):
        """Each request's accepted tokens through its stop conditions: (finished, keep, tokens kept per request)."""
        finished, keep, kept_counts = list(failed), [], []
        for i, (req, tokens) in enumerate(zip(reqs, result.token_lists())):
            try:
                kept = self._finish(req, tokens)
            except Exception:  # noqa: BLE001 - e.g. detokenising: only this request fails
                self._contain("finishing a request", [req])
                kept = 0
            kept_counts.append(kept)
            req.stats.steps += 1
            req.stats.emitted_per_step.append(kept)
            req.stats.verified_tokens += verified[i]
            keep.append(not req.finished)
            if req.finished:
                finished.append(req)
        return finished, keep, kept_counts

    def _commit_step(self, reqs, ctx, result, keep, features, drafter, drafted, finished) -> list[bool]:
        """The accepted tokens into the target's (and the draft's) KV, the finished requests' slots released;
        returns keep (all False where the target's commit failed: those requests end)."""
        b = len(reqs)
        try:
            self._commit(reqs, result, keep)
        except Exception:  # noqa: BLE001 - the target cache of these requests is no longer trustworthy
            self._contain("target KV commit", [r for r, k in zip(reqs, keep) if k])
            finished.extend(r for r, k in zip(reqs, keep) if k)
            keep = [False] * b
        if self.drafter is not None:
            try:
                if features is not None:  # the target's features of the tokens it has just committed
                    self._observe(reqs, ctx, result, keep, features)
                if drafter is not None:
                    drafter.commit(drafted, result, keep)
            except Exception:  # noqa: BLE001 - draft_ctx stays where it was; the next step catches up
                self._contain("draft KV commit")
        for req in finished:
            if req in self.running:
                self.running.remove(req)
            self._release(req)
        return keep

    def _decide(self, reqs: list[Request], context: float) -> Decision | None:
        """The controller's choice for this step (None without one, or during warm-up); a "forced" plain step where
        deciding failed (contained: the step runs plain). No price is a gate before the controller: a step the
        prices say cannot pay is the controller's to judge (a probe within its exploration budget, then measured
        evidence), since a gate on prices alone is never corrected by the steps it forbids."""
        if self.controller is None or self._forced is not None:
            return None
        b = len(reqs)
        try:
            # what the draft would read first, each chain bounded as `begin` bounds it (read only for a probe)
            return self.controller.decide(b, context, lambda: self.drafter.catch_up(reqs, self._max_pending(b)))
        except Exception:  # noqa: BLE001 - speculation is an optimisation: this step runs plain
            self._contain("speculation decision")
            return Decision(False, "forced", b)

    def _learn(self, b: int, packed, context: float, drafter, drafted: DraftResult, result: VerifyResult,
               timings: StepTimings, produced: int, decision: Decision | None):
        """The step as a `StepSample` for the online cost model, the controller and the policy's acceptance
        estimates. decision: the controller's, when the step ran as it chose (not a draft failure, nor a step the
        policy ran plain). Returns (sample, the model's prediction for it) or (None, None) without a model."""
        if self.step_cost is None or self._cold:
            return None, None
        try:
            return self._learn_from(b, packed, context, drafter, drafted, result, timings, produced, decision)
        except Exception:  # noqa: BLE001 - learning is an optimisation: the step's output stands
            self._contain("learning from a step")
            return None, None

    def _learn_from(self, b: int, packed, context: float, drafter, drafted: DraftResult, result: VerifyResult,
                    timings: StepTimings, produced: int, decision: Decision | None):
        forwards = tuple(t for t in drafter.forward_tokens if t > 0) if drafter is not None else ()
        sample = StepSample(b, int(packed.total_nodes), context, forwards, timings.drafting,
                            max(timings.total - timings.drafting, 0.0),
                            min(drafter.catch_up_tokens, forwards[0]) if forwards else 0)
        # the warm-up's steps price the speculative step's constants only (`StepCostModel.observe`): the load measured
        # the forwards
        prediction = self.step_cost.observe(sample, forwards=self._forced is None) if self.adapt else StepPrediction(
            *self.step_cost.predict_phases(sample), sample.drafting_seconds, sample.verification_seconds)
        if self.controller is not None:
            if self._forced is None:
                self.controller.observe(sample, produced, decision)
            else:  # warm-up: its speculative steps are the controller's first evidence, nothing more
                self.controller.record(sample, produced)
        if forwards and self._forced is None and self.adapt:
            self.policy.learn(drafted.selected, result.accepted_node_ids)
        return sample, prediction

    def _draft(self, reqs: list[Request], roots: torch.Tensor, ctx: torch.Tensor, speculate: bool,
               min_tokens: int = 0):
        """The step's Super-Tree and its packed batch: (DraftResult, PackedVerifyBatch, speculated). Falls back to
        plain AR when the draft side fails (the requests go on). min_tokens: the selection's floor (a probe's,
        `Decision.min_tokens`)."""
        failed = False
        if speculate and self.drafter is not None:
            try:
                self.drafter.begin(reqs, self.policy.max_children, self._max_pending(len(reqs)))
                budget = self._budget()
                if self.policy.beam_frontier:  # the loop on the draft's device, one read per sync point
                    # packed in the same host-library call as the selection where the host library packs
                    drafted = draft_tree_batched(self.policy, roots, self.drafter, budget, None, float(ctx.max()),
                                                 read=lambda *t: self.link.read("draft levels", *t),
                                                 send=lambda t: self.link.send("draft rows", t),
                                                 sync_every_level=self.sync_every_level, min_tokens=min_tokens,
                                                 context_lengths=ctx if self._pack_backend == "host" else None)
                else:
                    drafted = draft_tree(self.policy, roots, self.drafter.draft_fn, budget, None, float(ctx.max()),
                                         min_tokens)
                packed = drafted.packed if drafted.packed is not None else self._pack(drafted.selected, ctx)
                return drafted, packed, True
            except Exception:  # noqa: BLE001 - drafting is an optimisation: this step runs as plain AR
                self._contain("drafting")
                failed = True
        drafted = draft_tree(self._ar_policy, roots, None, None)  # the ar policy: a plain step or a failure
        # after a failure packed on the host: the failure may have been the device's packing kernel
        return drafted, pack(drafted.selected, ctx) if failed else self._pack(drafted.selected, ctx), False

    def _budget(self) -> int | None:
        """The step's global verification budget (the echo family), None for per-request policies."""
        return min(self.config.k_max, self.max_num_tokens) if self.policy.shares_budget else None

    def _observe(self, reqs: list[Request], ctx: torch.Tensor, result, keep: list[bool], features) -> None:
        """Hand the drafter the verification forward's features of each kept request's accepted path (root and
        accepted drafts: the tokens ctx, ctx + 1, ... the target has now committed)."""
        counts = torch.diff(result.cu_accepted)
        ids = result.accepted_node_ids
        kept = [i for i, k in enumerate(keep) if k]
        if len(kept) < len(keep):  # the rows of the requests that go on
            ids = ids[torch.repeat_interleave(torch.tensor(keep), counts)]
        rows = self.link.send("accepted path", ids)  # the store takes features[rows] (one copy on the CPU)
        starts, counts = ctx.tolist(), counts.tolist()
        self.drafter.observe([reqs[i] for i in kept], [starts[i] for i in kept], [counts[i] for i in kept], features,
                             rows)

    def _max_pending(self, batch_size: int) -> int | None:
        """Catch-up bound for the draft (drafter module docstring): the longest pending chain per request whose
        draft forward the prices put at no more than one plain step (at least MIN_PENDING; None without prices)."""
        cost = self.prices
        if cost is None:
            return None
        step = float(cost.verify_time(batch_size, None, batch_size))
        w = MIN_PENDING
        while w < self.max_seq_len and float(cost.draft_time(2 * w * batch_size)) <= step:
            w *= 2
        return w

    # ---------------------------------------------------------------- warm-up

    @torch.inference_mode()
    def warm_up(self, prompt: list[int], steps: int = 3, batch_sizes: tuple[int, ...] = (1, 4)) -> int:
        """Real steps before the first request, so the online prices know what a speculative step's drafting and
        host work cost (not only the forwards measured at load): at each batch size (capped at max_batch_size), one
        speculative and one plain step that are not learnt from (they pay one-off costs of a cold start), then
        `steps` speculative and `steps` plain steps of copies of `prompt`, greedy, discarded. The cost model learns
        the speculative step's constants from them (the forward curves and the per-request term stay as the load
        measured them: `StepCostModel.observe`), and
        the controller keeps the speculative ones as its first evidence (the oldest: the traffic's
        own steps outweigh them within a few dozen); the acceptance estimates learn from the traffic only. Returns
        the steps run. A no-op without prices or a drafter, or while requests are waiting or running."""
        if self.step_cost is None or self.drafter is None or self.has_work or not self.adapt:
            return 0
        ran = 0
        params = SamplingParams(max_tokens=8 * (steps + 1), temperature=0.0, ignore_eos=True)
        try:
            for b in sorted({min(max(1, x), self.max_batch_size) for x in batch_sizes}):
                # ids below zero: the requests users submit keep theirs from 0
                reqs = [Request(-1 - i, list(prompt), params, None, generator=torch.Generator().manual_seed(i))
                        for i in range(b)]
                for r in reqs:
                    self.submit(r)
                for k, forced in enumerate([True, False] * (steps + 1)):
                    self._forced = forced
                    if not self.has_work:
                        break
                    self._cold = k < 2  # the first of each kind pays one-off costs (allocation, kernel choice)
                    self.step()
                    ran += 1
                for r in reqs:
                    self.abort(r)
        finally:
            self._forced, self._cold = None, False
        return ran

    def _pack(self, selected, ctx: torch.Tensor):
        """Flatten & pack where the plugin's kernels run (echo_trtllm.kernels.backend_for): with CUDA models on the
        device (the result stays there for the target), with CPU models in the host library when it is built;
        otherwise the core."""
        if self._pack_backend != "torch":
            dev = self.target.device
            return kernels.pack(selected.to(dev), ctx.to(dev), backend=self._pack_backend)
        return pack(selected, ctx)

    def _commit(self, reqs: list[Request], result, keep: list[bool]) -> None:
        """Target KV: move the accepted path (root, accepted drafts) to ctx, ctx+1, ...; drop the rest."""
        src, dst, slots, new_ctx = [], [], [], []
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
            new_ctx.append((req, req.target_ctx + len(path)))
        if src:
            self.target_cache.compact(torch.tensor(slots), torch.tensor(src), torch.tensor(dst))
        for req, c in new_ctx:
            req.target_ctx = c
