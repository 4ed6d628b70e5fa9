"""A proposer whose drafting fails every other step (tests/backends/test_vllm.py, in vLLM's worker)."""

from echo_trtllm.backends.vllm import EchoProposer


class FailingProposer(EchoProposer):
    def __init__(self, vllm_config) -> None:
        super().__init__(vllm_config)
        inner, calls = self.speculator.propose, [0]

        def flaky(contexts, rows=None, clean=True):
            calls[0] += 1
            if calls[0] % 2 == 0:
                raise RuntimeError("injected drafting failure")
            return inner(contexts, rows, clean)

        self.speculator.propose = flaky
