"""Runs inside the vLLM environment (`scripts/setup_vllm.sh`), driven by tests/backends/test_vllm.py: the real vLLM
engine (CPU build) on the embedded pair, greedy, once per mode named on the command line, one JSON line each.

    ar              vLLM's plain decoding
    echo            vLLM + ECHO (echo_trtllm.backends.vllm), 4 draft tokens at most per request, pure (every step
                    drafts by the policy's rules)
    echo-priced     the same with prices learnt from vLLM's steps and the AR fallback (the default)
    echo-kmax       the same within a global budget of ECHO_VLLM_K_MAX tokens a step (roots included)
    echo-failing    a proposer whose drafting fails every other step (tests.backends.vllm_failing)
"""

import json
import os
import sys

PROMPTS = ["def main():\n    ", "ROMEO:\nBut soft, what light", "import os\nimport sys\n\n", "To be, or not to be",
           "class Parser:\n    def __init__(self", "KING LEAR:\nBlow, winds"]


def run(mode: str, trace: str) -> dict:
    from vllm import LLM, SamplingParams

    from echo_trtllm.backends.vllm import speculative_config
    from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET

    spec = None
    if mode != "ar":
        spec = speculative_config(str(DEFAULT_DRAFT), num_speculative_tokens=4, prices=mode == "echo-priced",
                                  k_max=int(os.environ["KMAX"]) if mode == "echo-kmax" else None)
        if mode == "echo-failing":
            spec["model"] = "tests.backends.vllm_failing.FailingProposer"
    os.environ["ECHO_VLLM_TRACE"] = trace
    llm = LLM(model=str(DEFAULT_TARGET), speculative_config=spec, dtype="float32", max_model_len=512,
              enforce_eager=True, seed=0, gpu_memory_utilization=0.1, disable_log_stats=False)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if "spec_decode_num" in m.name
               and hasattr(m, "value")}
    del llm
    return {"mode": mode, "outputs": [list(o.outputs[0].token_ids) for o in outs], "metrics": metrics}


def main() -> None:
    out_dir = sys.argv[1]
    for mode in sys.argv[2:]:
        result = run(mode, os.path.join(out_dir, f"trace-{mode}.jsonl"))
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
