"""A background thread that runs the executor loop, and the handles requests are answered through.

Threads: callers submit and abort through an inbox (a short lock, never held while a step runs, so a submission
never waits for a step and an asyncio event loop is never blocked); only the engine thread touches the executor.
Between steps it takes the inbox, aborts what was cancelled, runs `Executor.step()` and pushes each updated
request's output to its handle.

Every request ends, with output or an error, and returns its KV slot:
- the executor contains failures by phase (see runtime/executor.py); a step that still raises ends every request
  the loop holds with finish_reason "error" and the loop goes on;
- `GenerationHandle.abort()` / `LLM.abort(request_id)` end a request with finish_reason "abort"; a stream the caller
  stops iterating (sync or async) is aborted the same way;
- `shutdown()` (also run at interpreter exit) aborts whatever is left and joins the thread, so the process never
  exits with the loop inside a model forward.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass, field

from ..cpu import release_openmp_threads
from .executor import Executor, StepReport
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


def _held_back(req: Request) -> int:
    """Characters at the end of an unfinished request's text that may still turn into a stop string or are half
    of a multi-byte character; streaming withholds them so that sent text is never taken back. The half character
    (U+FFFD) at the end is held, and so is any stop-string prefix just before it (`StopMatcher.hold`, kept by the
    executor as the text grows: a stop string can continue with the character being completed)."""
    text = req.text
    partial = len(text) - len(text.rstrip("\ufffd"))
    return partial + (req.stop_matcher.hold if req.stop_matcher is not None else 0)


@dataclass(frozen=True)
class _Record:
    """One published snapshot, as lengths into the handle's append-only text and tokens (a long stream keeps
    O(steps) small records, not a copy of its text per step)."""

    text_len: int
    num_tokens: int
    steps: int
    verified_tokens: int
    finish_reason: str | None
    error: str | None


class GenerationHandle:
    """What `LLM.generate_async` returns: iterate (sync or async) for streaming snapshots, or call `result()`.

    Iterating again replays the snapshots from the start. Leaving an iteration before the final snapshot (break,
    an exception, an abandoned async generator) aborts the request, as does `abort()`."""

    def __init__(self, request: Request, streaming: bool, engine: "EngineLoop") -> None:
        self.request = request
        self.request_id = request.request_id
        self.streaming = streaming
        self._engine = engine
        self._cond = threading.Condition()
        self._records: list[_Record] = []
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        # append-only copies owned by the handle (the engine thread extends them)
        self._text = ""
        self._tokens: list[int] = []
        self._emitted: list[int] = []
        self._arrival = time.perf_counter()
        self._first_token: float | None = None
        self._finished_at: float | None = None

    # ------------------------------------------------------------ engine thread

    def _publish(self) -> None:
        req = self.request
        text = req.text if req.finished else req.text[: len(req.text) - _held_back(req)]
        if not text.startswith(self._text):
            raise RuntimeError(f"streamed text would be taken back: sent {self._text!r}, now {text!r}")
        self._push(text, req.output_token_ids, req.stats, req.finish_reason, req.error)

    def _publish_error(self, error: str) -> None:
        """The final snapshot when the request's own output could not be produced: what was sent stays."""
        self._push(self._text, self._tokens, None, "error", error)

    def _push(self, text: str, tokens: list[int], stats: RequestStats | None, finish_reason, error) -> None:
        now = time.perf_counter()
        with self._cond:
            if self._records and self._records[-1].finish_reason is not None:
                return  # already final
            self._text = text
            self._tokens.extend(tokens[len(self._tokens):])
            if stats is not None:
                self._emitted.extend(stats.emitted_per_step[len(self._emitted):])
            if self._tokens and self._first_token is None:
                self._first_token = now
            if finish_reason is not None:
                self._finished_at = now
            steps = stats.steps if stats is not None else len(self._emitted)
            verified = stats.verified_tokens if stats is not None else (
                self._records[-1].verified_tokens if self._records else 0)
            record = _Record(len(self._text), len(self._tokens), steps, verified, finish_reason, error)
            if self.streaming or finish_reason is not None:
                self._records.append(record)
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that event loop is closed: nobody waits there any more
                pass

    # ------------------------------------------------------------ caller side

    def _output(self, i: int) -> RequestOutput:
        rec = self._records[i]
        prev = self._records[i - 1] if i > 0 else _Record(0, 0, 0, 0, None, None)
        req = self.request
        out = CompletionOutput(0, self._text[: rec.text_len], self._tokens[: rec.num_tokens], rec.finish_reason,
                               self._text[prev.text_len : rec.text_len], self._tokens[prev.num_tokens : rec.num_tokens])
        stats = RequestStats(rec.steps, self._emitted[: rec.steps], rec.verified_tokens, self._arrival,
                             self._first_token if rec.num_tokens else None,
                             self._finished_at if rec.finish_reason is not None else None)
        return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), [out],
                             rec.finish_reason is not None, stats, rec.error)

    @property
    def done(self) -> bool:
        with self._cond:
            return bool(self._records) and self._records[-1].finish_reason is not None

    def latest(self) -> RequestOutput | None:
        """The newest published snapshot (the final one once finished), or None before the first."""
        with self._cond:
            return self._output(len(self._records) - 1) if self._records else None

    def abort(self) -> None:
        """Cancel the request (finish_reason "abort"; what was generated so far is kept). No-op once finished."""
        if not self.done:
            self._engine.abort(self.request_id)

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The final output. Raises RuntimeError if the request failed, TimeoutError after `timeout` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.done, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
            out = self._output(len(self._records) - 1)
        if out.error is not None:
            raise RuntimeError(f"request {self.request_id} failed: {out.error}")
        return out

    def _next(self, i: int) -> RequestOutput | None:
        with self._cond:
            return self._output(i) if i < len(self._records) else None

    def _checked(self, out: RequestOutput) -> RequestOutput:
        if out.error is not None:
            raise RuntimeError(f"request {self.request_id} failed: {out.error}")
        return out

    def __iter__(self):
        i = 0
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: i < len(self._records))
                    out = self._output(i)
                i += 1
                yield self._checked(out)
                if out.finished:
                    return
        finally:
            self.abort()  # the caller left early (no-op when finished)

    async def __aiter__(self):
        i = 0
        loop = asyncio.get_running_loop()
        try:
            while True:
                event = asyncio.Event()
                with self._cond:
                    out = self._output(i) if i < len(self._records) else None
                    if out is None:
                        self._waiters.append((loop, event))
                if out is None:
                    await event.wait()
                    continue
                i += 1
                yield self._checked(out)
                if out.finished:
                    return
        finally:
            self.abort()

    async def aresult(self) -> RequestOutput:
        """`result()` for asyncio: waits without blocking the event loop."""
        loop = asyncio.get_running_loop()
        while True:
            event = asyncio.Event()
            with self._cond:
                if self.done:
                    out = self._output(len(self._records) - 1)
                    break
                self._waiters.append((loop, event))
            await event.wait()
        return self._checked(out)


