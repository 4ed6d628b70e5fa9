"""What the engine thread's OpenMP team costs a decode step (echo_trtllm.cpu.release_openmp_threads), in one process,
conditions interleaved over rounds: one `LLM`'s executor stepped directly (a closed batch of greedy requests)

    loading thread     on the thread that loaded the models (one OpenMP team)
    new thread         on a new thread while the loading thread's idle team still exists (two teams: what the
                       engine thread ran before the release)
    new thread, released   on a new thread after the loading thread's team was released (what EngineLoop does)

    .venv/bin/python scripts/omp_threads.py --model TARGET [--batch-size 1] [--steps 24] [--rounds 3] [--json out.json]

Reports ms per step (mean over the recorded steps) and the process's CPU seconds per step: two teams show as wall
time the two cores do not spend (the workers parked between kernels).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

CONDITIONS = ("loading thread", "new thread", "new thread, released")


def steps(executor, prompt: str, batch_size: int, n: int) -> tuple[float, float]:
    from echo_trtllm.runtime.request import SamplingParams

    reqs = [executor.make_request(prompt, SamplingParams(max_tokens=n + 8, temperature=0, ignore_eos=True))
            for _ in range(batch_size)]
    for r in reqs:
        executor.submit(r)
    executor.step()  # prefill
    executor.step()
    t, c = time.perf_counter(), time.process_time()
    for _ in range(n):
        executor.step()
    wall, cpu = (time.perf_counter() - t) / n, (time.process_time() - c) / n
    for r in reqs:
        executor.abort(r)
    return wall, cpu


def main(argv=None) -> int:
    from echo_trtllm import LLM, EchoConfig
    from echo_trtllm.bench.run import report_meta
    from echo_trtllm.cpu import release_openmp_threads

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.batch_size < 1 or args.steps < 1 or args.rounds < 1:
        ap.error("--batch-size, --steps and --rounds must be >= 1")
    llm = LLM(args.model, None, speculative_config=EchoConfig(policy="ar"), max_batch_size=args.batch_size,
              max_seq_len=512, dtype=args.dtype)
    llm.shutdown()  # its executor is stepped below, on the threads each condition names
    ex = llm.executor
    prompt = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
    runs = []
    for k in range(args.rounds):
        for cond in CONDITIONS:
            out = {}
            if cond == "loading thread":
                out["r"] = steps(ex, prompt, args.batch_size, args.steps)
            else:
                if cond.endswith("released"):
                    release_openmp_threads()
                th = threading.Thread(target=lambda: out.update(r=steps(ex, prompt, args.batch_size, args.steps)))
                th.start()
                th.join()
            wall, cpu = out["r"]
            runs.append({"round": k, "condition": cond, "ms_per_step": round(wall * 1e3, 2),
                         "cpu_ms_per_step": round(cpu * 1e3, 2)})
            print(json.dumps(runs[-1]), flush=True)
    summary = {c: {"ms_per_step_median": statistics.median(r["ms_per_step"] for r in runs if r["condition"] == c),
                   "ms_per_step_range": [min(r["ms_per_step"] for r in runs if r["condition"] == c),
                                         max(r["ms_per_step"] for r in runs if r["condition"] == c)],
                   "cpu_ms_per_step_median": statistics.median(r["cpu_ms_per_step"] for r in runs
                                                               if r["condition"] == c)}
               for c in CONDITIONS}
    print(json.dumps(summary, indent=1))
    if args.json:
        meta = report_meta("scripts.omp_threads", argv, runner="python scripts/omp_threads.py")
        with open(args.json, "w") as f:
            json.dump({"batch_size": args.batch_size, "steps": args.steps, "runs": runs, "summary": summary, **meta},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
