"""`echo-trtllm serve --tp-size 2`: a real server process that spawns its second rank, answers the official
`openai` client exactly as a single-process engine on the same models does, and on SIGTERM ends with its rank."""

import os
import signal
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from echo_trtllm import LLM, EchoConfig, SamplingParams
from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_EAGLE3, DEFAULT_TARGET

from .conftest import child_pids, listening_url, sigterm_ends_with

MODEL = "echo-tp"
FLAGS = ["--dtype", "float32", "--no-cost-model", "--fallback", "off", "--max-batch-size", "4"]


def test_serve_tp2_equals_one_process_and_ends_with_its_ranks():
    prompts = ["ROMEO:\nBut soft, what light", "def fibonacci(n):"]
    # the pair `serve --tp-size 2` loads with no models: the embedded target and its EAGLE-3 head (on rank 0)
    with LLM(DEFAULT_TARGET, DEFAULT_EAGLE3, speculative_config=EchoConfig(policy="echo"), dtype="float32",
             cost_model=None, fallback=False, max_batch_size=4) as llm:
        expected = [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0),
                                                  use_tqdm=False)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "echo_trtllm.cli", "serve", "--port", "0", "--tp-size", "2",
                             "--threads", "1", "--served-model-name", MODEL, *FLAGS],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = listening_url(proc, timeout=180)
        assert url, "the server did not start"
        ranks = child_pids(proc.pid)
        assert len(ranks) == 1, f"expected one spawned rank, found {ranks}"
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        got = [client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0).choices[0].text
               for p in prompts]
        assert got == expected
        sigterm_ends_with(proc, ranks, (0, -signal.SIGTERM), "the spawned rank", wait_s=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_killed_rank_turns_health_to_503_and_the_server_leaves():
    """A rank killed while the server idles: /health answers 503 at the first request after it (it answered 200
    with every request failing before), completions are refused with 503 instead of running into the dead group,
    and the watchdog tells uvicorn to drain and exit (`echo-trtllm serve` then exits 1)."""
    import json
    import urllib.error
    import urllib.request

    from echo_trtllm.serve.openai_server import watch_engine

    from .conftest import RunningServer

    llm = LLM(DEFAULT_TARGET, DEFAULT_DRAFT, speculative_config=EchoConfig(policy="echo"), tensor_parallel_size=2,
              dtype="float32", cost_model=None, fallback=False, max_batch_size=4)
    srv = None
    try:
        srv = RunningServer(llm)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert client.completions.create(model="echo-test", prompt="O", max_tokens=4, temperature=0).choices
        with urllib.request.urlopen(srv.url + "/health") as r:
            assert r.status == 200
        assert llm.is_alive
        rank = llm._tp_group.processes[0]
        rank.kill()
        rank.wait(30)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(srv.url + "/health")
        assert e.value.code == 503 and json.loads(e.value.read())["error"]["type"] == "service_unavailable"
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="echo-test", prompt="O", max_tokens=4, temperature=0)
        assert e.value.status_code == 503
        watch_engine(srv.server, srv.uvicorn, interval=0.05)
        deadline = time.monotonic() + 30
        while not srv.uvicorn.should_exit and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.uvicorn.should_exit and srv.server.engine_lost
    finally:
        if srv is not None:
            srv.stop()
        llm.shutdown()
