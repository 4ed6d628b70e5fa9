"""The OpenAI-compatible server, started for real on a loopback port and driven by the official `openai` client.

References: the in-process `LLM` API on the same models (same prompt, same SamplingParams), and for the load
test plain AR decoding of each prompt alone."""

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from echo_trtllm import LLM, EchoConfig, SamplingParams
from echo_trtllm.serve.protocol import chat_prompt_ids

from .conftest import MAX_TOKENS, N_DISCONNECT, N_STREAMS, RunningServer, listening_url

MODEL = "echo-test"


def _reference(llm, prompt, **params):
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)


def test_completion_equals_llm_api(served):
    c = served.client()
    prompt = "ROMEO:\nBut soft, what light"
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    ref = _reference(served.llm, prompt, max_tokens=20, temperature=0)
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")


def test_streamed_completion_equals_llm_api_and_ends_with_usage(served):
    c = served.client()
    prompt = "def main():\n    "
    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    ref = _reference(served.llm, prompt, max_tokens=24, temperature=0)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == ref.text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [ref.finish_reason]
    assert len([ch for ch in chunks if ch.choices]) > 2, "the answer must arrive in several events"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_batched_prompts_and_token_id_prompts(served):
    c = served.client()
    prompts = ["To be, or not to be", "import os\nimport sys\n\n"]
    r = c.completions.create(model=MODEL, prompt=prompts, max_tokens=10, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1]
    for ch, p in zip(r.choices, prompts):
        assert ch.text == _reference(served.llm, p, max_tokens=10, temperature=0).text
    ids = served.llm.tokenizer.encode(prompts[0])
    r = c.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert r.choices[0].text == _reference(served.llm, ids, max_tokens=10, temperature=0).text
    echoed = c.completions.create(model=MODEL, prompt=prompts[0], max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(prompts[0])


def test_chat_equals_llm_api_on_the_rendered_conversation(served):
    c = served.client()
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A parser, please."}]
    ids = chat_prompt_ids([(m["role"], m["content"]) for m in messages], served.llm.tokenizer)
    ref = _reference(served.llm, ids, max_tokens=16, temperature=0)
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ids) and r.object == "chat.completion"
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                            stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_sampling_fields_reach_the_engine(served):
    """seed + temperature + top_p + top_k + stop: the same answer as the LLM API with the same SamplingParams."""
    c = served.client()
    prompt = "HAMLET:\n"
    fields = dict(max_tokens=24, temperature=0.8, top_p=0.9, seed=1234, stop=["\n\n"])
    r = c.completions.create(model=MODEL, prompt=prompt, extra_body={"top_k": 20}, **fields)
    ref = _reference(served.llm, prompt, top_k=20, **fields)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    r2 = c.completions.create(model=MODEL, prompt=prompt, extra_body={"top_k": 20, "ignore_eos": True}, **fields)
    assert r2.choices[0].text == r.choices[0].text  # the stop string came first either way


def test_models_health_and_metrics(served):
    c = served.client()
    models = c.models.list()
    assert [m.id for m in models.data] == [MODEL]
    # the dtypes the engine runs ("auto" resolved), as LLM.dtype says, in /v1/models and /metrics
    dtypes = served.llm.dtype
    assert (models.data[0].dtype, models.data[0].draft_dtype) == (dtypes["target"], dtypes["draft"])
    assert models.data[0].batch_invariant is False
    with urllib.request.urlopen(served.url + "/health") as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
    before = _metrics(served.url)
    assert before["echo_trtllm_model_info"] == {_labels(dtype=dtypes["target"], draft_dtype=dtypes["draft"] or "none",
                                                         model=MODEL, batch_invariant="false"): 1.0}
    r = c.completions.create(model=MODEL, prompt="O", max_tokens=8, temperature=0)
    after = _metrics(served.url)
    ended = {k: after["echo_trtllm_requests_total"].get(k, 0) - before.get("echo_trtllm_requests_total", {}).get(k, 0)
             for k in (("length",), ("stop",))}  # (no series before the first request ends)
    assert sum(ended.values()) == 1
    gen = after["echo_trtllm_generation_tokens_total"][()] - before["echo_trtllm_generation_tokens_total"][()]
    assert gen == r.usage.completion_tokens
    steps, verified = after["echo_trtllm_steps_total"][()], after["echo_trtllm_verified_tokens_total"][()]
    assert steps > 0
    assert after["echo_trtllm_mean_verified_tokens_per_step"][()] == pytest.approx(verified / steps)
    assert 0 <= after["echo_trtllm_speculative_step_share"][()] <= 1
    assert after["echo_trtllm_requests_running"][()] == 0 and after["echo_trtllm_requests_waiting"][()] == 0


