"""Attention's layout work once per batch (`ForwardBatch.dense`, `grouped_mask`) against the per-layer code it
replaced (tests/models/test_attention_layout.py's `old_attention`, bit for bit the same output), in one process,
alternating: decode forwards of B rows at context 150, with the linears left out (their outputs precomputed
zeros), so that what is timed is what the change touches, not the weights' streaming, which is 85-97 % of a
forward and varies more than the difference.

    python scripts/attention_layout_ab.py --model <target> [--dtype bfloat16] [--batch-sizes 1 16 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    import torch

    from echo_trtllm.bench.run import report_meta
    from echo_trtllm.models import llama, packed
    from echo_trtllm.models.loader import load_model
    from echo_trtllm.runtime.inputs import chain_batch
    from tests.models.test_attention_layout import old_attention

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--alternations", type=int, default=6)
    ap.add_argument("--forwards", type=int, default=25)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if min(args.batch_sizes) < 1 or args.alternations < 2 or args.forwards < 5:
        ap.error("--batch-sizes must be >= 1, --alternations >= 2, --forwards >= 5")
    torch.set_num_threads(2)
    model, _ = load_model(args.model, dtype=args.dtype, with_tokenizer=False)
    packed.FUSE_QKV = False  # every linear through _PackedForward, left out below in both arms alike
    packed.prepack_linears(model)
    zeros: dict = {}

    def no_linear(self, x):
        key = (x.shape[0], self.module.out_features, x.dtype)
        if key not in zeros:
            zeros[key] = x.new_zeros(key[:2])
        return zeros[key]

    packed._PackedForward.__call__ = no_linear
    for m in model.modules():  # float32 linears are PyTorch's own: left out the same way
        if type(m) is torch.nn.Linear and not isinstance(m.__dict__.get("forward"), packed._PackedForward):
            m.forward = packed._PackedForward.__new__(packed._PackedForward)
            m.forward.module = m
    new = llama.Attention.forward
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for b in args.batch_sizes:
            cache = model.allocate_cache(b, 512)
            model(chain_batch([torch.randint(0, 1000, (150,), generator=gen) for _ in range(b)],
                              torch.zeros(b, dtype=torch.long), torch.arange(b), logits="none"), cache)
            ms: dict[str, list[float]] = {"before": [], "after": []}
            for rep in range(args.alternations):
                order = (("before", old_attention), ("after", new)) if rep % 2 == 0 else (("after", new),
                                                                                          ("before", old_attention))
                for name, fwd in order:
                    llama.Attention.forward = fwd
                    ts = []
                    for _ in range(args.forwards):
                        step = chain_batch([torch.randint(0, 1000, (1,), generator=gen) for _ in range(b)],
                                           torch.full((b,), 150), torch.arange(b), logits="all")
                        t = time.perf_counter()
                        model(step, cache)
                        ts.append(time.perf_counter() - t)
                    ms[name].append(round(statistics.median(ts[3:]) * 1e3, 3))
            llama.Attention.forward = new
            row = {"batch_size": b, "ms_before": ms["before"], "ms_after": ms["after"],
                   "median_before": round(statistics.median(ms["before"]), 2),
                   "median_after": round(statistics.median(ms["after"]), 2),
                   "after_faster_in": sum(a < o for a, o in zip(ms["after"], ms["before"]))}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        meta = report_meta("scripts.attention_layout_ab", argv, runner="python scripts/attention_layout_ab.py")
        out = {"rows": rows, "alternations": args.alternations, **meta}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
