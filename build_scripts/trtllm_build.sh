#!/usr/bin/env bash
# Export an echo-trtllm engine directory as TensorRT-LLM checkpoints and build TensorRT-LLM engines from them.
#
#   bash build_scripts/trtllm_build.sh ENGINE_DIR OUTPUT_DIR
#
# Written against TensorRT-LLM 1.2.x (the last line with trtllm-build; pin it: pip install 'tensorrt_llm~=1.2.0'),
# NOT RUN by the project: TensorRT-LLM cannot be installed where it is built. The export step runs anywhere; the
# build step runs only where `import tensorrt_llm` works (a GPU machine), otherwise it stops after writing
# OUTPUT_DIR/trtllm_build.sh. Speculative flags come from the engine's EchoConfig (--max_draft_len =
# max_nodes_per_request - 1); the ECHO plugin library (plugins/, CMake) is loaded into trtllm-build's process.
set -euo pipefail
ENGINE=${1:?usage: trtllm_build.sh ENGINE_DIR OUTPUT_DIR}
OUT=${2:?usage: trtllm_build.sh ENGINE_DIR OUTPUT_DIR}
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
"$PY" -m echo_trtllm.cli export --format trtllm --engine-dir "$ENGINE" --output "$OUT" \
    --plugin-lib "${ECHO_PLUGIN_LIB:-$HERE/plugins/build/libecho_plugin.so}"
if "$PY" -c "import tensorrt_llm" 2>/dev/null; then
  bash "$OUT/trtllm_build.sh"
else
  echo "TensorRT-LLM is not installed here: wrote $OUT/trtllm_build.sh; run it where TensorRT-LLM 1.2 is" >&2
fi
