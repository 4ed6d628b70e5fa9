#!/usr/bin/env bash
# Create .venv and install echo-trtllm with its test extras. torch is pinned to 2.13.0 first: on a machine
# without a GPU that is the CPU build, and it keeps pip from resolving an unpinned multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
# The plugin's host library (plugins/csrc/echo_host.cpp): the runtime's budget allocation and packing on the CPU
# (echo_trtllm.kernels). Rebuilt every time (a second); without a C++ compiler the runtime uses the core's PyTorch
# reference, with the same results.
CXX_BIN=$(command -v "${CXX:-g++}" || command -v c++ || true)
mkdir -p plugins/build
rm -f plugins/build/libecho_host.so  # never a build of older sources
if [ -n "$CXX_BIN" ] && "$CXX_BIN" -std=c++17 -O2 -ffp-contract=off -shared -fPIC -Iplugins/include \
    plugins/csrc/echo_host.cpp -o plugins/build/libecho_host.so.tmp; then
  mv plugins/build/libecho_host.so.tmp plugins/build/libecho_host.so
else
  rm -f plugins/build/libecho_host.so.tmp
  echo "setup: the plugin's host library was not built (no C++ compiler, or it failed);" \
       "the control plane runs on the PyTorch reference" >&2
fi
# The forward's CPU kernels (plugins/csrc/echo_cpu_forward.cpp: the RMS norm and the rotary embedding in one pass,
# echo_trtllm.models.cpu_kernels), built for this machine's CPU; without them the eager PyTorch code runs.
rm -f plugins/build/libecho_cpu_forward.so
if [ -n "$CXX_BIN" ] && "$CXX_BIN" -std=c++17 -O3 -march=native -ffp-contract=off -Wall -Wextra -shared -fPIC -pthread \
    plugins/csrc/echo_cpu_forward.cpp -o plugins/build/libecho_cpu_forward.so.tmp; then
  mv plugins/build/libecho_cpu_forward.so.tmp plugins/build/libecho_cpu_forward.so
else
  rm -f plugins/build/libecho_cpu_forward.so.tmp
  echo "setup: the forward's CPU kernels were not built; the eager norm and rotary embedding run" >&2
fi
