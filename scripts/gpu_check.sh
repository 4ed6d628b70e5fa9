#!/usr/bin/env bash
# GPU check of the ECHO plugin and runtime, for a machine with a CUDA GPU (H100/H200 expected), in under 8 minutes:
#   1. build plugins/ with CMake for sm_90a (libecho_plugin.so, libecho_host.so, echo_host_test, echo_cuda_driver)
#      and run the host test binary
#   2. compute-sanitizer memcheck, racecheck and synccheck on the C++ driver of the C ABI (small random trees),
#      then the driver's full check (CUDA == host path on random trees, N past 5k, capacity mode)
#   3. the kernel tests on the GPU against the core (tests/plugins, backend "cuda"), the runtime's lossless test on
#      CUDA asserting that the plugin's CUDA backend is the one the step used
#   4. the control step's microbenchmark in C++ with CUDA events, launched plainly and replayed from a CUDA graph,
#      B in {16, 64, 256} x K_max in {512, 2048} (cuda_bench.jsonl), and the Python-level kernel benchmark
#   5. host syncs of real ECHO steps: the runtime's ledger against torch's CUDA sync debug mode (sync_report.json)
# Uses the machine's python3 (with a CUDA build of torch); the repository is used in place (PYTHONPATH).
#   bash scripts/gpu_check.sh [OUTPUT_DIR]      (logs, JSON and JSON lines are written there)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-gpu-check-out}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1
status=0
step() { echo "== $1 ($((SECONDS))s)"; }

step "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nvcc --version | tail -1
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

step "1. build (sm_90a)"
cmake -S plugins -B plugins/build -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release > "$OUT_DIR/cmake.log"
cmake --build plugins/build -j "$(nproc)" >> "$OUT_DIR/cmake.log"
plugins/build/echo_host_test

step "2. compute-sanitizer on the C ABI driver; CUDA == host on random trees"
if command -v compute-sanitizer > /dev/null; then
  for tool in memcheck racecheck synccheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 3 plugins/build/echo_cuda_driver check --small \
      > "$OUT_DIR/sanitizer-$tool.log" 2>&1 && echo "$tool: clean" || { echo "$tool: ERRORS (sanitizer-$tool.log)"; status=1; }
    tail -3 "$OUT_DIR/sanitizer-$tool.log"
  done
else
  echo "compute-sanitizer not found: sanitizer runs skipped"; status=1
fi
plugins/build/echo_cuda_driver check || status=1

step "3. kernels on the GPU vs the core; runtime lossless on CUDA with the CUDA backend"
export ECHO_PLUGIN_LIB="$PWD/plugins/build/libecho_plugin.so"
"$PY" -m pytest -q -p no:cacheprovider tests/plugins tests/runtime/test_cuda_runtime.py -rs || status=1

step "4. control-step microbenchmark: C++ with CUDA events, plain and CUDA graph (µs per step)"
plugins/build/echo_cuda_driver bench --iters 500 | tee "$OUT_DIR/cuda_bench.jsonl" || status=1
"$PY" -m echo_trtllm.cli bench-kernels --batch-sizes 16,64,256 --k-max-values 512,2048 --backends torch,cuda --threads 1 \
    --iters 200 --warmup 20 --json "$OUT_DIR/kernel_bench.json" || status=1

step "5. host syncs per step: the runtime's ledger vs torch's CUDA sync debug mode"
"$PY" scripts/sync_report.py "$OUT_DIR/sync_report.json" || status=1

step "done, status $status"
exit $status
