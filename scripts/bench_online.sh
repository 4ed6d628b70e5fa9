#!/usr/bin/env bash
# Issue 32's measurements: ECHO out of the box (no calibration file, default config) against AR and the best tuned
# tree, in closed batches and in sustained serving, on one pair; plus the online prices' prediction error.
#
#   bash scripts/bench_online.sh default        # the embedded pair (target + its separate tiny draft)
#   bash scripts/bench_online.sh qwen-draft     # Qwen2.5-Coder-1.5B + Qwen2.5-Coder-0.5B (GGUF, bfloat16)
#   bash scripts/bench_online.sh qwen-head      # Qwen2.5-Coder-1.5B + its EAGLE-3 head (build_scripts/qwen_eagle3.py)
#
# Steps (each writes docs/bench/online-$WHICH-*.json beside its markdown; skip any with SKIP="closed serve ..."):
#   closed   echo-trtllm bench: AR, ECHO (+fallback, the default), ECHO pure and (default pair) the tree pure and
#            +fallback at B = 1, 4, 16, 64, 32 tokens, ROUNDS timed rounds after a warm-up round, AR at both ends
#   serve    echo-trtllm bench-serve --duration: AR, ECHO, the tree +fallback at concurrency CONCURRENCY,
#            DURATION seconds per cell after WARMUP, ROUNDS rounds alternating the order (METHODS: ar,echo,TREE+fallback)
#   poisson  the same at RATES Poisson arrivals
#   online   echo-trtllm bench-online: the prices' prediction error after 50 steps at B = 1, 16, 64 and
#            the controller's expected vs emitted tokens
#   hf       (qwen-draft) B = 1 beside HF transformers' assisted generation (4 draft tokens) in the same process
# Environment: ROUNDS (3), DURATION (120), WARMUP (15), BATCHES (closed: 1 4 16 64), CONCURRENCY (serve: 1,4,16,64),
# RATES (per pair: near AR's capacity at concurrency 16),
# TREE (the tree to compare, per pair), CLOSED (the closed-batch methods), PROMPTS (per pair), OUT (docs/bench),
# PY, SKIP; for qwen-head, TARGET (the 1.5B target: GGUF or HF directory) and HEAD (the head directory) override
# the fetched GGUF and build_scripts/qwen_eagle3.py's default head.
set -euo pipefail
{
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WHICH=${1:-default}
OUT=${OUT:-docs/bench}
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-120}
WARMUP=${WARMUP:-15}
SKIP=${SKIP:-}
BATCHES=${BATCHES:-1 4 16 64}
CONCURRENCY=${CONCURRENCY:-1,4,16,64}
CLI=(.venv/bin/echo-trtllm)
case "$WHICH" in
  default)
    MODEL=(--draft-model echo_trtllm/models/default/draft)
    PROMPTS=${PROMPTS:-mixed}
    TREE=${TREE:-chain:num_draft_tokens=2}
    RATES=${RATES:-20}
    MAXSEQ=1024
    CLOSED=${CLOSED:-"ar,echo,echo:fallback=off,${TREE}:fallback=off,${TREE}:fallback=on"}
    ;;
  qwen-draft)
    TARGET=$($PY -m echo_trtllm.models.fetch qwen2.5-coder-1.5b)
    DRAFT=$($PY -m echo_trtllm.models.fetch qwen2.5-coder-0.5b)
    MODEL=(--model "$TARGET" --draft-model "$DRAFT")
    PROMPTS=${PROMPTS:-humaneval}
    TREE=${TREE:-chain:num_draft_tokens=2}
    RATES=${RATES:-0.7}
    MAXSEQ=512
    CLOSED=${CLOSED:-"ar,echo,echo:fallback=off"}
    ;;
  qwen-head)
    TARGET=${TARGET:-$($PY -m echo_trtllm.models.fetch qwen2.5-coder-1.5b)}
    HEAD=${HEAD:-$($PY build_scripts/qwen_eagle3.py)}
    MODEL=(--model "$TARGET" --draft-model "$HEAD")
    PROMPTS=${PROMPTS:-humaneval}
    TREE=${TREE:-static:static_nodes=2}
    RATES=${RATES:-0.7}
    MAXSEQ=512
    CLOSED=${CLOSED:-"ar,echo,echo:fallback=off"}
    ;;
  *) echo "usage: $0 default|qwen-draft|qwen-head" >&2; exit 2 ;;
esac
NAME=online-$WHICH
skip() { [[ " $SKIP " == *" $1 "* ]]; }

if ! skip closed; then
  for B in $BATCHES; do
    "${CLI[@]}" bench "${MODEL[@]}" --prompt-set "$PROMPTS" --batch-sizes "$B" --max-tokens 32 --max-seq-len "$MAXSEQ" \
      --methods "$CLOSED" \
      --rounds "$ROUNDS" --warmup-rounds 1 --ar-both-ends \
      --json "$OUT/$NAME-closed-b$B.json" --markdown "$OUT/$NAME-closed-b$B.md"
  done
fi
serve() {  # bench-serve's sustained cells for AR, ECHO and the tree; the arguments name the load and the JSON
  "${CLI[@]}" bench-serve "${MODEL[@]}" --prompts "$PROMPTS" --methods "${METHODS:-ar,echo,${TREE}:fallback=on}" \
    --duration "$DURATION" --warmup-seconds "$WARMUP" --max-tokens 64 --max-seq-len "$MAXSEQ" --rounds "$ROUNDS" "$@"
}
if ! skip serve; then
  serve --concurrency "$CONCURRENCY" --json "$OUT/$NAME-serve.json"
fi
if ! skip poisson; then
  serve --concurrency 64 --request-rate "$RATES" --json "$OUT/$NAME-serve-poisson.json"
fi
if ! skip online; then
  $PY -m echo_trtllm.cli bench-online "${MODEL[@]}" --prompt-set "$PROMPTS" --batch-sizes 1,16,64 --steps 150 \
    --max-seq-len "$MAXSEQ" --json "$OUT/$NAME-prices.json"
fi
if [ "$WHICH" = qwen-draft ] && ! skip hf; then
  "${CLI[@]}" bench "${MODEL[@]}" --prompt-set "$PROMPTS" --batch-sizes 1 --max-tokens 48 --max-seq-len "$MAXSEQ" \
    --methods ar,echo --rounds "$ROUNDS" --warmup-rounds 1 --hf-assisted 4 --dtype bfloat16 \
    --json "$OUT/$NAME-hf-b1.json" --markdown "$OUT/$NAME-hf-b1.md"
fi
exit 0
}
