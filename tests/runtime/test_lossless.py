"""The central property: at temperature 0 every policy emits exactly what plain AR greedy decoding of the target
emits, token for token, with requests of different lengths joining and leaving mid-flight."""

import pytest
import torch

from echo_trtllm.core import POLICY_NAMES
from tests.helpers import run_greedy as run
from tests.helpers import run_seeded_sampling


@pytest.fixture(scope="module")
def ar_reference(default_pair, prompts):
    target, draft, tok = default_pair
    lengths = [8 + (7 * i) % 25 for i in range(len(prompts))]  # 8..32 tokens, all different
    outs, _, _ = run(target, None, tok, "ar", prompts, 1, lengths)
    return lengths, outs


@pytest.mark.parametrize("batch_size", [1, 4, 16])
@pytest.mark.parametrize("policy", [p for p in POLICY_NAMES if p != "ar"])
def test_every_policy_equals_ar_greedy(default_pair, prompts, ar_reference, policy, batch_size):
    target, draft, tok = default_pair
    lengths, expected = ar_reference
    k_max = {1: 24, 4: 48, 16: 96}[batch_size]  # scarce at 16: the budget scheduler has to choose
    outs, reqs, sizes = run(target, draft, tok, policy, prompts, batch_size, lengths, k_max=k_max)
    for i, (got, exp) in enumerate(zip(outs, expected)):
        assert got == exp, f"prompt {i} ({prompts[i]!r}) diverged from AR under {policy}, batch {batch_size}"
    if batch_size > 1:
        assert max(sizes) == batch_size and min(sizes) < batch_size, "requests must join and leave mid-flight"
    steps = sum(r.stats.steps for r in reqs)
    assert steps < sum(lengths), f"{policy} accepted no draft token at all"


def test_ar_batched_equals_ar_single(default_pair, prompts, ar_reference):
    target, _, tok = default_pair
    lengths, expected = ar_reference
    outs, _, _ = run(target, None, tok, "ar", prompts, 16, lengths)
    assert outs == expected


def test_ar_equals_hf_transformers_greedy(default_pair, prompts):
    from transformers import AutoModelForCausalLM

    from echo_trtllm.models import DEFAULT_TARGET

    target, _, tok = default_pair
    hf = AutoModelForCausalLM.from_pretrained(str(DEFAULT_TARGET), dtype=torch.float32).eval()
    ours, _, _ = run(target, None, tok, "ar", prompts[:6], 6, [24] * 6, ignore_eos=False)
    for p, got in zip(prompts[:6], ours):
        ids = torch.tensor([tok.encode(p)])
        ref = hf.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=tok.eos_token_ids[0])
        assert got == ref[0, ids.shape[1]:].tolist(), f"AR differs from transformers for {p!r}"


@pytest.mark.parametrize("policy", ["chain", "static", "eagle2", "echo"])
def test_seeded_sampling_equals_ar_sampling_token_for_token(default_pair, prompts, policy):
    """Sampling verification draws each position's token from that position's uniform, so a seeded request emits
    exactly what plain AR sampling emits with the same seed, whatever was drafted (and it is still speculation:
    drafts are accepted)."""
    target, draft, tok = default_pair
    ar, ar_steps = run_seeded_sampling(target, None, tok, "ar", prompts[:8])
    spec, spec_steps = run_seeded_sampling(target, draft, tok, policy, prompts[:8])
    assert spec == ar
    assert spec_steps < ar_steps, f"{policy} accepted no draft token at all"
