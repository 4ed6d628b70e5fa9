"""How well the cost model predicts real steps: predicted vs measured step time by batch size.

    python -m echo_trtllm.bench.costmodel [--model T --draft-model D] [--batch-sizes 1,16,64] [--json out.json]
        [--calibration FILE] [--methods ar,chain:num_draft_tokens=1,echo]

Measures the cost model with its grid (`measure_cost_model(..., grid=True)`; or takes a calibration's, fitted
overhead included, with `--calibration`), then runs ECHO (pure: no AR fallback; or each of `--methods`, bench
entries with their shape options) at each batch size on held-out prompts and compares, step by step:

    verify   the target forward over the step's T tokens: measured, against the grid at the step's context (the
             batch's longest cached context, as the runtime's padded attention reads it: `verify_time(T, context)`)
             and against the context-blind curve (`verify_time(T)`)
    verify side  the step's seconds outside drafting (the tree's inputs, the target forward, acceptance, commit):
             measured, against the grid plus the step overhead fitted as `calibrate` fits it (on calibration
             prompts, at one batch size, `--fit-batch-size`)
    draft    the step's drafting (draft forwards and the drafting loop's host work, selection and packing):
             measured, against the draft curve at every level's frontier size plus the fitted overhead per level
             (`draft_level_time`) + the model's control seconds
    step     the whole step: measured, against the verify side's and the draft side's predictions summed

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
from echo_trtllm.core.cost import CostModel

__all__ = ["compare_steps"]


def _errors(pred: list[float], meas: list[float]) -> dict:
    rel = [abs(p - m) / m for p, m in zip(pred, meas) if m > 0]
    return {"median_abs_rel_error": round(statistics.median(rel), 4) if rel else None,
            "predicted_over_measured": round(sum(pred) / sum(meas), 4) if sum(meas) > 0 else None}


def compare_steps(reports, cost: CostModel) -> dict:
    """Errors of the cost model's predictions over executed step reports (steps that verified something): the
    forward against the grid alone and the context-blind curve, the verify side against the grid plus the fitted
    step overhead, the draft side (speculative steps) against `draft_level_time` per level plus control, and the
    whole step against both sides; and `full_batch`, medians of each phase over the steps at the widest batch
    (milliseconds; tokens per request is a mean)."""
    bare = dataclasses.replace(cost, step_overhead_seconds=0.0)
    meas_v, grid_v, curve_v, meas_side, pred_side, meas_s, pred_s, meas_d, pred_d = ([] for _ in range(9))
    ran = [r for r in reports if r.batch_size and r.verified_tokens]
    for rep in ran:
        t, c, tm = rep.verified_tokens, rep.context, rep.timings
        meas_v.append(tm.verify)
        grid_v.append(float(bare.verify_time(t, c)))
        curve_v.append(float(bare.verify_time(t)))
        meas_side.append(tm.verify_side)
        pred_side.append(float(cost.verify_time(t, c)))
        draft = 0.0
        if rep.speculated:
            draft = cost.drafting_time(rep.draft.state.frontier_sizes, c) + cost.control_seconds
            meas_d.append(tm.drafting)
            pred_d.append(draft)
        meas_s.append(tm.total)
        pred_s.append(pred_side[-1] + draft)
    widest = max((r.batch_size for r in ran), default=0)
    full = [r for r in ran if r.batch_size == widest]
    ms = lambda f: round(1e3 * statistics.median(f(r) for r in full), 2) if full else None  # noqa: E731
    return {"steps": len(meas_v),
            # medians over the steps at the full batch (a closed batch drains at its end), milliseconds
            "full_batch": {"steps": len(full), "step_ms": ms(lambda r: r.timings.total),
                           "forward_ms": ms(lambda r: r.timings.verify),
                           "host_around_forward_ms": ms(lambda r: r.timings.verify_side - r.timings.verify),
                           "draft_forwards_ms": ms(lambda r: r.timings.draft_model),
                           "control_ms": ms(lambda r: r.timings.control),
                           "verified_tokens": statistics.median(r.verified_tokens for r in full) if full else None,
                           "emitted_per_request": round(statistics.mean(r.emitted_tokens / r.batch_size
                                                                        for r in full), 3) if full else None},
            "mean_verified_tokens": round(statistics.mean(r.verified_tokens for r in reports if r.batch_size), 2),
            "mean_context_read": round(statistics.mean(r.context for r in reports if r.batch_size), 1),
            "mean_step_seconds": round(statistics.mean(meas_s), 5) if meas_s else None,
            "verify_grid": _errors(grid_v, meas_v), "verify_curve": _errors(curve_v, meas_v),
            "verify_side": _errors(pred_side, meas_side), "step_grid": _errors(pred_s, meas_s),
            "speculative_steps": len(meas_d), "draft": _errors(pred_d, meas_d) if meas_d else None}


def _parser() -> argparse.ArgumentParser:
    from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET

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
    return ap


def _cost_model(args, calibration, target, draft, engine, cal_prompts, params) -> CostModel:
    """The calibration's cost model, or one measured here with its grid and the step overhead fitted as
    `calibrate` fits it (on calibration prompts at one batch size)."""
    from echo_trtllm.runtime.calibrate import fit_overheads, measure_cost_model

    if calibration is not None:
        cost = calibration.cost_model
        print(f"cost model of {args.calibration} (step overhead {cost.step_overhead_seconds * 1e3:.2f} ms, per "
              f"draft level {cost.draft_level_overhead_seconds * 1e3:.2f} ms)", flush=True)
        return cost
    t0 = time.perf_counter()
    cost = measure_cost_model(target, draft, repeats=args.repeats, grid=True)
    print(f"cost model with grid measured in {time.perf_counter() - t0:.0f} s", flush=True)
    fb = args.fit_batch_size
    with engine(fb, cost) as llm:
        llm.generate([cal_prompts[i % len(cal_prompts)] for i in range(fb)], params, use_tqdm=False)  # warm-up
        llm.get_stats()
        llm.generate([cal_prompts[(fb + i) % len(cal_prompts)] for i in range(fb)], params, use_tqdm=False)
        cost = fit_overheads(cost, llm.get_stats())
    print(f"fitted at B={fb} on calibration prompts: step overhead {cost.step_overhead_seconds * 1e3:.2f} ms, "
          f"per draft level {cost.draft_level_overhead_seconds * 1e3:.2f} ms", flush=True)
    return cost


def main(argv=None) -> int:
    from echo_trtllm.api import LLM
    from echo_trtllm.bench.prompts import load_prompts
    from echo_trtllm.bench.run import report_meta
    from echo_trtllm.models.draft import load_draft
    from echo_trtllm.models.loader import load_model
    from echo_trtllm.runtime.request import SamplingParams

    args = _parser().parse_args(argv)
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

    cost = _cost_model(args, calibration, target, draft, engine, cal_prompts, params)
    rows = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        for spec, name, shape in methods:
            with engine(b, cost, name, shape) as llm:
                llm.generate([cal_prompts[i % len(cal_prompts)] for i in range(b)], params, use_tqdm=False)  # warm-up
                llm.get_stats()
                llm.generate([prompts[(b + i) % len(prompts)] for i in range(b)], params, use_tqdm=False)
                row = {"method": spec, "batch_size": b, **compare_steps(llm.get_stats(), cost)}
            rows.append(row)
            err = {k: row[k] for k in ("verify_grid", "verify_curve", "verify_side", "step_grid")}
            print(f"{spec} B={b}: {row['steps']} steps, T {row['mean_verified_tokens']}, context "
                  f"{row['mean_context_read']}: " + ", ".join(
                      f"{k} {e['median_abs_rel_error']:.1%} (bias {e['predicted_over_measured']:.2f})"
                      for k, e in err.items())
                  + (f"; draft {row['draft']['median_abs_rel_error']:.1%} (bias "
                     f"{row['draft']['predicted_over_measured']:.2f}) over {row['speculative_steps']} speculative "
                     f"steps" if row["draft"] else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "cost_model": json.loads(cost.to_json()), "dtype": args.dtype,
                       **report_meta("echo_trtllm.bench.costmodel", argv)}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
