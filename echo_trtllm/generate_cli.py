"""echo-trtllm generate: run prompts through the LLM API and print text plus a one-line stats summary.

    echo-trtllm generate --prompt "To be, or not to be" [--model PATH --draft-model PATH] [--policy echo]
                         [--max-tokens 64] [--temperature 0] [--k-max 512]
"""

from __future__ import annotations

import argparse
import sys
import time

from echo_trtllm.core.config import POLICY_NAMES


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="echo-trtllm generate", description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", action="append", help="prompt text (repeat for a batch); default: a short verse")
    ap.add_argument("--model", help="target: HF model directory or .gguf file (default: the embedded tiny target)")
    ap.add_argument("--draft-model", help="draft: HF model directory or .gguf file (default: the embedded draft)")
    ap.add_argument("--engine-dir", help="an engine directory built by `echo-trtllm build`")
    ap.add_argument("--policy", default="echo", choices=POLICY_NAMES)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--k-max", type=int, default=512, help="global verification budget per step (echo family)")
    ap.add_argument("--max-depth", type=int, default=6)
    ap.add_argument("--max-nodes-per-request", type=int, default=64, help="cap on each request's tree, root included")
    ap.add_argument("--tree-top-k", type=int, default=4, help="children drafted per expanded node")
    ap.add_argument("--beam-width", type=int, default=4, help="nodes expanded per request and level (echo family)")
    ap.add_argument("--max-batch-size", type=int, help="default: the number of prompts")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, help="torch CPU threads")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from echo_trtllm.api import LLM, EchoConfig, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = args.prompt or ["ROMEO:\nBut soft, what light through yonder window breaks?\n"]
    args.max_batch_size = args.max_batch_size or len(prompts)
    try:
        config = EchoConfig(policy=args.policy, k_max=args.k_max, max_depth=args.max_depth,
                            max_nodes_per_request=args.max_nodes_per_request, top_k=args.tree_top_k,
                            beam_width=args.beam_width)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed)
        if args.engine_dir:
            llm = LLM(engine_dir=args.engine_dir, speculative_config=config, max_batch_size=args.max_batch_size,
                      dtype=args.dtype)
        else:
            llm = LLM(args.model, args.draft_model, speculative_config=config, max_batch_size=args.max_batch_size,
                      dtype=args.dtype)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"echo-trtllm generate: error: {e}", file=sys.stderr)
        return 2
    with llm:
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outputs)
    steps = sum(o.stats.steps for o in outputs)
    for o in outputs:
        print(o.prompt + o.text)
        print(f"[finish_reason={o.finish_reason} tokens={len(o.token_ids)} steps={o.stats.steps} "
              f"mean_accepted_tokens={o.stats.mean_accepted_tokens:.2f}]")
    print(f"policy={args.policy} requests={len(outputs)} tokens={tokens} steps={steps} "
          f"mean_accepted_tokens={tokens / max(steps, 1):.2f} time={elapsed:.2f}s tokens/s={tokens / elapsed:.1f}")
    return 0
