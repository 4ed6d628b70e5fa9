"""A serving load generator in the way of vLLM's `benchmark_serving`: N streaming completion requests against an
OpenAI-compatible server, at a request rate (Poisson arrivals) or a fixed maximum concurrency, measuring per
request the time to first token (TTFT), the gaps between streamed events (ITL), the time per output token after
the first (TPOT) and the end-to-end latency, and overall output tokens/s and requests/s.

Two ways to run it:
- against a server that already runs (`--base-url`): one cell per concurrency;
- `--methods ar,echo`: for each method this launches `echo-trtllm serve --policy METHOD` itself (same models,
  same options otherwise), waits for it, runs every concurrency, stops it, then prints the methods side by side.

Every request uses the same prompts in the same order, greedy, `ignore_eos` and one `max_tokens`, so methods
produce the same number of tokens; a warm-up request per cell is not timed. With a range ratio r (`bench-serve
--max-tokens-range-ratio`, as vLLM's benchmark's `--random-range-ratio`) request i asks for its own `max_tokens`,
drawn uniformly from [max_tokens (1 - r), max_tokens (1 + r)] by its index and the seed (the round's under --duration) (`request_max_tokens`):
every method gets the same lengths in the same order. With one length for all, closed-loop clients that emit one
token a step (AR) finish together and are admitted together, so their prompts are prefilled as one batch, which
traffic with mixed lengths does not give them, while a speculating engine's requests drift apart.

Sustained serving (`run_sustained`, `--duration`): instead of a fixed number of requests, clients keep the load up
for a fixed time: at a fixed concurrency each of C clients sends its next request as soon as its last one ends; at
a request rate arrivals are a Poisson process (at most `concurrency` in flight when both are given). Requests ask
for `stream_options.continuous_usage_stats`, so every streamed chunk says how many tokens the request has so far,
and the cell's throughput is the tokens that arrived inside the measured window (after `warmup` seconds, for
`duration` seconds) over its length: requests cut by either edge count for what arrived inside, and nothing is
lost to a drain. The server's /metrics are read at both edges of the window (`scrape_metrics`), so the cell also
reports what the engine did inside it: the speculative share, mean accepted tokens, the controller's decisions
and exploration, and the online prices' predicted against measured step seconds.
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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

__all__ = ["RequestTiming", "CellResult", "run_load", "run_sustained", "scrape_metrics", "engine_stats", "summarise",
           "launch_server", "request_max_tokens"]

Clock = Callable[[], float]  # seconds


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


async def _post_stream(host: str, port: int, path: str, body: dict, clock: Clock = time.perf_counter):
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
            now = clock()
            buf += chunk[:-2]
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        yield now, line[6:].decode()
    finally:
        writer.close()


async def _one(url: tuple[str, int], model: str, prompt: str, max_tokens: int, arrivals: list | None = None,
               clock: Clock = time.perf_counter) -> RequestTiming:
    """One streamed completion. arrivals: when given, (time, tokens so far) of every chunk is appended to it (the
    server's continuous usage)."""
    t0 = clock()
    last = None
    out = RequestTiming(ok=False)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": arrivals is not None},
            "ignore_eos": True}
    try:
        async for now, data in _post_stream(*url, "/v1/completions", body, clock):
            if data == "[DONE]":
                break
            ch = json.loads(data)
            if "error" in ch:
                raise RuntimeError(ch["error"]["message"])
            if ch.get("usage"):
                out.output_tokens = ch["usage"]["completion_tokens"]
                if arrivals is not None:
                    arrivals.append((now, out.output_tokens))
            if not ch["choices"] or not ch["choices"][0]["text"]:
                continue
            if last is None:
                out.ttft = now - t0
            else:
                out.itl.append(now - last)
            last = now
        out.latency = clock() - t0
        out.ok = out.output_tokens > 0
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        out.error = f"{type(e).__name__}: {e}"
    return out


