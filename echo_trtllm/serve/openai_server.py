"""An OpenAI-compatible HTTP server over one `LLM` (FastAPI + uvicorn), the way `trtllm-serve` and vLLM serve.

    POST /v1/completions        text completion; `stream: true` answers server-sent events ending in `data: [DONE]`
    POST /v1/chat/completions   chat (the tokenizer's chat template, else the plain one: serve/protocol.py)
    GET  /v1/models             the one served model
    GET  /health                200 while the engine runs, 503 when it has stopped
    GET  /metrics               Prometheus text format (serve/metrics.py)

Every request ends and returns its resources: a client that disconnects (mid-stream or while waiting for a
non-streamed answer) aborts its engine requests, which frees their KV slots at the next step boundary. A full
queue answers 429 with `Retry-After` instead of growing without bound. A bad body or parameter gets 400 (404 for
an unknown model or path, 405 for a wrong method, 413 for an oversized body) with an OpenAI-style error body
naming the field (docs/serving.md has the table). Nothing a client sends stops the server; an engine failure
ends the affected requests with an error and the server keeps answering. SIGTERM (uvicorn's handler) stops
accepting connections, lets in-flight requests finish for up to `drain_timeout` seconds, then shuts the engine
down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from echo_trtllm.api import ENGINE_LOST
from echo_trtllm.runtime.engine import GenerationHandle

from .metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .protocol import GenerationPlan, RequestError, max_token_chars, parse_chat, parse_completion

__all__ = ["OpenAIServer", "uvicorn_server", "bound_port", "listen", "default_model_name", "DEFAULT_MAX_QUEUE",
           "DEFAULT_MAX_BODY_BYTES"]

log = logging.getLogger("echo_trtllm.serve")

DEFAULT_MAX_QUEUE = 1024  # requests accepted beyond the engine's batch before 429
DEFAULT_MAX_BODY_BYTES = 4 << 20
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


class _Disconnected(Exception):
    pass


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           headers: dict | None = None) -> JSONResponse:
    return JSONResponse(RequestError(status, message, param, kind).body(), status_code=status, headers=headers)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class OpenAIServer:
    """The FastAPI app over `llm` (`.app`); `serve_forever` runs it under uvicorn.

    model_name: the id clients pass as `model` (default: the model directory's name). max_queue_size: requests
    accepted beyond the engine's `max_batch_size` before 429. max_body_bytes: larger bodies get 413.
    """

    def __init__(self, llm, model_name: str | None = None, max_queue_size: int = DEFAULT_MAX_QUEUE,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if not isinstance(max_queue_size, int) or isinstance(max_queue_size, bool) or max_queue_size < 0:
            raise ValueError(f"max_queue_size must be an integer >= 0, got {max_queue_size!r}")
        if not isinstance(max_body_bytes, int) or isinstance(max_body_bytes, bool) or max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be an integer >= 1024, got {max_body_bytes!r}")
        self.llm = llm
        self.model_name = model_name or "echo-trtllm"
        self.capacity = llm.max_batch_size + max_queue_size
        self.max_body_bytes = max_body_bytes
        self.context = llm.max_seq_len
        # the longest vocabulary entry (characters): a prompt longer than context x this cannot fit
        self.max_token_chars = max_token_chars(llm.tokenizer)
        self.created = int(time.time())
        self._lock = threading.Lock()
        self.inflight = 0  # engine requests submitted through this server and not yet ended
        self.engine_lost = False  # set by watch_engine when the engine could no longer serve
        self.metrics = ServerMetrics(self._load, speculation=llm.speculation_stats,
                                     info={"model": self.model_name, "dtype": llm.dtype["target"],
                                           "draft_dtype": llm.dtype["draft"] or "none",
                                           "batch_invariant": str(llm.batch_invariant).lower()})
        llm.add_step_listener(self.metrics.on_step)
        self.app = self._build_app()

    def _load(self) -> tuple[int, int]:
        running, _ = self.llm.load
        with self._lock:
            inflight = self.inflight
        return running, max(inflight - running, 0)

    # ------------------------------------------------------------------ app

    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app):
            yield
            # after uvicorn's drain: whatever is still in flight ends with finish_reason "abort"
            await asyncio.to_thread(self.llm.shutdown)

        app = FastAPI(title="echo-trtllm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, exc: StarletteHTTPException):
            what = {404: f"no such endpoint: {request.method} {request.url.path}",
                    405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
            return _error(exc.status_code, what)

        @app.exception_handler(Exception)
        async def internal_error(request: Request, exc: Exception):
            log.exception("unhandled error in %s %s", request.method, request.url.path)
            return _error(500, f"internal error: {type(exc).__name__}: {exc}", kind="internal_error")

        @app.get("/health")
        async def health():
            if not self.llm.is_alive:
                return _error(503, ENGINE_LOST, kind="service_unavailable")
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                                "owned_by": "echo-trtllm", "max_model_len": self.context,
                                                "dtype": self.llm.dtype["target"],
                                                "draft_dtype": self.llm.dtype["draft"],
                                                "batch_invariant": self.llm.batch_invariant}]}

        @app.get("/metrics")
        async def metrics():
            return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._generate(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self._generate(request, chat=True)

        return app

    # ------------------------------------------------------------------ requests

    async def _body(self, request: Request):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise RequestError(413, f"the request body has {length} bytes; at most {self.max_body_bytes} are accepted")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise RequestError(413, f"the request body exceeds {self.max_body_bytes} bytes")
                chunks.append(chunk)
        except ClientDisconnect:
            raise _Disconnected from None
        raw = b"".join(chunks)
        if not raw:
            raise RequestError(400, "the request body is empty: send a JSON object")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(400, f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise RequestError(400, "the request body is not valid JSON here: it nests too deeply") from None

    def _plan(self, body, chat: bool) -> GenerationPlan:
        tok = self.llm.tokenizer
        if chat:
            return parse_chat(body, self.model_name, tok, self.context, self.max_token_chars)
        return parse_completion(body, self.model_name, tok.encode, self.llm.vocab_size, self.context,
                                self.max_token_chars)

    def _submit(self, plan: GenerationPlan) -> list[GenerationHandle]:
        if not self.llm.is_alive:
            raise RequestError(503, ENGINE_LOST, kind="service_unavailable")
        n = len(plan.prompts)
        if n > self.capacity:
            raise RequestError(400, f"prompt has {n} prompts; this server takes at most {self.capacity} requests in "
                                    "flight, so at most that many per request", "prompt")
        with self._lock:
            if self.inflight + n > self.capacity:
                raise RequestError(429, f"the server is at capacity ({self.capacity} requests in flight or queued); "
                                        "retry later", kind="rate_limit_error")
            self.inflight += n
        handles = []
        try:
            for p in plan.prompts:
                handles.append(self.llm.generate_async(p, plan.params, streaming=plan.stream))
        except BaseException:
            for h in handles:
                h.abort()
            with self._lock:
                self.inflight -= n
            raise
        return handles

    def _release(self, handles: list[GenerationHandle]) -> None:
        for h in handles:
            h.abort()  # no-op when finished
        with self._lock:
            self.inflight -= len(handles)

    async def _generate(self, request: Request, chat: bool):
        try:
            body = await self._body(request)
            # tokenising (and a chat template) can take long for a big prompt: off the event loop
            plan = await asyncio.to_thread(self._plan, body, chat)
            handles = self._submit(plan)
        except _Disconnected:
            return Response(status_code=499)
        except RequestError as e:
            self.metrics.rejected.labels(str(e.status)).inc()
            headers = {"Retry-After": "1"} if e.status == 429 else None
            return JSONResponse(e.body(), status_code=e.status, headers=headers)
        except (ValueError, TypeError) as e:  # the engine's own validation (a case the protocol did not foresee)
            self.metrics.rejected.labels("400").inc()
            return _error(400, str(e))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if plan.stream:
            return StreamingResponse(self._stream(handles, plan, rid, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            outputs = await self._wait(handles, request)
        except _Disconnected:
            return Response(status_code=499)
        except RuntimeError as e:
            return _error(500, str(e), kind="internal_error")
        finally:
            self._count(handles)
            self._release(handles)
        return self._response(outputs, plan, rid, chat)

    async def _wait(self, handles: list[GenerationHandle], request: Request):
        task = asyncio.ensure_future(asyncio.gather(*(h.aresult() for h in handles)))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise _Disconnected
        finally:
            if not task.done():
                task.cancel()
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no "never retrieved" log

    def _count(self, handles: list[GenerationHandle]) -> None:
        """Metrics of requests that end now (a request not finished yet is being aborted: its client left)."""
        for h in handles:
            out = h.latest()
            self.metrics.requests.labels(out.finish_reason if out is not None and out.finished else "abort").inc()
            self.metrics.prompt_tokens.inc(len(h.request.prompt_token_ids))
            self.metrics.generation_tokens.inc(len(out.token_ids) if out is not None else 0)

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def _response(self, outputs, plan: GenerationPlan, rid: str, chat: bool) -> dict:
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        completion_tokens = sum(len(o.token_ids) for o in outputs)
        base = {"id": rid, "created": int(time.time()), "model": self.model_name,
                "usage": self._usage(prompt_tokens, completion_tokens)}
        if chat:
            o = outputs[0]
            return {**base, "object": "chat.completion", "choices": [{
                "index": 0, "message": {"role": "assistant", "content": o.text}, "logprobs": None,
                "finish_reason": o.finish_reason}]}
        return {**base, "object": "text_completion", "choices": [
            {"index": i, "text": (p if plan.echo else "") + o.text, "logprobs": None, "finish_reason": o.finish_reason}
            for i, (p, o) in enumerate(zip(plan.prompts, outputs))]}

    def _with_usage(self, chunk: dict, plan: GenerationPlan, so_far: dict[int, tuple[int, int]]) -> dict:
        """The chunk with the usage so far over every choice (stream_options.continuous_usage_stats)."""
        if plan.continuous_usage:
            chunk["usage"] = self._usage(sum(p for p, _ in so_far.values()), sum(c for _, c in so_far.values()))
        return chunk

    async def _stream(self, handles: list[GenerationHandle], plan: GenerationPlan, rid: str, chat: bool):
        """Server-sent events: one chunk per new text of any choice, a last chunk per choice with its finish reason,
        the usage chunk when asked, `data: [DONE]`. Leaving early (the client went away) aborts every choice."""
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, h: GenerationHandle) -> None:
            try:
                async for out in h:
                    await queue.put((i, out, None))
            except Exception as e:  # noqa: BLE001 - the request failed: its error goes to the client
                await queue.put((i, None, e))

        def chunk(i: int, text: str | None, finish_reason, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            else:
                choice = {"index": i, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            return {"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": [choice]}

        tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
        prompt_tokens = completion_tokens = 0
        so_far: dict[int, tuple[int, int]] = {}  # choice -> (prompt, completion tokens) so far (continuous usage)
        try:
            for i, p in enumerate(plan.prompts):
                if chat:
                    yield _sse(chunk(i, None, None, role=True))
                elif plan.echo:
                    yield _sse(chunk(i, p, None))
            remaining = len(handles)
            while remaining:
                i, out, err = await queue.get()
                if err is not None:
                    yield _sse(RequestError(500, str(err), kind="internal_error").body())
                    remaining -= 1
                    continue
                diff = out.outputs[0].text_diff
                if plan.continuous_usage:
                    so_far[i] = (len(out.prompt_token_ids), len(out.token_ids))
                if diff:
                    yield _sse(self._with_usage(chunk(i, diff, None), plan, so_far))
                if out.finished:
                    remaining -= 1
                    prompt_tokens += len(out.prompt_token_ids)
                    completion_tokens += len(out.token_ids)
                    yield _sse(self._with_usage(chunk(i, None if chat else "", out.finish_reason), plan, so_far))
            if plan.include_usage:
                yield _sse({"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": [],
                            "usage": self._usage(prompt_tokens, completion_tokens)})
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            self._count(handles)
            self._release(handles)


def uvicorn_server(server: OpenAIServer, host: str = "127.0.0.1", port: int = 8000, drain_timeout: float = 30.0,
                   log_level: str = "info"):
    """A uvicorn.Server for the app: `.run()` serves until SIGINT / SIGTERM (its handlers, in the main thread) or
    `.should_exit = True`, then drains in-flight requests for up to `drain_timeout` seconds. `.started` turns True
    once it listens; `bound_port(it)` is then the real port (for `port=0`)."""
    import uvicorn

    config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=drain_timeout, access_log=log_level == "debug")
    return uvicorn.Server(config)


def watch_engine(server: OpenAIServer, userver, interval: float = 1.0) -> threading.Thread:
    """A thread that tells uvicorn to drain and exit once the engine can no longer serve (`LLM.is_alive`: its
    thread ended, or a tensor-parallel rank is gone), setting `server.engine_lost`: a server whose every request
    would fail leaves, so that a supervisor restarts it and a load balancer stops sending to it (its /health
    answers 503 from the moment the engine is lost). A shutdown uvicorn began itself (SIGTERM) is not a loss."""
    def run() -> None:
        while not userver.should_exit:
            if not server.llm.is_alive:
                if not userver.should_exit:
                    log.error("%s: draining and exiting", ENGINE_LOST)
                    server.engine_lost = True
                    userver.should_exit = True
                return
            time.sleep(interval)

    thread = threading.Thread(target=run, name="echo-engine-watch", daemon=True)
    thread.start()
    return thread


def bound_port(userver) -> int:
    return userver.servers[0].sockets[0].getsockname()[1]


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: any free one), bound before the server starts so its address can be
    announced at once; connections made before the server runs wait in the backlog."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def default_model_name(args_model: str | None, engine_dir: str | None) -> str:
    """What /v1/models lists: the engine directory's or the model's name, else the embedded default's."""
    source = engine_dir or args_model
    if not source:
        return "echo-trtllm-default"
    return Path(source).name.removesuffix(".gguf")
