"""The Triton Python-backend model that `echo-trtllm triton-repo` writes a repository for (imported by its
model.py inside Triton's Python backend stub; `triton_python_backend_utils` exists only there).

Decoupled: `execute` parses each request's tensors (serve/triton.py: tensorrtllm_backend's ensemble names),
submits it to the engine and returns at once; a thread per request sends its responses as the engine publishes
snapshots, then the final flag. A bad request gets an error response naming the tensor. A request the client
cancels (Triton 23.10+) is aborted, which frees its KV slot.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import triton_python_backend_utils as pb_utils

from echo_trtllm.serve.protocol import max_token_chars
from echo_trtllm.serve.triton import INPUT_NAMES, TritonInputError, parse_inputs, response_tensors

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args) -> None:
        from echo_trtllm.api import LLM

        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        engine_dir = params.get("engine_dir") or None
        if engine_dir and not Path(engine_dir).is_absolute():
            engine_dir = str(Path(args["model_repository"]) / engine_dir)
        batch = params.get("max_batch_size")  # "" or absent: LLM's default
        kwargs = dict(max_batch_size=int(batch) if batch else None, max_seq_len=int(params.get("max_seq_len", "1024")))
        self.llm = LLM(engine_dir=engine_dir, **kwargs) if engine_dir else LLM(**kwargs)
        self.context = self.llm.max_seq_len
        self.vocab_size = self.llm.vocab_size
        self.max_token_chars = max_token_chars(self.llm.tokenizer)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            data = {}
            for name in INPUT_NAMES:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    data[name] = tensor.as_numpy()
            try:
                prompt, params, stream, exclude = parse_inputs(data, self.context, self.llm.tokenizer.encode,
                                                               self.vocab_size, self.max_token_chars)
                handle = self.llm.generate_async(prompt, params, streaming=stream)
            except (TritonInputError, ValueError, TypeError) as e:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))), flags=FINAL)
                continue
            threading.Thread(target=self._respond, args=(request, sender, handle, prompt, stream, exclude),
                             name=f"echo-triton-{handle.request_id}", daemon=True).start()
        return None

    @staticmethod
    def _respond(request, sender, handle, prompt: str, stream: bool, exclude: bool) -> None:
        cancelled = getattr(request, "is_cancelled", lambda: False)
        try:
            for out in handle:
                if cancelled():
                    handle.abort()
                    break
                tensors = response_tensors(out, prompt, stream, exclude)
                if tensors is not None:
                    sender.send(pb_utils.InferenceResponse(
                        output_tensors=[pb_utils.Tensor(k, v) for k, v in tensors.items()]))
            sender.send(flags=FINAL)
        except Exception as e:  # noqa: BLE001 - the request ends with its error; the model keeps serving
            handle.abort()
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(e).__name__}: {e}")),
                        flags=FINAL)

    def finalize(self) -> None:
        self.llm.shutdown()
