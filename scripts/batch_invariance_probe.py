"""Does a linear's output row depend on how many rows run with it? The question behind a batch-invariant mode
(issue 35): for one weight of a 1.5B model's MLP shape (8960 x 1536), row 0 of x @ W.T computed alone and computed
inside M rows, through the paths the engine uses — PyTorch's float32 `F.linear`, the prepacked bfloat16 oneDNN
kernel (models/packed.py) — and through the same bfloat16 kernel run in fixed tiles of T rows (padded), the
candidate for the mode.

    .venv/bin/python scripts/batch_invariance_probe.py [--json out.json]

Prints, per path and M, whether row 0 is bit-identical to its value alone (and, for the tiles, whether every row
is), and writes them to the JSON with the machine.
"""

from __future__ import annotations

import argparse
import json

import torch

ROWS = (1, 2, 5, 16, 17, 64)


def main(argv=None) -> int:
    from echo_trtllm.bench.run import report_meta

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--tiles", default="4,16", help="tile sizes for the tiled bfloat16 path (comma-separated)")
    args = ap.parse_args(argv)
    tiles = [int(t) for t in args.tiles.split(",") if t]
    torch.manual_seed(0)
    w = (torch.randn(8960, 1536) * 0.02).bfloat16()
    x = torch.randn(max(ROWS), 1536).bfloat16()
    out: dict = {"weight": [8960, 1536], "rows": list(ROWS), "paths": {}}

    def record(name, f, every_row=False):
        alone = [f(x[i:i + 1]) for i in range(max(ROWS))] if every_row else [f(x[:1])]
        res = {}
        for m in ROWS:
            y = f(x[:m])
            res[m] = {"row0_equal": bool(torch.equal(y[:1], alone[0]))}
            if every_row:
                res[m]["all_rows_equal"] = all(torch.equal(y[i:i + 1], alone[i]) for i in range(m))
        out["paths"][name] = res
        print(name, {m: r for m, r in res.items()}, flush=True)

    wf = w.float()
    record("float32 F.linear", lambda v: torch.nn.functional.linear(v.float(), wf))
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        lin = lambda v, p=packed: torch.ops.mkldnn._linear_pointwise(v, p, None, "none", [], "")  # noqa: E731
        record("bfloat16 prepacked", lin)
        for t in tiles:
            def tiled(v, t=t):
                pad = (-v.shape[0]) % t
                vp = torch.cat([v, v.new_zeros(pad, v.shape[1])]) if pad else v
                return torch.cat([lin(vp[i:i + t]) for i in range(0, vp.shape[0], t)])[:v.shape[0]]
            record(f"bfloat16 prepacked, tiles of {t}", tiled, every_row=True)
    if args.json:
        meta = report_meta("scripts.batch_invariance_probe", argv, runner="python scripts/batch_invariance_probe.py")
        with open(args.json, "w") as f:
            json.dump({**out, **meta}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
