#!/usr/bin/env bash
# GPU check of the ECHO plugin, for a machine with a CUDA GPU (H100/H200 expected), in under 8 minutes:
#   1. build plugins/ with CMake for sm_90a (libecho_plugin.so, libecho_host.so, echo_host_test) and run the
#      host test binary
#   2. the kernel tests on the GPU against the core (tests/plugins, backend "cuda"), the runtime's lossless
#      test on CUDA (tests/runtime/test_cuda_runtime.py)
#   3. the control-kernel microbenchmark: µs per step for B in {16, 64, 256}, K_max in {512, 2048}
# Uses the machine's python3 (with a CUDA build of torch); the repository is used in place (PYTHONPATH).
#   bash scripts/gpu_check.sh [OUTPUT_DIR]      (the log and the benchmark JSON are written there)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-gpu-check-out}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1

echo "== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nvcc --version | tail -1
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

echo "== 1. build (sm_90a)"
t0=$SECONDS
cmake -S plugins -B plugins/build -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release > "$OUT_DIR/cmake.log"
cmake --build plugins/build -j "$(nproc)" >> "$OUT_DIR/cmake.log"
echo "built in $((SECONDS - t0)) s"
plugins/build/echo_host_test

echo "== 2. kernels on the GPU vs the core; runtime lossless on CUDA"
export ECHO_PLUGIN_LIB="$PWD/plugins/build/libecho_plugin.so"
"$PY" -m pytest -q -p no:cacheprovider tests/plugins tests/runtime/test_cuda_runtime.py -rs

echo "== 3. microbenchmark (µs per step: gate x3 + budget + select & pack)"
"$PY" -m echo_trtllm.cli bench-kernels --batch-sizes 16,64,256 --k-max-values 512,2048 --backends torch,cuda --threads 1 \
    --iters 200 --warmup 20 --json "$OUT_DIR/kernel_bench.json"
echo "== done in $SECONDS s"
