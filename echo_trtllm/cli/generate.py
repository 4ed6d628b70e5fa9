"""echo-trtllm generate: run prompts through the LLM API and print text plus a one-line stats summary.

    echo-trtllm generate --prompt "To be, or not to be" [--model PATH --draft-model PATH] [--policy echo]
                         [--max-tokens 64] [--temperature 0] [--k-max 512]
"""

from __future__ import annotations

import argparse
import time

from . import options

PROG = "echo-trtllm generate"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", action="append", help="prompt text (repeat for a batch); default: a short verse")
    options.add_model_options(ap)
    options.add_runtime_options(ap, parallel=True)
    options.add_speculation_options(ap)
    options.add_sampling_options(ap)
    options.add_calibration_options(ap)
    options.add_fallback_option(ap)
    return ap


def draft_kind(draft) -> str:
    """How the engine drafts: "eagle3-head" (from the target's features), "model" (a separate draft model) or
    "none"."""
    from echo_trtllm.models.eagle3 import Eagle3Head

    return "none" if draft is None else "eagle3-head" if isinstance(draft, Eagle3Head) else "model"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prompts = args.prompt or ["ROMEO:\nBut soft, what light through yonder window breaks?\n"]
    try:
        options.apply_threads(args)
        config = options.echo_config(args)
        params = options.sampling_params(args)
        llm = options.make_llm(args, config, args.max_batch_size or len(prompts))
    except options.USAGE_ERRORS as e:
        return options.fail(PROG, e)
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
    print(f"policy={config.policy} draft={draft_kind(llm.draft)} dtype={llm.dtype['target']}/{llm.dtype['draft']} "
          f"requests={len(outputs)} "
          f"tokens={tokens} steps={steps} mean_accepted_tokens={tokens / max(steps, 1):.2f} time={elapsed:.2f}s "
          f"tokens/s={tokens / elapsed:.1f}")
    return 0
