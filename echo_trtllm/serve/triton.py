"""The engine behind a real Triton Inference Server, with TensorRT-LLM's Triton interface (`serve --triton`).

`nvidia-pytriton` (the `triton` extra) bundles a `tritonserver` binary; this module binds one decoupled model to
it whose tensors are named as in tensorrtllm_backend's `ensemble` model (inflight_batcher_llm, 0.19 – 1.x), so
an existing Triton client of a TensorRT-LLM deployment works unchanged: gRPC streaming (`start_stream` +
`async_stream_infer`) or HTTP's generate extension (`POST /v2/models/ensemble/generate`, `/generate_stream`).

Inputs (dims without the batch dimension; the model takes one request per call, `max_batch_size` 1):

    text_input   BYTES [1]   the prompt (required)
    max_tokens   INT32 [1]   tokens to generate (required)
    temperature FP32 [1], top_p FP32 [1], top_k INT32 [1], random_seed / seed UINT64 [1]   sampling (optional)
    stop_words   BYTES [-1]  strings that end generation (optional)
    bad_words    BYTES [-1]  accepted only empty: banning words is not implemented (optional)
    end_id INT32 [1], pad_id INT32 [1]    accepted; end_id adds a stop token id (optional)
    beam_width   INT32 [1]   accepted only 1 (optional)
    stream       BOOL [1]    true: one response per engine step with the new text; false: one response
    exclude_input_in_output BOOL [1]   false (TensorRT-LLM's default): a non-streamed text_output starts with the
                             prompt text

Outputs: `text_output` BYTES [-1]; generation statistics as TensorRT-LLM names them, cumulative for the request:
`num_input_tokens`, `num_output_tokens`, `total_draft_tokens` (draft tokens the target verified),
`total_accepted_draft_tokens` (INT32 [1]) and `acceptance_rate` (FP32 [1]).

A bad input ends the request with an error response naming the tensor; the server keeps serving.
"""

from __future__ import annotations

import os
import socket
import sysconfig
import time

import numpy as np

from echo_trtllm.api import ENGINE_LOST
from echo_trtllm.runtime.request import (MAX_SEED, MAX_TOP_K, STOP_LIMITS, SamplingParams, stop_strings_fit,
                                         stops_described)
from echo_trtllm.serve.protocol import max_token_chars

__all__ = ["TritonInputError", "parse_inputs", "response_tensors", "triton_inputs", "triton_outputs", "TritonServing",
           "prepare_environment", "free_port", "stop_on_sigterm", "DEFAULT_TRITON_MODEL", "INPUTS", "OUTPUTS",
           "INPUT_NAMES"]

DEFAULT_TRITON_MODEL = "ensemble"

# (name, numpy dtype, dims, optional) -- tensorrtllm_backend's ensemble names
INPUTS = [
    ("text_input", bytes, (1,), False),
    ("max_tokens", np.int32, (1,), False),
    ("temperature", np.float32, (1,), True),
    ("top_p", np.float32, (1,), True),
    ("top_k", np.int32, (1,), True),
    ("random_seed", np.uint64, (1,), True),
    ("seed", np.uint64, (1,), True),
    ("stop_words", bytes, (-1,), True),
    ("bad_words", bytes, (-1,), True),
    ("end_id", np.int32, (1,), True),
    ("pad_id", np.int32, (1,), True),
    ("beam_width", np.int32, (1,), True),
    ("stream", np.bool_, (1,), True),
    ("exclude_input_in_output", np.bool_, (1,), True),
]
OUTPUTS = [
    ("text_output", bytes, (-1,)),
    ("num_input_tokens", np.int32, (1,)),
    ("num_output_tokens", np.int32, (1,)),
    ("total_draft_tokens", np.int32, (1,)),
    ("total_accepted_draft_tokens", np.int32, (1,)),
    ("acceptance_rate", np.float32, (1,)),
]
INPUT_NAMES = [i[0] for i in INPUTS]


class TritonInputError(ValueError):
    """A request tensor the model refuses; the message names the tensor and what is accepted."""


def _scalar(data: dict, name: str, kind, default):
    if name not in data:
        return default
    arr = np.asarray(data[name]).reshape(-1)
    if arr.size != 1:
        raise TritonInputError(f"{name} must hold one value, got {arr.size}")
    return kind(arr[0])


def _strings(data: dict, name: str) -> list[str]:
    if name not in data:
        return []
    out = []
    for v in np.asarray(data[name]).reshape(-1):
        try:
            s = v.decode("utf-8") if isinstance(v, (bytes, np.bytes_)) else str(v)
        except UnicodeDecodeError as e:
            raise TritonInputError(f"{name} is not valid UTF-8: {e}") from None
        # tensorrtllm_backend clients send "" for "none" and may join several words with commas
        out += [w for w in s.split(",") if w] if "," in s else ([s] if s else [])
    return out