def _metrics(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics") as r:
        text = r.read().decode()
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(s.labels.values())] = s.value
    return out


def _labels(**labels) -> tuple:
    """A sample's key in `_metrics` (label values in the order the exposition writes them: by name)."""
    return tuple(v for _, v in sorted(labels.items()))


# ----------------------------------------------------------------------------------------------- under load



async def _stream_one(client, i: int, prompt: str, leave_after: int | None):
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             stream=True, extra_body={"request_tag": i})
    text, finish, events = "", None, 0
    async for ch in stream:
        events += 1
        text += ch.choices[0].text
        finish = ch.choices[0].finish_reason or finish
        if leave_after is not None and events >= leave_after:
            await stream.close()  # the client goes away mid-stream
            return i, text, "left"
    return i, text, finish


def _run_streams(server: RunningServer, prompts: list[str], leave: set[int]):
    async def main():
        client = server.async_client(timeout=600)
        try:
            return await asyncio.gather(*(_stream_one(client, i, p, 2 if i in leave else None)
                                          for i, p in enumerate(prompts)))
        finally:
            await client.close()

    return asyncio.run(main())


def test_256_concurrent_streams_equal_single_request_ar(served, load_prompts, ar_single):
    before = _metrics(served.url)
    results = _run_streams(served, load_prompts, leave=set())
    assert sorted(i for i, _, _ in results) == list(range(N_STREAMS)), "a stream was lost or duplicated"
    for i, text, finish in results:
        ref = ar_single[i]
        assert text == ref.text, f"stream {i} ({load_prompts[i]!r}) differs from its single-request AR reference"
        assert finish == ref.finish_reason
    assert served.idle(), f"not idle after the streams: {served.server.inflight} in flight, " \
                          f"{len(served.llm.executor.free_slots)} free slots"
    after = _metrics(served.url)
    steps = after["echo_trtllm_steps_total"][()] - before["echo_trtllm_steps_total"][()]
    spec = after["echo_trtllm_speculative_steps_total"][()] - before["echo_trtllm_speculative_steps_total"][()]
    assert spec > 0.5 * steps, "the load test must exercise speculative steps"
    emitted = after["echo_trtllm_emitted_tokens_total"][()] - before["echo_trtllm_emitted_tokens_total"][()]
    assert emitted == sum(len(r.token_ids) for r in ar_single)


