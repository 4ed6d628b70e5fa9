"""ECHO as a drafter for TensorRT-LLM 1.2's PyTorch backend (`UserProvidedDecodingConfig(drafter=...)`).

    from tensorrt_llm import LLM
    from tensorrt_llm.llmapi import UserProvidedDecodingConfig
    from echo_trtllm.backends.trtllm import make_drafter
    drafter = make_drafter(draft_model, EchoConfig(policy="echo", max_depth=4), max_draft_len=4)
    llm = LLM(target, speculative_config=UserProvidedDecodingConfig(max_draft_len=4, drafter=drafter))

Written against TensorRT-LLM 1.2's `tensorrt_llm._torch.speculative.drafter.Drafter`; contract-tested against a
stand-in module mirroring its signatures (tests/backends/), not run with TensorRT-LLM here. docs/trtllm.md says
what of ECHO survives a linear-draft interface.
"""

from .drafter import EchoChainProposer, make_drafter

__all__ = ["EchoChainProposer", "make_drafter"]
