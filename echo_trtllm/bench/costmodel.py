"""How well the cost model predicts real steps: predicted vs measured step time by batch size.

    python -m echo_trtllm.bench.costmodel [--model T --draft-model D] [--batch-sizes 1,16,64] [--json out.json]
        [--calibration FILE] [--methods ar,chain:num_draft_tokens=1,echo]

Measures the cost model with its grid (`measure_cost_model(..., grid=True)`; or takes a calibration's, fitted
overhead included, with `--calibration`), then runs ECHO (pure: no AR fallback; or each of `--methods`, bench
entries with their shape options) at each batch size on held-out prompts and compares, step by step:

    verify   the target forward over the step's T tokens: measured, against the grid at the step's context (the
             batch's longest cached context, as the runtime's padded attention reads it: `verify_time(T, context)`)
             and against the context-blind curve (`verify_time(T)`)
             and against the grid plus the step overhead fitted as `calibrate` fits it (on calibration prompts,
             at one batch size, `--fit-batch-size`)
    draft    the step's drafting (draft forwards and the drafting loop's host work): measured, against the
             draft curve at every level's frontier size + the model's control seconds
    step     the whole step: measured, against the grid's verification + the fitted overhead + the draft curve at
             every level's frontier size + the model's control seconds

Reported per batch size: median absolute relative error, and the ratio of summed predicted to summed measured
seconds (bias). Wall-clock timings on a shared machine: the medians say more than any single step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from echo_trtllm.core import EchoConfig
from echo_trtllm.core.cost import CostModel, fit_step_overhead

__all__ = ["compare_steps"]


def _errors(pred: list[float], meas: list[float]) -> dict:
    rel = [abs(p - m) / m for p, m in zip(pred, meas) if m > 0]
    return {"median_abs_rel_error": round(statistics.median(rel), 4) if rel else None,
            "predicted_over_measured": round(sum(pred) / sum(meas), 4) if sum(meas) > 0 else None}


def measured_steps(reports) -> list[tuple[int, float, float]]:
    """(tokens verified, context read, verify seconds) of every step that verified something."""
    return [(r.verified_tokens, r.context, r.timings.verify) for r in reports if r.batch_size and r.verified_tokens]


def compare_steps(reports, cost: CostModel) -> dict:
    """Errors of the cost model's predictions over executed step reports (steps that verified something):
    the grid alone, the grid plus the cost model's fitted step overhead, the context-blind curve, and the whole
    step (grid + overhead + the draft curve per level + control)."""
    bare = dataclasses.replace(cost, step_overhead_seconds=0.0)
    meas_v, grid_v, fitted_v, curve_v, meas_s, pred_s, meas_d, pred_d = [], [], [], [], [], [], [], []
    for rep in reports:
        if not rep.batch_size or rep.verified_tokens == 0:
            continue
        t, c = rep.verified_tokens, rep.context
        meas_v.append(rep.timings.verify)
        grid_v.append(float(bare.verify_time(t, c)))
        fitted_v.append(float(cost.verify_time(t, c)))
        curve_v.append(float(bare.verify_time(t)))
        draft = sum(float(cost.draft_time(f)) for f in rep.draft.state.frontier_sizes) if rep.draft else 0.0
        meas_s.append(rep.timings.total)
        pred_s.append(fitted_v[-1] + draft + (cost.control_seconds if rep.speculated else 0.0))
        if rep.speculated:
            meas_d.append(rep.timings.draft_model + rep.timings.control)
            pred_d.append(draft + cost.control_seconds)
    return {"steps": len(meas_v),
            "mean_verified_tokens": round(statistics.mean(r.verified_tokens for r in reports if r.batch_size), 2),
            "mean_context_read": round(statistics.mean(r.context for r in reports if r.batch_size), 1),
            "verify_grid": _errors(grid_v, meas_v), "verify_grid_overhead": _errors(fitted_v, meas_v),
            "verify_curve": _errors(curve_v, meas_v), "step_grid": _errors(pred_s, meas_s),
            "speculative_steps": len(meas_d), "draft": _errors(pred_d, meas_d) if meas_d else None}


def main(argv=None) -> int:
    from echo_trtllm.api import LLM
    from echo_trtllm.bench.prompts import load_prompts
    from echo_trtllm.bench.run import report_meta
    from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET
    from echo_trtllm.models.draft import load_draft
    from echo_trtllm.models.loader import load_model
    from echo_trtllm.runtime.calibrate import measure_cost_model
    from echo_trtllm.runtime.request import SamplingParams

    ap = argparse.ArgumentParser(prog="python -m echo_trtllm.bench.costmodel", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_TARGET))
    ap.add_argument("--draft-model", default=str(DEFAULT_DRAFT))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--prompt-set", default="humaneval")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fit-batch-size", type=int, default=4, help="batch size of the step-overhead fit (calibrate's)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--calibration", default=None,
                    help="take this calibration's cost model (grid and fitted overhead) and gate samples instead of "
                         "measuring a cost model here")
    ap.add_argument("--methods", default="echo", help="bench entries run pure, each at every batch size")
    ap.add_argument("--max-seq-len", type=int, default=1024)
    args = ap.parse_args(argv)
    from echo_trtllm.bench.run import make_engine, parse_method
    from echo_trtllm.runtime.calibrate import Calibration

    methods = [(m, *parse_method(m)) for m in args.methods.split(",")]  # refused by name before loading
    target, tok = load_model(args.model, dtype=args.dtype)
    draft = load_draft(args.draft_model, target, dtype=args.dtype)
    prompts, cal_prompts = load_prompts(args.prompt_set, "eval"), load_prompts(args.prompt_set, "calibration")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    calibration = Calibration.load(args.calibration) if args.calibration else None

    def engine(b: int, cost_model: CostModel, name: str = "echo", shape: dict | None = None) -> LLM:
        config = EchoConfig(policy=name, **{"k_max": max(512, 8 * b), **(shape or {})})
        return make_engine(target, draft, tok, config, b, args.max_seq_len, calibration=calibration,
                           cost_model=cost_model, fallback="off")

    if calibration is not None:
        cost = calibration.cost_model
        print(f"cost model of {args.calibration} (step overhead {cost.step_overhead_seconds * 1e3:.2f} ms)", flush=True)
    else:
        t0 = time.perf_counter()
        cost = measure_cost_model(target, draft, repeats=args.repeats, grid=True)
        print(f"cost model with grid measured in {time.perf_counter() - t0:.0f} s", flush=True)
        # the step overhead, fitted as `calibrate` fits it: on calibration prompts at one batch size
        fb = args.fit_batch_size
        with engine(fb, cost) as llm:
            llm.generate([cal_prompts[i % len(cal_prompts)] for i in range(fb)], params, use_tqdm=False)  # warm-up
            llm.get_stats()
            llm.generate([cal_prompts[(fb + i) % len(cal_prompts)] for i in range(fb)], params, use_tqdm=False)
            cost = dataclasses.replace(cost, step_overhead_seconds=fit_step_overhead(cost, measured_steps(llm.get_stats())))
        print(f"step overhead fitted at B={fb} on calibration prompts: {cost.step_overhead_seconds * 1e3:.2f} ms",
              flush=True)
    rows = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        for spec, name, shape in methods:
            with engine(b, cost, name, shape) as llm:
                llm.generate([cal_prompts[i % len(cal_prompts)] for i in range(b)], params, use_tqdm=False)  # warm-up
                llm.get_stats()
                llm.generate([prompts[(b + i) % len(prompts)] for i in range(b)], params, use_tqdm=False)
                row = {"method": spec, "batch_size": b, **compare_steps(llm.get_stats(), cost)}
            rows.append(row)
            draft_err = row["draft"]
            print(f"{spec} B={b}: {row['steps']} steps, T {row['mean_verified_tokens']}, context "
                  f"{row['mean_context_read']}: verify error grid {row['verify_grid']['median_abs_rel_error']:.1%} "
                  f"(bias {row['verify_grid']['predicted_over_measured']:.2f}), grid + overhead "
                  f"{row['verify_grid_overhead']['median_abs_rel_error']:.1%} (bias "
                  f"{row['verify_grid_overhead']['predicted_over_measured']:.2f}), curve "
                  f"{row['verify_curve']['median_abs_rel_error']:.1%} (bias "
                  f"{row['verify_curve']['predicted_over_measured']:.2f}); whole step "
                  f"{row['step_grid']['median_abs_rel_error']:.1%} (bias {row['step_grid']['predicted_over_measured']:.2f})"
                  + (f"; draft bias {draft_err['predicted_over_measured']:.2f} over {row['speculative_steps']} "
                     f"speculative steps" if draft_err else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "cost_model": json.loads(cost.to_json()), "dtype": args.dtype,
                       **report_meta("echo_trtllm.bench.costmodel", argv)}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
