"""Where sustained serving's time goes, in process: for each method, an engine as a server builds it (max batch size
64 unless told), `--concurrency` requests kept in flight (a new one submitted as one finishes, as bench-serve's
clients do), stepped for `--warmup-seconds` and then measured for `--duration` seconds: the wall time split into
the admission of new requests (the target's prefill of their prompts, the draft's prefill) and the decode steps
(speculative and plain apart, with tokens a second over each), tokens emitted, and the speculation controller's
decisions with its exploration credit.

    python scripts/sustained_split.py --model <target> --head <its EAGLE-3 head> [--methods ar,echo,echo:fallback=off]
        [--concurrency 16] [--duration 60] [--warmup-seconds 10] [--max-tokens 64] [--max-tokens-range-ratio 0.5]
        [--rounds 3] [--lead-steps 4] [--dtype bfloat16] [--token-price-scale S] [--json out.json]

--token-price-scale S: every engine starts from one cost curve, measured once at load (as an engine measures its
own) and shared by every method and round, with each verified token beyond the first priced S times what was
measured: the start of a build that drew a verified token far too dear (docs/performance.md: 37 ms where about 7
was measured), so a method's recovery from it is compared from the same prices. Without it each engine measures its
own curve at load, as a server does.

The engine admits waiting requests at the start of a step and prefills their whole prompts before the decode step
(`Executor.admit`), so under sustained load part of the wall time is prefill that no speculation can shorten; the
decode steps' rate is where the methods differ. --lead-steps: steps the first request runs alone before the rest
arrive (a server's first client is usually alone for a moment: the controller then explores at one row first).
All methods submit the same prompts in the same order, with the same lengths (--max-tokens-range-ratio: each request
its own, as bench-serve draws them); within a time window each admits as many as it finishes, so each round also
compares the target's prefill with the first method's on the prompts both prefilled. With one length for all, AR's
requests, one token a step each, finish together and are prefilled as one batch, which mixed lengths do not give.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo_trtllm.bench.prompts import load_prompts  # noqa: E402
from echo_trtllm.bench.run import make_engine, parse_method, split_fallback, write_report  # noqa: E402
from echo_trtllm.bench.serve import request_max_tokens  # noqa: E402
from echo_trtllm.core import EchoConfig  # noqa: E402
from echo_trtllm.core.cost import CostModel, marginal_token_time  # noqa: E402
from echo_trtllm.models.eagle3 import load_eagle3  # noqa: E402
from echo_trtllm.models.loader import load_model  # noqa: E402
from echo_trtllm.runtime.calibrate import LOAD_REPEATS, measure_cost_model  # noqa: E402
from echo_trtllm.runtime.request import SamplingParams  # noqa: E402


def _num(x) -> float | None:
    """A decision's number for JSON: rounded, None where unknown (nan) or unbounded."""
    return None if x is None or not math.isfinite(x) else round(float(x), 4)


