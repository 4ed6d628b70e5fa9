"""SuperTree construction, selection and paths against naive list-based constructions."""

import pytest
import torch

from echo_trtllm.core.tree import (SuperTree, expand_level, global_parent_ids, greedy_path, request_ids_from_cu,
                                   root_level, segment_rank)
from tests.helpers import markov_draft_fn, naive_ancestors, random_parents


def _levels(batch_size, depth, vocab, width, gen):
    draft = markov_draft_fn(vocab, seed=int(torch.randint(0, 1000, (1,), generator=gen)))
    levels = [root_level(torch.randint(0, vocab, (batch_size,), generator=gen))]
    for _ in range(depth):
        prev = levels[-1]
        frontier = torch.nonzero(torch.rand(prev.num_nodes, generator=gen) < 0.7, as_tuple=True)[0]
        if frontier.numel() == 0:
            break
        levels.append(expand_level(prev, frontier, draft(prev, frontier), width))
    return levels


@pytest.mark.parametrize("batch_size", [1, 3, 17])
def test_from_levels_matches_naive_request_major_build(batch_size):
    gen = torch.Generator().manual_seed(batch_size)
    levels = _levels(batch_size, 4, 37, 3, gen)
    tree = SuperTree.from_levels(levels)
    # Naive: walk levels, give every node a (request, level, index) key, then list per request.
    nodes = []  # (request, depth, index_in_level, parent_key, token, path_prob)
    for d, lv in enumerate(levels):
        for j in range(lv.num_nodes):
            parent_key = (d - 1, int(lv.parent_ids[j])) if d else None
            nodes.append((int(lv.request_ids[j]), d, j, parent_key, int(lv.token_ids[j]), float(lv.path_probs[j])))
    pos = 0
    for i in range(batch_size):
        mine = [nd for nd in nodes if nd[0] == i]
        key_to_local = {(nd[1], nd[2]): k for k, nd in enumerate(mine)}
        assert tree.num_nodes[i] == len(mine)
        for k, nd in enumerate(mine):
            assert int(tree.token_ids[pos + k]) == nd[4]
            assert int(tree.depths[pos + k]) == nd[1]
            assert float(tree.path_probs[pos + k]) == pytest.approx(nd[5])
            expected_parent = -1 if nd[3] is None else key_to_local[nd[3]]
            assert int(tree.parents[pos + k]) == expected_parent
            assert expected_parent < k
        pos += len(mine)


def test_path_probs_are_products_of_draft_probs():
    gen = torch.Generator().manual_seed(5)
    tree = SuperTree.from_levels(_levels(4, 5, 23, 2, gen))
    gp = tree.global_parents
    for j in range(tree.total_nodes):
        if gp[j] >= 0:
            assert float(tree.path_probs[j]) == pytest.approx(float(tree.path_probs[gp[j]] * tree.draft_probs[j]))
            assert tree.path_probs[j] <= tree.path_probs[gp[j]]


def test_path_nodes_match_naive_ancestors():
    gen = torch.Generator().manual_seed(2)
    parents = [random_parents(n, gen) for n in (1, 7, 40)]
    tree = SuperTree.from_parents(parents)
    path = tree.path_nodes()
    start = 0
    for p in parents:
        for j in range(p.numel()):
            expected = [start + a for a in naive_ancestors(p.tolist(), j)]
            got = [x for x in path[start + j].tolist() if x >= 0]
            assert got == expected
        start += p.numel()


@pytest.mark.parametrize("seed", range(3))
def test_greedy_path_is_every_ancestor_a_best_child(seed):
    """A node is on the draft's greedy path when it and every ancestor below the root are rank 0: checked by
    walking each node's naive ancestor list, on drafted trees and after a selection drops nodes."""
    gen = torch.Generator().manual_seed(seed)
    tree = SuperTree.from_levels(_levels(5, 5, 29, 3, gen))
    keep = (torch.rand(tree.total_nodes, generator=gen) < 0.8) | tree.is_root
    gp = tree.global_parents
    for _ in range(6):  # ancestor-closed: a node goes with its parent
        keep &= tree.is_root | keep[gp.clamp(min=0)]
    for t in (tree, tree.select(keep)):
        gp = t.global_parents.tolist()
        for j in range(t.total_nodes):
            chain, k = [], j
            while k >= 0:
                chain.append(k)
                k = gp[k]
            want = all(int(t.ranks[a]) == 0 for a in chain)
            assert bool(t.on_greedy_path[j]) == want
        assert bool(t.on_greedy_path[t.is_root].all())
        assert 0 < int(t.on_greedy_path[~t.is_root].sum()) < int((~t.is_root).sum())


