"""A soak of `echo-trtllm serve`: many requests through one server process, mixed as clients send them — plain
completions, streamed ones, streams the client leaves after their first event, bad requests — at a fixed number
in flight; the server's resident memory sampled as the requests go by, and at the end /metrics' counts compared
with what was sent.

    python scripts/soak_serve.py --requests 20000 --out docs/bench/soak-serve.json [-- SERVE FLAGS...]

The server runs on the embedded pair unless serve flags after `--` say otherwise. Reports the RSS curve (MiB at
each sample), the requests by kind and outcome, and whether the metrics' counts equal them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = {"complete": 0.70, "stream": 0.15, "leave": 0.10, "bad": 0.05}  # shares of the requests sent


def rss_mib(pid: int) -> float:
    """Resident memory of the process and its children (a tensor-parallel server's ranks), MiB."""
    total = 0
    for p in [pid] + [int(x) for x in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                                      text=True).stdout.split()]:
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (FileNotFoundError, StopIteration):
            continue
    return total / 1024


async def _request(host: str, port: int, kind: str, prompt: str, max_tokens: int) -> str:
    """One request of `kind`; returns its outcome: "ok", "left" (the client closed the stream after one event),
    an HTTP status for a refused one, or "error: ..."."""
    from echo_trtllm.bench.serve import _post_stream

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if kind == "bad":
        body["max_tokens"] = 0
    if kind in ("stream", "leave"):
        body["stream"] = True
        stream = _post_stream(host, port, "/v1/completions", body)
        try:
            async for _, data in stream:
                if kind == "leave":
                    return "left"
                if data == "[DONE]":
                    return "ok"
            return "error: stream ended without [DONE]"
        except RuntimeError as e:
            return f"error: {e}"
        finally:
            await stream.aclose()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        data = json.dumps(body).encode()
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        await reader.read()
        return "ok" if status == 200 else str(status)
    finally:
        writer.close()


async def soak(host: str, port: int, pid: int, n: int, concurrency: int, max_tokens: int, sample_every: int,
               seed: int) -> dict:
    from echo_trtllm.bench.prompts import load_prompts

    rng = random.Random(seed)
    prompts = load_prompts("humaneval", "eval")
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=n)
    outcomes: dict[str, dict[str, int]] = {k: {} for k in ("complete", "stream", "leave", "bad")}
    curve = [(0, rss_mib(pid))]
    done = 0
    t0 = time.perf_counter()
    queue = iter(enumerate(kinds))

    async def worker() -> None:
        nonlocal done
        for i, kind in queue:
            out = await _request(host, port, kind, prompts[i % len(prompts)][:400], max_tokens)
            outcomes[kind][out] = outcomes[kind].get(out, 0) + 1
            done += 1
            if done % sample_every == 0:
                curve.append((done, rss_mib(pid)))
                print(f"{done} requests, {time.perf_counter() - t0:.0f} s, RSS {curve[-1][1]:.0f} MiB", flush=True)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"outcomes": outcomes, "rss_mib": curve, "seconds": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--sample-every", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mix", help="shares of the request kinds as KIND=SHARE,... (default: "
                    + ",".join(f"{k}={v}" for k, v in KINDS.items()) + ")")
    ap.add_argument("--out", required=True)
    ap.add_argument("serve_flags", nargs=argparse.REMAINDER, help="-- flags for echo-trtllm serve")
    args = ap.parse_args()
    flags = args.serve_flags[1:] if args.serve_flags[:1] == ["--"] else args.serve_flags
    if args.mix:
        mix = {k: float(v) for k, v in (part.split("=") for part in args.mix.split(","))}
        unknown = set(mix) - set(KINDS)
        if unknown:
            ap.error(f"--mix: unknown kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
        KINDS.clear()
        KINDS.update(mix)
    from echo_trtllm.bench.run import report_meta
    from echo_trtllm.bench.serve import scrape_metrics

    proc = subprocess.Popen([sys.executable, "-m", "echo_trtllm.cli", "serve", "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        url = None
        for line in proc.stdout:
            if "listening on " in line:
                url = line.split("listening on ")[1].split()[0]
                break
        if url is None:
            print("the server did not start", file=sys.stderr)
            return 1
        host, port = url.removeprefix("http://").rsplit(":", 1)
        result = asyncio.run(soak(host, int(port), proc.pid, args.requests, args.concurrency, args.max_tokens,
                                  args.sample_every, args.seed))
        time.sleep(1.0)  # the last aborts reach the engine at its next step
        metrics = scrape_metrics(url)
    finally:
        proc.terminate()
        proc.wait(120)
    o = result["outcomes"]
    accepted = sum(v for k in ("complete", "stream", "leave") for s, v in o[k].items() if s in ("ok", "left"))
    ended = sum(v for k, v in metrics.items() if k.startswith("echo_trtllm_requests_total"))
    rejected = metrics.get('echo_trtllm_rejected_requests_total{status="400"}', 0.0)
    checks = {"requests_ended_by_metrics": ended, "requests_accepted_by_clients": accepted,
              "rejected_400_by_metrics": rejected, "bad_sent": sum(o["bad"].values()),
              "equal": ended == accepted and rejected == o["bad"].get("400", 0) == sum(o["bad"].values())}
    meta = report_meta("scripts/soak_serve.py", sys.argv[1:])
    meta["command"] = meta["command"].replace("python -m ", "python ", 1)
    report = {"meta": {**meta, "serve_flags": flags,
                       "requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                       "kinds": KINDS},
              **result, "metrics_check": checks,
              "metrics": {k: v for k, v in metrics.items() if k.startswith(("echo_trtllm_requests_total",
                                                                            "echo_trtllm_rejected"))}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({"rss_mib": result["rss_mib"], "metrics_check": checks}))
    return 0 if checks["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