class Load:
    """An executor kept at `concurrency` requests in flight, its admission and the admission's parts timed (wrapping
    the instance's `admit` and prefill methods; what the step call takes beyond its own measured total and the
    admission, its learning from the step among it, is reported as "other")."""

    def __init__(self, executor, prompts: list[str], concurrency: int, max_tokens: int, range_ratio: float = 0.0,
                 seed: int = 0) -> None:
        self.ex, self.prompts, self.concurrency = executor, prompts, concurrency
        self.max_tokens, self.range_ratio, self.seed = max_tokens, range_ratio, seed
        self.submitted = 0
        self.rejected = 0  # requests the engine refused (`submit`)
        self.parts: dict[str, float] = collections.defaultdict(float)
        self.index_of: dict[str, int] = {}  # request id -> its place in the prompt sequence
        self.prefills: list[tuple[int, int, float]] = []  # (prompt index, tokens, seconds) of the target's prefill
        for name, label in (("admit", "admission"), ("_prefill_target", "target prefill"),
                            ("_prefill_draft", "draft prefill")):
            self._wrap(name, label)

    def _wrap(self, name: str, label: str) -> None:
        f = getattr(self.ex, name)

        def timed(*args, _f=f, _label=label):
            t = time.perf_counter()
            try:
                return _f(*args)
            finally:
                elapsed = time.perf_counter() - t
                self.parts[_label] += elapsed
                if _label == "target prefill":
                    group = args[0]
                    tokens = sum(n for _, n in group)
                    # a chunk's time shared by its requests' tokens (one request a chunk under sustained load)
                    self.prefills += [(self.index_of.get(r.request_id, -1), n, elapsed * n / max(tokens, 1))
                                      for r, n in group]
        setattr(self.ex, name, timed)

    def submit(self, n: int = 1) -> None:
        """n more requests, the next of the sequence each; one the engine refuses (its prompt and length do not fit
        the context) is counted in `rejected` and the next is taken, as a server answers it 400 and the client
        sends its next: the same prompts are refused for every method."""
        sent = 0
        while sent < n:
            prompt = self.prompts[self.submitted % len(self.prompts)]
            length = request_max_tokens(self.submitted, self.max_tokens, self.range_ratio, self.seed)
            self.submitted += 1
            try:
                request = self.ex.make_request(prompt, SamplingParams(max_tokens=length, temperature=0,
                                                                      ignore_eos=True))
            except ValueError:
                self.rejected += 1
                if self.rejected > 1000 * (self.submitted - self.rejected + 1):
                    raise  # nothing fits: the first refusal's message names why
                continue
            self.index_of[request.request_id] = self.submitted - 1
            self.ex.submit(request)
            sent += 1

    def token_ms(self, rows: int, context: float) -> float | None:
        """The engine's price of one more verified token at `rows` requests and `context` (None: unpriced)."""
        prices = self.ex.prices
        if prices is None or rows < 1:
            return None
        return round(marginal_token_time(prices, rows, context) * 1e3, 3)

    def step(self) -> dict:
        """One step; refills the batch for every request that finished. Its row."""
        t = time.perf_counter()
        r = self.ex.step()
        wall = time.perf_counter() - t
        self.submit(len(r.finished))
        d, ctl = r.decision, self.ex.controller
        return {"rows": r.batch_size, "speculated": bool(r.speculated), "wall_s": wall, "step_s": r.timings.total,
                # what the prices the budget rule reads charge for one more verified token at this batch (ms)
                "token_ms": self.token_ms(r.batch_size, r.context),
                "verified": r.verified_tokens, "emitted": r.emitted_tokens, "finished": len(r.finished),
                "reason": getattr(d, "reason", None), "credit": None if ctl is None else round(ctl.credit, 3),
                # the controller's estimate of speculative over plain tokens a second and its band (None: no decision)
                "ratio": _num(getattr(d, "ratio", None)), "low": _num(getattr(d, "low", None)),
                "high": _num(getattr(d, "high", None)), "expected_loss": _num(getattr(d, "expected_loss", None))}


def measure(load: Load, warmup_s: float, duration_s: float, lead_steps: int,
            clock=time.perf_counter) -> tuple[list[dict], dict, float]:
    """Lead steps with one request, then the rest of the batch; (rows of the measured window, admission parts
    there, the window's seconds). clock: what bounds the warm-up and the window (injected by tests)."""
    load.submit(1)
    for _ in range(lead_steps):
        load.step()
    load.submit(load.concurrency - 1)
    start = clock()
    while clock() - start < warmup_s:
        load.step()
    load.parts.clear()
    load.prefills = []
    load.rejected = 0
    rows, t0 = [], clock()
    while clock() - t0 < duration_s:
        rows.append(load.step())
    return rows, {**load.parts, "prompt_tokens": sum(n for _, n, _ in load.prefills), "prefills": load.prefills,
                  "rejected": load.rejected}, clock() - t0


def summary(rows: list[dict], parts: dict, wall_s: float) -> dict:
    """The window's split (module docstring)."""
    def rate(group):
        s = sum(r["step_s"] for r in group)
        return {"steps": len(group), "seconds": round(s, 3), "tokens": sum(r["emitted"] for r in group),
                "tokens_per_s": round(sum(r["emitted"] for r in group) / s, 2) if s > 0 else None}

    steps_s = sum(r["step_s"] for r in rows)
    outside = sum(r["wall_s"] for r in rows) - steps_s  # the step calls' time beyond the steps' own totals
    admission = parts.get("admission", outside)
    tokens = sum(r["emitted"] for r in rows)
    prefill = parts.get("target prefill", 0.0)
    return {"wall_s": round(wall_s, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall_s, 2),
            "finished": sum(r["finished"] for r in rows), "rejected": parts.get("rejected", 0),
            "admission_s": round(admission, 3),
            "admission_share": round(admission / wall_s, 4), "other_s": round(outside - admission, 3),
            "target_prefill_s": round(prefill, 3), "draft_prefill_s": round(parts.get("draft prefill", 0.0), 3),
            "prompt_tokens": parts.get("prompt_tokens", 0),
            "prefill_ms_per_prompt_token": round(prefill / parts["prompt_tokens"] * 1e3, 3)
            if parts.get("prompt_tokens") else None,
            "decode": rate(rows), "speculative": rate([r for r in rows if r["speculated"]]),
            "plain": rate([r for r in rows if not r["speculated"]]),
            "verified_per_step": round(sum(r["verified"] for r in rows) / len(rows), 2) if rows else None,
            "decisions": dict(collections.Counter(r["reason"] for r in rows if r["reason"]))}


