"""Where an engine step's host time goes: cProfile over whole decode runs of the embedded target with its EAGLE-3
head, per policy and batch size, on a device of your choice (scripts/gpu_check.sh's companion for a GPU, where a
step of this small pair is host-bound). Prints ms per step (under the profiler) and the top functions by own and
by cumulative time.

    python scripts/profile_host.py [--device cuda] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from echo_trtllm.bench.prompts import load_prompts
from echo_trtllm.core import EchoConfig
from echo_trtllm.models import DEFAULT_EAGLE3, DEFAULT_TARGET
from echo_trtllm.models.eagle3 import load_eagle3
from echo_trtllm.models.loader import load_model
from echo_trtllm.runtime.executor import Executor
from echo_trtllm.runtime.request import SamplingParams

CASES = (("ar", 16), ("echo", 16), ("chain", 16), ("echo", 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=25, help="functions listed per ordering")
    args = ap.parse_args()
    target, tok = load_model(DEFAULT_TARGET, device=args.device)
    head = load_eagle3(DEFAULT_EAGLE3, target)
    prompts = load_prompts("mixed")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    for policy, batch in CASES:
        ex = Executor(target, None if policy == "ar" else head, tok, EchoConfig(policy=policy, k_max=256),
                      max_batch_size=batch, max_seq_len=512)

        def fill() -> None:
            for i in range(batch):
                ex.submit(ex.make_request(prompts[i % len(prompts)], params))

        fill()  # one untimed run: allocations, kernels' first launches
        while ex.has_work:
            ex.step()
        fill()
        ex.step()  # the prefill step, not profiled
        prof, steps, t0 = cProfile.Profile(), 0, time.perf_counter()
        prof.enable()
        while ex.has_work:
            ex.step()
            steps += 1
        prof.disable()
        if target.device.type == "cuda":
            torch.cuda.synchronize()
        ms = 1000 * (time.perf_counter() - t0) / steps
        print(f"=== {policy} B={batch} on {args.device}: {steps} steps, {ms:.2f} ms/step (profiled)")
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumtime").print_stats(args.top)


if __name__ == "__main__":
    main()
