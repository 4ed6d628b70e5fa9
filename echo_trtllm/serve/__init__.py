"""Serving: an OpenAI-compatible HTTP server (`echo-trtllm serve`). Needs the `serve` extra (FastAPI, uvicorn,
prometheus-client); importing `echo_trtllm` never imports this package."""
