"""The batched drafting loop (device-side frontiers, host reads only at sync points) against `draft_tree`, the
level-by-level loop it must reproduce exactly: same candidates, same selection, same decisions."""

import pytest
import torch

from echo_trtllm.core import CostModel, DraftTopK, EchoConfig, draft_tree, make_policy
from echo_trtllm.core.policies import draft_tree_batched
from tests.helpers import markov_draft_fn


class MarkovLevels:
    """A `LevelDrafter` over the Markov table of `markov_draft_fn`: each node's distribution is its token's row."""

    def __init__(self, table: torch.Tensor, roots: torch.Tensor, k: int) -> None:
        self.table, self.roots, self.k = table, roots, k
        self.rows_per_level: list[int] = []

    def expand_roots(self, rows):
        self.rows_per_level.append(rows.numel())
        return DraftTopK.of(self.table[self.roots[rows]], self.k)

    def expand_level(self, depth, tokens, parents):
        r, w = tokens.shape
        assert parents.shape == (r, w) and int(parents.max()) >= 0
        self.rows_per_level.append(r)
        top = DraftTopK.of(self.table[tokens.reshape(-1)], self.k)
        return DraftTopK(top.probs.reshape(r, w, -1), top.tokens.reshape(r, w, -1))

    def keep_rows(self, index):
        assert bool((index[1:] > index[:-1]).all())


