"""One method of `scripts/bench_vllm.py`, in a process of its own: load once, warm up, then one closed batch per
concurrency (c requests submitted together, greedy, ignore_eos: the batch holds c rows throughout), printing one
RESULT line of JSON. vLLM methods run in the vLLM environment (`scripts/setup_vllm.sh`), this project's engine in
the project's.

    python scripts/vllm_cell.py SPEC.json        SPEC: method, models, prompts, concurrencies, max_tokens
"""

import json
import os
import sys
import time


def vllm_llm(spec: dict):
    from vllm import LLM

    method = spec["method"]
    speculative, additional = None, None
    if method in ("vllm-echo-draft", "vllm-echo-draft-pure"):  # ECHO around vLLM's own draft-model runner
        from echo_trtllm.backends.vllm_draft import engine_args

        args = engine_args(spec["draft_hf"], spec["echo_k"], prices=method == "vllm-echo-draft",
                           trace=spec.get("trace"))
        speculative, additional = args["speculative_config"], args["additional_config"]
    elif method == "vllm-draft-table":  # vLLM's batch-size table (num_speculative_tokens_per_batch_size)
        speculative = {"method": "draft_model", "model": spec["draft_hf"],
                       "num_speculative_tokens": max(k for _, _, k in spec["table"]),
                       "num_speculative_tokens_per_batch_size": [tuple(e) for e in spec["table"]]}
    elif method.startswith("vllm-draft-k"):
        speculative = {"method": "draft_model", "model": spec["draft_hf"],
                       "num_speculative_tokens": int(method.removeprefix("vllm-draft-k"))}
    elif method.startswith("vllm-echo"):
        from echo_trtllm.backends.vllm import speculative_config

        if spec.get("trace"):
            os.environ["ECHO_VLLM_TRACE"] = spec["trace"]
        speculative = speculative_config(spec["echo_draft"], num_speculative_tokens=spec["echo_k"],
                                         dtype=spec["dtype"], prices=method != "vllm-echo-pure",
                                         max_rows=max(spec["concurrency"]))
    elif method != "vllm-ar":
        raise ValueError(f"unknown vLLM method {method!r}")
    extra = {"additional_config": additional} if additional else {}
    llm = LLM(model=spec["target_hf"], speculative_config=speculative, dtype=spec["dtype"], **extra,
              max_model_len=spec["max_model_len"], max_num_seqs=max(spec["concurrency"]), seed=0,
              gpu_memory_utilization=spec["memory_share"], disable_log_stats=False)

    def generate(prompts, max_tokens):
        from vllm import SamplingParams

        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                            use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def counters():
        names = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
                 "vllm:spec_decode_num_drafts")
        return {m.name: m.value for m in llm.get_metrics() if m.name in names and hasattr(m, "value")}

    return generate, counters


def engine_llm(spec: dict):
    from echo_trtllm import LLM, EchoConfig, SamplingParams

    policy = {"engine-ar": "ar", "engine-echo": "echo"}[spec["method"]]
    llm = LLM(spec["target"], spec["draft"] if policy != "ar" else None, speculative_config=EchoConfig(policy=policy),
              max_batch_size=max(spec["concurrency"]), max_seq_len=spec["max_model_len"], dtype=spec["dtype"])

    def generate(prompts, max_tokens):
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return generate, dict


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    generate, counters = (vllm_llm if spec["method"].startswith("vllm") else engine_llm)(spec)
    load = time.perf_counter() - t0
    prompts = spec["prompts"]
    generate(prompts[:2], spec["warmup_tokens"])  # first shapes, kernels, the prior's first steps
    cells = []
    for c in spec["concurrency"]:
        batch = [prompts[(spec["offset"] + i) % len(prompts)] for i in range(c)]
        if spec.get("cell_warmup_tokens"):  # this batch size's shapes once, untimed (every method alike)
            warm = [prompts[(spec["offset"] + c + i) % len(prompts)] for i in range(c)]
            generate(warm, spec["cell_warmup_tokens"])
        before = counters()
        t = time.perf_counter()
        tokens = generate(batch, spec["max_tokens"])
        seconds = time.perf_counter() - t
        after = counters()
        cells.append({"concurrency": c, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                      "spec_decode": {k: after[k] - before.get(k, 0) for k in after}})
        print(f"{spec['method']} c={c}: {tokens / seconds:.2f} tok/s", file=sys.stderr, flush=True)
    print("RESULT " + json.dumps({"method": spec["method"], "load_seconds": load, "cells": cells}), flush=True)
    sys.stdout.flush()
    os._exit(0)  # vLLM's engine processes are torn down with ours


if __name__ == "__main__":
    main()