async def run_load(base_url: str, model: str, prompts: list[str], num_requests: int, max_tokens: int,
                   concurrency: int | None = None, request_rate: float | None = None, seed: int = 0,
                   range_ratio: float = 0.0):
    """Send `num_requests` requests (prompts in order, cycling); at most `concurrency` in flight, arrivals a Poisson
    process of `request_rate` per second (None: all at once); request i asks for `request_max_tokens(i, ...)`.
    Returns (timings, wall seconds)."""
    url = _endpoint(base_url, max_tokens, range_ratio)
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(seed)

    async def limited(p: str, n: int) -> RequestTiming:
        if gate is None:
            return await _one(url, model, p, n)
        async with gate:
            return await _one(url, model, p, n)

    await _one(url, model, prompts[0], min(max_tokens, 8))  # warm-up, not timed
    t0 = time.perf_counter()
    tasks = []
    for i in range(num_requests):
        tasks.append(asyncio.ensure_future(limited(prompts[i % len(prompts)],
                                                   request_max_tokens(i, max_tokens, range_ratio, seed))))
        if request_rate:
            await asyncio.sleep(rng.expovariate(request_rate))
    timings = await asyncio.gather(*tasks)
    return timings, time.perf_counter() - t0


def _endpoint(base_url: str, max_tokens: int, range_ratio: float) -> tuple[str, int]:
    """(host, port) of an http:// base URL; a bad URL or range ratio is named before any request."""
    request_max_tokens(0, max_tokens, range_ratio)
    parts = urlsplit(base_url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"--base-url must be http://HOST:PORT, got {base_url!r}")
    return parts.hostname, parts.port or 80


