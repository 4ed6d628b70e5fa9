#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. The vLLM environment (.venv-vllm, scripts/setup_vllm.sh) is made
# too, so the tests of ECHO inside vLLM run the real engine; ECHO_VLLM=0 skips making it (those tests then skip).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${ECHO_VLLM:-1}" != 0 ]; then
  bash scripts/setup_vllm.sh
fi
exec .venv/bin/python -m pytest -q "$@"
