"""Where vLLM's decode step spends its time, per configuration: timers around vLLM 0.32's model-runner and scheduler
methods (model forward, sampling, input preparation, the proposer, ...) over one closed batch of c greedy requests,
each configuration in a fresh process (the engine in-process), the configurations alternated over rounds.

    ar          vLLM's plain decoding
    spec-empty  vLLM's draft-model speculation whose proposer drafts nothing: what vLLM does around a step that
                verifies no drafts
    echo-plain  vLLM + ECHO (backends.vllm_draft) speculating only at its first call (`cycle` [1, 10**9], spent in
                the untimed batch): ECHO's plain steps as they run

    python scripts/profile_vllm_step.py --target-hf T_HF --draft-hf D_HF --concurrency 64 --max-tokens 32 \\
        --rounds 2 --out docs/bench/vllm-step-profile.json

Needs the vLLM environment (`scripts/setup_vllm.sh`); the parent runs in either.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = ("ar", "spec-empty", "echo-plain")
RUNNER_METHODS = ("execute_model", "sample_tokens", "_model_forward", "_sample", "_prepare_inputs", "_update_states",
                  "_build_attention_metadata", "_calc_spec_decode_metadata", "_bookkeeping_sync",
                  "propose_draft_token_ids", "take_draft_token_ids")
SCHEDULER_METHODS = ("schedule", "update_from_output", "update_draft_token_ids")


def _timed(cls, name: str, acc: dict) -> None:
    f = getattr(cls, name)

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            v = acc.setdefault(name, [0.0, 0])
            v[0] += time.perf_counter() - t
            v[1] += 1

    setattr(cls, name, timed)


def child(spec: dict) -> dict:
    """One configuration in this process (the vLLM environment)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, where the timers are
    from vllm import LLM, SamplingParams

    config, c = spec["config"], spec["concurrency"]
    kwargs: dict = {}
    if config == "spec-empty":
        from vllm.v1.spec_decode.draft_model import DraftModelProposer

        def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                    next_token_ids, token_indices_to_sample, common_attn_metadata, *a, **k):
            return [[] for _ in range(int(common_attn_metadata.num_reqs))]

        DraftModelProposer.propose = propose  # every subclass (the plugin's too) inherits it; no "echo" entry here
        kwargs["speculative_config"] = {"method": "draft_model", "model": spec["draft_hf"],
                                        "num_speculative_tokens": 4}
    elif config == "echo-plain":
        from echo_trtllm.backends.vllm_draft import engine_args

        kwargs.update(engine_args(spec["draft_hf"], 4, cycle=(1, 10**9)))
    elif config != "ar":
        raise ValueError(f"unknown configuration {config!r}; accepted: {', '.join(CONFIGS)}")
    llm = LLM(model=spec["target_hf"], dtype="bfloat16", max_model_len=1024, max_num_seqs=c, seed=0,
              gpu_memory_utilization=0.5, **kwargs)
    prompts = [f'def function_{i}(x):\n    """Return the value number {i} of x."""\n' for i in range(2 * c)]

    def params(n):
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

    llm.generate(prompts[c:], params(8), use_tqdm=False)  # shapes, kernels; ECHO's one speculative step
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    acc: dict = {}
    for name in RUNNER_METHODS:
        if hasattr(GPUModelRunner, name):
            _timed(GPUModelRunner, name, acc)
    for name in SCHEDULER_METHODS:
        if hasattr(Scheduler, name):
            _timed(Scheduler, name, acc)
    t = time.perf_counter()
    outs = llm.generate(prompts[:c], params(spec["max_tokens"]), use_tqdm=False)
    seconds = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"config": config, "concurrency": c, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "seconds_by_method": {k: v[0] for k, v in acc.items()}, "calls_by_method": {k: v[1] for k, v in acc.items()}}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target-hf", required=True)
    ap.add_argument("--draft-hf", required=True)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    for name in ("target_hf", "draft_hf"):
        if not Path(getattr(args, name)).is_dir():
            ap.error(f"--{name.replace('_', '-')} must be an HF model directory, got {getattr(args, name)!r}")
    if args.concurrency < 1 or args.max_tokens < 1 or args.rounds < 1:
        ap.error("--concurrency, --max-tokens and --rounds must be >= 1")
    return args


def main(argv=None) -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(child(json.loads(sys.argv[2]))), flush=True)
        os._exit(0)
    args = parse(argv)
    from scripts.bench_vllm import VLLM_ENV, vllm_report_meta

    runs = []
    for r in range(args.rounds):
        order = args.configs if r % 2 == 0 else list(reversed(args.configs))
        for config in order:
            spec = {"config": config, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                    "target_hf": args.target_hf, "draft_hf": args.draft_hf}
            proc = subprocess.run([args.vllm_python, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                                  capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT), **VLLM_ENV),
                                  cwd=str(ROOT), timeout=1800, check=False)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise SystemExit(f"{config} failed:\n{proc.stderr[-4000:]}")
            run = {"round": r, **json.loads(lines[-1][len("RESULT "):])}
            runs.append(run)
            t = run["seconds_by_method"]
            # sample_tokens, not _sample: ECHO's routing is set on the runner instance, past the class's timer
            print(f"round {r} {config}: {run['tokens_per_s']:.1f} tok/s, forward {t.get('_model_forward', 0):.2f} s, "
                  f"sample_tokens {t.get('sample_tokens', 0):.2f} s", file=sys.stderr, flush=True)
    meta = vllm_report_meta("scripts/profile_vllm_step.py", argv, args.vllm_python)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": {**meta, "concurrency": args.concurrency,
                                                   "max_tokens": args.max_tokens},
                                          "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