def request_max_tokens(index: int, max_tokens: int, range_ratio: float = 0.0, seed: int = 0) -> int:
    """Request `index`'s max_tokens: `max_tokens` itself at range ratio 0, else drawn uniformly from the integers in
    [max_tokens (1 - r), max_tokens (1 + r)] (at least 1) by the index and the seed alone."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"max_tokens range ratio must lie in [0, 1), got {range_ratio}")
    if range_ratio == 0.0:
        return max_tokens
    lo = max(1, round(max_tokens * (1.0 - range_ratio)))
    hi = max(lo, round(max_tokens * (1.0 + range_ratio)))
    return random.Random(seed * 1_000_003 + index).randint(lo, hi)


def scrape_metrics(base_url: str) -> dict[str, float]:
    """The server's /metrics as {series: value} (labels kept in the series name, e.g.
    'echo_trtllm_speculation_decisions_total{reason="probe"}'); {} when the server has none."""
    import urllib.request

    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def engine_stats(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the engine did between two scrapes (`scrape_metrics`): steps, the speculative share, mean accepted
    tokens, mean verified tokens, the controller's decisions by reason, the exploration's net loss as a share of
    the tokens, the predicted / measured step seconds and the mean absolute relative error of the prediction, the
    tokens the decisions expected / emitted, and the prices' median error at the end."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    p = "echo_trtllm_"
    steps = d.get(f"{p}steps_total", 0.0)
    if not steps:
        return {}
    seconds = d.get(f"{p}step_seconds_total", 0.0)
    predicted = d.get(f"{p}predicted_step_seconds_total", 0.0)
    emitted = d.get(f"{p}emitted_tokens_total", 0.0)
    net_loss = d.get(f"{p}exploration_loss_tokens", float("nan")) - d.get(f"{p}exploration_gain_tokens", float("nan"))
    decisions = {k.split('reason="')[1].rstrip('"}'): v for k, v in d.items()
                 if k.startswith(f"{p}speculation_decisions_total") and v}
    return {"steps": steps, "speculative_share": d.get(f"{p}speculative_steps_total", 0.0) / steps,
            "mat": emitted / max(d.get(f"{p}request_steps_total", 0.0), 1.0),
            "verified_per_step": d.get(f"{p}verified_tokens_total", 0.0) / steps,
            "decisions": decisions,
            "exploration_share": max(net_loss, 0.0) / emitted if emitted and net_loss == net_loss else float("nan"),
            "predicted_over_measured": predicted / seconds if seconds else float("nan"),
            "prediction_abs_error": d.get(f"{p}step_prediction_abs_error_seconds_total", 0.0) / seconds
            if seconds else float("nan"),
            "expected_over_emitted": d.get(f"{p}expected_tokens_total", 0.0) / d[f"{p}decided_tokens_total"]
            if d.get(f"{p}decided_tokens_total") else float("nan"),
            "step_prediction_error_median": after.get(f"{p}step_prediction_error", float("nan")),
            "step_seconds_mean": seconds / steps}


async def _sleep_until(t: float, clock: Clock) -> None:
    """Sleep until clock() reaches t, in slices of at most 50 ms (a clock that is not the wall's is read again)."""
    while (left := t - clock()) > 0:
        await asyncio.sleep(min(left, 0.05))


async def run_sustained(base_url: str, model: str, prompts: list[str], duration: float, warmup: float,
                        max_tokens: int, concurrency: int | None = None, request_rate: float | None = None,
                        seed: int = 0, clock: Clock = time.perf_counter, range_ratio: float = 0.0):
    """Keep the load up for warmup + duration seconds (module docstring). Returns (timings of the requests that
    finished inside the window, tokens that arrived inside it, the window's seconds, the metrics scraped at its
    two edges). clock: the window's time (a test gives one that advances with the engine's work, so that what
    falls inside the window does not depend on the machine's speed). range_ratio: request i asks for
    `request_max_tokens(i, max_tokens, range_ratio, seed)`."""
    url = _endpoint(base_url, max_tokens, range_ratio)
    if not concurrency and not request_rate:
        raise ValueError("sustained load needs a concurrency or a request rate")
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    await _one(url, model, prompts[0], min(max_tokens, 8), clock=clock)  # warm-up, not timed
    t0 = clock()
    start, end = t0 + warmup, t0 + warmup + duration
    streams: list[list] = []  # [timing (None until it ends), chunk arrivals, time sent] per request
    counter = iter(range(1 << 62))

    async def request() -> None:
        i = next(counter)
        record = [None, [], clock()]
        streams.append(record)  # before it streams: a request cut at the end still counts what arrived
        record[0] = await _one(url, model, prompts[i % len(prompts)],
                               request_max_tokens(i, max_tokens, range_ratio, seed), record[1], clock)

    before: dict = {}

    async def scrape_at(t: float) -> dict:
        await _sleep_until(t, clock)
        return await loop.run_in_executor(None, scrape_metrics, base_url)

    first_scrape = asyncio.ensure_future(scrape_at(start))
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    tasks: list[asyncio.Future] = []
    if request_rate is None:  # closed loop: C clients, back to back
        async def client() -> None:
            while clock() < end:
                await request()

        tasks = [asyncio.ensure_future(client()) for _ in range(concurrency)]
    else:
        async def limited() -> None:
            if gate is None:
                return await request()
            async with gate:
                if clock() < end:
                    await request()

        while clock() < end:
            tasks.append(asyncio.ensure_future(limited()))
            await _sleep_until(clock() + rng.expovariate(request_rate), clock)
    await _sleep_until(end, clock)
    before = await first_scrape
    after = await loop.run_in_executor(None, scrape_metrics, base_url)
    for t in tasks:  # requests still streaming: closing their connections aborts them on the server
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return (*_inside_window(streams, start, end), duration, before, after)


def _inside_window(streams: list[list], start: float, end: float) -> tuple[list[RequestTiming], int]:
    """(the requests sent and finished inside [start, end], the tokens that arrived inside it) of the streams'
    records [timing or None, [(time, tokens so far)], time sent]."""
    tokens = 0
    for _, arrivals, _ in streams:
        prev = 0
        for when, so_far in arrivals:
            if start <= when <= end:
                tokens += so_far - prev
            prev = so_far
    done = [timing for timing, arrivals, sent in streams
            if timing is not None and sent >= start and arrivals and arrivals[-1][0] <= end]
    return done, tokens


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
