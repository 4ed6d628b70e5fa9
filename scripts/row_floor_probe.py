"""What a prepacked bfloat16 product costs by its number of rows, the way a decode step meets it: a stack of
decoder layers' linears with their weights streamed from memory (random weights of the target's shapes, packed as
`models/packed.py` packs them), then the LM head alone, each timed on 1, 2, ... rows. `models.packed.ROW_FLOOR`
(products of fewer rows run on that many, zero rows added) was chosen from this table; run it on another CPU to see
whether its kernels call for another floor.

    python scripts/row_floor_probe.py [--hidden 1536 --intermediate 8960 --kv 256 --layers 28 --vocab 151936]
        [--rows 1,2,3,4,5,6,8,12,16] [--rounds 5] [--threads 2] [--json OUT]

Defaults: Qwen2.5-Coder-1.5B's shapes (q, k and v stacked as one product, as the engine runs them; o; gate; up;
down). Per row count: the median over rounds of the layers' total and of the head, and each over the one-row time.
The row counts are visited in turn within a round, so a drift of the machine falls on all of them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo_trtllm.bench.run import write_report  # noqa: E402
from echo_trtllm.models.packed import PACK_ROWS, ROW_FLOOR, prepack_available  # noqa: E402


def _pack(rows_out: int, rows_in: int, gen: torch.Generator) -> torch.Tensor:
    w = (torch.randn(rows_out, rows_in, generator=gen) * 0.02).to(torch.bfloat16)
    return torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)


def _timed(products, rows: int) -> float:
    """Milliseconds of one pass over `products` ((packed weight, input width) pairs) on `rows` rows."""
    inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {k for _, k in products}}
    t = time.perf_counter()
    for w, k in products:
        torch.ops.mkldnn._linear_pointwise(inputs[k], w, None, "none", [], "")
    return (time.perf_counter() - t) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--intermediate", type=int, default=8960)
    ap.add_argument("--kv", type=int, default=256, help="k's (and v's) output width")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,12,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows takes comma-separated row counts, got {args.rows!r}")
    if not rows or min(rows) < 1 or min(args.hidden, args.intermediate, args.kv, args.layers, args.vocab,
                                          args.rounds, args.threads) < 1:
        ap.error("--rows, --hidden, --intermediate, --kv, --layers, --vocab, --rounds and --threads must be >= 1")
    if not prepack_available():
        ap.error("oneDNN's bfloat16 kernels are not available on this CPU: nothing is packed, no floor applies")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    h, i = args.hidden, args.intermediate
    layers = []
    for _ in range(args.layers):
        layers += [(_pack(h + 2 * args.kv, h, gen), h), (_pack(h, h, gen), h), (_pack(i, h, gen), h),
                   (_pack(i, h, gen), h), (_pack(h, i, gen), i)]
    head = [(_pack(args.vocab, h, gen), h)]
    times = {r: {"layers": [], "head": []} for r in rows}
    for _ in range(args.rounds + 1):  # the first round warms up, untimed
        for r in rows:
            times[r]["layers"].append(_timed(layers, r))
            times[r]["head"].append(_timed(head, r))
    table, medians = [], {}
    for r in rows:
        timed = {k: v[1:] for k, v in times[r].items()}  # the warm-up round left out
        med = medians[r] = {k: statistics.median(v) for k, v in timed.items()}
        table.append({"rows": r, **{f"{k}_ms": round(med[k], 2) for k in timed},
                      **{f"{k}_spread_ms": [round(min(v), 2), round(max(v), 2)] for k, v in timed.items()}})
    one = medians.get(1)

    def rel(r: int, key: str) -> str:  # the unrounded medians over the one-row one's ("-" without it or at 0)
        return f"{medians[r][key] / one[key]:.2f}" if one and one[key] > 0 else "-"

    print(f"| rows | {args.layers} layers' linears, ms (min-max) | x one row | LM head, ms (min-max) | x one row |")
    print("|---:|---|---:|---|---:|")
    for t in table:
        r = t["rows"]
        print(f"| {r} | {t['layers_ms']:.1f} ({t['layers_spread_ms'][0]:.1f}-{t['layers_spread_ms'][1]:.1f}) | "
              f"{rel(r, 'layers')} | {t['head_ms']:.2f} ({t['head_spread_ms'][0]:.2f}-{t['head_spread_ms'][1]:.2f}) | "
              f"{rel(r, 'head')} |")
    if args.json:
        write_report(args.json, "row_floor_probe", argv, rows=table, pack_rows=PACK_ROWS, row_floor=ROW_FLOOR,
                     shapes={"hidden": h, "intermediate": i, "kv": args.kv, "layers": args.layers,
                             "vocab": args.vocab}, rounds=args.rounds, threads=args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
