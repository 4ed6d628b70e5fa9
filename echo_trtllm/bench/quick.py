"""Side-by-side throughput of tree policies on one model pair: tokens/s and mean accepted tokens (MAT).

Each (batch size, policy) cell is measured in rounds interleaved with the other policies in the same process,
so ratios compare like with like on a noisy machine. Greedy decoding, fixed prompts, fixed max_tokens.

    python -m echo_trtllm.bench.quick --policies ar,echo --batch-sizes 1,16 --max-tokens 48 [--model M --draft-model D]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from echo_trtllm.core import EchoConfig
from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET
from echo_trtllm.models.loader import load_model
from echo_trtllm.runtime.executor import Executor
from echo_trtllm.runtime.request import SamplingParams

CODE_PROMPTS = [
    "def read_config(path):\n    \"\"\"Read a JSON configuration file and return it as a dict.\"\"\"\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
    "def is_palindrome(text: str) -> bool:\n    \"\"\"Return True if text reads the same backwards.\"\"\"\n",
]
PROMPTS = [
    "ROMEO:\nBut soft, what light through yonder window breaks?\n",
    "def read_config(path):\n    \"\"\"Read a configuration file.\"\"\"\n",
    "HAMLET:\nTo be, or not to be, that is the question:\n",
    "class Queue:\n    def __init__(self, maxsize=0):\n",
    "KING LEAR:\nBlow, winds, and crack your cheeks! rage! blow!\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "PORTIA:\nThe quality of mercy is not strain'd,\n",
    "    for key, value in sorted(items.items()):\n",
]


PROMPT_SETS = {"mixed": None, "code": CODE_PROMPTS}


def run_cell(target, draft, tok, config: EchoConfig, batch_size: int, max_tokens: int, max_seq_len: int,
             prompts: list[str] | None = None, cost_model=None) -> dict:
    ex = Executor(target, draft if config.policy != "ar" else None, tok, config, max_batch_size=batch_size,
                  max_seq_len=max_seq_len, cost_model=cost_model)
    prompts = prompts or PROMPTS
    reqs = [ex.make_request(prompts[i % len(prompts)], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                     ignore_eos=True)) for i in range(batch_size)]
    for r in reqs:
        ex.submit(r)
    ex.admit()  # prefill outside the timed decode loop
    steps = verified = 0
    t0 = time.perf_counter()
    while ex.has_work:
        rep = ex.step()
        steps += 1
        verified += rep.verified_tokens
    elapsed = time.perf_counter() - t0
    tokens = sum(len(r.output_token_ids) for r in reqs)
    req_steps = sum(r.stats.steps for r in reqs)
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed, "mat": tokens / req_steps,
            "verified_per_step": verified / steps, "steps": steps}


def command_line(argv: list[str] | None) -> str:
    """The command as run, with model paths cut to their file names (no machine paths in recorded results)."""
    import os
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    return "python -m echo_trtllm.bench.quick " + " ".join(os.path.basename(a) if os.sep in a else a for a in args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_TARGET))
    ap.add_argument("--draft-model", default=str(DEFAULT_DRAFT))
    ap.add_argument("--policies", default="ar,echo")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--k-max", type=int, default=64)
    ap.add_argument("--max-depth", type=int, default=6)
    ap.add_argument("--max-nodes-per-request", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--prompt-set", default="mixed", choices=list(PROMPT_SETS))
    ap.add_argument("--budget-rule", default="fixed", choices=["fixed", "cost"],
                    help="cost: measure t_verify/t_draft first and let the echo family pick K per step (<= K_max)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    target, tok = load_model(args.model, dtype=args.dtype)
    draft, _ = load_model(args.draft_model, dtype=args.dtype, with_tokenizer=False)
    print(f"loaded target + draft in {time.perf_counter() - t0:.0f} s", flush=True)
    policies = args.policies.split(",")
    cost = None
    if args.budget_rule == "cost":
        from echo_trtllm.runtime.calibrate import measure_cost_model

        cost = measure_cost_model(target, draft)
        print("cost model: t_verify " + ", ".join(f"{t}:{s * 1e3:.1f}ms" for t, s in zip(cost.verify_tokens,
                                                                                      cost.verify_seconds)), flush=True)
    rows = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        samples: dict[str, list[dict]] = {p: [] for p in policies}
        for _ in range(args.rounds):
            for p in policies:
                cfg = EchoConfig(policy=p, k_max=max(args.k_max, b), max_depth=args.max_depth,
                                 max_nodes_per_request=args.max_nodes_per_request,
                                 total_tokens=args.max_nodes_per_request, top_k=args.top_k,
                                 beam_width=args.beam_width, num_draft_tokens=args.num_draft_tokens)
                samples[p].append(run_cell(target, draft, tok, cfg, b, args.max_tokens, 512,
                                           PROMPT_SETS[args.prompt_set], cost))
        ar_tps = statistics.median(s["tokens_per_s"] for s in samples[policies[0]])
        for p in policies:
            tps = statistics.median(s["tokens_per_s"] for s in samples[p])
            row = {"policy": p, "batch_size": b, "tokens_per_s": tps, "mat": samples[p][-1]["mat"],
                   "verified_per_step": samples[p][-1]["verified_per_step"], f"ratio_vs_{policies[0]}": tps / ar_tps}
            rows.append(row)
            print(f"B={b:<4} {p:<11} tokens/s={tps:8.1f}  MAT={row['mat']:.2f}  verified/step={row['verified_per_step']:.1f}"
                  f"  x{policies[0]}={tps / ar_tps:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": rows, "machine": platform.platform(), "command": command_line(argv)}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
