"""Where a speculative step's draft phase goes, read inside the engine: ECHO with an EAGLE-3 head, every step
speculative, B requests in a closed batch stepped directly (the executor's own `step`), and each recorded step's
draft phase (`StepTimings.draft_model`) split into

- root: the head's first forward of the step (the pending chains with the target's features, through its fc), the
  first to run after the target's forward has streamed the target's weights through the caches;
- levels: its forwards of the tree's deeper levels (each frontier node reading its parent's head output);
- top-k: the draft vocabulary's probabilities and top-k of each forward's rows;
- bookkeeping: the rest of the phase (the features read for the root, the levels' input tensors, the rows kept);

and the head's forwards (root and levels) further into their products (the packed bfloat16 and the int8 kernels'
calls), the attention kernel, and the rest of the forward (norms, rotary tables, the KV write, masks, the Python
around each operation).

With `--arms bf16,w8a16` a second engine on the same target runs its own copy of the head with
`LLM(draft_quantization="w8a16")` (models/weight_int8.py: products of at most four rows, a one-row step's draft
forwards, read int8 weights with per-output-channel scales, half the bytes of bfloat16; wider ones the packed
bfloat16 weights as before); its acceptance is read beside its time. The arms alternate within each round (the
order reversed every other round), each on its own engine and head.

    python scripts/head_split.py --model <target> --head <its EAGLE-3 head> [--dtype bfloat16] [--batch-size 1]
        [--steps 40] [--rounds 3] [--arms bf16,w8a16] [--threads 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARMS = ("bf16", "w8a16")  # the head as loaded; the head with LLM(draft_quantization="w8a16")
WARM_STEPS = 4  # steps after the prefill and before any is recorded
PARTS = ("root_ms", "levels_ms", "top_k_ms", "bookkeeping_ms", "products_ms", "attention_ms", "forward_rest_ms")


class DraftSplit:
    """Timers on one drafter's forwards and top-k, told apart by the drafting call they run in (module
    docstring)."""

    def __init__(self, drafter) -> None:
        self.where = None
        self.in_forward = False
        self.reset()
        for name in ("expand_roots", "expand_level"):
            setattr(drafter, name, self._marked(getattr(drafter, name), "root" if name == "expand_roots" else "levels"))
        drafter._forward = self._timed(drafter._forward, None)
        drafter._top_k = self._timed(drafter._top_k, "top_k")

    def reset(self) -> None:
        self.seconds = {"root": 0.0, "levels": 0.0, "top_k": 0.0, "products": 0.0, "attention": 0.0}
        self.forwards = 0

    def kernel(self, fn, part: str):
        """fn timed into `part` while a head forward of a drafting call runs (the target's calls are not)."""
        def call(*args, **kwargs):
            if not self.in_forward:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - t0
        return call

    def _marked(self, fn, where: str):
        def call(*args, **kwargs):
            self.where = where
            try:
                return fn(*args, **kwargs)
            finally:
                self.where = None
        return call

    def _timed(self, fn, part: str | None):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            self.in_forward = part is None and self.where is not None
            try:
                return fn(*args, **kwargs)
            finally:
                self.in_forward = False
                key = part or self.where
                if key is not None:
                    self.seconds[key] += time.perf_counter() - t0
                    self.forwards += part is None
        return call


@contextlib.contextmanager
def kernel_timers(splits: list[DraftSplit]):
    """The packed bfloat16 and int8 products and the attention kernel timed for every split (while its head
    forwards run); restored after."""
    import torch.nn.functional as F

    from echo_trtllm.models import packed, weight_int8

    saved = [(packed, "_product", packed._product), (weight_int8, "_product", weight_int8._product),
             (F, "scaled_dot_product_attention", F.scaled_dot_product_attention)]
    for owner, name, fn in saved:
        part = "attention" if name == "scaled_dot_product_attention" else "products"
        for split in splits:
            fn = split.kernel(fn, part)
        setattr(owner, name, fn)
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def run_round(llm, split: DraftSplit, prompts: list[str], batch_size: int, steps: int) -> list[dict]:
    """One closed batch of `batch_size` greedy requests: the recorded speculative steps' splits (ms)."""
    from echo_trtllm.bench.phases import submit_closed_batch

    ex = llm.executor
    reqs = submit_closed_batch(ex, prompts, batch_size, steps, WARM_STEPS)
    rows = []
    try:
        ex.step()  # admission, prefill and the first decode step
        for k in range(WARM_STEPS + steps):
            split.reset()
            t0 = time.perf_counter()
            report = ex.step()
            wall = time.perf_counter() - t0
            if k < WARM_STEPS or not report.speculated or report.batch_size != batch_size:
                continue
            ms = {k2: v * 1e3 for k2, v in split.seconds.items()}
            draft = report.timings.draft_model * 1e3
            rows.append({"step_ms": wall * 1e3, "draft_ms": draft, "root_ms": ms["root"], "levels_ms": ms["levels"],
                         "top_k_ms": ms["top_k"], "bookkeeping_ms": draft - ms["root"] - ms["levels"] - ms["top_k"],
                         "products_ms": ms["products"], "attention_ms": ms["attention"],
                         "forward_rest_ms": ms["root"] + ms["levels"] - ms["products"] - ms["attention"],
                         "forwards": split.forwards, "emitted": report.emitted_tokens,
                         "verified": report.verified_tokens})
    finally:
        for r in reqs:
            ex.abort(r)
    return rows


def summarize(rows: list[dict]) -> dict:
    """Medians over a round's steps (ms a step), with the head's share of the step (the draft phase over the step's
    wall time, as `scripts/phase_criteria.py` reads it: means) and tokens a second."""
    if not rows:
        return {"steps": 0}
    out = {"steps": len(rows)}
    for key in ("step_ms", "draft_ms", *PARTS):
        out[key] = round(statistics.median(r[key] for r in rows), 3)
    forwards = sum(r["forwards"] for r in rows)
    levels = sum(max(r["forwards"] - 1, 0) for r in rows)
    out["forwards_per_step"] = round(forwards / len(rows), 3)
    out["root_ms_per_forward"] = round(statistics.mean(r["root_ms"] for r in rows), 3)
    out["level_ms_per_forward"] = round(sum(r["levels_ms"] for r in rows) / levels, 3) if levels else None
    out["emitted_per_step"] = round(statistics.mean(r["emitted"] for r in rows), 3)
    out["verified_per_step"] = round(statistics.mean(r["verified"] for r in rows), 3)
    out["head_share"] = round(sum(r["draft_ms"] for r in rows) / sum(r["step_ms"] for r in rows), 4)
    out["tokens_per_s"] = round(sum(r["emitted"] for r in rows) * 1e3 / sum(r["step_ms"] for r in rows), 3)
    return out


def combine(rounds: list[dict]) -> dict:
    """Each number's median over the rounds with its (min, max)."""
    keys = [k for k in rounds[0] if k != "steps" and all(r.get(k) is not None for r in rounds)]
    return {k: {"median": round(statistics.median(r[k] for r in rounds), 4),
                "min": min(r[k] for r in rounds), "max": max(r[k] for r in rounds)} for k in keys}


def _rounds(args, arms: list[str], engines: dict, prompts: list[str], rounds: dict) -> None:
    """The arms alternating within each round (the order reversed every other round), each round's prompts its
    own and the same for every arm; each arm's round summaries appended to rounds[arm]."""
    for rnd in range(args.rounds):
        for arm in (arms if rnd % 2 == 0 else arms[::-1]):
            llm, split = engines[arm]
            start = rnd * args.batch_size  # each round its own prompts, the same for every arm
            summary = summarize(run_round(llm, split, prompts[start:] + prompts[:start], args.batch_size, args.steps))
            rounds[arm].append(summary)
            print(f"round {rnd + 1} {arm}: " + ", ".join(f"{k} {v}" for k, v in summary.items()), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", required=True, help="the target's EAGLE-3 head")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arms", default="bf16", help=f"comma-separated, from {', '.join(ARMS)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    if not arms or any(a not in ARMS for a in arms) or len(set(arms)) < len(arms):
        ap.error(f"--arms takes distinct entries from {', '.join(ARMS)}, got {args.arms!r}")
    if "w8a16" in arms and args.dtype != "bfloat16":
        ap.error("--arms w8a16 quantises a bfloat16 head's linears (--dtype bfloat16)")
    for name in ("batch_size", "steps", "rounds", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")

    from echo_trtllm.bench.prompts import load_prompts
    from echo_trtllm.bench.run import make_engine, write_report
    from echo_trtllm.core.config import EchoConfig
    from echo_trtllm.models.eagle3 import load_eagle3
    from echo_trtllm.models.loader import load_model

    torch.set_num_threads(args.threads)
    target, tok = load_model(args.model, dtype=args.dtype)
    engines = {}
    for arm in arms:  # each arm its own head: LLM(draft_quantization=...) switches the loaded head in place
        head = load_eagle3(args.head, target)
        llm = make_engine(target, head, tok, EchoConfig(), args.batch_size, args.max_seq_len, fallback="off",
                          draft_quantization=None if arm == "bf16" else arm)
        llm.shutdown()  # stepped on this thread
        engines[arm] = (llm, DraftSplit(llm.executor.drafter))
    prompts = load_prompts("humaneval", "eval")
    rounds = {arm: [] for arm in arms}
    with kernel_timers([split for _, split in engines.values()]):
        _rounds(args, arms, engines, prompts, rounds)
    out = {"batch_size": args.batch_size, "steps": args.steps, "dtype": args.dtype, "threads": args.threads,
           "arms": {arm: {"rounds": rounds[arm], "combined": combine([r for r in rounds[arm] if r["steps"]])
                          if any(r["steps"] for r in rounds[arm]) else {},
                          "draft_quantization": engines[arm][0].draft_quantization}
                    for arm in arms}}
    for arm in arms:
        c = out["arms"][arm]["combined"]
        if c:
            print(f"{arm}: " + ", ".join(f"{k} {v['median']} ({v['min']}-{v['max']})" for k, v in c.items()))
    if args.json:
        write_report(args.json, "head_split", argv, **out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
