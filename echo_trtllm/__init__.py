"""echo-trtllm: ECHO elastic speculative decoding, deployed the TensorRT-LLM way.

    from echo_trtllm import LLM, SamplingParams, EchoConfig
"""

__version__ = "0.1.0"

_API = ("LLM", "SamplingParams", "EchoConfig", "RequestOutput", "CompletionOutput", "RequestStats")


def __getattr__(name: str):
    # Lazy: `import echo_trtllm.core` must not pull in the runtime, transformers or a model.
    if name in _API:
        from echo_trtllm import api

        return getattr(api, name)
    raise AttributeError(f"module 'echo_trtllm' has no attribute {name!r}")


__all__ = list(_API)