def test_32_clients_leaving_midway_free_their_slots(served, load_prompts, ar_single):
    leave = set(random.Random(0).sample(range(N_STREAMS), N_DISCONNECT))
    before = _metrics(served.url)["echo_trtllm_requests_total"].get(("abort",), 0)
    results = _run_streams(served, load_prompts, leave)
    assert sorted(i for i, _, _ in results) == list(range(N_STREAMS))
    for i, text, finish in results:
        ref = ar_single[i]
        if i in leave:
            assert finish == "left" and ref.text.startswith(text)
        else:
            assert text == ref.text and finish == ref.finish_reason
    assert served.idle(), "a slot leaked after clients disconnected"
    aborted = _metrics(served.url)["echo_trtllm_requests_total"].get(("abort",), 0) - before
    assert 0 < aborted <= N_DISCONNECT  # a client may leave after its last token but before the final event
    # and the server still answers exactly
    r = served.client().completions.create(model=MODEL, prompt=load_prompts[0], max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == ar_single[0].text


def test_non_streamed_request_whose_client_leaves_is_aborted(served):
    c = served.client(timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        c.completions.create(model=MODEL, prompt="To be", max_tokens=200, temperature=0,
                             extra_body={"ignore_eos": True})
    assert served.idle(), "the abandoned request kept its slot"


# ----------------------------------------------------------------------------------------------- limits

def test_full_queue_answers_429_with_retry_after(pair_llm):
    llm = pair_llm(max_batch_size=1, max_seq_len=512)
    srv = RunningServer(llm, max_queue_size=0)
    try:
        c = srv.client()
        stream = c.completions.create(model=MODEL, prompt="ROMEO:\n", max_tokens=400, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        next(iter(stream))  # in flight: the one place is taken
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model=MODEL, prompt="HAMLET:\n", max_tokens=4)
        assert e.value.response.headers["retry-after"] == "1"
        assert "capacity" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:  # more prompts than the server can ever hold: not a 429
            c.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=4)
        assert e.value.body["param"] == "prompt"
        stream.close()
        assert srv.idle()
        r = c.completions.create(model=MODEL, prompt="HAMLET:\n", max_tokens=4, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop")
    finally:
        srv.stop()


def test_sigterm_drains_in_flight_streams_then_exits(tmp_path):
    """A real `echo-trtllm serve` process: SIGTERM while 4 streams run; each still ends with its final event and
    [DONE], then the process ends by the signal it was sent (uvicorn re-raises it after draining, the exit status
    supervisors expect) instead of being killed mid-request."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "echo_trtllm.cli", "serve", "--port", "0", "--max-batch-size", "4",
                             "--served-model-name", MODEL, "--drain-timeout", "60", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = listening_url(proc)
        assert url, "the server did not start"
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        streams = [client.completions.create(model=MODEL, prompt=p, max_tokens=48, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
                   for p in ("ROMEO:\n", "HAMLET:\n", "def f(", "import os\n")]
        iters = [iter(s) for s in streams]
        for it in iters:
            next(it)
        proc.send_signal(signal.SIGTERM)
        for it in iters:
            rest = list(it)
            assert rest and rest[-1].choices[0].finish_reason == "length"
        assert proc.wait(60) in (0, -signal.SIGTERM)
        with pytest.raises(openai.APIConnectionError):  # and it takes no new work
            client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_bench_serve_load_generator_counts_every_token(served):
    from echo_trtllm.bench.serve import run_load, summarise

    timings, wall = asyncio.run(run_load(served.url, MODEL, ["HAMLET:\n", "def f("], 6, 8, concurrency=3))
    assert all(t.ok and t.output_tokens == 8 for t in timings), [t.error for t in timings]
    assert all(0 < t.ttft <= t.latency for t in timings)
    cell = summarise("echo", timings, wall, 3, None)
    assert cell.requests == 6 and cell.failed == 0 and cell.output_tokens == 48
    with pytest.raises(ValueError, match="base-url"):
        asyncio.run(run_load("https://x", MODEL, ["a"], 1, 1))
    bad, _ = asyncio.run(run_load(served.url, "no-such-model", ["a"], 2, 4))
    assert not any(t.ok for t in bad) and all("404" in t.error for t in bad)


def test_a_range_ratio_gives_each_request_its_own_length_the_same_for_every_caller(served):
    """bench-serve --max-tokens-range-ratio: request i asks for request_max_tokens(i, ...), drawn by its index and
    the seed alone inside [n (1 - r), n (1 + r)], so every method meets the same lengths in the same order; with
    ignore_eos each request streams exactly that many tokens."""
    from echo_trtllm.bench.serve import request_max_tokens, run_load

    lengths = [request_max_tokens(i, 10, 0.5, seed=3) for i in range(200)]
    assert lengths == [request_max_tokens(i, 10, 0.5, seed=3) for i in range(200)]
    assert min(lengths) == 5 and max(lengths) == 15 and len(set(lengths)) == 11  # every length in range, drawn
    assert lengths != [request_max_tokens(i, 10, 0.5, seed=4) for i in range(200)]
    assert [request_max_tokens(i, 10) for i in range(5)] == [10] * 5
    assert {request_max_tokens(i, 1, 0.9) for i in range(50)} == {1, 2}  # never below one token
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="range ratio must lie in"):
            request_max_tokens(0, 10, bad)
    timings, _ = asyncio.run(run_load(served.url, MODEL, ["HAMLET:\n", "def f("], 5, 8, concurrency=2,
                                      range_ratio=0.5))
    assert [t.output_tokens for t in timings] == [request_max_tokens(i, 8, 0.5) for i in range(5)]


def test_continuous_usage_stats_count_the_tokens_so_far_in_every_chunk(served):
    """vLLM's stream_options.continuous_usage_stats through the official client: every chunk carries the usage so
    far, rising to the final count of the in-process reference."""
    c = served.client()
    prompt = "HAMLET:\n"
    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True}))
    ref = _reference(served.llm, prompt, max_tokens=20, temperature=0)
    counts = [ch.usage.completion_tokens for ch in chunks if ch.choices]
    assert counts == sorted(counts) and counts[-1] == len(ref.token_ids) and counts[0] >= 1
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text


def test_sustained_load_counts_the_tokens_inside_its_window_and_reads_the_engine(served):
    """bench-serve --duration: clients keep 3 requests in flight for a window after a warm-up; the tokens counted
    inside the window are at most what was streamed and at least the finished requests' tokens, and the engine's
    steps in the window are read from /metrics. The window's clock is the engine's work (one second per 20 tokens
    the server has generated), so what falls inside it does not depend on the machine's speed."""
    from echo_trtllm.bench.serve import engine_stats, run_sustained

    metrics = served.server.metrics.registry

    def work_clock() -> float:
        return (metrics.get_sample_value("echo_trtllm_generation_tokens_total") or 0.0) / 20

    done, tokens, window, before, after = asyncio.run(run_sustained(served.url, MODEL, ["HAMLET:\n", "def f("], 4.0,
                                                                    0.5, 8, concurrency=3, clock=work_clock))
    # 80 tokens inside the window, 3 clients: each client's requests of 8 tokens end inside it more than once
    assert window == 4.0 and done and all(t.ok and t.output_tokens == 8 for t in done)
    assert 8 * len(done) <= tokens
    stats = engine_stats(before, after)
    assert stats["steps"] > 0 and stats["mat"] >= 1.0
    streamed = after["echo_trtllm_generation_tokens_total"] - before["echo_trtllm_generation_tokens_total"]
    assert tokens <= streamed + 3 * 8  # requests cut at either edge count only what arrived inside
    with pytest.raises(ValueError, match="concurrency or a request rate"):
        asyncio.run(run_sustained(served.url, MODEL, ["a"], 1.0, 0.0, 4))


def test_a_normal_shutdown_is_not_an_engine_loss(pair_llm):
    """The watchdog that takes a server out when its engine is lost (tests/serve/test_tensor_parallel_serve.py)
    must not count uvicorn's own shutdown, which stops the engine too, as a loss (`echo-trtllm serve` would exit 1
    on every SIGTERM)."""
    from echo_trtllm.serve.openai_server import watch_engine

    llm = pair_llm(max_batch_size=2, max_seq_len=128)
    srv = RunningServer(llm)
    watcher = watch_engine(srv.server, srv.uvicorn, interval=0.01)
    assert srv.client().completions.create(model=MODEL, prompt="O", max_tokens=2, temperature=0).choices
    srv.stop()  # uvicorn's should_exit, as its SIGTERM handler sets it; the lifespan then shuts the engine down
    watcher.join(10)
    assert not llm.is_alive and not watcher.is_alive() and not srv.server.engine_lost
