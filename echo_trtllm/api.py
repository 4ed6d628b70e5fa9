"""The user-facing API, named as in TensorRT-LLM's LLM API.

    from echo_trtllm import LLM, SamplingParams, EchoConfig
    llm = LLM()                                     # the embedded default target/draft pair, policy "echo"
    outputs = llm.generate(["To be, or not"], SamplingParams(max_tokens=32, temperature=0))
    print(outputs[0].text, outputs[0].stats.mean_accepted_tokens)

Every argument is checked before anything is loaded or submitted; a bad one raises ValueError / TypeError naming
the argument and what is accepted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence, Union

import torch

from echo_trtllm.core.config import EchoConfig
from echo_trtllm.core.cost import CostModel
from echo_trtllm.core.policies import make_policy, policy_class
from echo_trtllm.engine_dir import read_engine
from echo_trtllm.models import DEFAULT_TARGET, default_drafter
from echo_trtllm.models.draft import load_draft
from echo_trtllm.models.eagle3 import Eagle3Head
from echo_trtllm.models.llama import CausalLM
from echo_trtllm.models.invariant import is_batch_invariant, make_batch_invariant
from echo_trtllm.models.packed import prepack_linears
from echo_trtllm.models.weight_int8 import apply_draft_quantization, check_draft_quantization, is_w8a16
from echo_trtllm.models.loader import DTYPE_CHOICES, Tokenizer, check_model_path, check_same_vocabulary, load_model
from echo_trtllm.runtime.calibrate import LOAD_REPEATS, Calibration, measure_cost_model
from echo_trtllm.runtime.clock import Clock
from echo_trtllm.runtime.engine import CompletionOutput, EngineLoop, GenerationHandle, RequestOutput
from echo_trtllm.runtime.executor import Executor, StepReport, check_limits, default_max_num_tokens
from echo_trtllm.runtime.request import RequestStats, SamplingParams, _is_int

__all__ = ["LLM", "SamplingParams", "EchoConfig", "RequestOutput", "CompletionOutput", "RequestStats", "FALLBACK_MODES",
           "ENGINE_LOST", "DEFAULT_MAX_BATCH_SIZE"]

# what the servers say when `LLM.is_alive` turns False (/health, refused requests, the exit message)
ENGINE_LOST = "the engine cannot serve (it has stopped, or a tensor-parallel rank is gone)"

# the command-line spelling of LLM(fallback=...): the AR fallback as the default has it, for every method, never
FALLBACK_MODES = {"auto": "auto", "on": True, "off": False}

Prompt = Union[str, Sequence[int]]
ModelSource = Union[str, Path, CausalLM]
DraftSource = Union[str, Path, CausalLM, Eagle3Head]


def _is_token_ids(value) -> bool:
    """One prompt given as token ids: a non-empty list / tuple of integers (numpy's included: `list(array)`)."""
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(_is_int(t) for t in value)


def _positive_int(name: str, value, minimum: int = 1, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        accepted = f"an integer >= {minimum}" + (" or None" if allow_none else "")
        raise ValueError(f"{name} must be {accepted}, got {value!r}")


def _check_source(name: str, source) -> None:
    if isinstance(source, CausalLM) or (name == "draft_model" and isinstance(source, Eagle3Head)):
        return
    if not isinstance(source, (str, Path)):
        raise TypeError(f"{name} must be a path (HF model directory or .gguf file) or a CausalLM, got "
                        f"{type(source).__name__}")
    check_model_path(source, name)


# what the engine runs at load to price real steps (any text works: only the steps' costs are kept)
WARM_UP_TEXT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


DEFAULT_MAX_BATCH_SIZE = 64  # requests in the batch at most, unless told (the CLI's --max-batch-size too)


def default_max_batch_size(config: EchoConfig, shares_budget: bool, tree_room: int, max_num_tokens: int | None) -> int:
    """LLM's max_batch_size when none is given: DEFAULT_MAX_BATCH_SIZE, or fewer where the speculation config could
    not run that many (the echo family's K_max must hold every request's root; a fixed-shape tree policy's step of
    full trees must fit max_num_tokens, by default the executor's)."""
    tokens = max_num_tokens or default_max_num_tokens(config)
    limit = config.k_max if shares_budget else tokens // tree_room
    return max(1, min(DEFAULT_MAX_BATCH_SIZE, limit, tokens))


def _check_options(*, max_batch_size, tensor_parallel_size, max_seq_len, max_num_tokens, iter_stats_max_iterations,
                   cost_model, fallback, adapt, batch_invariant, tokenizer, device, draft_quantization) -> None:
    """LLM's scalar arguments, each refused by name before anything loads."""
    _positive_int("max_batch_size", max_batch_size, allow_none=True)
    _positive_int("tensor_parallel_size", tensor_parallel_size)
    _positive_int("max_seq_len", max_seq_len, minimum=2, allow_none=True)
    _positive_int("max_num_tokens", max_num_tokens, allow_none=True)
    _positive_int("iter_stats_max_iterations", iter_stats_max_iterations, minimum=0)
    if not (isinstance(cost_model, CostModel) or cost_model is None or cost_model == "auto"):
        raise ValueError(f"cost_model must be 'auto', a CostModel or None, got {cost_model!r}")
    if not (fallback is True or fallback is False or fallback == "auto"):
        raise ValueError(f"fallback must be 'auto', True or False, got {fallback!r}")
    if adapt is not True and adapt is not False:
        raise ValueError(f"adapt must be True or False, got {adapt!r}")
    if batch_invariant is not True and batch_invariant is not False:
        raise ValueError(f"batch_invariant must be True or False, got {batch_invariant!r}")
    if batch_invariant and tensor_parallel_size > 1:
        raise ValueError("batch_invariant=True runs on one device: tensor_parallel_size must be 1")
    if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer must be an echo_trtllm.models.loader.Tokenizer, got {type(tokenizer).__name__}")
    if device is not None:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device must be a torch device string such as 'cpu' or 'cuda:0', got {device!r}") from None
        if dev.type == "cuda" and not (torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()):
            raise ValueError(f"device {device!r}: no such CUDA device here ({torch.cuda.device_count()} visible)")
    check_draft_quantization(draft_quantization, device, None)
    if draft_quantization is not None and tensor_parallel_size > 1:
        raise ValueError(f"draft_quantization={draft_quantization!r} runs on one device: tensor_parallel_size "
                         f"must be 1")


def _resolve_sources(model, draft_model, engine_dir, dtype, speculative_config, calibration):
    """(model, draft_model, dtype, EchoConfig, Calibration or None): an engine directory's own, or the arguments',
    with the embedded pair as the default; each checked by name."""
    if engine_dir is not None:
        if model is not None or draft_model is not None:
            raise ValueError("give either engine_dir or model/draft_model, not both")
        spec = read_engine(engine_dir)
        model, draft_model, engine_dtype = spec.target, spec.draft, spec.dtype
        dtype = engine_dtype if dtype == "auto" else dtype
        speculative_config = speculative_config or spec.config
        calibration = calibration if calibration is not None else spec.calibration
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    if model is None:
        model = DEFAULT_TARGET
        if draft_model is None:
            draft_model = default_drafter()
    _check_source("model", model)
    if draft_model is not None:
        _check_source("draft_model", draft_model)
    config = speculative_config or EchoConfig()
    if not isinstance(config, EchoConfig):
        raise TypeError(f"speculative_config must be an EchoConfig, got {type(config).__name__}")
    if calibration is not None and not isinstance(calibration, Calibration):
        if not isinstance(calibration, (str, Path)):
            raise TypeError(f"calibration must be a path or a Calibration, got {type(calibration).__name__}")
        calibration = Calibration.load(calibration)
    return model, draft_model, dtype, config, calibration


class LLM:
    """Target + draft model pair behind an in-flight-batching executor running on a background thread.

    model / draft_model: HF model directories, .gguf files, or loaded `CausalLM`s (a draft must share the
    target's tokenizer). draft_model may also be an EAGLE-3 head for the target: a directory as the EAGLE /
    SpecForge repositories write them (config.json with `LlamaForCausalLMEagle3` + safetensors) or a loaded
    `Eagle3Head`; it drafts from the target's own hidden states (docs/eagle3.md). engine_dir: a directory built by
    `echo-trtllm build` (engine.json names both models and the EchoConfig). With neither, the embedded default
    target, drafting with its committed EAGLE-3 head (`models.default_drafter`).

    dtype: "auto" (bfloat16 on CUDA; on a CPU bfloat16 where it has bf16 matrix instructions, AMX-BF16 or
    AVX512-BF16, else float32: a rule, the same on every start; docs/dtype.md), "float32", "bfloat16", "float16".

    max_batch_size: requests in the batch at most (their KV is allocated up front); None: 64, or fewer where the
    speculation config cannot run 64 (`default_max_batch_size`). The CLI's --max-batch-size has the same default.

    Speculation under load (echo family): each step's budget K and the gate's break-even probability come from
    prices learned online from the engine's own steps (`core.prices.StepCostModel`, warm-started by a cost curve
    and a few real steps at load), and a controller runs plain AR steps where measured speculation does not pay
    beyond its uncertainty (`core.controller.SpeculationController`). calibration: a file (or `Calibration`)
    written by `echo-trtllm calibrate` (an engine directory's own is used when none is given): its cost curve and
    its gate samples (the prior of the acceptance estimates, which are re-learned as traffic goes). cost_model:
    "auto" (the calibration's curve, else one measured at load, a few seconds), a `CostModel`, or None (no prices,
    no fallback: the fixed K_max of the config every step, for ablations). clock: where step times come from
    (default wall time; `ModelledClock` for tests). fallback: the AR fallback: "auto" (the echo family with a cost
    model), True (every drafting policy, the fixed-shape baselines too), False (never: "pure", every step drafts
    and the policy's own rules choose its tree; how the fair benchmark judges allocation).

    iter_stats_max_iterations: keep this many per-step reports for `get_stats()` (0 = none).

    adapt: learn prices and acceptance from the engine's own steps (default True). False is the ablation without
    it: the budget rule and the gate read the load-time (or calibration's) cost model and acceptance, fixed.

    tensor_parallel_size: shard the target and a separate draft model over this many ranks (one process each,
    torch.distributed: gloo on CPU, NCCL on CUDA; docs/scale-out.md); an EAGLE-3 head is not sharded: rank 0 runs
    it, whole, on the features the sharded target's forward returns (with its own copy of the target's token
    embedding). This process is rank 0 and runs the one control plane; it spawns the other ranks itself, or, under
    `torchrun`, ranks > 0 serve rank 0 from inside `LLM(...)` and leave the process (exit status 0) when it shuts
    down. Needs model paths (each rank loads only its shard).

    batch_invariant: every request's logits the same bits whatever else is in the batch and however many tokens a
    step verifies (models/invariant.py: linears on fixed row tiles, attention over each token's own positions in a
    fixed order), so greedy and seeded output is the same alone, in any batch and under any policy, in bfloat16 as
    in float32; it costs speed (docs/performance.md). One device only. A loaded model passed in is switched in place
    and stays so (`batch_invariant` then reads True for every LLM built on it).

    draft_quantization: None, or "w8a16" (TensorRT-LLM's name: int8 weights, 16-bit activations): the draft's
    products of one to four rows (a one-row step's draft forwards) read an int8 copy of its weights, one scale per
    output channel, half the bytes (models/weight_int8.py); wider ones the bfloat16 weights as before. Needs a
    bfloat16 draft on the CPU, one device. Only proposals change: verification decides every emitted token. A loaded
    draft passed in is switched in place and stays so (`draft_quantization` reads "w8a16" for every LLM built on it).
    """

    def __init__(
        self,
        model: ModelSource | None = None,
        draft_model: DraftSource | None = None,
        *,
        engine_dir: str | Path | None = None,
        speculative_config: EchoConfig | None = None,
        tokenizer: Tokenizer | None = None,
        max_batch_size: int | None = None,
        max_seq_len: int | None = 1024,
        max_num_tokens: int | None = None,
        dtype: str = "auto",
        device: str | None = None,
        calibration: "str | Path | Calibration | None" = None,
        cost_model: "CostModel | str | None" = "auto",
        clock: Clock | None = None,
        iter_stats_max_iterations: int = 0,
        fallback: "bool | str" = "auto",
        tensor_parallel_size: int = 1,
        adapt: bool = True,
        batch_invariant: bool = False,
        draft_quantization: str | None = None,
    ) -> None:
        _check_options(max_batch_size=max_batch_size, tensor_parallel_size=tensor_parallel_size,
                       max_seq_len=max_seq_len, max_num_tokens=max_num_tokens,
                       iter_stats_max_iterations=iter_stats_max_iterations, cost_model=cost_model, fallback=fallback,
                       adapt=adapt, batch_invariant=batch_invariant, tokenizer=tokenizer, device=device,
                       draft_quantization=draft_quantization)
        self.batch_invariant = batch_invariant
        fallback = None if fallback == "auto" else fallback
        model, draft_model, dtype, config, calibration = _resolve_sources(
            model, draft_model, engine_dir, dtype, speculative_config, calibration)
        self.calibration = calibration
        policy = policy_class(config)
        if draft_quantization is not None and not policy.needs_draft_model:
            raise ValueError(f"draft_quantization={draft_quantization!r} quantises the draft; policy "
                             f"{config.policy!r} runs none")
        self._draft_quantization = draft_quantization
        gate_samples = calibration.gate_samples() if calibration is not None and policy.shares_budget else None
        # a calibration for another max_depth is refused here, before loading
        tree_room = make_policy(config, None, gate_samples).max_tree_nodes
        if max_batch_size is None:
            max_batch_size = default_max_batch_size(config, policy.shares_budget, tree_room, max_num_tokens)
        check_limits(config, max_batch_size, has_draft=draft_model is not None or not policy.needs_draft_model)

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        check_draft_quantization(draft_quantization, device, dtype)  # the device and dtype resolved, nothing loaded
        self._tp_group = None
        if draft_model is not None and not policy.needs_draft_model:
            draft_model = None
        target, draft = self._load_pair(model, draft_model, tokenizer, dtype, device, tensor_parallel_size)
        try:
            self._start(target, draft, config, calibration, policy, cost_model, fallback, max_batch_size,
                        max_seq_len, max_num_tokens, gate_samples, clock, iter_stats_max_iterations, adapt)
        except BaseException:
            self._close_group()
            raise

    def _load_pair(self, model, draft_model, tokenizer, dtype, device, tensor_parallel_size):
        """The target and the draft (or None) on `device`, sharded over the ranks when tensor_parallel_size > 1;
        sets self.tokenizer."""
        if tensor_parallel_size > 1:
            target, target_tok, draft = self._load_parallel(model, draft_model, dtype, device, tensor_parallel_size)
            self.tokenizer = tokenizer or target_tok
            return target, draft
        target, target_tok = self._load(model, dtype, device)
        self.tokenizer = tokenizer or target_tok
        if self.tokenizer is None:
            raise ValueError("a loaded CausalLM needs tokenizer=... (a Tokenizer from echo_trtllm.models.loader)")
        draft = None if draft_model is None else load_draft(draft_model, target, dtype, device, self.tokenizer)
        return target, draft

    def _start(self, target, draft, config, calibration, policy, cost_model, fallback, max_batch_size, max_seq_len,
               max_num_tokens, gate_samples, clock, iter_stats_max_iterations, adapt) -> None:
        self.config = config
        self.target, self.draft = target, draft
        for model in (target, draft):  # bfloat16 linears run oneDNN's prepacked kernels (models/packed.py)
            if model is not None:
                prepack_linears(model)
        if is_w8a16(target):  # a draft quantised by another LLM, now a target: its tokens would not be its own
            raise ValueError("model: its few-row products run int8 copies (it was given draft_quantization='w8a16' "
                             "as a draft); load it again to use it as a target")
        if draft is not None and self._draft_quantization is not None:
            shared = {id(p) for p in target.parameters()} & {id(p) for p in draft.parameters()}
            if shared:
                raise ValueError(f"draft_quantization={self._draft_quantization!r}: the draft shares {len(shared)} "
                                 f"weights with the target, whose products would run int8 too; give a separate draft")
            apply_draft_quantization(draft, self._draft_quantization)  # few-row products on int8 copies
        self.draft_quantization = "w8a16" if draft is not None and is_w8a16(draft) else None
        if self.batch_invariant:  # the target's logits; the draft only proposes (verification decides the tokens)
            make_batch_invariant(target)
        self.batch_invariant = is_batch_invariant(target)  # a model switched earlier, in place, stays so
        self.dtype = {"target": str(target.dtype).removeprefix("torch."),
                      "draft": str(draft.dtype).removeprefix("torch.") if draft is not None else None}
        self.cost_model = self._cost_model(cost_model, calibration, policy, target, draft, fallback)
        self.executor = Executor(target, draft, self.tokenizer, config, max_batch_size, max_seq_len, max_num_tokens,
                                 cost_model=self.cost_model, gate_samples=gate_samples, clock=clock, fallback=fallback,
                                 adapt=adapt)
        # a few real steps, speculative and plain, so the online prices know drafting and host work before the
        # first request (Executor.warm_up; nothing without prices)
        self.executor.warm_up(self.tokenizer.encode(WARM_UP_TEXT))
        self._loop = EngineLoop(self.executor, iter_stats_max_iterations)

    def _load_parallel(self, model, draft_model, dtype: str, device: str, world: int):
        """Start the tensor-parallel group (runtime/parallel.py) and load the shards on every rank."""
        from echo_trtllm.models.eagle3 import is_eagle3_dir, load_eagle3, read_eagle3_config
        from echo_trtllm.models.loader import load_tokenizer, resolve_dtype
        from echo_trtllm.models.tp import check_shardable, check_shardable_source, load_embedding, read_config
        from echo_trtllm.runtime import parallel

        for name, source in (("model", model), ("draft_model", draft_model)):
            if source is not None and not isinstance(source, (str, Path)):
                raise ValueError(f"tensor_parallel_size > 1 needs {name} as a path (each rank loads only its "
                                 f"shard), got a loaded {type(source).__name__}")
        # an EAGLE-3 head is not sharded: the leader runs it on the features every rank's forward ends with
        eagle3 = draft_model is not None and is_eagle3_dir(draft_model)
        dev = torch.device(device)
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"tensor_parallel_size > 1 runs on 'cpu' (gloo) or 'cuda' (NCCL), got device {device!r}")
        if dev.type == "cuda" and (dev.index is not None or world > torch.cuda.device_count()):
            raise ValueError(f"tensor_parallel_size={world} on CUDA puts rank r on cuda:r: pass device='cuda' (not an "
                             f"index) with at most {torch.cuda.device_count()} ranks (the visible GPUs)")
        config = None
        for name, source in (("model", model), ("draft_model", draft_model)):
            if source is None or (eagle3 and name == "draft_model"):
                continue
            try:
                check_shardable_source(source, world)
                cfg = read_config(source)
                check_shardable(cfg, world)
            except ValueError as e:
                raise ValueError(f"{name} {str(source)!r}: {e}") from None
            config = config or cfg
        if eagle3:  # the head is read on rank 0 only, after the shards: its fit is checked before any rank starts
            read_eagle3_config(draft_model, config)
        dt = resolve_dtype(dtype, device, config)
        sharded_draft = draft_model is not None and not eagle3
        specs = [("target", str(model))] + ([("draft", str(draft_model))] if sharded_draft else [])
        group = parallel.start(world, device, specs, dt)
        self._tp_group = group
        try:
            dt = group.agree(dt) if not group.processes and group.world > 1 else dt  # torchrun: the leader's
            target = group.load("target", model, dt)
            draft = group.load("draft", draft_model, dt) if sharded_draft else None
            if not group.is_leader:  # torchrun: this rank serves rank 0 until it shuts down, then leaves
                parallel.ignore_stop_signals()
                group.serve()
                self._close_group()
                raise SystemExit(0)
            tok = load_tokenizer(model, target.config)
            if draft is not None:
                check_same_vocabulary(tok, load_tokenizer(draft_model, draft.config))
            if eagle3:
                draft = load_eagle3(draft_model, target, dt, embed_tokens=load_embedding(model, dt, target.device))
        except BaseException:
            self._close_group()
            raise
        return target, tok, draft

    def _close_group(self) -> None:
        """Close the tensor-parallel group once nothing runs on it: now if the engine thread has ended (or never
        started), else from that thread as it ends, the spawned ranks killed first so it cannot stay blocked."""
        group, self._tp_group = getattr(self, "_tp_group", None), None
        if group is None:
            return
        loop = getattr(self, "_loop", None)
        if loop is None or loop.ended:
            group.close()
        else:
            loop.on_exit.append(group.close)
            if loop.ended:  # it ended between the two checks: its hooks have run
                group.close()
            else:
                group.abandon("the LLM was shut down while the engine was still inside a step")

    @property
    def tensor_parallel_stats(self) -> list[dict] | None:
        """Every rank's weight bytes per model (None without tensor parallelism)."""
        return None if self._tp_group is None else self._tp_group.all_stats()

    @staticmethod
    def _load(source: ModelSource, dtype: str, device: str) -> tuple[CausalLM, Tokenizer | None]:
        if isinstance(source, CausalLM):
            return source, None
        return load_model(source, dtype=dtype, device=device)

    @staticmethod
    def _cost_model(choice, calibration, policy, target, draft, fallback) -> CostModel | None:
        """The echo family's cost curve, or any drafting policy's with fallback=True (see the class docstring);
        None for policies that do not use one."""
        if not policy.uses_cost_curve(fallback) or draft is None or choice is None:
            return None
        if isinstance(choice, CostModel):
            return choice
        if calibration is not None:
            return calibration.cost_model
        return measure_cost_model(target, draft, repeats=LOAD_REPEATS)

    # ---------------------------------------------------------------- generation

    def _requests(self, prompts, sampling_params):
        """Validate and tokenise every prompt (nothing is submitted until all are good)."""
        single = isinstance(prompts, str) or _is_token_ids(prompts)
        if single:
            plist = [prompts]
        elif isinstance(prompts, (list, tuple)):
            plist = list(prompts)
        else:
            raise TypeError(f"prompts must be a string, a list of token ids, or a list of those, got "
                            f"{type(prompts).__name__}")
        if not plist:
            raise ValueError("prompts is empty: give a string, a list of token ids, or a list of those")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
            if len(params) != len(plist):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(plist)} prompts")
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(plist)
        else:
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                            f"{type(sampling_params).__name__}")
        reqs = []
        for i, (p, sp) in enumerate(zip(plist, params)):
            try:
                reqs.append(self.executor.make_request(p, sp))
            except (ValueError, TypeError) as e:
                raise type(e)(e if single else f"prompt {i}: {e}") from None
        return single, reqs

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> RequestOutput | list[RequestOutput]:
        """Generate for one prompt (returns one RequestOutput) or a list (returns a list, in order). Every prompt
        is validated before any is submitted; a bad one raises naming its index. If the wait is interrupted
        (KeyboardInterrupt), the call's requests are aborted."""
        single, reqs = self._requests(prompts, sampling_params)
        handles = self._loop.submit(reqs)
        try:
            outputs = self._wait(handles, bool(use_tqdm) and not single)
        except BaseException:
            for h in handles:
                h.abort()
            raise
        return outputs[0] if single else outputs

    def _wait(self, handles: list[GenerationHandle], progress: bool) -> list[RequestOutput]:
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(handles), desc="Processed prompts", unit="req")
        outputs = []
        for h in handles:
            outputs.append(h.result())
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return outputs

    def generate_async(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, streaming: bool = False
    ) -> GenerationHandle:
        """Submit one request without waiting for a step; returns a handle: `.result()` / `await .aresult()`,
        or iterate it (for / async for) when streaming; `.abort()` cancels it."""
        if not (isinstance(prompt, str) or _is_token_ids(prompt)):
            raise TypeError(f"generate_async takes one prompt (a string or a list of token ids), got "
                            f"{type(prompt).__name__}")
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        _, reqs = self._requests(prompt, sampling_params)
        return self._loop.submit(reqs, streaming=streaming)[0]

    def abort(self, request_id: int) -> None:
        """Cancel a request (finish_reason "abort"); its KV slot is freed. Unknown or finished ids are ignored."""
        self._loop.abort(request_id)

    def get_stats(self) -> list[StepReport]:
        """Per-step reports since the last call (needs iter_stats_max_iterations > 0)."""
        return self._loop.get_stats()

    def add_step_listener(self, listener) -> None:
        """Call `listener(report: StepReport)` on the engine thread after every step (quick, must not raise)."""
        self._loop.add_listener(listener)

    def speculation_stats(self) -> dict | None:
        """The online cost model's median relative error over its last 256 steps and, with the AR fallback, what the
        speculation controller did since load (`core.controller.ControllerStats`: steps, speculative steps, probes,
        tokens, the exploration's measured loss and gain in tokens, its share), its exploration credit (that of
        the batch-size bucket of its last decision or step) and its last estimate of speculative over plain tokens a
        second (`SpeculationController.last_estimate`); None without prices. A snapshot read from another thread."""
        ex = self.executor
        if ex.step_cost is None:
            return None
        out = {"step_prediction_error": ex.step_cost.median_relative_error(256)}
        if ex.controller is not None:
            out.update(ex.controller.stats.as_dict(), credit=ex.controller.credit,
                       last_estimate=ex.controller.last_estimate())
        return out

    @property
    def max_batch_size(self) -> int:
        """Requests the engine runs at once (its KV slots)."""
        return self.executor.max_batch_size

    @property
    def max_seq_len(self) -> int:
        """Tokens one request holds, prompt included (the context a server enforces)."""
        return self.executor.max_seq_len

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary: token ids (prompts, stop ids, end ids) lie in [0, vocab_size)."""
        return self.target.config.vocab_size

    @property
    def is_alive(self) -> bool:
        """The engine can serve: its thread runs and takes work, and (tensor parallel) its group is whole. False for
        good once a rank is gone: every later request would fail (servers answer /health with 503 then)."""
        group = self._tp_group
        return self._loop.alive and (group is None or group.healthy)

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting) requests in the executor now (a snapshot from another thread)."""
        ex = self.executor
        return len(ex.running), len(ex.waiting)

    def shutdown(self) -> None:
        self._loop.shutdown()
        self._close_group()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        # An LLM dropped without shutdown(): the engine thread holds the loop, not the LLM, so stop it here
        # (without waiting: it ends after its current step, ending what is left with an error).
        loop = getattr(self, "_loop", None)
        if loop is not None:
            loop.shutdown(timeout=0)
        if getattr(self, "_tp_group", None) is not None:
            group = self._tp_group
            if loop is None:
                self._close_group()
            else:  # the engine thread closes it as it ends (shutdown above asked it to)
                loop.on_exit.append(group.close)
                if loop.ended:
                    group.close()

