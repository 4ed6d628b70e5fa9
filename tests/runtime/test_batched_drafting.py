"""The runtime's batched drafting (`draft_tree_batched` driving the drafter's fixed-shape levels) against its
level-by-level drafting (`draft_tree` with `draft_fn`), step after step on real models: the same trees with the
same draft probabilities. This covers the fixed scratch positions, the visibility of each frontier slot, the rows
dropped at a sync point (EAGLE-3: the head's outputs carried per slot) and the draft KV kept after verification
(`Drafter.commit` placing nodes by their frontier slots): a wrong draft cache would change later steps' drafts."""

import pytest
import torch

from echo_trtllm.core import EchoConfig
from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_EAGLE3, DEFAULT_TARGET
from echo_trtllm.models.eagle3 import load_eagle3
from echo_trtllm.models.loader import load_model
from echo_trtllm.runtime.executor import Executor
from echo_trtllm.runtime.request import SamplingParams


@pytest.fixture(scope="module")
def fp32_models():
    target, tok = load_model(DEFAULT_TARGET, dtype="float32")
    draft, _ = load_model(DEFAULT_DRAFT, dtype="float32")
    return target, {"model": draft, "eagle3": load_eagle3(DEFAULT_EAGLE3, target)}, tok


@pytest.mark.parametrize("kind", ["model", "eagle3"])
@pytest.mark.parametrize("config", [
    EchoConfig(policy="echo", k_max=48, beam_width=3, top_k=3, max_depth=5),
    EchoConfig(policy="eagle2", top_k=3, max_depth=4, total_tokens=12),
], ids=lambda c: c.policy)
def test_batched_drafting_equals_level_by_level_drafting(fp32_models, prompts, kind, config):
    target, drafts, tok = fp32_models
    runs = []
    for batched in (True, False):
        ex = Executor(target, drafts[kind], tok, config, max_batch_size=4, max_seq_len=256)
        if not batched:
            ex.policy.beam_frontier = False  # this executor drafts level by level (the reference)
        for i, p in enumerate(prompts[:6]):
            ex.submit(ex.make_request(p, SamplingParams(max_tokens=10 + 3 * i, temperature=0, ignore_eos=True)))
        runs.append(ex)
    batched, reference = runs
    kept = []  # rows kept at each sync that stopped requests (the compaction path)
    real_keep = batched.drafter.keep_rows
    batched.drafter.keep_rows = lambda index: (kept.append(index.numel()), real_keep(index))[1]
    steps = compacted = 0
    while batched.has_work or reference.has_work:
        a, b = batched.step(), reference.step()
        assert not batched.failures and not reference.failures, batched.last_error or reference.last_error
        assert a.request_ids == b.request_ids and a.emitted == b.emitted
        if a.draft is None or not a.speculated:
            continue
        ca, cb = a.draft.candidates, b.draft.candidates
        assert torch.equal(ca.token_ids, cb.token_ids) and torch.equal(ca.parents, cb.parents)
        torch.testing.assert_close(ca.path_probs, cb.path_probs, rtol=0, atol=1e-5)
        assert torch.equal(a.draft.mask, b.draft.mask)
        assert a.draft.state.frontier_sizes == b.draft.state.frontier_sizes
        steps += 1
        compacted += int(a.draft.state.failed_at.gt(0).any())
    assert steps >= 5
    if config.policy == "echo":
        assert compacted >= 1 and kept, "no step dropped rows at the first gate"


def test_the_loops_benchmark_runs_both_loops_to_the_same_tokens(tmp_path):
    import json

    from echo_trtllm.bench.loops import main

    out = tmp_path / "loops.json"
    assert main(["--batch-sizes", "2", "--requests", "4", "--max-tokens", "6", "--rounds", "1", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["results"][0]
    assert row["batch_size"] == 2 and row["batched_over_levels"] > 0
    assert row["batched"]["syncs_per_speculative_step"] <= 3 < row["levels"]["syncs_per_speculative_step"]


def test_a_step_with_no_budget_beyond_the_roots_drafts_nothing_and_fails_nothing(fp32_models, prompts):
    """K_max = B: nobody drafts, so the batched loop never calls the drafter; the step still commits cleanly."""
    target, drafts, tok = fp32_models
    ex = Executor(target, drafts["model"], tok, EchoConfig(policy="echo", k_max=4), max_batch_size=4, max_seq_len=256)
    for p in prompts[:4]:
        ex.submit(ex.make_request(p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)))
    while ex.has_work:
        report = ex.step()
        assert report.verified_tokens == report.batch_size  # roots only
    assert not ex.failures, ex.last_error
