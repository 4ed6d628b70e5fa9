"""The verification forward keeps a bfloat16 model's logits in bfloat16 (no float32 copy of every vocabulary row)
and verification takes their argmax itself: on the runtime's own steps, every emitted token is torch.argmax of
those logits made float32 (the oracle), plain and speculative, and a float32 model's logits stay float32."""

import pytest
import torch

from echo_trtllm.bench.run import make_engine
from echo_trtllm.core import EchoConfig
from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET
from echo_trtllm.models.loader import load_model
from echo_trtllm.runtime.request import SamplingParams


@pytest.mark.parametrize("policy", ["ar", "echo"])
def test_emitted_tokens_are_the_argmax_of_the_verification_logits(prompts, policy):
    target, tok = load_model(DEFAULT_TARGET, dtype=torch.bfloat16)
    draft = load_model(DEFAULT_DRAFT, dtype=torch.bfloat16)[0] if policy != "ar" else None
    llm = make_engine(target, draft, tok, EchoConfig(policy=policy), 4, 512, fallback="off")
    llm.shutdown()
    ex = llm.executor
    seen = []  # (packed batch, logits) of each verification forward
    forward = ex._target_forward

    def recording(batch):
        logits, features = forward(batch)
        if batch.logits_index is None and batch.input_ids.numel():
            seen.append(logits)
        return logits, features

    ex._target_forward = recording
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    reqs = [ex.make_request(p, params) for p in prompts[:4]]
    for r in reqs:
        ex.submit(r)
    checked = speculative = 0
    while ex.has_work:
        seen.clear()
        report = ex.step()
        if not report.batch_size or report.result is None:
            continue
        (logits,) = seen[-1:]
        assert logits.dtype == torch.bfloat16
        oracle = logits.float().argmax(-1)
        result = report.result
        for i in range(report.batch_size):
            lo, hi = int(result.cu_accepted[i]), int(result.cu_accepted[i + 1])
            nodes = result.accepted_node_ids[lo:hi].tolist()
            tokens = result.accepted_token_ids[lo:hi].tolist()
            # the token after each accepted node is the oracle's at that node (the last one: the bonus token)
            assert tokens == [int(oracle[n]) for n in nodes]
            checked += len(tokens)
        speculative += bool(report.speculated)
    assert checked >= 4 * 12
    if policy != "ar":
        assert speculative > 0


def test_float32_model_keeps_float32_logits(default_pair):
    from echo_trtllm.core.pack import pack
    from echo_trtllm.core.tree import SuperTree
    from echo_trtllm.runtime.inputs import tree_batch

    target = default_pair[0]
    packed = pack(SuperTree.from_parents([torch.tensor([-1, 0])]), torch.tensor([0]))
    cache = target.allocate_cache(1, 8)
    for flag in (True, False):
        batch = tree_batch(packed, torch.tensor([0]), torch.tensor([0]), float_logits=flag)
        assert target(batch, cache).dtype == torch.float32
    bf = load_model(DEFAULT_TARGET, dtype=torch.bfloat16)[0]
    cache = bf.allocate_cache(1, 8)
    assert bf(tree_batch(packed, torch.tensor([0]), torch.tensor([0])), cache).dtype == torch.float32
    assert bf(tree_batch(packed, torch.tensor([0]), torch.tensor([0]), float_logits=False), cache).dtype == \
        torch.bfloat16