def tied_table(vocab: int, seed: int) -> torch.Tensor:
    """A Markov table whose probabilities take few distinct values: many ties in path probabilities."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(1, 4, (vocab, vocab), generator=gen).float()
    return raw / raw.sum(dim=1, keepdim=True)


COST = CostModel((1, 8, 16, 32, 64, 128), (0.010, 0.011, 0.016, 0.026, 0.046, 0.086), (1, 8, 64), (0.001, 0.0012, 0.003))

CASES = [
    EchoConfig(policy="echo", beam_width=3, top_k=3, max_depth=5, k_max=40, gate_depths=(1, 3, 5),
               gate_thresholds=(0.3, 0.1, 0.02)),
    EchoConfig(policy="echo", beam_width=2, top_k=4, max_depth=6, k_max=12, gate_depths=(2, 4),
               gate_thresholds=(0.2, 0.05)),
    EchoConfig(policy="echo-dense", beam_width=3, top_k=2, max_depth=4, k_max=30),
    EchoConfig(policy="echo-fixed", beam_width=4, top_k=3, max_depth=5, k_max=60, fixed_threshold=0.05),
    EchoConfig(policy="echo-no-budget-stop", beam_width=2, top_k=3, max_depth=5, k_max=20),
    EchoConfig(policy="eagle2", top_k=3, max_depth=4, total_tokens=12),
    EchoConfig(policy="ddd", top_k=3, max_depth=6, total_tokens=16, ddd_threshold=-1.0, ddd_check_every=2),
    EchoConfig(policy="chain", num_draft_tokens=4),
]


def same_result(a, b):
    for name in ("token_ids", "parents", "depths", "path_probs", "draft_probs", "ranks", "cu_num_nodes", "source_index"):
        assert torch.equal(getattr(a.candidates, name), getattr(b.candidates, name)), name
    assert torch.equal(a.mask, b.mask)
    assert a.state.frontier_sizes == b.state.frontier_sizes
    assert torch.equal(a.state.spine_depth, b.state.spine_depth)
    assert torch.equal(a.state.failed_at, b.state.failed_at)
    assert torch.equal(a.state.active, b.state.active)


@pytest.mark.parametrize("config", CASES, ids=lambda c: c.policy)
@pytest.mark.parametrize("batch_size", [1, 5, 16])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("cost", [None, COST])
def test_batched_loop_equals_level_by_level_loop(config, batch_size, tied, cost):
    vocab, seed = 40, batch_size
    draft_fn = markov_draft_fn(vocab, seed=seed)
    table = tied_table(vocab, seed) if tied else draft_fn.table
    roots = torch.randint(0, vocab, (batch_size,), generator=torch.Generator().manual_seed(seed))
    budget = batch_size + config.k_max if make_policy(config).shares_budget else None  # K_max - B spare = k_max
    reference = draft_tree(make_policy(config, cost), roots, lambda level, frontier: table[level.token_ids[frontier]],
                           budget, context=100.0)
    reads = []

    def read(*tensors):
        reads.append(len(tensors))
        return tuple(t.cpu() for t in tensors)

    policy = make_policy(config, cost)
    drafter = MarkovLevels(table, roots, policy.max_children)
    batched = draft_tree_batched(policy, roots, drafter, budget, context=100.0, read=read)
    same_result(batched, reference)
    # one read for the whole drafting loop, plus one at the first decision depth (echo: first gate; ddd: first check)
    assert 1 <= len(reads) <= (1 if config.policy in ("eagle2", "chain") else 2)
    # every expanded node's frontier slot is recorded, and only those
    slots = torch.cat(batched.state.frontier_slots)
    assert slots.numel() == batched.candidates.total_nodes
    assert int((slots >= 0).sum()) == sum(batched.state.frontier_sizes)
    # deciding after every level (a CPU drafter) changes what the device drafts, never the result
    every = draft_tree_batched(make_policy(config, cost), roots, MarkovLevels(table, roots, policy.max_children),
                               budget, context=100.0, sync_every_level=True)
    same_result(every, reference)


def test_syncing_every_level_drafts_no_level_after_the_host_stopped_everyone():
    """Everyone passes the gate at depth 1 and fails it at depth 2. Deciding at the first gate only, the device
    drafts levels 3 and 4 that the host then drops; deciding after every level, it stops after level 2."""
    config = EchoConfig(policy="echo", beam_width=1, top_k=2, max_depth=4, k_max=64, gate_depths=(1, 2, 4),
                        gate_thresholds=(0.5, 0.5, 0.0))
    vocab = 10
    table = torch.full((vocab, vocab), 0.4 / (vocab - 1))
    table[:, 0] = 0.6  # c_1 = 0.6 passes, c_2 = 0.36 fails
    roots = torch.tensor([1, 2, 3, 4])
    reference = draft_tree(make_policy(config), roots, lambda level, frontier: table[level.token_ids[frontier]], 64)
    first_gate, every = (MarkovLevels(table, roots, make_policy(config).max_children) for _ in range(2))
    same_result(draft_tree_batched(make_policy(config), roots, first_gate, 64), reference)
    same_result(draft_tree_batched(make_policy(config), roots, every, 64, sync_every_level=True), reference)
    assert reference.state.failed_at.tolist() == [2, 2, 2, 2]
    assert first_gate.rows_per_level == [4, 4, 4, 4] and every.rows_per_level == [4, 4]


def test_requests_stopped_at_the_first_gate_leave_the_device_batch():
    config = EchoConfig(policy="echo", beam_width=2, top_k=2, max_depth=4, k_max=64, gate_depths=(1, 4),
                        gate_thresholds=(0.5, 0.0))
    vocab = 10
    table = torch.full((vocab, vocab), 0.4 / (vocab - 1))
    table[:, 0] = 0.6  # token 0 is the draft's confident choice after every token
    table[0] = torch.full((vocab,), 1.0 / vocab)  # after token 0 the draft is flat
    roots = torch.tensor([1, 2, 3, 4])
    policy = make_policy(config)
    drafter = MarkovLevels(table, roots, policy.max_children)
    result = draft_tree_batched(policy, roots, drafter, 64)
    reference = draft_tree(make_policy(config), roots, lambda level, frontier: table[level.token_ids[frontier]], 64)
    same_result(result, reference)
    assert drafter.rows_per_level[0] == 4 and all(r == 4 for r in drafter.rows_per_level)  # everyone passes 0.5
    confident = torch.tensor([0, 0, 0, 0])
    roots2 = torch.tensor([1, 0, 2, 0])  # requests 1 and 3 start flat: c_1 = 0.1 < 0.5
    drafter2 = MarkovLevels(table, roots2, policy.max_children)
    result2 = draft_tree_batched(make_policy(config), roots2, drafter2, 64)
    same_result(result2, draft_tree(make_policy(config), roots2,
                                    lambda level, frontier: table[level.token_ids[frontier]], 64))
    assert drafter2.rows_per_level == [4, 2, 2, 2]
    assert result2.state.failed_at.tolist() == [0, 1, 0, 1] and not confident.any()


def test_policies_without_a_beam_frontier_are_refused():
    config = EchoConfig(policy="static", static_choices=((0,), (1,), (0, 0)))
    with pytest.raises(ValueError, match="draft_tree"):
        draft_tree_batched(make_policy(config), torch.tensor([1]), None)
