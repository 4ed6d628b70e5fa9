"""echo-trtllm calibrate: measure the cost curve, run warm-up traffic, calibrate the gate, write the result.

    echo-trtllm calibrate --engine-dir engines/tiny            # writes engines/tiny/calibration.json
    echo-trtllm calibrate --model T --draft-model D --output calib.json [--prompt-set humaneval]

The runtime picks it up from the engine directory (LLM(engine_dir=...)) or from LLM(calibration="calib.json").
"""

from __future__ import annotations

import argparse
import time

from . import options

PROG = "echo-trtllm calibrate"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    options.add_model_options(ap)
    ap.add_argument("--output", help="calibration JSON to write (required without --engine-dir)")
    options.add_prompt_set_option(ap, "warm-up prompts")
    ap.add_argument("--num-prompts", type=int, default=16, help="warm-up prompts taken from the set's calibration side")
    ap.add_argument("--batch-size", type=int, default=4, help="warm-up batch size (the record's operating point)")
    ap.add_argument("--cost-tokens", default="1,2,4,8,16,32,64,128", help="tokens per forward to time")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per cost point (fastest kept)")
    ap.add_argument("--num-sweet-spots", type=int, default=2)
    ap.add_argument("--grid", action="store_true",
                    help="also time verification by tokens x cached context per request (the budget rule then "
                         "prices each step at its own context; docs/calibration.md)")
    options.add_runtime_options(ap, batch=False)
    options.add_speculation_options(ap, policy=False)
    options.add_sampling_options(ap, temperature=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import dataclasses

    from echo_trtllm.bench.prompts import load_prompts
    from echo_trtllm.engine_dir import attach_calibration, read_engine
    from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET, default_drafter
    from echo_trtllm.models.draft import load_draft
    from echo_trtllm.models.loader import load_model
    from echo_trtllm.runtime.calibrate import calibrate

    if bool(args.engine_dir) == bool(args.output):
        return options.fail(PROG, "give exactly one of --engine-dir DIR (writes DIR/calibration.json) or --output FILE")
    if args.engine_dir and (args.model or args.draft_model):
        return options.fail(PROG, "--engine-dir names its own models; do not also give --model/--draft-model")
    for name in ("num_prompts", "batch_size", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            return options.fail(PROG, f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        options.apply_threads(args)
        cost_tokens = tuple(options.int_list(args.cost_tokens, "--cost-tokens"))
        if args.engine_dir:
            spec = read_engine(args.engine_dir)
            target_src, draft_src, dtype = spec.target, spec.draft, spec.dtype if args.dtype == "auto" else args.dtype
            # the engine's own tree shape (its EchoConfig; the speculation flags describe --model runs)
            config = dataclasses.replace(spec.config, gate_depths=None, gate_thresholds=None)
            if draft_src is None:
                return options.fail(PROG, f"engine {args.engine_dir} has no draft model: there is nothing to calibrate")
        else:
            target_src = args.model or DEFAULT_TARGET
            draft_src = args.draft_model or (default_drafter() if args.model is None else DEFAULT_DRAFT)
            config, dtype = options.echo_config(args), args.dtype
        prompts = load_prompts(args.prompt_set, "calibration")[: args.num_prompts]  # never an eval prompt
        t0 = time.perf_counter()
        target, tok = load_model(target_src, dtype=dtype, device=args.device or "cpu")
        draft = load_draft(draft_src, target, dtype=dtype, device=args.device or "cpu")
        print(f"loaded target + draft in {time.perf_counter() - t0:.0f} s", flush=True)
        cal = calibrate(target, draft, tok, config, prompts, batch_size=args.batch_size, max_tokens=args.max_tokens,
                        max_seq_len=args.max_seq_len, cost_tokens=cost_tokens, repeats=args.repeats,
                        num_sweet_spots=args.num_sweet_spots, grid=args.grid)
    except options.USAGE_ERRORS as e:
        return options.fail(PROG, e)
    out = attach_calibration(args.engine_dir, cal) if args.engine_dir else args.output
    if not args.engine_dir:
        cal.save(out)
    cm, g = cal.cost_model, cal.gate
    print("t_verify: " + ", ".join(f"{t}:{s * 1e3:.1f}ms" for t, s in zip(cm.verify_tokens, cm.verify_seconds)))
    print("t_draft:  " + ", ".join(f"{t}:{s * 1e3:.1f}ms" for t, s in zip(cm.draft_tokens, cm.draft_seconds)))
    for t, row in zip(cm.grid_tokens, cm.grid_seconds):
        print(f"t_verify({t} tokens) by context per request: " +
              ", ".join(f"{c}:{x * 1e3:.1f}ms" for c, x in zip(cm.grid_contexts, row)))
    print(f"break-even acceptance probability (B={cal.operating_batch_size}): {cal.break_even_accept_prob:.3f}")
    print(f"warm-up: {cal.warmup['steps']} steps, {cal.warmup['samples']} gate samples")
    print("acceptance by depth: " + ", ".join(f"{d}:{r:.2f}" for d, r in g.acceptance_rate.items()))
    print("AUC by depth (90 % bootstrap interval; rejected samples): " + ", ".join(
        f"{d}:{g.auc[d]:.2f} [{g.auc_interval[d][0]:.2f}, {g.auc_interval[d][1]:.2f}]; {g.num_rejected[d]}"
        if d in g.auc_interval else f"{d}: not ranked ({g.unranked.get(d, 'no samples')})" for d in g.auc))
    print(f"gate depths {g.gate_depths}, tau {[float(f'{t:.3g}') for t in g.thresholds]}")
    print(out)
    return 0