def _exit_hook(ref: "weakref.ref[EngineLoop]"):
    def hook() -> None:
        loop = ref()
        if loop is not None:
            loop.shutdown()

    return hook


class EngineLoop:
    """Runs `executor.step()` on its own thread while there is work (module docstring).

    iter_stats_max_iterations: keep the last this-many `StepReport`s for `get_stats()` (0 = none)."""

    def __init__(self, executor: Executor, iter_stats_max_iterations: int = 0) -> None:
        self.executor = executor
        self._handles: dict[int, GenerationHandle] = {}  # engine thread only
        self._inbox: deque[tuple[str, object]] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._stats: deque[StepReport] = deque(maxlen=max(iter_stats_max_iterations, 1))
        self._keep_stats = iter_stats_max_iterations > 0
        self._listeners: list = []  # called on the engine thread with each step's report (add_listener)
        self.on_exit: list = []  # called on the engine thread as it ends (e.g. closing a tensor-parallel group)
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="echo-trtllm-executor", daemon=True)
        # Interpreter exit runs this before daemon threads are stopped: the loop finishes its step, aborts what
        # is left and ends, instead of being killed inside a model forward.
        self._atexit = _exit_hook(weakref.ref(self))
        atexit.register(self._atexit)
        # the models were loaded and warmed on this thread; its idle OpenMP team would make libgomp park the
        # engine thread's workers after every kernel (echo_trtllm.cpu)
        release_openmp_threads()
        self._thread.start()

    # ------------------------------------------------------------ any thread

    def submit(self, requests: list[Request], streaming: bool = False) -> list[GenerationHandle]:
        """Queue requests (atomically: one step sees all of them or none) and return their handles at once."""
        handles = [GenerationHandle(r, streaming, self) for r in requests]
        with self._cond:
            if self._stop:
                raise RuntimeError("the engine has been shut down")
            self._inbox.append(("submit", handles))
            self._cond.notify()
        return handles

    def abort(self, request_id: int) -> None:
        """Cancel a request by id (finish_reason "abort"); unknown or finished ids are ignored."""
        if isinstance(request_id, bool) or not isinstance(request_id, int):
            raise TypeError(f"request_id must be an int (GenerationHandle.request_id), got {type(request_id).__name__}")
        with self._cond:
            self._inbox.append(("abort", request_id))
            self._cond.notify()

    def add_listener(self, listener) -> None:
        """Call `listener(report)` on the engine thread after every step that ran a batch (servers' metrics). It must
        be quick and must not raise; an exception it raises is logged in `last_error` and the loop goes on."""
        with self._cond:
            self._listeners = self._listeners + [listener]

    @property
    def alive(self) -> bool:
        """The engine thread runs and takes work."""
        return self._thread.is_alive() and not self._stop

    @property
    def ended(self) -> bool:
        """The engine thread has returned (nothing runs a model any more)."""
        return not self._thread.is_alive()

    def get_stats(self) -> list[StepReport]:
        """The step reports kept since the last call (oldest first)."""
        with self._cond:
            out = list(self._stats)
            self._stats.clear()
        return out

    def shutdown(self, timeout: float | None = 60.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        atexit.unregister(self._atexit)

    # ------------------------------------------------------------ engine thread

    def _run(self) -> None:
        """The engine thread. Failures are contained inside `_serve`; should anything still escape it, the engine
        stops taking work and every request it holds ends with the error instead of waiting forever."""
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - the thread must not die with requests waiting on it
            self._fail_all(exc)
        finally:
            for hook in self.on_exit:
                try:
                    hook()
                except Exception:  # noqa: BLE001 - the thread is ending; keep the reason, run the other hooks
                    self.last_error = traceback.format_exc()

    def _fail_all(self, exc: BaseException) -> None:
        """Stop taking work and end every request held with the error that escaped the loop."""
        self.last_error = traceback.format_exc()
        with self._cond:
            self._stop = True
            items = list(self._inbox)
            self._inbox.clear()
        for kind, item in items:
            if kind == "submit":
                for h in item:
                    self._handles[h.request_id] = h
        for handle in list(self._handles.values()):
            handle._publish_error(f"the engine stopped: {type(exc).__name__}: {exc}")
        self._handles.clear()

    def _serve(self) -> None:
        ex = self.executor
        while True:
            with self._cond:
                while not self._stop and not self._inbox and not ex.has_work:
                    self._cond.wait()
                items = list(self._inbox)
                self._inbox.clear()
                stop = self._stop
            for kind, item in items:
                if kind == "submit":
                    for h in item:
                        self._handles[h.request_id] = h
                        ex.submit(h.request)
                else:
                    self._end(item, "abort", None)
            if stop:
                for rid in list(self._handles):
                    self._end(rid, "abort", "the engine was shut down")
                return
            if not ex.has_work:
                continue
            try:
                report = ex.step()
                updated = report.updated
                if self._keep_stats and report.batch_size:
                    with self._cond:
                        self._stats.append(report)
                if report.batch_size:
                    for listener in self._listeners:
                        try:
                            listener(report)
                        except Exception:  # noqa: BLE001 - a metrics hook never stops the engine
                            self.last_error = traceback.format_exc()
            except Exception as exc:  # noqa: BLE001 - last resort: the executor contains failures by phase
                self.last_error = traceback.format_exc()
                for rid in list(self._handles):
                    self._end(rid, "error", f"engine step failed: {type(exc).__name__}: {exc}")
                continue
            for req in updated:
                self._publish(req)

    def _publish(self, req: Request) -> None:
        handle = self._handles.get(req.request_id)
        if handle is None:
            return
        try:
            handle._publish()
        except Exception as exc:  # noqa: BLE001 - never let one output kill the loop
            self.last_error = traceback.format_exc()
            error = f"output failed: {type(exc).__name__}: {exc}"
            self.executor.abort(req, "error", error)  # a request that had already finished keeps its slot freed
            handle._publish_error(error)
        if req.finished:
            del self._handles[req.request_id]

    def _end(self, request_id: int, reason: str, error: str | None) -> None:
        handle = self._handles.get(request_id)
        if handle is None:
            return
        self.executor.abort(handle.request, reason, error)
        self._publish(handle.request)
