#!/usr/bin/env bash
# Create .venv and install echo-trtllm with its test extras. torch is pinned to 2.13.0 first: on a machine
# without a GPU that is the CPU build, and it keeps pip from resolving an unpinned multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