def engine_for(method: str, target, head, tok, max_batch_size: int, max_seq_len: int, cost_model="auto"):
    """One --methods entry's engine (bench's grammar: policy[:option=value]...[:fallback=MODE]); cost_model: as
    `LLM`'s ("auto": measured at load)."""
    policy, overrides = parse_method(method)
    fallback = split_fallback(method)[1] or "auto"
    llm = make_engine(target, head, tok, EchoConfig(policy=policy, **overrides), max_batch_size, max_seq_len,
                      cost_model=cost_model, fallback=fallback)
    llm.shutdown()  # the executor is stepped here, in this thread
    return llm.executor


def scaled_token_price(cost: CostModel, scale: float) -> CostModel:
    """The curve with each verified token beyond the first priced `scale` times (--token-price-scale); a curve with a
    context grid is refused (its grid would keep the measured prices)."""
    if cost.grid_tokens:
        raise ValueError("scaled_token_price scales a curve without a context grid (the load's measurement)")
    first = cost.verify_seconds[0]
    return dataclasses.replace(cost, verify_seconds=tuple(first + scale * (v - first) for v in cost.verify_seconds))


def paired_prefill(base: list, other: list) -> dict | None:
    """The target's prefill over the prompts both runs prefilled whole (same prompt index, same tokens): seconds
    over seconds and ms per prompt token of each; None without a common prompt."""
    a = {(i, n): t for i, n, t in base}
    common = [(a[(i, n)], t, n) for i, n, t in other if (i, n) in a]
    if not common:
        return None
    tokens = sum(n for _, _, n in common)
    sa, sb = sum(x for x, _, _ in common), sum(y for _, y, _ in common)
    return {"prompts": len(common), "tokens": tokens, "ratio": round(sb / sa, 4),
            "base_ms_per_token": round(sa / tokens * 1e3, 3), "ms_per_token": round(sb / tokens * 1e3, 3)}


def spread(values: list) -> dict:
    vals = sorted(v for v in values if v is not None)
    return {"median": statistics.median(vals), "min": vals[0], "max": vals[-1]} if vals else {"median": None}


