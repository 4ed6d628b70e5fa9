"""The runtime on a CUDA device (skipped without one; scripts/gpu_check.sh runs it on a GPU): ECHO's greedy
outputs equal plain AR's on the same device, with the plugin's CUDA pack kernel in the step when it is built."""

import os

import pytest
import torch

from echo_trtllm import kernels
from echo_trtllm.core import EchoConfig
from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET
from echo_trtllm.models.loader import load_model
from echo_trtllm.runtime.executor import Executor
from echo_trtllm.runtime.request import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def run(target, draft, tok, prompts, policy):
    ex = Executor(target, draft, tok, EchoConfig(policy=policy, k_max=64, max_nodes_per_request=16),
                  max_batch_size=8, max_seq_len=256)
    reqs = [ex.make_request(p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)) for p in prompts]
    for r in reqs:
        ex.submit(r)
    steps = 0
    while ex.has_work:
        ex.step()
        steps += 1
    return [r.output_token_ids for r in reqs], steps


def test_echo_on_cuda_is_lossless(prompts):
    target, tok = load_model(DEFAULT_TARGET, device="cuda")
    draft, _ = load_model(DEFAULT_DRAFT, device="cuda", with_tokenizer=False)
    print("pack backend:", kernels.backend_for(target.device))
    if os.environ.get("ECHO_PLUGIN_LIB"):  # scripts/gpu_check.sh built the plugin: the step must use its kernel
        assert kernels.backend_for(target.device) == "cuda"
    ar, ar_steps = run(target, None, tok, prompts[:8], "ar")
    for policy in ("echo", "chain", "eagle2"):
        out, steps = run(target, draft, tok, prompts[:8], policy)
        assert out == ar, policy
        assert steps < ar_steps, f"{policy} accepted no drafts on CUDA"
