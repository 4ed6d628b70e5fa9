"""What the batched drafting loop costs end to end: the runtime drafting with `draft_tree_batched` (the host reads
the levels at sync points only) against the same executor drafting level by level (`draft_tree`, one read per
level), alternating round by round on the same requests. Both emit the same tokens (greedy, lossless); they differ
in host syncs per step and in draft compute (the batched loop drafts on for requests a later decision stops, until
the next read). On a CPU the model's device is the host, so a sync costs nothing and only the extra draft work
shows; on a GPU a sync stalls the host on the device. (The runtime itself reads after every level on a CPU,
`Executor.sync_every_level`; this benchmark runs the batched loop in its accelerator form everywhere.)

    python -m echo_trtllm.bench.loops [--drafter eagle3|model] [--policy echo] [--batch-sizes 16,64] [--rounds 3] \\
        [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from echo_trtllm.bench.prompts import load_prompts
from echo_trtllm.bench.run import machine_info
from echo_trtllm.core import EchoConfig
from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_EAGLE3, DEFAULT_TARGET
from echo_trtllm.models.eagle3 import load_eagle3
from echo_trtllm.models.loader import load_model
from echo_trtllm.runtime.executor import Executor
from echo_trtllm.runtime.request import SamplingParams

LOOPS = ("batched", "levels")


def run_once(target, draft, tok, config: EchoConfig, batch_size: int, prompts: list[str], max_tokens: int,
             loop: str) -> dict:
    ex = Executor(target, draft, tok, config, max_batch_size=batch_size, max_seq_len=512)
    if loop == "levels":
        ex.policy.beam_frontier = False  # the executor then drafts level by level
    else:
        ex.sync_every_level = False  # the accelerator's form (reads at the policy's sync depths), even on a CPU
    reqs = [ex.make_request(p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)) for p in prompts]
    for r in reqs:
        ex.submit(r)
    tokens, control, draft_model, syncs, spec = 0, 0.0, 0.0, 0, 0
    t0 = time.perf_counter()
    while ex.has_work:
        rep = ex.step()
        tokens += rep.emitted_tokens
        control += rep.timings.control
        draft_model += rep.timings.draft_model
        if rep.speculated:
            syncs += rep.traffic.syncs
            spec += 1
    seconds = time.perf_counter() - t0
    if ex.failures:
        raise RuntimeError(f"a step failed: {ex.last_error}")
    return {"tokens_per_s": tokens / seconds, "control_s": control, "draft_model_s": draft_model,
            "syncs_per_speculative_step": syncs / max(spec, 1), "outputs": [r.output_token_ids for r in reqs]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m echo_trtllm.bench.loops", description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", choices=("eagle3", "model"), default="eagle3")
    ap.add_argument("--policy", default="echo")
    ap.add_argument("--batch-sizes", default="16,64")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    config = EchoConfig(policy=args.policy)
    target, tok = load_model(DEFAULT_TARGET, dtype="float32")
    draft = (load_eagle3(DEFAULT_EAGLE3, target) if args.drafter == "eagle3"
             else load_model(DEFAULT_DRAFT, dtype="float32", with_tokenizer=False)[0])
    base = load_prompts("mixed") + load_prompts("code")
    prompts = [base[i % len(base)] for i in range(args.requests)]
    results = []
    print(f"{args.policy} with the {args.drafter} drafter, {args.requests} requests x {args.max_tokens} tokens, "
          f"greedy, {torch.get_num_threads()} thread(s); rounds alternate the loops")
    print(f"{'B':>4} {'loop':>8} {'tok/s median':>12} {'min':>7} {'max':>7} {'draft s':>8} {'control s':>9} "
          f"{'syncs/step':>10}")
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        runs: dict[str, list[dict]] = {loop: [] for loop in LOOPS}
        run_once(target, draft, tok, config, b, prompts[:b], 4, "batched")  # warm-up
        for rnd in range(args.rounds):
            for loop in LOOPS if rnd % 2 == 0 else LOOPS[::-1]:
                runs[loop].append(run_once(target, draft, tok, config, b, prompts, args.max_tokens, loop))
        if runs["batched"][0]["outputs"] != runs["levels"][0]["outputs"]:
            raise RuntimeError("the two loops emitted different tokens")
        row = {"batch_size": b}
        for loop in LOOPS:
            tps = [r["tokens_per_s"] for r in runs[loop]]
            med = lambda key: statistics.median(r[key] for r in runs[loop])  # noqa: E731
            row[loop] = {"tokens_per_s": tps, "tokens_per_s_median": statistics.median(tps),
                         "draft_model_s_median": med("draft_model_s"), "control_s_median": med("control_s"),
                         "syncs_per_speculative_step": runs[loop][0]["syncs_per_speculative_step"]}
            r = row[loop]
            print(f"{b:>4} {loop:>8} {r['tokens_per_s_median']:>12.1f} {min(tps):>7.1f} {max(tps):>7.1f} "
                  f"{r['draft_model_s_median']:>8.2f} {r['control_s_median']:>9.2f} "
                  f"{r['syncs_per_speculative_step']:>10.2f}")
        row["batched_over_levels"] = row["batched"]["tokens_per_s_median"] / row["levels"]["tokens_per_s_median"]
        print(f"{b:>4} batched / levels tok/s: {row['batched_over_levels']:.3f}")
        results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python -m echo_trtllm.bench.loops " + " ".join(sys.argv[1:] if argv is None else argv), "drafter": args.drafter,
                       "policy": args.policy, "requests": args.requests, "max_tokens": args.max_tokens,
                       "results": results, "machine": machine_info()}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
