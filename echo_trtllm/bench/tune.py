"""Pick each method's tree shape from a simulation over calibration traces (SIMULATION-based tuning).

    echo-trtllm simulate --trace cal-trace.json --calibration cal.json --tree-source eagle2:total_tokens=64 \
        --methods "$(python -m echo_trtllm.bench.tune --grid)" --batch-sizes 16 --json sim.json
    python -m echo_trtllm.bench.tune --simulation sim.json --batch-size 16     # -> the --methods of the bench
    python -m echo_trtllm.bench.tune --simulation sim.json --one-shape         # one shape for every batch size

Every method gets the same treatment: a small grid of its own shape options (`GRID`), each replayed through the
runtime's drafting loop on the same recorded trees of calibration prompts with the same measured cost model
(`bench.simulate`), and the shape with the most simulated tokens/s at the batch size is the one benchmarked. No
evaluation prompt is read.

`one_shape` asks the deployment question instead: a server runs one shape at every load. Per policy it reports the
shape fastest at the smallest batch size (tuned for latency) and the shape whose worst ratio to the best row of
any policy at each batch size is highest (maximin), each with its simulated tokens/s at every batch size.
"""

from __future__ import annotations

import argparse
import json

__all__ = ["GRID", "grid_methods", "best_shapes", "one_shape", "one_shape_table"]

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


def one_shape(rows: list[dict]) -> dict[str, dict]:
    """policy -> {"latency": shape, "maximin": shape, "worst": its worst ratio to the best, "rates": {shape: {B:
    tokens/s}}, "best": {B: the best drafting row's tokens/s}} over the batch sizes at which every drafting shape of
    every policy was simulated (AR rows are left out). latency: fastest at the smallest of them; maximin: the
    highest worst ratio (ties: the first in row order)."""
    rates: dict[str, dict[int, float]] = {}
    for r in rows:
        if r["method"].split(":", 1)[0] != "ar":
            rates.setdefault(r["method"], {})[r["batch_size"]] = r["tokens_per_s"]
    if not rates:
        raise ValueError("the simulation has no drafting rows")
    sizes = sorted(set.intersection(*(set(v) for v in rates.values())))
    if not sizes:
        raise ValueError("no batch size was simulated for every shape")
    best = {b: max(v[b] for v in rates.values()) for b in sizes}
    out: dict[str, dict] = {}
    for shape, v in rates.items():
        entry = out.setdefault(shape.split(":", 1)[0], {"rates": {}, "best": best})
        entry["rates"][shape] = {b: v[b] for b in sizes}
    for entry in out.values():
        shapes = entry["rates"]
        worst = {s: min(v[b] / best[b] for b in sizes) for s, v in shapes.items()}
        entry["latency"] = max(shapes, key=lambda s: shapes[s][sizes[0]])
        entry["maximin"] = max(shapes, key=lambda s: worst[s])
        entry["worst"] = worst[entry["maximin"]]
    return out


def one_shape_table(rows: list[dict]) -> str:
    """`one_shape` as markdown: each policy's latency-tuned and maximin shapes, ×AR at every batch size."""
    ar = {r["batch_size"]: r["tokens_per_s"] for r in rows if r["method"] == "ar"}
    shapes = one_shape(rows)
    sizes = sorted(next(iter(shapes.values()))["best"])
    lines = ["| policy | one shape for every B | " + " | ".join(f"×AR B = {b}" for b in sizes) + " | worst ÷ best |",
             "|---|---|" + "---|" * len(sizes) + "---|"]
    for policy, e in shapes.items():
        for label in ("latency", "maximin"):
            v = e["rates"][e[label]]
            ratios = " | ".join(f"{v[b] / ar[b]:.2f}" if b in ar else "–" for b in sizes)
            worst = min(v[b] / e["best"][b] for b in sizes)
            lines.append(f"| {policy} | {label}: `{e[label]}` | {ratios} | {worst:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m echo_trtllm.bench.tune", description=__doc__.splitlines()[0])
    ap.add_argument("--grid", action="store_true", help="print the shapes to simulate (simulate --methods)")
    ap.add_argument("--methods", default=",".join(GRID), help="policies to tune")
    ap.add_argument("--simulation", help="simulate --json output over the grid")
    ap.add_argument("--batch-size", type=int, help="the batch size to pick shapes for")
    ap.add_argument("--one-shape", action="store_true",
                    help="print each policy's latency-tuned and maximin shapes across the simulated batch sizes")
    args = ap.parse_args(argv)
    methods = tuple(m for m in args.methods.split(",") if m)
    try:
        if args.grid:
            print(",".join(grid_methods(methods)))
            return 0
        if not args.simulation or (args.batch_size is None) == (not args.one_shape):
            ap.error("give --grid, or --simulation with one of --batch-size and --one-shape")
        with open(args.simulation) as f:
            rows = json.load(f)["rows"]
        if args.one_shape:
            print(one_shape_table(rows))
            return 0
        best = best_shapes(rows, args.batch_size)
    except (ValueError, OSError, KeyError) as e:
        print(f"tune: error: {e}")
        return 2
    print(",".join(best[m]["method"] for m in methods if m in best))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
