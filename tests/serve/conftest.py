import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from echo_trtllm.serve.openai_server import OpenAIServer, bound_port, uvicorn_server  # noqa: E402


class RunningServer:
    """A real uvicorn server on a free loopback port, on a thread of the test process."""

    def __init__(self, llm, **options) -> None:
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
        ex = self.llm.executor
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (self.server.inflight == 0 and not ex.running and not ex.waiting
                    and len(ex.free_slots) == ex.max_batch_size):
                return True
            time.sleep(0.05)
        return False

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
