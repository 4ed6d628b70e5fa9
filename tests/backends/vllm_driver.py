"""Runs inside the vLLM environment (`scripts/setup_vllm.sh`), driven by tests/backends/test_vllm.py: the real vLLM
engine (CPU build) on the embedded pair, greedy, once per mode named on the command line, one JSON line each.

    ar              vLLM's plain decoding
    echo            vLLM + ECHO (echo_trtllm.backends.vllm), 4 draft tokens at most per request, pure (every step
                    drafts by the policy's rules)
    echo-priced     the same with prices learnt from vLLM's steps and the AR fallback (the default)
    echo-kmax       the same within a global budget of ECHO_VLLM_K_MAX tokens a step (roots included)
    echo-failing    a proposer whose drafting fails every other step (tests.backends.vllm_failing)
    draft-k4        vLLM's own draft-model speculation, 4 tokens a step
    echo-draft      vLLM's draft-model speculation with ECHO around it (echo_trtllm.backends.vllm_draft), pure
    echo-draft-self the same with the target as its own draft, one speculative step then three plain steps in turn
                    (every speculative step reads back what the plain one skipped), within ECHO_VLLM_K_MAX tokens
    echo-draft-priced  the same as echo-draft with prices learnt from vLLM's steps (the default settings)
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

    spec, extra = None, {}
    if mode.startswith("echo-draft") or mode == "draft-k4":
        from echo_trtllm.backends.vllm_draft import engine_args

        draft = DEFAULT_TARGET if mode == "echo-draft-self" else DEFAULT_DRAFT
        extra = engine_args(str(draft), num_speculative_tokens=4, prices=mode == "echo-draft-priced", trace=trace,
                            cycle=(1, 3) if mode == "echo-draft-self" else None,
                            k_max=int(os.environ["KMAX"]) if mode == "echo-draft-self" else None)
        if mode == "draft-k4":
            extra.pop("additional_config")
    elif mode != "ar":
        spec = speculative_config(str(DEFAULT_DRAFT), num_speculative_tokens=4, prices=mode == "echo-priced",
                                  k_max=int(os.environ["KMAX"]) if mode == "echo-kmax" else None)
        if mode == "echo-failing":
            spec["model"] = "tests.backends.vllm_failing.FailingProposer"
    os.environ["ECHO_VLLM_TRACE"] = trace
    if spec is not None:
        extra["speculative_config"] = spec
    llm = LLM(model=str(DEFAULT_TARGET), dtype="float32", max_model_len=512,
              enforce_eager=True, seed=0, gpu_memory_utilization=0.1, disable_log_stats=False, **extra)
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
