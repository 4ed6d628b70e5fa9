"""echo-trtllm bench: every method side by side, by batch size, on real prompt sets (echo_trtllm.bench.run).

    echo-trtllm bench --methods ar,chain,static,eagle2,ddd,echo,echo-dense,echo-fixed --batch-sizes 1,4,16 \
        --max-tokens 32 --prompt-set humaneval --json r.json --markdown r.md --plot r --trace t.json

The echo family's cost curve: --calibration FILE (its curve and gate samples), --calibration in-process
(calibrated here first, on the first 8 prompts of the set), or by default the out-of-the-box path: one curve
measured at load, shared by every echo-family engine, with the uncalibrated gate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from . import options

PROG = "echo-trtllm bench"


def build_parser() -> argparse.ArgumentParser:
    from echo_trtllm.bench.run import SHAPE_OPTIONS
    from echo_trtllm.core.config import POLICY_NAMES

    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    options.add_model_options(ap, engine_dir=False)
    ap.add_argument("--methods", default=",".join(POLICY_NAMES),
                    help="comma-separated policies (AR always runs); an entry may set its own tree shape, e.g. "
                         "chain:num_draft_tokens=2 or eagle2:total_tokens=16:max_depth=4 (options: "
                         f"{', '.join(SHAPE_OPTIONS)}), and fallback=on|off|auto to run it in that mode only "
                         "(e.g. echo:fallback=on beside --fallback off)")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--temperatures", default="0", help="comma-separated; 0 = greedy (e.g. 0,0.8)")
    options.add_prompt_set_option(ap)
    ap.add_argument("--prompt-split", default="eval", choices=["eval", "calibration", "all"],
                    help="evaluate on the set's eval side (default; --calibration in-process warms up on the "
                         "calibration side, so the two never share a prompt), on the calibration side (tuning tree "
                         "shapes without touching eval prompts) or on all of it")
    ap.add_argument("--rounds", type=int, default=1,
                    help="timed rounds (medians and min-max reported; with --profile-phases: profile rounds, the "
                         "methods' order alternating)")
    ap.add_argument("--warmup-rounds", type=int, default=1, help="untimed rounds first (same engines)")
    ap.add_argument("--waves", type=int, default=1,
                    help="requests per cell and round = WAVES x batch size, at most batch size in flight (in-flight "
                         "batching refills the batch as requests finish: sustained load); 1 (default): one closed "
                         "batch per round, which drains at its end")
    ap.add_argument("--ar-both-ends", action="store_true",
                    help="run AR at both ends of every round (one more AR cell a round): ratios are to AR's rate "
                         "interpolated at each cell's time, and AR's change within a round is reported and warned "
                         "about above 10%% (a machine whose speed steps mid-round)")
    ap.add_argument("--hf-assisted", type=lambda t: [x for x in t.split(",") if x], default=[],
                    help="at B=1, T=0 also run HF transformers generate(): plain and assisted by the same draft with "
                         "these num_assistant_tokens, e.g. heuristic,4,8")
    options.add_runtime_options(ap, batch=False, quantize=True)
    options.add_speculation_options(ap, policy=False)
    options.add_sampling_options(ap, temperature=False)
    options.add_calibration_options(ap)
    options.add_fallback_option(ap, several=True)
    ap.add_argument("--json", help="write results (and the machine, the command) here")
    ap.add_argument("--trace", help="write per-step acceptance traces here (input of echo-trtllm simulate)")
    ap.add_argument("--markdown", help="write the markdown table here (it is printed either way)")
    ap.add_argument("--plot", help="write PNG plots PREFIX-t<temperature>.png")
    ap.add_argument("--profile", action="store_true",
                    help="also print host <-> device traffic per step (syncs, bytes each way, largest read; every "
                         "row's JSON has it either way)")
    ap.add_argument("--profile-phases", action="store_true",
                    help="instead of the timed cells: where a decode step's time goes, per method and batch size "
                         "(control, the draft's forwards, the tree's inputs, the target's forward by layer kind, "
                         "acceptance, finishing, commit; plain and speculative steps apart; echo_trtllm.bench.phases)")
    ap.add_argument("--profile-steps", type=int, default=16,
                    help="--profile-phases: steps recorded per method and batch size, after a few warm ones "
                         "(echo_trtllm.bench.phases.WARM_STEPS)")
    return ap


def command_line(argv: list[str] | None) -> str:
    """The command as run, with paths cut to their file names (recorded results carry no machine paths)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return "echo-trtllm bench " + " ".join(os.path.basename(a) if os.sep in a else a for a in args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from tqdm import tqdm

    from echo_trtllm.bench.prompts import load_prompts
    from echo_trtllm.bench.run import BenchConfig, bench, load_hf_pair, markdown_table, plot, profile_table
    from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET
    from echo_trtllm.models.draft import draft_kind
    from echo_trtllm.models.weight_int8 import check_draft_quantization
    from echo_trtllm.runtime.calibrate import Calibration

    try:
        options.apply_threads(args)
        cfg = BenchConfig(
            methods=tuple(m for m in args.methods.split(",") if m),
            batch_sizes=tuple(options.int_list(args.batch_sizes, "--batch-sizes")),
            temperatures=tuple(options.float_list(args.temperatures, "--temperatures")),
            max_tokens=args.max_tokens, rounds=args.rounds, warmup_rounds=args.warmup_rounds, waves=args.waves,
            ar_both_ends=args.ar_both_ends, speculation=options.echo_config(args, policy="echo"),
            max_seq_len=args.max_seq_len,
            hf_assisted=tuple(args.hf_assisted), fallback=options.fallback_modes(args.fallback, several=True))
        prompts = load_prompts(args.prompt_set, args.prompt_split)
        calibration_prompts = load_prompts(args.prompt_set, "calibration")
        in_process = args.calibration == "in-process"
        calibration = Calibration.load(args.calibration) if args.calibration and not in_process else None
        if args.profile_steps < 1:
            raise ValueError(f"--profile-steps must be >= 1, got {args.profile_steps}")
        if args.no_cost_model and args.calibration:
            raise ValueError("--no-cost-model runs without the calibration's cost curve: do not give --calibration")
        check_draft_quantization(args.draft_quantization, args.device or "cpu", args.dtype)
    except options.USAGE_ERRORS as e:
        return options.fail(PROG, e)
    try:
        target, tok, draft = _load(args)
    except ValueError as e:
        return options.fail(PROG, e)
    calibration, cost_model = _prices(args, cfg, target, draft, tok, calibration, calibration_prompts, in_process)
    if args.profile_phases:
        try:
            return _profile(args, argv, cfg, target, draft, tok, prompts, calibration, cost_model)
        except (ValueError, RuntimeError) as e:  # e.g. a context too short for the steps asked
            return options.fail(PROG, e)
    hf = None
    if cfg.hf_assisted and 1 in cfg.batch_sizes and 0.0 in cfg.temperatures and draft_kind(draft) == "model":
        hf = load_hf_pair(args.model or str(DEFAULT_TARGET), args.draft_model or str(DEFAULT_DRAFT),
                          str(target.dtype).removeprefix("torch."))
    cells = (len(cfg.batch_sizes) * len(cfg.temperatures) * (cfg.warmup_rounds + cfg.rounds)
             * (len(cfg.runs()) + cfg.ar_both_ends))
    cells += (cfg.warmup_rounds + cfg.rounds) * (len(cfg.hf_assisted) + 1) * (hf is not None)
    with tqdm(total=cells, desc="bench", unit="cell", file=sys.stderr) as bar:
        def progress(m, b, temp, cell):
            bar.set_postfix_str(f"{m} B={b} T={temp:g} {cell['tokens_per_s']:.1f} tok/s MAT {cell['mat']:.2f}")
            bar.update()

        rows, traces = bench(target, draft, tok, prompts, cfg, calibration, cost_model, progress, hf)
    table = markdown_table(rows)
    if args.profile:
        table += "\nHost <-> device traffic per speculative step (runtime.transfer):\n\n" + profile_table(
            rows, target.config.vocab_size)
    print(table)
    meta = _meta(args, argv, cfg, target, draft, prompts, calibration_prompts, in_process, calibration, cost_model)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": rows, **meta}, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump({"traces": traces, **meta}, f)
    if args.plot:
        for name in plot(rows, args.plot, os.path.basename(args.model or "default pair")):
            print(name)
    return 0


def _prices(args, cfg, target, draft, tok, calibration, calibration_prompts, in_process):
    """(calibration, cost model) the engines start from: the file's, one calibrated here, or a cost curve measured
    at load ("auto": each engine's own; None with --no-cost-model)."""
    from echo_trtllm.bench.run import parse_method
    from echo_trtllm.core.policies import POLICIES
    from echo_trtllm.runtime.calibrate import LOAD_REPEATS, calibrate, measure_cost_model

    # methods that use a cost curve: the echo family, and every drafting method when its fallback is on
    uses_cost_curve = any(POLICIES[parse_method(m)[0]].uses_cost_curve(mode == "on") for _, m, mode in cfg.runs())
    cost_model = None if args.no_cost_model else "auto"
    if in_process and uses_cost_curve:
        calibration = calibrate(target, draft, tok, cfg.speculation, calibration_prompts[:8], batch_size=8,
                                max_tokens=min(args.max_tokens, 32))
        print(f"calibrated in-process: {calibration.warmup['samples']} gate samples", flush=True)
    elif calibration is None and uses_cost_curve and not args.no_cost_model:
        cost_model = measure_cost_model(target, draft, repeats=LOAD_REPEATS)
        print("cost curve measured at load (out of the box, no calibration): t_verify " +
              ", ".join(f"{t}:{s * 1e3:.1f}ms" for t, s in zip(cost_model.verify_tokens, cost_model.verify_seconds)),
              flush=True)
    return calibration, cost_model


def _load(args):
    """(target, tokenizer, draft) of the model flags; the draft quantised as --draft-quantization says: every
    method's engine runs this one draft, quantised here before its prices are measured."""
    from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET
    from echo_trtllm.models.draft import load_draft
    from echo_trtllm.models.loader import load_model
    from echo_trtllm.models.weight_int8 import apply_draft_quantization

    device = args.device or "cpu"
    t0 = time.perf_counter()
    target, tok = load_model(args.model or DEFAULT_TARGET, dtype=args.dtype, device=device)
    draft = load_draft(args.draft_model or DEFAULT_DRAFT, target, dtype=args.dtype, device=device)
    apply_draft_quantization(draft, args.draft_quantization)
    print(f"loaded target + draft in {time.perf_counter() - t0:.0f} s ({target.dtype} / {draft.dtype}"
          f"{', draft ' + args.draft_quantization if args.draft_quantization else ''})", flush=True)
    return target, tok, draft


def _meta(args, argv, cfg, target, draft, prompts, calibration_prompts, in_process, calibration, cost_model) -> dict:
    """What the JSON and the trace record beside the rows: machine, date, command, dtypes, prompts, prices."""
    from echo_trtllm.bench.run import machine_info
    from echo_trtllm.models.draft import draft_kind

    source = ("file" if args.calibration and not in_process else "in-process" if in_process else
              "none (no cost model)" if args.no_cost_model else "none (cost curve measured at load)")
    return {"machine": machine_info(), "date": time.strftime("%Y-%m-%d"), "command": command_line(argv),
            "dtype": {"target": str(target.dtype), "draft": str(draft.dtype)}, "draft_kind": draft_kind(draft),
            "draft_quantization": args.draft_quantization,
            "calibration_source": source, "waves": cfg.waves, "ar_both_ends": cfg.ar_both_ends,
            "prompts": {"set": args.prompt_set, "split": args.prompt_split, "eval": len(prompts),
                        "calibration": len(calibration_prompts) if in_process else 0,
                        "rule": "calibration = prompts 0, 4, 8, ... of the set; eval = all others"},
            "calibration": json.loads(calibration.to_json()) if calibration else None,
            "cost_model": json.loads(cost_model.to_json()) if hasattr(cost_model, "to_json") else None}


def _profile(args, argv, cfg, target, draft, tok, prompts, calibration, cost_model) -> int:
    """--profile-phases: each method's engine at each batch size, stepped and timed phase by phase."""
    from echo_trtllm.bench.phases import WARM_STEPS, combine_rounds, phase_table, profile_steps
    from echo_trtllm.bench.run import machine_info, make_engine

    rows = []
    for b in cfg.batch_sizes:
        runs = cfg.runs()
        engines = {}
        try:
            for label, method, mode in runs:
                engines[label] = make_engine(target, draft, tok, cfg.config_for(method, b), b, cfg.max_seq_len,
                                             calibration, cost_model, mode)
            # rounds alternate the methods' order (ABBA), so drift of the machine falls on every method alike; the
            # layers pass runs in the last round only, after its plain pass: its hooks slow the forwards, and the
            # engine learns its prices from every step, so nothing is measured after it
            profiles: dict[str, list[dict]] = {label: [] for label, _, _ in runs}
            for r in range(cfg.rounds):
                order = [label for label, _, _ in runs]
                for label in order if r % 2 == 0 else order[::-1]:
                    profiles[label].append(profile_steps(engines[label], prompts, b, args.profile_steps,
                                                         layers=r == cfg.rounds - 1))
                    print(f"round {r + 1}/{cfg.rounds} {label} B={b}: "
                          + ", ".join(f"{k} {v['total_ms']:.1f} ms/step" for k, v in profiles[label][-1].items()
                                      if k != "prefill_step" and v["steps"]), flush=True)
        finally:
            for llm in engines.values():
                llm.shutdown()
        for label, _, _ in runs:
            rows.append({"method": label, "batch_size": b, **combine_rounds(profiles[label])})
            print("\n".join(x for x in phase_table(rows[-1:]).split("\n")[2:4] if x.startswith("| ")), flush=True)
    table = phase_table(rows)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"phases": rows, "machine": machine_info(), "date": time.strftime("%Y-%m-%d"),
                       "command": command_line(argv), "steps": args.profile_steps, "warm_steps": WARM_STEPS,
                       "rounds": cfg.rounds,
                       "dtype": {"target": str(target.dtype), "draft": str(draft.dtype)},
                       "draft_quantization": args.draft_quantization,
                       "cost_model": json.loads(cost_model.to_json()) if hasattr(cost_model, "to_json") else None},
                      f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    return 0
