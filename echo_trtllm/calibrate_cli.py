"""echo-trtllm calibrate: measure the cost curve, run warm-up traffic, calibrate the gate, write the result.

    echo-trtllm calibrate --engine-dir engines/tiny            # writes engines/tiny/calibration.json
    echo-trtllm calibrate --model T --draft-model D --output calib.json [--prompt-set humaneval]

The runtime picks it up from the engine directory (LLM(engine_dir=...)) or from LLM(calibration="calib.json").
"""

from __future__ import annotations

import argparse
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    from echo_trtllm.bench.prompts import PROMPT_SETS

    ap = argparse.ArgumentParser(prog="echo-trtllm calibrate", description=__doc__.splitlines()[0])
    ap.add_argument("--engine-dir", help="engine directory to calibrate (the result is written into it)")
    ap.add_argument("--model", help="target (HF directory or .gguf); default: the embedded tiny target")
    ap.add_argument("--draft-model", help="draft (HF directory or .gguf); default: the embedded tiny draft")
    ap.add_argument("--output", help="calibration JSON to write (required without --engine-dir)")
    ap.add_argument("--prompt-set", default="mixed", choices=list(PROMPT_SETS), help="warm-up prompts")
    ap.add_argument("--num-prompts", type=int, default=16, help="warm-up prompts taken from the set")
    ap.add_argument("--batch-size", type=int, default=4, help="warm-up and operating batch size (sets lambda)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per warm-up prompt")
    ap.add_argument("--max-depth", type=int, help="default: the engine's, else 6")
    ap.add_argument("--cost-tokens", default="1,2,4,8,16,32,64,128", help="tokens per forward to time")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per cost point (median kept)")
    ap.add_argument("--num-sweet-spots", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, help="torch CPU threads")
    return ap


def _error(message: str) -> int:
    print(f"echo-trtllm calibrate: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import dataclasses

    import torch

    from echo_trtllm.bench.prompts import load_prompts
    from echo_trtllm.core.config import EchoConfig
    from echo_trtllm.engine_dir import attach_calibration, read_engine
    from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET
    from echo_trtllm.models.loader import load_model
    from echo_trtllm.runtime.calibrate import calibrate

    if args.threads:
        torch.set_num_threads(args.threads)
    if bool(args.engine_dir) == bool(args.output):
        return _error("give exactly one of --engine-dir DIR (writes DIR/calibration.json) or --output FILE")
    if args.engine_dir and (args.model or args.draft_model):
        return _error("--engine-dir names its own models; do not also give --model/--draft-model")
    for name in ("num_prompts", "batch_size", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            return _error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        cost_tokens = tuple(int(x) for x in args.cost_tokens.split(","))
    except ValueError:
        return _error(f"--cost-tokens must be comma-separated integers, got {args.cost_tokens!r}")
    try:
        if args.engine_dir:
            spec = read_engine(args.engine_dir)
            target_src, draft_src, config, dtype = spec.target, spec.draft, spec.config, spec.dtype
            if draft_src is None:
                return _error(f"engine {args.engine_dir} has no draft model: there is nothing to calibrate")
        else:
            target_src, draft_src = args.model or DEFAULT_TARGET, args.draft_model or DEFAULT_DRAFT
            config, dtype = EchoConfig(), "float32"
        dtype = args.dtype or dtype
        if args.max_depth is not None:
            config = dataclasses.replace(config, max_depth=args.max_depth, gate_depths=None, gate_thresholds=None)
        prompts = load_prompts(args.prompt_set)[: args.num_prompts]
        t0 = time.perf_counter()
        target, tok = load_model(target_src, dtype=dtype)
        draft, _ = load_model(draft_src, dtype=dtype, with_tokenizer=False)
        print(f"loaded target + draft in {time.perf_counter() - t0:.0f} s", flush=True)
        cal = calibrate(target, draft, tok, config, prompts, batch_size=args.batch_size, max_tokens=args.max_tokens,
                        cost_tokens=cost_tokens, repeats=args.repeats, num_sweet_spots=args.num_sweet_spots)
    except (ValueError, FileNotFoundError) as e:
        return _error(str(e))
    out = attach_calibration(args.engine_dir, cal) if args.engine_dir else args.output
    if not args.engine_dir:
        cal.save(out)
    cm, g = cal.cost_model, cal.gate
    print("t_verify: " + ", ".join(f"{t}:{s * 1e3:.1f}ms" for t, s in zip(cm.verify_tokens, cm.verify_seconds)))
    print("t_draft:  " + ", ".join(f"{t}:{s * 1e3:.1f}ms" for t, s in zip(cm.draft_tokens, cm.draft_seconds)))
    print(f"break-even acceptance probability (B={cal.operating_batch_size}): {cal.break_even_accept_prob:.3f}")
    print(f"warm-up: {cal.warmup['steps']} steps, {cal.warmup['samples']} gate samples")
    print("acceptance by depth: " + ", ".join(f"{d}:{r:.2f}" for d, r in g.acceptance_rate.items()))
    print(f"gate depths {g.gate_depths}, tau {[float(f'{t:.3g}') for t in g.thresholds]}")
    print(out)
    return 0
