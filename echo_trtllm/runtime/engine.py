"""A background thread that runs the executor loop, and the handles requests are answered through.

The loop sleeps while there is no work, runs `Executor.step()` otherwise, and pushes a snapshot to each updated
request's handle. A failure inside a step fails the requests of that step (finish_reason "error", the message
kept) and the loop goes on serving everyone else.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import traceback
from dataclasses import dataclass, field

from .executor import Executor
from .request import Request, RequestStats

__all__ = ["CompletionOutput", "RequestOutput", "GenerationHandle", "EngineLoop"]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    # new since the previous snapshot (streaming)
    text_diff: str = ""
    token_ids_diff: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    """One request's result (TensorRT-LLM / vLLM shape: `.outputs[0]`), with shortcuts for the single output."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    stats: RequestStats
    error: str | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def _held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of an unfinished text that may still turn into a stop string (or are half of a
    multi-byte character); streaming withholds them so that sent text is never taken back."""
    hold = len(text) - len(text.rstrip("\ufffd"))
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


def snapshot(req: Request, prev_text: str = "", prev_tokens: int = 0) -> RequestOutput:
    text = req.text
    if not req.finished:
        text = text[: len(text) - _held_back(text, req.params.stop_strings)]
    if not text.startswith(prev_text):
        raise RuntimeError(f"streamed text would be taken back: sent {prev_text!r}, now {text!r}")
    diff = text[len(prev_text):]
    out = CompletionOutput(0, text, list(req.output_token_ids), req.finish_reason, diff,
                           list(req.output_token_ids[prev_tokens:]))
    stats = RequestStats(req.stats.steps, list(req.stats.emitted_per_step), req.stats.verified_tokens)
    return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), [out], req.finished, stats, req.error)


class GenerationHandle:
    """What `LLM.generate_async` returns: iterate (sync or async) for streaming snapshots, or call `result()`."""

    def __init__(self, request: Request, streaming: bool) -> None:
        self.request = request
        self.streaming = streaming
        self._queue: queue.Queue[RequestOutput] = queue.Queue()
        self._done = threading.Event()
        self._final: RequestOutput | None = None
        self._sent_text, self._sent_tokens = "", 0

    # called by the engine thread
    def _publish(self) -> None:
        out = snapshot(self.request, self._sent_text, self._sent_tokens)
        self._sent_text, self._sent_tokens = out.text, len(out.token_ids)
        if self.streaming or out.finished:
            self._queue.put(out)
        if out.finished:
            self._final = out
            self._done.set()

    def _publish_error(self) -> None:
        out = RequestOutput(self.request.request_id, self.request.prompt, list(self.request.prompt_token_ids),
                            [CompletionOutput(0, self._sent_text, [], "error")], True, RequestStats(), self.request.error)
        self._final = out
        self._queue.put(out)
        self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> RequestOutput:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request.request_id} did not finish within {timeout} s")
        assert self._final is not None
        if self._final.error is not None:
            raise RuntimeError(f"request {self.request.request_id} failed: {self._final.error}")
        return self._final

    def __iter__(self):
        while True:
            out = self._queue.get()
            if out.error is not None:
                raise RuntimeError(f"request {self.request.request_id} failed: {out.error}")
            yield out
            if out.finished:
                return

    async def __aiter__(self):
        while True:
            out = await asyncio.to_thread(self._queue.get)
            if out.error is not None:
                raise RuntimeError(f"request {self.request.request_id} failed: {out.error}")
            yield out
            if out.finished:
                return

    async def aresult(self) -> RequestOutput:
        return await asyncio.to_thread(self.result)


class EngineLoop:
    """Runs `executor.step()` on a daemon thread while there is work."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._handles: dict[int, GenerationHandle] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stop = False
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="echo-trtllm-executor", daemon=True)
        self._thread.start()

    def submit(self, request: Request, streaming: bool = False) -> GenerationHandle:
        handle = GenerationHandle(request, streaming)
        with self._wake:
            if self._stop:
                raise RuntimeError("the engine has been shut down")
            self._handles[request.request_id] = handle
            self.executor.submit(request)
            self._wake.notify()
        return handle

    def shutdown(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self.executor.has_work:
                    self._wake.wait()
                if self._stop:
                    for h in self._handles.values():
                        self.executor.abort(h.request, "error", "the engine was shut down")
                        h._publish()
                    return
                try:
                    report = self.executor.step()
                    updated = report.updated
                except Exception as exc:  # noqa: BLE001 - one bad step must not kill the server
                    self.last_error = traceback.format_exc()
                    updated = list(self.executor.running)
                    for req in updated:
                        self.executor.abort(req, "error", f"{type(exc).__name__}: {exc}")
                for req in updated:
                    handle = self._handles.get(req.request_id)
                    if handle is None:
                        continue
                    try:
                        handle._publish()
                    except Exception as exc:  # noqa: BLE001 - never let one output kill the loop
                        self.last_error = traceback.format_exc()
                        self.executor.abort(req, "error", f"output failed: {type(exc).__name__}: {exc}")
                        handle._publish_error()
                    if req.finished:
                        del self._handles[req.request_id]
