"""echo-trtllm: ECHO elastic speculative decoding, deployed the TensorRT-LLM way."""

__version__ = "0.1.0"
