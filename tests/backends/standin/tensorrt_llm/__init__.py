"""A STAND-IN for TensorRT-LLM, for contract tests only: the few names echo_trtllm.backends.trtllm touches, with
the signatures of TensorRT-LLM 1.2's sources (tensorrt_llm/_torch/speculative/drafter.py, 1.2.0rc2). Not
TensorRT-LLM; nothing here runs a model."""
