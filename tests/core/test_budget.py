"""Elastic budget scheduler: invariants (hypothesis), a naive sequential reference, and the load behaviour."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from echo_trtllm.core.budget import DEPTH, WIDTH, allocate_budget
from echo_trtllm.core.tree import SuperTree, expand_level, root_level
from tests.helpers import markov_draft_fn


def random_candidates(batch_size, depth, width, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    draft = markov_draft_fn(vocab, seed=seed, sharpness=float(torch.rand(1, generator=gen)) * 4)
    levels = [root_level(torch.randint(0, vocab, (batch_size,), generator=gen))]
    for _ in range(depth):
        prev = levels[-1]
        keep = torch.rand(prev.num_nodes, generator=gen) < 0.8
        frontier = torch.nonzero(keep, as_tuple=True)[0]
        if frontier.numel() == 0:
            break
        levels.append(expand_level(prev, frontier, draft(prev, frontier), width))
    return SuperTree.from_levels(levels)


def naive_allocate(tree, spine_depth, budget, cap):
    """The documented rule, one node at a time in plain Python."""
    n = tree.total_nodes
    req = tree.request_ids.tolist()
    depth = tree.depths.tolist()
    prob = tree.path_probs.tolist()
    gp = tree.global_parents.tolist()
    selected = [gp[j] < 0 for j in range(n)]
    left = budget - tree.batch_size
    count = [0] * tree.batch_size
    spine = set()
    for i in range(tree.batch_size):
        at = [j for j in range(n) if req[j] == i and depth[j] == int(spine_depth[i]) and depth[j] > 0]
        if at:
            j = max(at, key=lambda x: (prob[x], -x))
            while gp[j] >= 0:
                spine.add(j)
                j = gp[j]
    key = lambda j: (-prob[j], depth[j], j)  # noqa: E731
    phase = {}
    for name, pool in ((DEPTH, sorted(spine, key=key)), (WIDTH, sorted((j for j in range(n) if not selected[j] and j not in spine), key=key))):
        for j in pool:
            if selected[j] or left == 0:
                continue
            if cap is not None and count[req[j]] >= cap - 1:
                continue
            selected[j] = True
            phase[j] = name
            count[req[j]] += 1
            left -= 1
    return selected, phase


@settings(max_examples=60, deadline=None)
@given(
    batch_size=st.integers(1, 12), depth=st.integers(1, 5), width=st.integers(1, 3), seed=st.integers(0, 10_000),
    extra=st.integers(0, 80), cap=st.one_of(st.none(), st.integers(1, 12)), data=st.data(),
)
def test_allocation_invariants_and_naive_reference(batch_size, depth, width, seed, extra, cap, data):
    tree = random_candidates(batch_size, depth, width, 29, seed)
    spine_depth = torch.tensor(data.draw(st.lists(st.integers(0, depth), min_size=batch_size, max_size=batch_size)))
    budget = batch_size + extra
    alloc = allocate_budget(tree, spine_depth, budget, cap)
    sel = alloc.selected
    # Budget and progress.
    assert alloc.total == int(sel.sum()) <= budget
    assert sel[tree.is_root].all() and (alloc.num_nodes >= 1).all()
    if cap is not None:
        assert (alloc.num_nodes <= cap).all()
    # Ancestor closure, checked through select().
    tree.select(sel)
    gp = tree.global_parents
    assert not (sel & (gp >= 0) & ~sel[gp.clamp(min=0)]).any()
    # Work-conserving: budget is left over only when no candidate could take it.
    if alloc.total < budget:
        room = torch.ones(tree.batch_size, dtype=torch.bool) if cap is None else alloc.num_nodes < cap
        assert not (~sel & room[tree.request_ids]).any()
    # Determinism and the naive reference.
    again = allocate_budget(tree, spine_depth, budget, cap)
    assert torch.equal(again.selected, sel) and torch.equal(again.phase, alloc.phase)
    naive_sel, naive_phase = naive_allocate(tree, spine_depth, budget, cap)
    assert sel.tolist() == naive_sel
    assert {j: int(alloc.phase[j]) for j in range(tree.total_nodes) if alloc.phase[j] > 0} == naive_phase


@pytest.mark.parametrize("batch_size", [1, 3, 64, 257])
def test_budget_equal_to_batch_size_is_plain_autoregressive(batch_size):
    tree = random_candidates(batch_size, 3, 2, 31, batch_size)
    alloc = allocate_budget(tree, torch.full((batch_size,), 3), batch_size)
    assert alloc.num_nodes.tolist() == [1] * batch_size


def test_budget_below_batch_size_is_an_error():
    tree = random_candidates(4, 2, 2, 31, 0)
    with pytest.raises(ValueError, match="below the batch size"):
        allocate_budget(tree, torch.zeros(4, dtype=torch.long), 3)


def test_priority_one_depth_beats_more_likely_width_nodes():
    """A spine node is chosen before any width node, even a more likely one."""
    tree = random_candidates(2, 4, 3, 17, 3)
    spine_depth = torch.tensor([4, 0])
    spine_only = allocate_budget(tree, spine_depth, 2 + 4)
    assert (spine_only.phase == DEPTH).sum() == 4 and (spine_only.phase == WIDTH).sum() == 0
    assert spine_only.num_nodes.tolist() == [5, 1]


def test_width_grows_when_budget_is_plentiful():
    tree = random_candidates(8, 3, 3, 23, 1)
    none_pass = torch.zeros(8, dtype=torch.long)
    small = allocate_budget(tree, none_pass, 8 + 4)
    large = allocate_budget(tree, none_pass, 8 + 200)
    assert (large.phase == WIDTH).sum() > (small.phase == WIDTH).sum() >= 4
    assert (large.num_nodes > 1).sum() > (small.num_nodes > 1).sum()


@settings(max_examples=40, deadline=None)
@given(batch_size=st.integers(1, 10), seed=st.integers(0, 5000), extra=st.integers(0, 60), cut=st.integers(0, 60),
       data=st.data())
def test_truncating_an_allocation_equals_allocating_the_smaller_budget(batch_size, seed, extra, cut, data):
    """What the budget rule relies on: every prefix of the taken order is the allocation of that budget."""
    tree = random_candidates(batch_size, 4, 2, 23, seed)
    spine_depth = torch.tensor(data.draw(st.lists(st.integers(0, 4), min_size=batch_size, max_size=batch_size)))
    full = allocate_budget(tree, spine_depth, batch_size + extra, 12)
    small_budget = batch_size + min(cut, extra)
    cut_alloc = full.truncated(small_budget, tree.request_ids)
    direct = allocate_budget(tree, spine_depth, small_budget, 12)
    assert torch.equal(cut_alloc.selected, direct.selected)
    assert torch.equal(cut_alloc.phase, direct.phase)
    assert torch.equal(cut_alloc.order, direct.order)
