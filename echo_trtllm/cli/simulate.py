"""echo-trtllm simulate: predicted throughput vs batch size from recorded traces (SIMULATION; echo_trtllm.bench.simulate).

    echo-trtllm simulate --trace t.json --target 235b --gpu H100 --gpu-dtype fp8 --batch-sizes 1,16,64,256
"""

from __future__ import annotations

import argparse
import json
import math

from echo_trtllm.core.config import EchoConfig

from . import options

PROG = "echo-trtllm simulate"


def build_parser() -> argparse.ArgumentParser:
    from echo_trtllm.bench.simulate import GPUS, MODELS

    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True, help="trace JSON from echo-trtllm bench --trace")
    ap.add_argument("--source-batch-size", type=int, help="use only the traces recorded at this batch size")
    ap.add_argument("--calibration", help="use this calibration's measured cost curve instead of a roofline")
    ap.add_argument("--target", default="235b", choices=list(MODELS))
    ap.add_argument("--gpu", default="H100", choices=list(GPUS))
    ap.add_argument("--gpu-dtype", default="fp8", choices=["bf16", "fp8"], help="the simulated GPU's precision")
    ap.add_argument("--context", type=int, default=None,
                    help="tokens of KV per request read every step (roofline: default 2048; a measured calibration "
                         "with a grid reads its grid there, without one its curve)")
    ap.add_argument("--mfu", type=float, default=0.5)
    ap.add_argument("--batch-sizes", default="1,4,16,64,128,256")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--control-us", type=float, default=0.0, help="ECHO control per speculative step (µs)")
    ap.add_argument("--methods", help="comma-separated bench --methods entries to simulate, shape options included "
                                      "(default: the traced methods); 'oracle' adds the hindsight ceiling of any "
                                      "allocation over the tree source's drafts")
    ap.add_argument("--tree-source", help="replay every method on this traced method's drafted trees (e.g. a wide "
                                          "eagle2 run; tunes shapes no run drafted)")
    g = ap.add_argument_group("the replay (recorded trees through the runtime's drafting loop, gate and budget; "
                              "a --methods entry's own shape options win)")
    options.add_tree_shape_options(g)
    g.add_argument("--confidence-shift", type=float, default=None,
                   help="WHAT-IF: move every drafted node's confidence toward its hindsight outcome by this much in "
                        "logit space (inf: perfect knowledge) before the replay; the echo family's gate and "
                        "acceptance estimates are then calibrated from the shifted trace itself")
    g.add_argument("--gate-calibration", help="calibration JSON whose gate samples calibrate the replayed gate "
                                              "(default: --calibration's when given, else the uncalibrated gate)")
    ap.add_argument("--json", help="write the rows here")
    return ap


def main(argv: list[str] | None = None) -> int:
    from echo_trtllm.bench.simulate import (GPUS, MODELS, PAPER, depth_aucs, has_trees, load_traces, roofline_cost,
                                            shift_confidence, simulate)

    args = build_parser().parse_args(argv)
    if args.confidence_shift is not None and not args.confidence_shift >= 0:
        return options.fail(PROG, f"--confidence-shift must be a number >= 0 (inf: perfect knowledge), "
                                  f"got {args.confidence_shift}")
    if args.confidence_shift is not None and args.gate_calibration:
        return options.fail(PROG, "--gate-calibration does not apply with --confidence-shift: the what-if calibrates "
                                  "the gate from the shifted trace itself")
    try:
        traces = load_traces(args.trace, args.source_batch_size)
        batch_sizes = options.int_list(args.batch_sizes, "--batch-sizes")
        from echo_trtllm.runtime.calibrate import Calibration

        cal = Calibration.load(args.calibration) if args.calibration else None
        if cal is not None:
            measured = cal.cost_model
            label = f"measured cost curve ({measured.device})"

            def cost_for_batch(b):
                return measured
        else:
            model, gpu = MODELS[args.target], GPUS[args.gpu]
            context = args.context or 2048
            label = f"{model.name} on {model.num_gpus}x{gpu.name}, {args.gpu_dtype}, context {context}"

            def cost_for_batch(b):
                return roofline_cost(model, gpu, args.gpu_dtype, b, context, mfu=args.mfu)

        config = EchoConfig(k_max=args.k_max, max_depth=args.max_depth,
                            max_nodes_per_request=args.max_nodes_per_request, top_k=args.tree_top_k,
                            beam_width=args.beam_width)
        gates = Calibration.load(args.gate_calibration) if args.gate_calibration else cal
        gate_samples = gates.gate_samples() if gates is not None and gates.samples is not None else None
        rows = simulate(traces, batch_sizes, cost_for_batch, args.steps, args.k_max, args.control_us * 1e-6,
                        config, gate_samples,
                        methods=[m for m in args.methods.split(",") if m] if args.methods else None,
                        tree_source=args.tree_source, context=args.context if args.calibration else None,
                        confidence_shift=args.confidence_shift)
    except (*options.USAGE_ERRORS, KeyError) as e:
        return options.fail(PROG, e)
    print(f"SIMULATION — {label}; acceptance replayed from {args.trace.rsplit('/', 1)[-1]}")
    if args.confidence_shift is not None:
        print(f"WHAT-IF: the replayed methods read the draft confidence shifted by {args.confidence_shift:g} (logit) "
              f"toward each node's outcome, the echo family's gate calibrated on that trace itself"
              + (" (the calibration's cost curve is used, its gate samples are not)" if args.calibration else ""))
    aucs = None
    source = traces.get(args.tree_source) if args.tree_source else None
    if source and has_trees(source):
        if args.confidence_shift is not None:
            source = shift_confidence(source, args.confidence_shift)
        aucs = depth_aucs(source, max((d for r in source for d in r["depths"]), default=0))
        print(f"confidence AUC by depth ({args.tree_source}): " + " ".join(f"{a:.3f}" for a in aucs))
    print("| method | B | sim tokens/s | sim ×AR | sim MAT | sim verified/step | request-steps | allocation |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        sp = "–" if r["speedup_vs_ar"] is None else f"{r['speedup_vs_ar']:.2f}"
        print(f"| {r['method']} | {r['batch_size']} | {r['tokens_per_s']:.0f} | {sp} | {r['mat']:.2f} | "
              f"{r['verified_per_step']:.1f} | {r['records']} | {r['allocation']} |")
    if not args.calibration:
        print(f"for orientation ({PAPER[args.target]}); not comparable: other draft, other acceptance")
    if args.json:
        with open(args.json, "w") as f:
            shift = args.confidence_shift  # strict JSON: no Infinity / NaN
            auc = None if aucs is None else [None if math.isnan(a) else a for a in aucs]
            json.dump({"simulation": True, "cost": label,
                       "confidence_shift": "inf" if shift is not None and math.isinf(shift) else shift,
                       "confidence_auc_by_depth": auc, "rows": rows}, f, indent=2)
    return 0
