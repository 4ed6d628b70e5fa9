#!/usr/bin/env bash
# The tuned EAGLE-3 table: every method with the same head and its own best shape, one side-by-side bench per
# batch size (issue 10).
#
#   bash scripts/bench_eagle3_tuned.sh qwen      # Qwen2.5-Coder-1.5B + its trained head (fetched / trained once)
#   bash scripts/bench_eagle3_tuned.sh default   # the embedded pair + its committed head
#
# Steps, all on the prompt set's calibration side until the last one:
#   1. calibrate (cost curve with its tokens x context grid, the step overhead, the gate's samples);
#   2. trace a wide eagle2 tree (the tree source) on calibration prompts;
#   3. simulate every shape of bench.tune's grid on those trees with that cost model (bench.simulate replays
#      each policy through the runtime's drafting loop) and pick each method's fastest shape per batch size;
#   4. per batch size, one bench on held-out prompts: AR, every method pure with its tuned shape, ECHO also
#      with the AR fallback.
# Environment: BS (batch sizes), MAXTOK, ROUNDS, WARMUP, WAVES (requests per cell = WAVES x B, B in flight: the
# batch stays full until the last wave drains; default 1, one closed batch; the file names do not carry it, so give a
# waved run its own TAG), OUT (default docs/bench), PY; SRC_B, SRC_TOKENS, CONTEXT (tuning);
# CAL_PROMPTS, CAL_TOKENS (the calibration's warm-up);
# DTYPE (default float32: an AVX2-only CPU has no bf16 instructions; bfloat16 where it has them, docs/dtype.md);
# TRACE (the tuning trace, default $OUT/$NAME-tune-trace.json, shared by every TAG; give another to trace anew);
# TAG (suffix of the calibration's, the simulation's and the benches' file names, so a rerun keeps earlier
# results; the tuning trace is shared);
# DROP (tuned methods left out of the bench, a regex of policy names, e.g. "eagle2|ddd": a B = 64 round is long);
# PAPER_ABLATIONS=1 (also the paper's ablations with ECHO's tuned shape, pure: echo-dense, a threshold at every
# depth, and echo-fixed, no budget moved between requests);
# FALLBACK_ALL=1 (every tuned method twice, pure and +fallback; default: pure, and ECHO also +fallback);
# AR_BOTH_ENDS=1 (AR at both ends of every round, ratios to AR interpolated in time, AR's drift reported: bench
# --ar-both-ends; one more AR cell a round);
# CAL (a calibration file to use instead of $OUT/$NAME$TAG-calibration.json: a rerun under another TAG keeps it);
# MAXSEQ (context per request, default 1024: the bench holds one engine per method at once, so at B = 64 the Qwen
# pair's float32 KV caches need MAXSEQ=448 to fit 24 GiB; HumanEval's longest eval prompt is 391 tokens).
set -euo pipefail
# the whole script is one block, read before any of it runs: editing this file while a bench runs (hours) cannot
# make bash resume at a stale offset and run a half-line or a command twice
{
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WHICH=${1:-default}
OUT=${OUT:-docs/bench}
BS=${BS:-"1 4 16 64"}
MAXTOK=${MAXTOK:-16}
ROUNDS=${ROUNDS:-2}
MAXSEQ=${MAXSEQ:-1024}
WARMUP=${WARMUP:-1}  # untimed rounds first: without one, the first timed round's first cell (AR) pays the cold start
# the tree source: eagle2 drafts its full tree (top-4 frontier, 6 levels: 84 nodes per request) whatever it
# verifies, and traces record every drafted node, so a cheap 8-node verification gives the whole tree
SRC="eagle2:total_tokens=8:max_depth=6"
SRC_B=${SRC_B:-16}
SRC_TOKENS=${SRC_TOKENS:-32}
CONTEXT=${CONTEXT:-192}  # the cost grid is read at this context (HumanEval prompt + output, tokens)
# the calibration's warm-up: 24 of the 41 calibration-side HumanEval prompts, 32 tokens each (~100 steps at B = 4,
# ~400 gate samples per depth; 8 prompts x 16 tokens gave ~50 and a depth-1 threshold cut from a dozen rejections)
CAL_PROMPTS=${CAL_PROMPTS:-24}
CAL_TOKENS=${CAL_TOKENS:-32}
case "$WHICH" in
  qwen)
    TARGET=$($PY -m echo_trtllm.models.fetch qwen2.5-coder-1.5b)
    HEAD=$($PY build_scripts/qwen_eagle3.py)
    MODEL=(--model "$TARGET" --draft-model "$HEAD")
    NAME=qwen-eagle3 ;;
  default)
    MODEL=(--draft-model echo_trtllm/models/default/eagle3)
    NAME=default-eagle3-tuned ;;
  *) echo "usage: $0 qwen|default" >&2; exit 2 ;;