def aggregate(runs: list[dict], base_runs: list[dict]) -> dict:
    """A method's rounds: median and range of its rates and shares, the ratio to the first method's round by
    round, and its prefill paired with the first method's on the same prompts."""
    def pick(key, sub=None):
        return [r[key][sub] if sub else r[key] for r in runs]
    return {"tokens_per_s": spread(pick("tokens_per_s")), "decode_tokens_per_s": spread(pick("decode", "tokens_per_s")),
            "speculative_tokens_per_s": spread(pick("speculative", "tokens_per_s")),
            "plain_tokens_per_s": spread(pick("plain", "tokens_per_s")),
            "admission_share": spread(pick("admission_share")),
            "speculative_steps_share": spread([r["speculative"]["steps"] / max(r["decode"]["steps"], 1) for r in runs]),
            "vs_first_by_round": [round(r["tokens_per_s"] / b["tokens_per_s"], 4) for r, b in zip(runs, base_runs)],
            "decode_vs_first_by_round": [round(r["decode"]["tokens_per_s"] / b["decode"]["tokens_per_s"], 4)
                                         for r, b in zip(runs, base_runs)],
            "prefill_vs_first_by_round": [paired_prefill(b["prefills"], r["prefills"])
                                          for r, b in zip(runs, base_runs)]}


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="target (default: the embedded target)")
    p.add_argument("--head", default=None, help="its EAGLE-3 head (default: the embedded head)")
    p.add_argument("--methods", default="ar,echo,echo:fallback=off")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-batch-size", type=int, default=64, help="the engine's slots (a server's default: 64)")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--warmup-seconds", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=1, help="rounds; the methods' order alternates round by round")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-tokens-range-ratio", type=float, default=0.0,
                   help="request i asks for request_max_tokens(i, --max-tokens, r, round): as bench-serve's option")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--lead-steps", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--token-price-scale", type=float, default=None,
                   help="engines start from one measured curve, each verified token priced this many times (docstring)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.token_price_scale is not None and not args.token_price_scale > 0:
        p.error(f"--token-price-scale must be > 0, got {args.token_price_scale}")
    if not 1 <= args.concurrency <= args.max_batch_size:
        p.error(f"--concurrency must lie in [1, --max-batch-size={args.max_batch_size}], got {args.concurrency}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.max_tokens < 1 or not args.duration > 0 or args.warmup_seconds < 0 or args.lead_steps < 0:
        p.error("--max-tokens must be >= 1, --duration > 0, --warmup-seconds and --lead-steps >= 0")
    if not 0.0 <= args.max_tokens_range_ratio < 1.0:
        p.error(f"--max-tokens-range-ratio must lie in [0, 1), got {args.max_tokens_range_ratio}")
    args.methods = [m for m in args.methods.split(",") if m]
    for m in args.methods:
        parse_method(m)  # a bad entry is named before anything loads
    return args


def _line(m: str, row: dict) -> str:
    return (f"{m:>20}: {row['tokens_per_s']:7.2f} tok/s, admission {row['admission_share']:.1%} (prefill "
            f"{row['prefill_ms_per_prompt_token']} ms/prompt token, draft prefill {row['draft_prefill_s']} s), decode "
            f"{row['decode']['tokens_per_s']} tok/s (speculative {row['speculative']['steps']} steps "
            f"{row['speculative']['tokens_per_s']}, plain {row['plain']['steps']} steps {row['plain']['tokens_per_s']}"
            f"), {row['decisions']}")


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    from echo_trtllm.models import DEFAULT_EAGLE3, DEFAULT_TARGET
    target, tok = load_model(args.model or DEFAULT_TARGET, dtype=args.dtype)
    head = load_eagle3(args.head or DEFAULT_EAGLE3, target)
    prompts = load_prompts("humaneval")
    runs: dict[str, list[dict]] = {m: [] for m in args.methods}
    cost, start_prices = "auto", None
    if args.token_price_scale is not None:
        cost = scaled_token_price(measure_cost_model(target, head, repeats=LOAD_REPEATS), args.token_price_scale)
        start_prices = {"verify_tokens": list(cost.verify_tokens),
                        "verify_ms": [round(v * 1e3, 3) for v in cost.verify_seconds]}
    with torch.inference_mode():
        for rnd in range(args.rounds):
            for m in (args.methods if rnd % 2 == 0 else args.methods[::-1]):
                ex = engine_for(m, target, head, tok, args.max_batch_size, args.max_seq_len, cost)
                load = Load(ex, prompts, args.concurrency, args.max_tokens, args.max_tokens_range_ratio, rnd)
                rows, parts, wall = measure(load, args.warmup_seconds, args.duration, args.lead_steps)
                row = {"method": m, "round": rnd, **summary(rows, parts, wall), "steps": rows,
                       "prefills": parts["prefills"]}
                runs[m].append(row)
                print(f"round {rnd} " + _line(m, row), flush=True)
    first = runs[args.methods[0]]
    out = {m: aggregate(r, first) for m, r in runs.items()}
    for m, a in out.items():
        print(f"{m:>20}: x first by round {a['vs_first_by_round']}, decode {a['decode_vs_first_by_round']}, "
              f"prefill {[p and p['ratio'] for p in a['prefill_vs_first_by_round']]}")
    if args.json:
        write_report(args.json, "sustained_split", argv, concurrency=args.concurrency,
                     max_batch_size=args.max_batch_size, duration_s=args.duration, warmup_s=args.warmup_seconds,
                     rounds=args.rounds, max_tokens=args.max_tokens, range_ratio=args.max_tokens_range_ratio,
                     lead_steps=args.lead_steps, dtype=args.dtype, token_price_scale=args.token_price_scale,
                     start_prices=start_prices,
                     summary=out, runs=runs)


if __name__ == "__main__":
    main()
