#!/usr/bin/env bash
# The control-plane microbenchmark of this checkout against an earlier commit, alternating runs (ABAB...), one
# cell, so the VM's drift between minutes hits both sides alike. Writes one JSON with every run and the medians.
#
#   bash scripts/bench_control_ab.sh REV [ROUNDS] [OUT.json]
#   e.g. bash scripts/bench_control_ab.sh c2e1e3f 5 docs/bench/control-ab-issue11.json
#
# REV's `bench-control` reports its own loop (before issue 11: the level-by-level loop with full draft
# distributions on the host); this checkout's reports the batched loop (the runtime's path) and the level loop.
set -euo pipefail
rev=${1:?usage: bench_control_ab.sh REV [ROUNDS] [OUT.json]}
rounds=${2:-5}
out=${3:-control-ab.json}
B=${B:-256}
KMAX=${KMAX:-2048}
here=$(pwd)
py=${PYTHON:-$here/.venv/bin/python}
work=$(mktemp -d)
trap 'git -C "$here" worktree remove --force "$work/old" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git worktree add --detach -q "$work/old" "$rev"
args=(bench-control --batch-sizes "$B" --k-max-values "$KMAX" --threads 1 --steps 50 --warmup 5)
for i in $(seq 1 "$rounds"); do
  (cd "$work/old" && PYTHONPATH="$work/old" "$py" -m echo_trtllm.cli "${args[@]}" --json "$work/old-$i.json" >/dev/null)
  PYTHONPATH="$here" "$py" -m echo_trtllm.cli "${args[@]}" --json "$work/new-$i.json" >/dev/null
  echo "round $i done" >&2
done
"$py" - "$work" "$rounds" "$rev" "$(git rev-parse --short HEAD)" "$out" <<'EOF'
import json, statistics, sys
work, rounds, rev, head, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
load = lambda side, i: json.load(open(f"{work}/{side}-{i}.json"))
runs = [{"old": load("old", i)["results"][0], "new": load("new", i)["results"][0]} for i in range(1, rounds + 1)]
old = [r["old"]["control_ms_median"] for r in runs]
new = [r["new"]["control_ms_median"] for r in runs]
levels = [r["new"].get("levels_ms_median") for r in runs]
summary = {
    "old_rev": rev, "new_rev": head, "rounds": rounds,
    "old_median_ms": statistics.median(old), "old_min_ms": min(old), "old_max_ms": max(old),
    "new_batched_median_ms": statistics.median(new), "new_batched_min_ms": min(new), "new_batched_max_ms": max(new),
    "new_levels_median_ms": statistics.median(levels),
    "new_over_old": statistics.median(new) / statistics.median(old),
}
json.dump({"summary": summary, "runs": runs, "machine": load("new", 1)["machine"]}, open(out, "w"), indent=2)
print(json.dumps(summary, indent=2))
EOF
