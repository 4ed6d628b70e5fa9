import signal
import subprocess
import threading
import time

import pytest

from echo_trtllm import LLM, EchoConfig, SamplingParams


def engine_idle(llm, timeout: float = 30.0, also=lambda: True) -> bool:
    """Wait until the engine runs and queues nothing and every KV slot is free again (and `also()` holds)."""
    ex = llm.executor
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if also() and not ex.running and not ex.waiting and len(ex.free_slots) == ex.max_batch_size:
            return True
        time.sleep(0.05)
    return False


def listening_url(proc, timeout: float = 120.0) -> str | None:
    """The URL an `echo-trtllm serve` process prints once it listens (None if it ends or times out first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            return None
        if "listening on " in line:
            return line.split("listening on ")[1].split()[0]
    return None


def child_pids(pid: int, recursive: bool = False) -> list[int]:
    """The processes `pid` started (and theirs, recursively)."""
    out, todo = [], [pid]
    while todo:
        kids = [int(x) for x in subprocess.run(["pgrep", "-P", str(todo.pop())], capture_output=True,
                                               text=True).stdout.split()]
        out += kids
        todo += kids if recursive else []
    return out


def process_running(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie still answers kill(0))."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def sigterm_ends_with(proc, children: list[int], exit_codes: tuple[int, ...], what: str, wait_s: float = 90,
                      gone_s: float = 30) -> None:
    """SIGTERM `proc`; it must exit with one of `exit_codes` within wait_s and `children` end within gone_s."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(wait_s) in exit_codes
    deadline = time.monotonic() + gone_s
    while any(process_running(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(process_running(p) for p in children), f"{what} outlived the server"


class RunningServer:
    """A real uvicorn server on a free loopback port, on a thread of the test process."""

    def __init__(self, llm, **options) -> None:
        from echo_trtllm.serve.openai_server import OpenAIServer, bound_port, uvicorn_server

        self.llm = llm
        self.server = OpenAIServer(llm, "echo-test", **options)
        self.uvicorn = uvicorn_server(self.server, "127.0.0.1", 0, drain_timeout=5, log_level="warning")
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.port = bound_port(self.uvicorn)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kw)

    def async_client(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kw)

    def idle(self, timeout: float = 30.0) -> bool:
        """Wait until nothing is in flight and every KV slot is free again."""
        return engine_idle(self.llm, timeout, lambda: self.server.inflight == 0)

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def served(pair_llm):
    """The embedded pair behind the OpenAI server, ECHO policy, 32 requests in the batch, no AR fallback (every step
    speculates, so every exactness test below covers speculative decoding)."""
    llm = pair_llm(max_batch_size=32, max_seq_len=256, fallback=False)
    srv = RunningServer(llm)
    yield srv
    srv.stop()


# the load tests of both servers: 256 concurrent streams of 12 greedy tokens, 32 of whose clients leave midway
N_STREAMS, N_DISCONNECT, MAX_TOKENS = 256, 32, 12


@pytest.fixture(scope="session")
def load_prompts(prompts):
    return [f"{i}. {prompts[i % len(prompts)]}" for i in range(N_STREAMS)]


@pytest.fixture(scope="session")
def ar_single(default_pair, load_prompts):
    """Each prompt decoded alone by plain AR through the LLM API."""
    target, _, tok = default_pair
    with LLM(target, None, tokenizer=tok, speculative_config=EchoConfig(policy="ar"), max_batch_size=1,
             max_seq_len=256) as llm:
        return [llm.generate(p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False)
                for p in load_prompts]