@pytest.mark.parametrize("seed", range(4))
def test_derived_tensors_built_with_the_tree_equal_their_definitions(seed):
    """from_levels and select fill request_ids, global_parents and on_greedy_path as they build the tree; each
    equals what the module's functions compute from the tree's own fields (parents, cu_num_nodes, ranks)."""
    gen = torch.Generator().manual_seed(seed)
    tree = SuperTree.from_levels(_levels(1 + 3 * seed, 5, 29, 3, gen))
    keep = (torch.rand(tree.total_nodes, generator=gen) < 0.7) | tree.is_root
    for _ in range(6):
        keep &= tree.is_root | keep[global_parent_ids(tree.parents, tree.cu_num_nodes).clamp(min=0)]
    plain = SuperTree.from_parents([tree.parents[a:b] for a, b in zip(tree.cu_num_nodes[:-1].tolist(),
                                                                      tree.cu_num_nodes[1:].tolist())])
    # the greedy flags are filled by from_levels and carried by a selection; a tree from parent lists has none
    for t, greedy_filled in ((tree, True), (tree.select(keep), True), (plain.select(keep), False)):
        assert {"request_ids", "global_parents"} <= set(vars(t))
        assert ("on_greedy_path" in vars(t)) == greedy_filled
        gp = global_parent_ids(t.parents, t.cu_num_nodes)
        assert torch.equal(t.request_ids, request_ids_from_cu(t.cu_num_nodes))
        assert torch.equal(t.global_parents, gp)
        assert torch.equal(t.on_greedy_path, greedy_path(gp, t.ranks))


def test_to_a_device_the_tree_is_on_is_the_tree_and_a_move_keeps_the_derived_tensors():
    gen = torch.Generator().manual_seed(7)
    tree = SuperTree.from_levels(_levels(3, 4, 29, 3, gen))
    assert tree.to("cpu") is tree
    moved = tree.to("meta")
    assert moved is not tree and moved.token_ids.device.type == "meta"
    for name in ("request_ids", "global_parents", "on_greedy_path"):
        assert vars(moved)[name].device.type == "meta" and vars(moved)[name].shape == vars(tree)[name].shape


def test_select_reindexes_parents_and_rejects_orphans():
    tree = SuperTree.from_parents([torch.tensor([-1, 0, 0, 1, 2]), torch.tensor([-1, 0])],
                                  [torch.tensor([10, 11, 12, 13, 14]), torch.tensor([20, 21])])
    sub = tree.select(torch.tensor([True, False, True, False, True, True, False]))
    assert sub.token_ids.tolist() == [10, 12, 14, 20]
    assert sub.parents.tolist() == [-1, 0, 1, -1]
    assert sub.cu_num_nodes.tolist() == [0, 3, 4]
    with pytest.raises(ValueError, match="ancestor-closed"):
        tree.select(torch.tensor([True, False, False, True, False, True, False]))
    with pytest.raises(ValueError, match="root"):
        tree.select(torch.tensor([True, True, False, False, False, False, True]))


def test_segment_rank_matches_naive_counts():
    gen = torch.Generator().manual_seed(9)
    req = torch.randint(0, 5, (60,), generator=gen)
    order = torch.randperm(60, generator=gen)
    rank = segment_rank(req, order, 5)
    seen = {}
    for pos, node in enumerate(order.tolist()):
        r = int(req[node])
        assert rank[pos] == seen.get(r, 0)
        seen[r] = seen.get(r, 0) + 1


def test_priority_order_matches_naive_sort_with_ties():
    from echo_trtllm.core.tree import priority_order

    gen = torch.Generator().manual_seed(4)
    scores = torch.randint(0, 5, (300,), generator=gen).float() / 7  # ties and zeros
    scores[:3] = torch.tensor([1.0, 1e-30, 0.0])
    depths = torch.randint(0, 9, (300,), generator=gen)
    expected = sorted(range(300), key=lambda j: (-float(scores[j]), int(depths[j]), j))
    assert priority_order(scores, depths).tolist() == expected
    with pytest.raises(ValueError, match=">= 0"):
        priority_order(torch.tensor([-0.5]), torch.tensor([0]))


def test_source_index_points_back_to_the_drafted_levels():
    gen = torch.Generator().manual_seed(12)
    levels = _levels(5, 3, 19, 2, gen)
    flat_tokens = torch.cat([lv.token_ids for lv in levels])
    tree = SuperTree.from_levels(levels)
    assert torch.equal(flat_tokens[tree.source_index], tree.token_ids)
    keep = torch.ones(tree.total_nodes, dtype=torch.bool)
    keep[tree.depths == 3] = False
    sub = tree.select(keep)
    assert torch.equal(flat_tokens[sub.source_index], sub.token_ids)
