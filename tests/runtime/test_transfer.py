"""Host <-> device traffic of a step (runtime.transfer.HostLink), counted on the path the executor runs: drafting
hands back each level's top-k, verification runs beside the logits and one read brings the accepted path back;
no vocabulary-sized row ever crosses."""

import pytest
import torch

from echo_trtllm import EchoConfig, SamplingParams
from echo_trtllm.runtime.transfer import HostLink


def test_host_link_counts_reads_as_syncs_and_bytes():
    link = HostLink("cpu")
    a, b = torch.zeros(3, 4), torch.zeros(5, dtype=torch.long)
    link.read("x", a, b)
    link.read("x", a)
    link.send("y", b)
    t = link.take()
    assert (t.syncs, t.to_host_bytes, t.to_device_bytes, t.largest_read_bytes) == (2, 48 + 40 + 48, 40, 88)
    assert t.reads == {"x": [2, 136]} and t.sends == {"y": [1, 40]}
    assert link.take().syncs == 0, "take starts a new count"


@pytest.mark.parametrize("policy, temperature", [("echo", 0.0), ("eagle2", 0.0), ("echo", 0.8), ("static", 0.0)])
def test_a_step_reads_its_levels_at_sync_points_and_the_accepted_path_once(pair_llm, prompts, policy, temperature):
    """Beam policies run the batched drafting loop: one read at the policy's first decision depth (echo: its first
    gate), one after the last level, one for the accepted path: <= 3 syncs per step. The static tree's frontier is
    its choice trie, drafted level by level: one read per level. (The accelerator form, which the runtime uses
    off the CPU; on the CPU it reads after every level, the next test.)"""
    config = EchoConfig(policy=policy, k_max=64)
    with pair_llm(speculative_config=config, max_batch_size=4, cost_model=None, iter_stats_max_iterations=200) as llm:
        llm.executor.sync_every_level = False
        llm.generate(prompts[:4], [SamplingParams(max_tokens=10, temperature=temperature, seed=i, ignore_eos=True)
                                   for i in range(4)], use_tqdm=False)
        reports = llm.get_stats()
        vocab = llm.executor.target.config.vocab_size
        k = llm.executor.policy.max_children
        width = llm.executor.policy.expand_width
    spec = [r for r in reports if r.speculated]
    assert len(spec) >= 3
    for r in spec:
        t = r.traffic
        levels = len(r.draft.state.frontier_sizes)
        assert t.reads["accepted path"][0] == 1
        assert t.largest_read_bytes < 4 * vocab, "a vocabulary-sized row came back to the host"
        if policy == "static":
            frontier = sum(r.draft.state.frontier_sizes)
            assert t.reads["draft top-k"] == [levels, frontier * k * (4 + 8)]  # float32 probs + int64 ids
            assert t.syncs == levels + 1, t.reads  # nothing else is read back
            continue
        count, size = t.reads["draft levels"]
        assert 1 <= count <= (2 if policy == "echo" else 1)
        assert t.syncs == count + 1 <= 3, t.reads  # nothing else is read back
        # per drafted row and level at most: frontier slots (int64 + bool), then k children (float32 + int64)
        assert size <= 4 * config.max_depth * width * (9 + k * 12)


def test_on_the_cpu_a_step_reads_after_every_drafted_level(pair_llm, prompts):
    """Where a read costs nothing the batched loop decides after every level: one read per level the device
    drafted (the replay's levels, at most one more that found its frontier empty), one for the accepted path."""
    with pair_llm(speculative_config=EchoConfig(policy="echo", k_max=64), max_batch_size=4, cost_model=None,
                  iter_stats_max_iterations=200) as llm:
        assert llm.executor.sync_every_level  # the models are on the CPU
        llm.generate(prompts[:4], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
        reports = llm.get_stats()
    spec = [r for r in reports if r.speculated]
    assert len(spec) >= 3
    for r in spec:
        levels = len(r.draft.state.frontier_sizes)
        count = r.traffic.reads["draft levels"][0]
        assert levels <= count <= levels + 1 and r.traffic.syncs == count + 1, r.traffic.reads
    assert max(r.traffic.reads["draft levels"][0] for r in spec) >= 3  # deeper than the first gate and the end
