"""The user-facing API, named as in TensorRT-LLM's LLM API.

    from echo_trtllm import LLM, SamplingParams, EchoConfig
    llm = LLM()                                     # the embedded default target/draft pair, policy "echo"
    outputs = llm.generate(["To be, or not"], SamplingParams(max_tokens=32, temperature=0))
    print(outputs[0].text, outputs[0].stats.mean_accepted_tokens)
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence, Union

import torch

from echo_trtllm.core.config import EchoConfig
from echo_trtllm.engine_dir import read_engine
from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET
from echo_trtllm.models.llama import CausalLM
from echo_trtllm.models.loader import Tokenizer, check_same_vocabulary, load_model
from echo_trtllm.runtime.calibrate import Calibration
from echo_trtllm.runtime.engine import CompletionOutput, EngineLoop, GenerationHandle, RequestOutput
from echo_trtllm.runtime.executor import Executor, check_limits
from echo_trtllm.runtime.request import RequestStats, SamplingParams

__all__ = ["LLM", "SamplingParams", "EchoConfig", "RequestOutput", "CompletionOutput", "RequestStats"]

Prompt = Union[str, Sequence[int]]
ModelSource = Union[str, Path, CausalLM]


def _is_single_prompt(prompts) -> bool:
    return isinstance(prompts, str) or (
        isinstance(prompts, (list, tuple)) and len(prompts) > 0 and all(isinstance(t, int) for t in prompts)
    )


class LLM:
    """Target + draft model pair behind an in-flight-batching executor running on a background thread.

    model / draft_model: HF model directories, .gguf files, or loaded `CausalLM`s (a draft must share the
    target's tokenizer). engine_dir: a directory built by `echo-trtllm build` (engine.json names both models and
    the EchoConfig). With neither, the embedded default pair is used. calibration: a file (or `Calibration`)
    written by `echo-trtllm calibrate`; an engine directory's own calibration is used when none is given. A
    calibration sets the gate (depths, tau_d) and lets the echo family pick each step's budget from the measured
    cost curve, falling back to plain AR by itself when speculation does not pay.
    """

    def __init__(
        self,
        model: ModelSource | None = None,
        draft_model: ModelSource | None = None,
        *,
        engine_dir: str | Path | None = None,
        speculative_config: EchoConfig | None = None,
        tokenizer: Tokenizer | None = None,
        max_batch_size: int = 16,
        max_seq_len: int | None = 1024,
        max_num_tokens: int | None = None,
        dtype: str = "float32",
        device: str | None = None,
        calibration: "str | Path | Calibration | None" = None,
    ) -> None:
        if engine_dir is not None:
            if model is not None or draft_model is not None:
                raise ValueError("give either engine_dir or model/draft_model, not both")
            spec = read_engine(engine_dir)
            model, draft_model, dtype = spec.target, spec.draft, spec.dtype
            speculative_config = speculative_config or spec.config
            calibration = calibration if calibration is not None else spec.calibration
        if model is None:
            model = DEFAULT_TARGET
            if draft_model is None:
                draft_model = DEFAULT_DRAFT
        config = speculative_config or EchoConfig()
        if not isinstance(config, EchoConfig):
            raise TypeError(f"speculative_config must be an EchoConfig, got {type(config).__name__}")
        cost_model = gate_provider = None
        if calibration is not None:
            if not isinstance(calibration, Calibration):
                calibration = Calibration.load(calibration)
            config = calibration.apply(config)
            cost_model, gate_provider = calibration.cost_model, calibration.gate_for
        self.calibration = calibration
        check_limits(config, max_batch_size, has_draft=draft_model is not None or config.policy == "ar")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        target, target_tok = self._load(model, dtype, device)
        self.tokenizer = tokenizer or target_tok
        if self.tokenizer is None:
            raise ValueError("a loaded CausalLM needs tokenizer=... (a Tokenizer from echo_trtllm.models.loader)")
        draft = None
        if draft_model is not None and config.policy != "ar":
            draft, draft_tok = self._load(draft_model, dtype, device)
            if draft_tok is not None:
                check_same_vocabulary(self.tokenizer, draft_tok)
        self.config = config
        self.target, self.draft = target, draft
        self.executor = Executor(target, draft, self.tokenizer, config, max_batch_size, max_seq_len, max_num_tokens,
                                 cost_model=cost_model, gate_provider=gate_provider)
        self._loop = EngineLoop(self.executor)

    @staticmethod
    def _load(source: ModelSource, dtype: str, device: str) -> tuple[CausalLM, Tokenizer | None]:
        if isinstance(source, CausalLM):
            return source, None
        return load_model(source, dtype=dtype, device=device)

    # ---------------------------------------------------------------- generation

    def _requests(self, prompts, sampling_params):
        single = _is_single_prompt(prompts)
        plist = [prompts] if single else list(prompts)
        if not plist:
            raise ValueError("prompts is empty: give a string, a list of token ids, or a list of those")
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(plist)
        if len(params) != len(plist):
            raise ValueError(f"got {len(params)} sampling_params for {len(plist)} prompts")
        reqs = []
        for i, (p, sp) in enumerate(zip(plist, params)):
            try:
                reqs.append(self.executor.make_request(list(p) if not isinstance(p, str) else p, sp))
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
        return single, reqs

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> RequestOutput | list[RequestOutput]:
        """Generate for one prompt (returns one RequestOutput) or a list (returns a list, in order). Every prompt
        is validated before any is submitted; a bad one raises ValueError naming its index."""
        single, reqs = self._requests(prompts, sampling_params)
        handles = [self._loop.submit(r) for r in reqs]
        outputs = self._wait(handles, use_tqdm and not single)
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
        """Submit one request; returns a handle: `.result()`, or iterate it (for / async for) when streaming."""
        if not _is_single_prompt(prompt):
            raise TypeError("generate_async takes one prompt (a string or a list of token ids)")
        _, reqs = self._requests(prompt, sampling_params)
        return self._loop.submit(reqs[0], streaming=streaming)

    def shutdown(self) -> None:
        self._loop.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
