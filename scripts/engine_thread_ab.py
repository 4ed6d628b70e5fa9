"""The CPU settings a closed batch meets on the engine's own thread, arm against arm: oneDNN's packing hint for the
prepacked linears (models.packed.PACK_ROWS), glibc's top pad (cpu.TOP_PAD), attention's q, k and v as one packed
product (models.packed.FUSE_QKV), the one-pass norm and rotary embedding (models.cpu_kernels.ENABLED) and the rows
a packed product runs on at least (models.packed.ROW_FLOOR), each arm in fresh processes, the arms alternating over
rounds.

    python scripts/engine_thread_ab.py --model <target> [--arms old:1:0:0 pad:1:1:0 hint:32:1:0 new:32:1:1:1:4]
        [--batch-size 16] [--max-tokens 64] [--rounds 3] [--json out.json]

An arm is NAME:PACK_ROWS:PAD:FUSE[:KERNELS[:FLOOR]] (PAD 1: cpu.TOP_PAD as it is, 0: glibc's top pad; FUSE 1: q, k
and v fused; KERNELS 1: the one-pass norm and rotary embedding, 0, the default of a four-field arm: the eager code;
FLOOR: models.packed.ROW_FLOOR, 1, the default of a four- or five-field arm: every product on its own rows). Each
process builds the LLM (AR, bfloat16), runs two untimed batches of other prompts, then one timed batch through
LLM.generate as bench_vllm's closed batches do (greedy HumanEval eval prompts, ignore_eos): the admission (every
prompt's prefill, with the process's minor page faults during it), the median decode step and the whole batch's
tokens/s.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

from echo_trtllm.bench.run import child_result, print_result, write_report

ROOT = Path(__file__).resolve().parents[1]


def child(args) -> dict:
    import torch

    import echo_trtllm.cpu as cpu
    import echo_trtllm.models.cpu_kernels as cpu_kernels
    import echo_trtllm.models.packed as packed
    from echo_trtllm import LLM, EchoConfig, SamplingParams
    from echo_trtllm.bench.prompts import load_prompts

    packed.PACK_ROWS, packed.FUSE_QKV, cpu_kernels.ENABLED = args.pack_rows, bool(args.fuse), bool(args.kernels)
    packed.ROW_FLOOR = args.floor
    if not args.pad:
        cpu.TOP_PAD = 0
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, None, speculative_config=EchoConfig(policy="ar"), max_batch_size=args.batch_size,
              max_seq_len=1024, dtype=args.dtype)
    ex, prompts, b = llm.executor, load_prompts("humaneval", "eval"), args.batch_size
    admits, steps = [], []
    admit, step = ex.admit, ex.step

    def timed_admit():
        faults, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        out = admit()
        if out[0] or out[1]:
            admits.append((time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
        return out

    def timed_step():
        t = time.perf_counter()
        out = step()
        steps.append(time.perf_counter() - t)
        return out

    ex.admit, ex.step = timed_admit, timed_step  # the engine thread calls them through the executor
    for first, tokens in ((b + 1, 8), (2 * b + 1, 8), (1, args.max_tokens)):  # two untimed batches, then the timed
        admits.clear()
        steps.clear()
        t = time.perf_counter()
        llm.generate(prompts[first:first + b], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True),
                     use_tqdm=False)
        seconds = time.perf_counter() - t
    llm.shutdown()
    return {"prefill_s": round(sum(a for a, _ in admits), 3), "prefill_faults": sum(f for _, f in admits),
            "decode_step_ms_median": round(statistics.median(steps) * 1e3, 2), "decode_steps": len(steps),
            "tokens_per_s": round(b * args.max_tokens / seconds, 2), "kept": cpu.keep_freed_memory(),
            "cpu_kernels": cpu_kernels.available()}


def parse_arm(spec: str) -> tuple[str, ...]:
    """An --arms entry as (NAME, PACK_ROWS, PAD, FUSE, KERNELS, FLOOR), the fields a shorter arm leaves out at their
    defaults (module docstring); ValueError naming what is accepted."""
    parts = spec.split(":")
    parts += ["0"] * (len(parts) == 4)  # four fields: an arm as it was before the kernels existed
    parts += ["1"] * (len(parts) == 5)  # five: before the row floor
    if len(parts) != 6 or not all(p.isdigit() and int(p) >= 1 for p in (parts[1], parts[5])) \
            or set(parts[2:5]) - {"0", "1"}:
        raise ValueError(f"--arms takes NAME:PACK_ROWS:PAD:FUSE[:KERNELS[:FLOOR]] (PACK_ROWS and FLOOR >= 1, PAD, FUSE "
                         f"and KERNELS 0 or 1), got {spec!r}")
    return tuple(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--arms", nargs="+", default=["old:1:0:0", "pad:1:1:0", "hint:32:1:0", "new:32:1:1:1:4"])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pack-rows", type=int, default=32, help=argparse.SUPPRESS)
    ap.add_argument("--pad", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--fuse", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--kernels", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--floor", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.batch_size < 1 or args.max_tokens < 2 or args.rounds < 1 or args.threads < 1:
        ap.error("--batch-size, --rounds and --threads must be >= 1, --max-tokens >= 2")
    if args.child:
        print_result(child(args))
        return 0
    arms = []
    for spec in args.arms:
        try:
            arms.append(parse_arm(spec))
        except ValueError as e:
            ap.error(str(e))
    rows = []
    for k in range(args.rounds):
        for name, pack_rows, pad, fuse, kernels, floor in (arms if k % 2 == 0 else arms[::-1]):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", args.model, "--dtype",
                   args.dtype, "--batch-size", str(args.batch_size), "--max-tokens", str(args.max_tokens),
                   "--threads", str(args.threads), "--pack-rows", pack_rows, "--pad", pad, "--fuse", fuse,
                   "--kernels", kernels, "--floor", floor]
            row = child_result(cmd, cwd=ROOT)
            rows.append({"round": k + 1, "arm": name, "pack_rows": int(pack_rows), "pad": int(pad),
                         "fuse_qkv": int(fuse), "kernels": int(kernels), "row_floor": int(floor), **row})
            print(json.dumps(rows[-1]), flush=True)
    keys = ("prefill_s", "prefill_faults", "decode_step_ms_median", "tokens_per_s")
    summary = {name: {key: [r[key] for r in rows if r["arm"] == name] for key in keys} for name, *_ in arms}
    print(json.dumps(summary))
    if args.json:
        write_report(args.json, "engine_thread_ab", argv, rows=rows, per_arm=summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
