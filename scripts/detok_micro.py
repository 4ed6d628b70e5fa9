"""What keeping a request's text costs a step: the whole output decoded at every step (the executor before
runtime/detok.py) against `IncrementalText` (a window of a few tokens), by how long the output already is.

    python scripts/detok_micro.py [--tokenizer <model dir or .gguf>] [--tokens-per-step 1 4] [--json out.json]

The token stream is this package's own source text, encoded by the tokenizer (code, as the benchmarks' prompts
are); each run grows one request's output to 1,024 tokens, k tokens a step, and times every step's text update
(the best of --repeats runs per step). Both ways' texts are checked equal at every step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BUCKETS = (64, 256, 1024)


def _stream(tok, n: int) -> list[int]:
    text = "".join(p.read_text() for p in sorted((ROOT / "echo_trtllm" / "runtime").glob("*.py")))
    ids = tok.encode(text)
    if len(ids) < n:
        raise SystemExit(f"the source text encodes to {len(ids)} tokens, fewer than {n}")
    return ids[:n]


def _per_step(update, ids: list[int], k: int, repeats: int) -> list[tuple[int, float]]:
    """(output length after the step, best seconds of the step's update) over a growing output."""
    best: dict[int, float] = {}
    for _ in range(repeats):
        state = update()
        for at in range(k, len(ids) + 1, k):
            part = ids[:at]
            t = time.perf_counter()
            state(part)
            dt = time.perf_counter() - t
            best[at] = min(best.get(at, dt), dt)
    return sorted(best.items())


def main(argv=None) -> int:
    from echo_trtllm.models import DEFAULT_TARGET
    from echo_trtllm.models.loader import load_tokenizer
    from echo_trtllm.runtime.detok import IncrementalText

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=None, help="a model directory or .gguf (default: the embedded target)")
    ap.add_argument("--tokens-per-step", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if any(k < 1 for k in args.tokens_per_step) or args.repeats < 1:
        ap.error("--tokens-per-step values and --repeats must be >= 1")
    tok = load_tokenizer(args.tokenizer or DEFAULT_TARGET)
    ids = _stream(tok, BUCKETS[-1])
    for at in range(1, len(ids) + 1, 7):  # the two ways agree (the tests check this on many more streams)
        inc = IncrementalText(tok.decode) if at == 1 else inc
        if inc.text(ids[:at]) != tok.decode(ids[:at]):
            raise SystemExit(f"the incremental text differs from the whole decode at {at} tokens")
    rows = []
    for k in args.tokens_per_step:
        whole = _per_step(lambda: tok.decode, ids, k, args.repeats)
        incr = _per_step(lambda: IncrementalText(tok.decode).text, ids, k, args.repeats)
        lo = 0
        for hi in BUCKETS:
            w = [t for at, t in whole if lo < at <= hi]
            i = [t for at, t in incr if lo < at <= hi]
            rows.append({"tokens_per_step": k, "output_tokens": f"{lo + 1}-{hi}", "steps": len(w),
                         "whole_decode_us": round(sum(w) / len(w) * 1e6, 1),
                         "incremental_us": round(sum(i) / len(i) * 1e6, 1)})
            lo = hi
    for r in rows:
        print(f"k={r['tokens_per_step']} output {r['output_tokens']:>9}: whole decode {r['whole_decode_us']:7.1f} us "
              f"a step, incremental {r['incremental_us']:6.1f} us")
    if args.json:
        out = {"tokenizer": "embedded target" if args.tokenizer is None else Path(args.tokenizer).name,
               "vocab_size": tok.vocab_size, "repeats": args.repeats, "rows": rows,
               "command": "python scripts/detok_micro.py " + " ".join(argv if argv is not None else sys.argv[1:])}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
