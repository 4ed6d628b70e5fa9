"""What a ragged Super-Tree's verification forward costs with the CPU attention split into groups
(`ForwardBatch.attention_groups`) and with every request padded to the widest tree, side by side.

    python -m echo_trtllm.bench.attention [--model T] [--batch-size 64] [--context 300] [--trees 10] [--nodes 5]
        [--repeats 3] [--json FILE]

One verification forward of the target over `batch-size` requests, each with `context` cached tokens: `trees` of
them verify a chain of `nodes` nodes, the others their root alone (ECHO under load: most requests' drafts do not
pay). Three layouts, each timed `repeats` times (minimum reported), alternating: the split attention (the
runtime's), the padded one (every request N_max = `nodes` query rows), and, for scale, the same batch with every
request verifying its root alone. The split and padded logits are compared before timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from echo_trtllm.core.pack import pack
from echo_trtllm.core.tree import SuperTree
from echo_trtllm.runtime.inputs import chain_batch, tree_batch


def batches(target, batch_size: int, context: int, trees: int, nodes: int):
    """(cache, split batch, padded batch, roots-only batch): contexts prefilled into slots 0..B-1."""
    gen = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    cache = target.allocate_cache(batch_size, context + nodes + 1)
    contexts = [torch.randint(0, vocab, (context,), generator=gen) for _ in range(batch_size)]
    slots = torch.arange(batch_size)
    for i in range(0, batch_size, 8):  # prefill in chunks of 8 requests
        target(chain_batch(contexts[i:i + 8], torch.zeros(len(contexts[i:i + 8]), dtype=torch.long), slots[i:i + 8],
                           "none"), cache)
    ctx = torch.full((batch_size,), context)

    def tree_of(sizes):
        parents = [torch.arange(-1, n - 1, dtype=torch.int32) for n in sizes]  # chains
        tree = SuperTree.from_parents(parents, [torch.randint(0, vocab, (n,), generator=gen) for n in sizes])
        return tree_batch(pack(tree, ctx), ctx, slots)

    sizes = [nodes if i < trees else 1 for i in range(batch_size)]
    split = tree_of(sizes)
    padded = dataclasses.replace(split)  # the same tensors, its own attention layout
    padded.__dict__["_groups"] = None  # one padded group
    return cache, split, padded, tree_of([1] * batch_size)


def main(argv: list[str] | None = None) -> int:
    from echo_trtllm.bench.run import report_meta
    from echo_trtllm.models import DEFAULT_TARGET
    from echo_trtllm.models.loader import load_model

    ap = argparse.ArgumentParser(prog="python -m echo_trtllm.bench.attention", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_TARGET))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--trees", type=int, default=10)
    ap.add_argument("--nodes", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    for name in ("batch_size", "context", "nodes", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.trees <= args.batch_size:
        ap.error(f"--trees must be in 0..--batch-size ({args.batch_size}), got {args.trees}")
    target, _ = load_model(args.model, dtype=args.dtype)
    with torch.inference_mode():
        cache, split, padded, roots = batches(target, args.batch_size, args.context, args.trees, args.nodes)
        diff = float((target(split, cache) - target(padded, cache)).abs().max())
        seconds = {"split": [], "padded": [], "roots_only": []}
        for _ in range(args.repeats):
            for name, batch in (("split", split), ("padded", padded), ("roots_only", roots)):
                t0 = time.perf_counter()
                target(batch, cache)
                seconds[name].append(time.perf_counter() - t0)
    best = {k: min(v) for k, v in seconds.items()}
    tokens = args.batch_size + args.trees * (args.nodes - 1)
    print(f"B={args.batch_size} context {args.context}, {args.trees} trees of {args.nodes} nodes ({tokens} tokens): "
          f"split {best['split']:.3f} s, padded {best['padded']:.3f} s (split / padded {best['split'] / best['padded']:.2f}), "
          f"roots only ({args.batch_size} tokens) {best['roots_only']:.3f} s; max |logit difference| {diff:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            shape = {k: getattr(args, k) for k in ("batch_size", "context", "trees", "nodes", "repeats")}
            json.dump({"model": Path(args.model).name, "dtype": args.dtype, **shape, "tokens": tokens,
                       "seconds": seconds, "min_seconds": best, "max_abs_logit_difference": diff,
                       **report_meta("echo_trtllm.bench.attention", argv)}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
