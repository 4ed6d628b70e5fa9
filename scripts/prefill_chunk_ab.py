"""Prefill chunks of max_num_tokens (before) against the executor's `prefill_chunk` (the widest activation within the
heap's largest block, echo_trtllm.cpu.heap_tokens), in one process, alternating: B HumanEval prompts admitted at
once (their prefill timed), then decoded two tokens so their slots free.

    python scripts/prefill_chunk_ab.py --model <target> [--dtype bfloat16] [--batch-size 64] [--rounds 3]
        [--json out.json]
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

    from echo_trtllm import LLM, EchoConfig, SamplingParams
    from echo_trtllm.bench.prompts import load_prompts
    from echo_trtllm.bench.run import write_report

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.batch_size < 1 or args.rounds < 1:
        ap.error("--batch-size and --rounds must be >= 1")
    torch.set_num_threads(2)
    llm = LLM(args.model, None, speculative_config=EchoConfig(policy="ar"), max_batch_size=args.batch_size,
              max_seq_len=512, dtype=args.dtype)
    llm.shutdown()  # stepped directly
    ex, prompts = llm.executor, load_prompts("humaneval", "all")
    chunks = {"before (max_num_tokens)": ex.max_num_tokens, "prefill_chunk": ex.prefill_chunk}
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    rows, at = [], 0
    for k in range(args.rounds):
        for name in (list(chunks) if k % 2 == 0 else list(chunks)[::-1]):
            ex.prefill_chunk = chunks[name]
            batch = [prompts[(at + i) % len(prompts)] for i in range(args.batch_size)]
            at += args.batch_size // 2  # the next batch overlaps half of this one: similar lengths, not the same
            reqs = [ex.make_request(q, params) for q in batch]
            for r in reqs:
                ex.submit(r)
            t = time.perf_counter()
            ex.admit()
            seconds = time.perf_counter() - t
            while ex.has_work:
                ex.step()
            tokens = sum(len(r.prompt_token_ids) - 1 for r in reqs)
            rows.append({"round": k + 1, "setting": name, "chunk": chunks[name], "prefill_tokens": tokens,
                         "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1)})
            print(json.dumps(rows[-1]), flush=True)
    medians = {name: statistics.median(r["tokens_per_s"] for r in rows if r["setting"] == name) for name in chunks}
    print(json.dumps({"median prefill tokens/s": medians}))
    if args.json:
        write_report(args.json, "prefill_chunk_ab", argv, rows=rows, median_tokens_per_s=medians)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
