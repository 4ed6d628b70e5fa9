"""What one forward of an EAGLE-3 head costs beside one forward of its target at one row, and whether the head's
bytes set it: the weights each reads (embeddings left out: a forward gathers a few of their rows), and the median
forward times, measured the way a step meets them (each head forward right after a target forward, which streams
the target's weights through the caches). Both are prepacked as the engine runs them (`models/packed.py`), but for
the head's q, k and v: wrapped for the int8 arm, they run as three packed products in both arms, where the engine
runs one.

Beside it, the same head with int8 weight-only linears (per-output-channel scales, PyTorch's CPU kernel
`torch._weight_int8pack_mm`): half the bytes; measured only, as a candidate for a smaller head forward, not used by
the engine.

    python scripts/head_floor.py --model <target> --head <its EAGLE-3 head> [--dtype bfloat16] [--rounds 16]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from echo_trtllm.models.eagle3 import load_eagle3
from echo_trtllm.models.loader import load_model
from echo_trtllm.models.packed import prepack_linears
from echo_trtllm.runtime.inputs import chain_batch

TOKENS = (1, 3, 5, 16)  # a head forward's tokens: a level at one row, a chain's catch-up, a wider level


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the parameters a forward reads in full: every module's own but an embedding's (a forward gathers a
    few of its rows), a weight shared by two modules counted for each (a tied LM head reads the embedding matrix in
    full)."""
    return sum(p.numel() * p.element_size() for m in model.modules() if not isinstance(m, nn.Embedding)
               for p in m.parameters(recurse=False))


class Int8WeightOnly:
    """A linear's forward with int8 weights and per-output-channel scales (measurement only)."""

    def __init__(self, module: nn.Linear) -> None:
        w = module.weight.detach().float()
        scale = w.abs().amax(1).clamp(min=1e-8) / 127
        self.weight = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.scale = scale.to(module.weight.dtype)
        self.bias, self.dense, self.on = module.bias, module.forward, False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.on:
            return self.dense(x)
        y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.weight, self.scale)
        y = y.reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def measure(target, head, rounds: int) -> list[dict]:
    """Per head-forward token count: median ms of the target's one-token forward, the head's forward after it,
    and the int8 head's."""
    int8 = []
    for m in head.modules():
        if type(m) is nn.Linear:
            m.forward = Int8WeightOnly(m)
            int8.append(m.forward)
    t_cache, h_cache = target.allocate_cache(1, 1024), head.allocate_cache(1, 1024)
    rows = []
    for n in TOKENS:
        ids = torch.randint(0, 1000, (n,))
        one = chain_batch([ids[:1]], torch.tensor([300]), torch.tensor([0]), logits="last")
        batch = chain_batch([ids], torch.tensor([300]), torch.tensor([0]), logits="last")
        feats = torch.randn(n, 3 * target.config.hidden_size, dtype=head.dtype)
        times = {"target": [], "head": [], "head_int8": []}
        for i in range(rounds + 2):
            for quantised in (False, True):
                for f in int8:
                    f.on = quantised
                t = _timed(lambda: target(one, t_cache))
                h = _timed(lambda: head(batch, h_cache, feats))
                if i >= 2:  # warm-up
                    times["head_int8" if quantised else "head"].append(h)
                    times["target"].append(t)
        med = {k: round(statistics.median(v), 3) for k, v in times.items()}
        rows.append({"head_tokens": n, "target_ms": med["target"], "head_ms": med["head"],
                     "head_int8_ms": med["head_int8"], "head_over_target": round(med["head"] / med["target"], 4)})
    for f in int8:
        f.on = False
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    torch.set_num_threads(args.threads)
    target, _ = load_model(args.model, dtype=args.dtype)
    head = load_eagle3(args.head, target)
    prepack_linears(target)
    prepack_linears(head)
    with torch.no_grad():
        rows = measure(target, head, args.rounds)
    t_bytes, h_bytes = weight_bytes(target), weight_bytes(head)
    out = {"target_weight_bytes": t_bytes, "head_weight_bytes": h_bytes,
           "bytes_ratio": round(h_bytes / t_bytes, 4), "rows": rows, "dtype": args.dtype,
           "threads": args.threads, "rounds": args.rounds,
           "command": "python scripts/head_floor.py --model <target> --head <head> --dtype " + args.dtype}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
