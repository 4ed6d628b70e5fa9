"""echo-trtllm generate: run prompts through the LLM API and print text plus a one-line stats summary.

    echo-trtllm generate --prompt "To be, or not to be" [--model PATH --draft-model PATH] [--policy echo]
                         [--max-tokens 64] [--temperature 0] [--k-max 512]
"""

from __future__ import annotations

import argparse
import time

from echo_trtllm.api import DEFAULT_MAX_BATCH_SIZE

from . import options

PROG = "echo-trtllm generate"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", action="append", help="prompt text (repeat for a batch); default: a short verse")
    options.add_model_options(ap)
    options.add_runtime_options(ap, parallel=True, invariant=True, quantize=True)
    options.add_speculation_options(ap)
    options.add_sampling_options(ap)
    options.add_calibration_options(ap)
    options.add_fallback_option(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    from echo_trtllm.models.draft import draft_kind

    args = build_parser().parse_args(argv)
    prompts = args.prompt or ["ROMEO:\nBut soft, what light through yonder window breaks?\n"]
    try:
        options.apply_threads(args)
        config = options.echo_config(args)
        params = options.sampling_params(args)
        llm = options.make_llm(args, config, min(args.max_batch_size or DEFAULT_MAX_BATCH_SIZE, len(prompts)))
    except options.USAGE_ERRORS as e:
        return options.fail(PROG, e)
    with llm:
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        spec = llm.speculation_stats()
    tokens = sum(len(o.token_ids) for o in outputs)
    steps = sum(o.stats.steps for o in outputs)
    for o in outputs:
        print(o.prompt + o.text)
        print(f"[finish_reason={o.finish_reason} tokens={len(o.token_ids)} steps={o.stats.steps} "
              f"mean_accepted_tokens={o.stats.mean_accepted_tokens:.2f}]")
    kind = "none" if llm.draft is None else draft_kind(llm.draft)  # the bench JSON's draft_kind, or no draft
    quant = f" draft_quantization={llm.draft_quantization}" if llm.draft_quantization else ""
    print(f"policy={config.policy} draft={kind}{quant} dtype={llm.dtype['target']}/{llm.dtype['draft']} "
          f"requests={len(outputs)} tokens={tokens} steps={steps} mean_accepted_tokens={tokens / max(steps, 1):.2f} "
          f"time={elapsed:.2f}s tokens/s={tokens / elapsed:.1f}")
    if spec is not None and "speculative_steps" in spec:
        print(fallback_line(spec))
    return 0


def fallback_line(spec: dict) -> str:
    """What the AR fallback did, from `LLM.speculation_stats`: a run that speculated little says why (the
    controller measured speculation no faster than plain steps at this batch, on this machine)."""
    line = (f"fallback: {spec['speculative_steps']} of {spec['steps']} steps speculative "
            f"(probes {spec['probes']}, plain probes {spec['plain_probes']})")
    est = spec.get("last_estimate")
    if est is not None:
        line += (f"; estimate at {est['batch_size']} request{'s' if est['batch_size'] != 1 else ''}: "
                 f"speculative {est['ratio']:.2f}x plain tokens/s ({est['low']:.2f}-{est['high']:.2f})")
    if spec["speculative_steps"] < spec["steps"]:
        line += "; speculation is exploited where its band lies above 1x (--fallback off speculates every step)"
    return line