def parse_inputs(data: dict, context: int, encode=None, vocab_size: int | None = None,
                 max_token_chars: int | None = None) -> tuple[str, SamplingParams, bool, bool]:
    """One request's tensors -> (prompt, SamplingParams, stream, exclude_input_in_output). encode(text) -> ids:
    when given, a prompt whose tokens plus max_tokens exceed the context is refused (as the OpenAI server does);
    vocab_size: when given, end_id must lie in [0, vocab_size); max_token_chars: the longest vocabulary entry in
    characters: a text_input longer than context x that is refused before it is tokenised. The limits are the
    engine's own (runtime/request.py), each error naming the tensor; every cheap check runs before the tokenizer."""
    raw = np.asarray(data["text_input"]).reshape(-1) if "text_input" in data else np.array([])
    if raw.size != 1:
        raise TritonInputError(f"text_input must hold one string, got {raw.size}")
    try:
        prompt = raw[0].decode("utf-8") if isinstance(raw[0], (bytes, np.bytes_)) else str(raw[0])
    except UnicodeDecodeError as e:
        raise TritonInputError(f"text_input is not valid UTF-8: {e}") from None
    if not prompt:
        raise TritonInputError("text_input must be a non-empty string")
    if max_token_chars is not None and len(prompt) > context * max_token_chars:
        raise TritonInputError(f"text_input has {len(prompt)} characters: more than this model's context of "
                               f"{context} tokens can hold")
    max_tokens = _scalar(data, "max_tokens", int, None)
    if max_tokens is None or max_tokens < 1:
        raise TritonInputError(f"max_tokens must be an integer >= 1, got {max_tokens}")
    if max_tokens >= context:
        raise TritonInputError(f"max_tokens must be below the context ({context} tokens), got {max_tokens}")
    temperature = _scalar(data, "temperature", float, 1.0)
    top_p = _scalar(data, "top_p", float, 1.0)
    top_k = _scalar(data, "top_k", int, 0)
    seed_name = "seed" if "seed" in data else "random_seed"
    seed = _scalar(data, seed_name, int, None)
    beam = _scalar(data, "beam_width", int, 1)
    if beam != 1:
        raise TritonInputError(f"beam_width must be 1 (beam search is not implemented), got {beam}")
    if _strings(data, "bad_words"):
        raise TritonInputError("bad_words must be empty: banning words is not implemented")
    end_id = _scalar(data, "end_id", int, None)
    checks = [("temperature", np.isfinite(temperature) and temperature >= 0, "a finite number >= 0", temperature),
              ("top_p", 0 < top_p <= 1, "a number in (0, 1]", top_p),
              ("top_k", 0 <= top_k <= MAX_TOP_K, f"an integer in [0, {MAX_TOP_K}] (0 = off)", top_k),
              (seed_name, seed is None or 0 <= seed <= MAX_SEED, "in [0, 2**63 - 1]", seed),
              ("end_id", end_id is None or (end_id >= 0 and (vocab_size is None or end_id < vocab_size)),
               "a token id >= 0" if vocab_size is None else f"a token id in [0, {vocab_size})", end_id)]
    for name, ok, accepted, value in checks:
        if not ok:
            raise TritonInputError(f"{name} must be {accepted}, got {value}")
    stops = _strings(data, "stop_words")
    if not stop_strings_fit(stops):
        raise TritonInputError(f"stop_words must be {STOP_LIMITS}, got {stops_described(stops)}")
    if encode is not None:
        n = len(encode(prompt))
        if n + max_tokens > context:
            raise TritonInputError(f"max_tokens: the context holds {context} tokens, but the request needs "
                                   f"{n + max_tokens} ({n} in text_input, {max_tokens} in max_tokens)")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            stop=stops or None, stop_token_ids=[end_id] if end_id is not None else None)
    stream = _scalar(data, "stream", bool, False)
    exclude = _scalar(data, "exclude_input_in_output", bool, False)
    return prompt, params, stream, exclude


def response_tensors(out, prompt: str, stream: bool, exclude_input: bool) -> dict | None:
    """The response to send for a RequestOutput snapshot (arrays with the batch dimension first), or None when a
    streamed snapshot brought no new text. Streamed: the new text; not streamed: the whole text, after the prompt
    unless `exclude_input_in_output`. Statistics are cumulative for the request."""
    if stream:
        text = out.outputs[0].text_diff
        if not text and not out.finished:
            return None
    else:
        text = out.text if exclude_input else prompt + out.text
    s = out.stats
    drafted = max(s.verified_tokens - s.steps, 0)
    accepted = max(sum(s.emitted_per_step) - s.steps, 0)
    i32 = lambda v: np.array([[v]], dtype=np.int32)  # noqa: E731
    return {"text_output": np.array([[text.encode("utf-8")]], dtype=object),
            "num_input_tokens": i32(len(out.prompt_token_ids)), "num_output_tokens": i32(len(out.token_ids)),
            "total_draft_tokens": i32(drafted), "total_accepted_draft_tokens": i32(accepted),
            "acceptance_rate": np.array([[accepted / drafted if drafted else 0.0]], dtype=np.float32)}


