"""A serving load generator in the way of vLLM's `benchmark_serving`: N streaming completion requests against an
OpenAI-compatible server, at a request rate (Poisson arrivals) or a fixed maximum concurrency, measuring per
request the time to first token (TTFT), the gaps between streamed events (ITL), the time per output token after
the first (TPOT) and the end-to-end latency, and overall output tokens/s and requests/s.

Two ways to run it:
- against a server that already runs (`--base-url`): one cell per concurrency;
- `--methods ar,echo`: for each method this launches `echo-trtllm serve --policy METHOD` itself (same models,
  same options otherwise), waits for it, runs every concurrency, stops it, then prints the methods side by side.

Every request uses the same prompts in the same order, greedy, `ignore_eos` and one `max_tokens`, so methods
produce the same number of tokens; a warm-up request per cell is not timed.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

__all__ = ["RequestTiming", "CellResult", "run_load", "summarise", "launch_server"]


@dataclass
class RequestTiming:
    ok: bool
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between streamed events after the first
    error: str = ""


@dataclass
class CellResult:
    method: str
    concurrency: int | None
    request_rate: float | None
    requests: int
    failed: int
    duration_s: float
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    ttft_ms: dict
    itl_ms: dict
    tpot_ms: dict
    latency_ms: dict

    def as_dict(self) -> dict:
        return asdict(self)


def _pcts(values: list[float]) -> dict:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    s = sorted(values)
    pick = lambda q: s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]  # noqa: E731
    return {"mean": 1e3 * statistics.fmean(s), "p50": 1e3 * pick(0.5), "p99": 1e3 * pick(0.99)}


async def _post_stream(host: str, port: int, path: str, body: dict):
    """POST `body` as JSON over one fresh HTTP/1.1 connection (the request in one write, TCP_NODELAY) and yield
    (arrival time, event data) for each server-sent event. A plain socket client: the official openai client
    measured ~45 ms to the first text on this machine where this client sees ~13 ms (docs/serving.md), an
    artefact of the client library, not of the server."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        data = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Accept: text/event-stream\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
                     .encode() + data)
        await writer.drain()
        status = (await reader.readline()).decode()
        headers = {}
        while (line := (await reader.readline()).decode().strip()):
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        code = int(status.split()[1])
        if code != 200:
            raise RuntimeError(f"HTTP {code}: {(await reader.read()).decode()[:200]}")
        if headers.get("transfer-encoding") != "chunked":
            raise RuntimeError("expected a chunked event stream")
        buf = b""
        while True:
            size = int((await reader.readline()).strip(), 16)
            if size == 0:
                return
            chunk = await reader.readexactly(size + 2)
            now = time.perf_counter()
            buf += chunk[:-2]
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        yield now, line[6:].decode()
    finally:
        writer.close()


async def _one(url: tuple[str, int], model: str, prompt: str, max_tokens: int) -> RequestTiming:
    t0 = time.perf_counter()
    last = None
    out = RequestTiming(ok=False)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    try:
        async for now, data in _post_stream(*url, "/v1/completions", body):
            if data == "[DONE]":
                break
            ch = json.loads(data)
            if "error" in ch:
                raise RuntimeError(ch["error"]["message"])
            if ch.get("usage"):
                out.output_tokens = ch["usage"]["completion_tokens"]
            if not ch["choices"] or not ch["choices"][0]["text"]:
                continue
            if last is None:
                out.ttft = now - t0
            else:
                out.itl.append(now - last)
            last = now
        out.latency = time.perf_counter() - t0
        out.ok = out.output_tokens > 0
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        out.error = f"{type(e).__name__}: {e}"
    return out


async def run_load(base_url: str, model: str, prompts: list[str], num_requests: int, max_tokens: int,
                   concurrency: int | None = None, request_rate: float | None = None, seed: int = 0):
    """Send `num_requests` requests (prompts in order, cycling); at most `concurrency` in flight, arrivals a Poisson
    process of `request_rate` per second (None: all at once). Returns (timings, wall seconds)."""
    parts = urlsplit(base_url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"--base-url must be http://HOST:PORT, got {base_url!r}")
    url = (parts.hostname, parts.port or 80)
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(seed)

    async def limited(p: str) -> RequestTiming:
        if gate is None:
            return await _one(url, model, p, max_tokens)
        async with gate:
            return await _one(url, model, p, max_tokens)

    await _one(url, model, prompts[0], min(max_tokens, 8))  # warm-up, not timed
    t0 = time.perf_counter()
    tasks = []
    for i in range(num_requests):
        tasks.append(asyncio.ensure_future(limited(prompts[i % len(prompts)])))
        if request_rate:
            await asyncio.sleep(rng.expovariate(request_rate))
    timings = await asyncio.gather(*tasks)
    return timings, time.perf_counter() - t0


def summarise(method: str, timings: list[RequestTiming], wall: float, concurrency: int | None,
              request_rate: float | None) -> CellResult:
    ok = [t for t in timings if t.ok]
    tokens = sum(t.output_tokens for t in ok)
    tpot = [(t.latency - t.ttft) / (t.output_tokens - 1) for t in ok if t.output_tokens > 1]
    return CellResult(method, concurrency, request_rate, len(timings), len(timings) - len(ok), wall, tokens,
                      tokens / wall if wall else 0.0, len(ok) / wall if wall else 0.0, _pcts([t.ttft for t in ok]),
                      _pcts([g for t in ok for g in t.itl]), _pcts(tpot), _pcts([t.latency for t in ok]))


def launch_server(serve_args: list[str], timeout: float = 600.0) -> tuple[subprocess.Popen, str]:
    """Start `echo-trtllm serve --port 0 ...` and return (process, base URL) once it listens."""
    proc = subprocess.Popen([sys.executable, "-m", "echo_trtllm.cli", "serve", "--port", "0", *serve_args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "listening on " in line:
            url = line.split("listening on ")[1].split()[0]
            # keep draining its output so a chatty server never blocks on a full pipe
            import threading

            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, url
    proc.kill()
    raise RuntimeError("the server did not start:\n" + "".join(lines[-20:]))