esac
COMMON=("${MODEL[@]}" --dtype "${DTYPE:-float32}" --prompt-set humaneval)
TRACE=${TRACE:-$OUT/$NAME-tune-trace.json}
CAL=${CAL:-$OUT/$NAME${TAG:-}-calibration.json}
if [ ! -f "$CAL" ]; then
  $PY -m echo_trtllm.cli calibrate "${COMMON[@]}" --num-prompts "$CAL_PROMPTS" --batch-size 4 --max-tokens "$CAL_TOKENS" \
    --grid --repeats 2 \
    --cost-tokens 1,2,4,8,16,32,64,128,256 --output "$CAL"
fi
if [ ! -f "$TRACE" ]; then
  $PY -m echo_trtllm.cli bench "${COMMON[@]}" --methods "$SRC" --batch-sizes "$SRC_B" --fallback off \
    --prompt-split calibration --max-tokens "$SRC_TOKENS" --rounds 1 --warmup-rounds 0 --calibration "$CAL" --trace "$TRACE" \
    --json "${TRACE%-trace.json}-source.json"
fi
# one simulation file per set of batch sizes: a later run for other batch sizes keeps the earlier one
SIM=$OUT/$NAME${TAG:-}-tune-sim$( [ "$BS" = "1 4 16 64" ] || echo "-b$(echo $BS | tr ' ' -)" )
$PY -m echo_trtllm.cli simulate --k-max 1073741824 --trace "$TRACE" --calibration "$CAL" --tree-source "$SRC" \
  --methods "$($PY -m echo_trtllm.bench.tune --grid)" --batch-sizes "$(echo $BS | tr ' ' ,)" --steps 40 \
  --context "$CONTEXT" \
  --json "$SIM.json" > "$SIM.md"
for B in $BS; do
  M=$($PY -m echo_trtllm.bench.tune --simulation "$SIM.json" --batch-size "$B")
  E=$(echo "$M" | tr , '\n' | grep '^echo')
  if [ -n "${DROP:-}" ]; then M=$(echo "$M" | tr , '\n' | grep -Ev "^($DROP)(:|$)" | paste -sd, -); fi
  echo "B=$B tuned: $M" >&2
  # AR listed too: its row (and the warning when its own spread over rounds exceeds 10 %) is in the table
  A=""
  if [ -n "$E" ]; then
    [ -z "${PAPER_ABLATIONS:-}" ] || A="$A,${E/#echo/echo-dense},${E/#echo/echo-fixed}"
  fi
  if [ -n "${FALLBACK_ALL:-}" ]; then
    # ablations are pure rows only: each gets its own :fallback=off (tuned entries carry no fallback= option)
    F="off,on" W="" A=$(echo "$A" | sed 's/\(,[^,]*\)/\1:fallback=off/g')
  else
    F=off W="${E:+,$E:fallback=on}"
  fi
  $PY -m echo_trtllm.cli bench "${COMMON[@]}" --methods "ar,$M$A$W" \
    --batch-sizes "$B" --fallback "$F" \
    --max-tokens "$MAXTOK" --max-seq-len "$MAXSEQ" --rounds "$ROUNDS" --warmup-rounds "$WARMUP" --waves "${WAVES:-1}" \
    --calibration "$CAL" ${AR_BOTH_ENDS:+--ar-both-ends} \
    --json "$OUT/$NAME${TAG:-}-b$B.json" --markdown "$OUT/$NAME${TAG:-}-b$B.md" --trace "$OUT/$NAME${TAG:-}-b$B-trace.json"
done
exit
}