def triton_inputs():
    from pytriton.model_config import Tensor

    return [Tensor(name=n, dtype=d, shape=s, optional=o) for n, d, s, o in INPUTS]


def triton_outputs():
    from pytriton.model_config import Tensor

    return [Tensor(name=n, dtype=d, shape=s) for n, d, s in OUTPUTS]


def prepare_environment() -> None:
    """What the bundled tritonserver needs from this process's environment, set here rather than by the user:
    the Python installation's shared library directory on LD_LIBRARY_PATH (its Python backend stub loads
    libpython), and this package importable from the stub (PYTHONPATH)."""
    libdir = sysconfig.get_config_var("LIBDIR")
    paths = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    if libdir and libdir not in paths:
        os.environ["LD_LIBRARY_PATH"] = ":".join([libdir, *paths])


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now (tritonserver takes no port 0; it may be taken again before the server binds it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TritonServing:
    """`llm` served by the bundled tritonserver: HTTP, gRPC and metrics ports, one decoupled model.

        with TritonServing(llm) as t:      # or t.run() ... t.stop()
            t.http_port, t.grpc_port
    """

    def __init__(self, llm, model_name: str = DEFAULT_TRITON_MODEL, host: str = "127.0.0.1",
                 http_port: int | None = None, grpc_port: int | None = None, metrics_port: int | None = None,
                 log_verbose: int = 0) -> None:
        from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

        prepare_environment()
        self.llm = llm
        self.model_name = model_name
        self.context = llm.max_seq_len
        self.vocab_size = llm.vocab_size
        self.max_token_chars = max_token_chars(llm.tokenizer)
        self.http_port = http_port or free_port(host)
        self.grpc_port = grpc_port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)
        config = TritonConfig(http_address=host, http_port=self.http_port, grpc_address=host,
                              grpc_port=self.grpc_port, metrics_port=self.metrics_port, log_verbose=log_verbose)
        # only inference, health and metadata are served; nothing needs the admin endpoints' token
        self.triton = Triton(config=config, security_config=TritonSecurityConfig(restricted_endpoints=[]))
        from pytriton.model_config import ModelConfig

        self.triton.bind(model_name=model_name, infer_func=self._infer, inputs=triton_inputs(),
                         outputs=triton_outputs(), config=ModelConfig(batching=True, max_batch_size=1,
                                                                      decoupled=True), strict=False)

    async def _infer(self, requests):
        """One request per call (max_batch_size 1); each yield answers it once."""
        (request,) = requests
        prompt, params, stream, exclude = parse_inputs(request.data, self.context, self.llm.tokenizer.encode,
                                                       self.vocab_size, self.max_token_chars)
        handle = self.llm.generate_async(prompt, params, streaming=stream)
        async for out in handle:
            tensors = response_tensors(out, prompt, stream, exclude)
            if tensors is not None:
                yield [tensors]

    def run(self) -> "TritonServing":
        self.triton.run()
        return self

    def serve(self, poll_s: float = 1.0) -> str | None:
        """Block while tritonserver and the engine both run; on SIGINT or SIGTERM (the caller turns SIGTERM into
        KeyboardInterrupt: `stop_on_sigterm`), on tritonserver's end or on the engine's (`LLM.is_alive`: its thread
        ended, or a tensor-parallel rank is gone), stop tritonserver and free its workspace, so nothing outlives
        the server. Returns None when a signal ended it, else what ended it (the caller exits non-zero)."""
        lost = None
        try:
            while lost is None:
                if not self.llm.is_alive:
                    lost = ENGINE_LOST
                elif not self.triton.is_alive():
                    lost = "tritonserver ended on its own"
                else:
                    time.sleep(poll_s)
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()
        return lost

    def stop(self) -> None:
        """Stop tritonserver and free its workspace and shared memory (pytriton's stop; a second call does nothing)."""
        self.triton.stop()

    def __enter__(self) -> "TritonServing":
        return self.run()

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_on_sigterm() -> None:
    """The first SIGTERM raises KeyboardInterrupt in the main thread, as SIGINT does, so `TritonServing.serve` stops
    tritonserver before the process ends (by default SIGTERM ended the process at once and tritonserver, reparented,
    ran on for 30-45 s with its shared memory); further SIGTERMs are ignored while that cleanup runs."""
    import signal

    def interrupt(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
