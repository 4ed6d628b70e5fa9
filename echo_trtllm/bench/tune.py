"""Pick each method's tree shape from a simulation over calibration traces (SIMULATION-based tuning).

    echo-trtllm simulate --trace cal-trace.json --calibration cal.json --tree-source eagle2:total_tokens=64 \
        --methods "$(python -m echo_trtllm.bench.tune --grid)" --batch-sizes 16 --json sim.json
    python -m echo_trtllm.bench.tune --simulation sim.json --batch-size 16     # -> the --methods of the bench

Every method gets the same treatment: a small grid of its own shape options (`GRID`), each replayed through the
runtime's drafting loop on the same recorded trees of calibration prompts with the same measured cost model
(`bench.simulate`), and the shape with the most simulated tokens/s at the batch size is the one benchmarked. No
evaluation prompt is read.
"""

from __future__ import annotations

import argparse
import json

__all__ = ["GRID", "grid_methods", "best_shapes"]

# the shapes tried per method (bench --methods entries); the echo family keeps the calibrated depth (its gate's
# samples are per depth) and varies its beam and per-request cap, its gate and budget rule pick the rest each step
GRID: dict[str, tuple[str, ...]] = {
    "chain": tuple(f"chain:num_draft_tokens={n}" for n in (1, 2, 3, 4, 5, 6)),
    "static": tuple(f"static:static_nodes={n}" for n in (2, 3, 5, 8, 11, 16)),
    "eagle2": tuple(f"eagle2:total_tokens={t}:max_depth={d}" for t in (4, 8, 16, 32, 64) for d in (3, 6)),
    "ddd": tuple(f"ddd:total_tokens={t}" for t in (4, 8, 16, 32, 64)),
    "echo": tuple(f"echo:beam_width={w}:max_nodes_per_request={n}" for w in (1, 2, 4) for n in (8, 16, 64)),
}


def grid_methods(methods: tuple[str, ...] = tuple(GRID)) -> list[str]:
    """AR and every shape of `methods`."""
    unknown = [m for m in methods if m not in GRID]
    if unknown:
        raise ValueError(f"no tuning grid for {unknown}; grids: {', '.join(GRID)}")
    return ["ar", *(s for m in methods for s in GRID[m])]


def best_shapes(rows: list[dict], batch_size: int) -> dict[str, dict]:
    """policy -> the simulated row with the most tokens/s at `batch_size` (ties: the first, i.e. the smaller
    shape in GRID order)."""
    best: dict[str, dict] = {}
    for r in rows:
        if r["batch_size"] != batch_size:
            continue
        policy = r["method"].split(":", 1)[0]
        if policy == "ar":
            continue
        if policy not in best or r["tokens_per_s"] > best[policy]["tokens_per_s"]:
            best[policy] = r
    if not best:
        raise ValueError(f"the simulation has no drafting rows at batch size {batch_size}")
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m echo_trtllm.bench.tune", description=__doc__.splitlines()[0])
    ap.add_argument("--grid", action="store_true", help="print the shapes to simulate (simulate --methods)")
    ap.add_argument("--methods", default=",".join(GRID), help="policies to tune")
    ap.add_argument("--simulation", help="simulate --json output over the grid")
    ap.add_argument("--batch-size", type=int, help="the batch size to pick shapes for")
    args = ap.parse_args(argv)
    methods = tuple(m for m in args.methods.split(",") if m)
    try:
        if args.grid:
            print(",".join(grid_methods(methods)))
            return 0
        if not args.simulation or args.batch_size is None:
            ap.error("give --grid, or --simulation and --batch-size")
        with open(args.simulation) as f:
            rows = json.load(f)["rows"]
        best = best_shapes(rows, args.batch_size)
    except (ValueError, OSError, KeyError) as e:
        print(f"tune: error: {e}")
        return 2
    print(",".join(best[m]["method"] for m in methods if m in best))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
