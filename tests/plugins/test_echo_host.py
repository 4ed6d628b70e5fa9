"""The echo policy's decisions on the plugin's host library, as the runtime installs them: the drafted levels
replayed with the gate and the stops (`kernels.host_level_replayer`) against the torch replay and
`EchoPolicy.observe`, and the selection (`kernels.host_selector`: allocation and budget rule in one call) against the
allocator, `choose_budget` and `truncated`, the oracles: the same candidates, selection, allocation, gate failures,
spines, confidences and frontier slots, step after step while the policy learns online; bad arrays refused by
name."""

import dataclasses
from ctypes import c_double as ctypes_double

import numpy as np

import pytest
import torch

from echo_trtllm import kernels
from echo_trtllm.core import CostModel, EchoConfig, make_policy
from echo_trtllm.core.budget import allocate_budget
from echo_trtllm.core.pack import pack as core_pack
from echo_trtllm.core.policies import EchoPolicy, draft_tree_batched
from echo_trtllm.core.prices import KalmanLinear, StepCostModel
from echo_trtllm.core.steps import StepSample
from tests.core.test_batched_drafting import COST, MarkovLevels, same_result, tied_table
from tests.helpers import markov_draft_fn

ECHO_CASES = [
    EchoConfig(policy="echo", beam_width=3, top_k=3, max_depth=5, k_max=40, gate_depths=(1, 3, 5),
               gate_thresholds=(0.3, 0.1, 0.02)),
    EchoConfig(policy="echo", beam_width=2, top_k=4, max_depth=6, k_max=12, gate_depths=(2, 4),
               gate_thresholds=(0.2, 0.05)),
    EchoConfig(policy="echo", beam_width=2, top_k=2, max_depth=6, k_max=256),  # the online gate, a loose budget
    EchoConfig(policy="echo-dense", beam_width=3, top_k=2, max_depth=4, k_max=30),
    EchoConfig(policy="echo-fixed", beam_width=4, top_k=3, max_depth=5, k_max=60, fixed_threshold=0.05),
    EchoConfig(policy="echo-no-budget-stop", beam_width=2, top_k=3, max_depth=5, k_max=20),
    EchoConfig(policy="echo", beam_width=3, top_k=3, max_depth=5, k_max=60, max_nodes_per_request=3),  # a cap binds
]
# verification priced, drafting not (no draft curve: no cost stop; the budget rule still prices)
VERIFY_ONLY = CostModel((1, 8, 16, 32, 64, 128), (0.010, 0.011, 0.016, 0.026, 0.046, 0.086))


class Counting:
    """The host replayer, counting its calls (the host path must be the one taken)."""

    def __init__(self, replayer, next_frontier: bool = True):
        self.replayer, self.calls, self.frontiers = replayer, 0, 0
        # a replayer that chooses the next frontier too makes `draft_tree_batched` draft level by level in one call
        # each where it decides after every level (`_draft_on_host`); next_frontier=False: the device loop's replay
        self.next_frontier = next_frontier and getattr(replayer, "next_frontier", False)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.frontiers += kwargs.get("next_width", 0) > 0
        return self.replayer(*args, **kwargs)


def _learn(policies, result, gen):
    """Both policies learn the same random verification outcome of the step (accepted: a prefix of each request's
    nodes in node order, so deeper nodes are accepted less often)."""
    sel = result.selected
    accepted = []
    for r in range(sel.batch_size):
        lo, hi = int(sel.cu_num_nodes[r]), int(sel.cu_num_nodes[r + 1])
        keep = int(torch.randint(0, hi - lo + 1, (1,), generator=gen))
        accepted += list(range(lo, lo + max(keep, 1)))
    ids = torch.tensor(accepted, dtype=torch.long)
    for p in policies:
        p.learn(sel, ids)


@pytest.mark.parametrize("config", ECHO_CASES, ids=lambda c: f"{c.policy}-k{c.k_max}")
@pytest.mark.parametrize("batch_size", [1, 5, 16])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("cost", [None, COST, VERIFY_ONLY], ids=["unpriced", "priced", "verify-priced"])
@pytest.mark.parametrize("parts", ["replay", "select", "both", "replay-only"])
def test_the_host_library_decides_what_the_torch_oracle_decides(host_backend, monkeypatch, config, batch_size, tied,
                                                                 cost, parts):
    """replay: the levels replayed on the host library (`replay_level`) against the torch replay and `observe`;
    select: the allocation and budget rule in one call (`selector`) against the allocator, `choose_budget` and
    `truncated`; both: as the runtime installs them. Deciding after every level (a CPU drafter), replay and both
    draft each level in one call that also chooses the next frontier (`_draft_on_host`) against the device loop in
    torch; replay-only: as both, the frontier chosen by the device loop (the host library replays only)."""
    vocab = 40
    table = tied_table(vocab, batch_size) if tied else markov_draft_fn(vocab, seed=batch_size).table
    reference, host = make_policy(config, cost), make_policy(config, cost)
    # the estimates read and refitted with the same library functions on both sides, as the runtime installs them
    # (their own oracle: test_acceptance_host.py; NumPy's vectorised power rounds c^(1/d) differently in the last
    # bits)
    reference.acceptance.reader = host.acceptance.reader = kernels.host_estimate_reader()
    reference.acceptance.refitter = host.acceptance.refitter = kernels.host_acceptance_refitter()
    counting = Counting(kernels.host_level_replayer() if parts != "select" else kernels.host_selector(),
                        next_frontier=parts != "replay-only")
    if parts == "replay":
        host.level_replayer = counting
    elif parts == "select":
        host.selector = counting
        counting.allocator = host.allocator
    else:
        kernels.install_host(host)
        host.level_replayer = counting
        assert host.selector is not None
    stops: dict = {id(reference): [], id(host): []}  # every cost stop's (requests, claimed, tokens): equal
    real = EchoPolicy._stop_unless_paid

    def record(self, state, n, claimed, gain):
        stops[id(self)].append((n, claimed, gain))
        return real(self, state, n, claimed, gain)
    monkeypatch.setattr(EchoPolicy, "_stop_unless_paid", record)  # on the class: the host guard still holds
    assert host.replays_on_host == (parts != "select") and not reference.replays_on_host
    gen = torch.Generator().manual_seed(batch_size)
    budget = batch_size + config.k_max
    packed_in_one = 0
    for step in range(12):  # the online estimates and the gate learn between steps
        roots = torch.randint(0, vocab, (batch_size,), generator=gen)
        every = step % 2 == 0  # a CPU drafter syncs every level; a GPU one at the first gate only
        want = draft_tree_batched(reference, roots, MarkovLevels(table, roots, reference.max_children), budget,
                                  context=100.0 + step, sync_every_level=every)
        # "both" as the runtime runs it on the CPU: the tree, the selection, the selected tree and its packing in
        # one call where the host library selects (`draft_result_on_host`), against the four calls and the core's pack
        ctx = torch.randint(50, 90, (batch_size,), generator=gen) if parts == "both" else None
        got = draft_tree_batched(host, roots, MarkovLevels(table, roots, host.max_children), budget,
                                 context=100.0 + step, sync_every_level=every, context_lengths=ctx)
        same_result(got, want)
        if got.packed is not None:
            packed_in_one += 1
            _same_tree(got.candidates, want.candidates)
            _same_tree(got.selected, want.selected)
            _same_packed(got.packed, core_pack(want.selected, ctx))
            _same_packed(got.packed, kernels.pack(want.selected, ctx, backend="host"), dtypes=True)
        assert len(got.state.confidence) == len(want.state.confidence)
        for a, b in zip(got.state.confidence, want.state.confidence):
            assert torch.equal(a, b)
        assert len(got.state.frontier_slots) == len(want.state.frontier_slots)
        for a, b in zip(got.state.frontier_slots, want.state.frontier_slots):
            assert torch.equal(a, b)
        for name in ("selected", "phase", "num_nodes", "order"):
            assert torch.equal(getattr(got.state.allocation, name), getattr(want.state.allocation, name)), name
        _learn((reference, host), want, gen)
    assert counting.calls > 0 or (parts == "select" and cost is None)  # unpriced: the allocator alone
    # the level-by-level steps chose their frontier in the replay's call wherever a level followed another
    assert (counting.frontiers > 0) == (parts in ("replay", "both") and config.max_depth > 1)
    assert stops[id(host)] == stops[id(reference)]  # (some cases stop at the gate or budget before any cost stop)
    # priced, the host library selects (but where a refit is due: some steps take the four calls)
    assert (packed_in_one > 0) == (parts == "both" and cost is not None)


def _same_packed(a, b, dtypes: bool = False):
    for name in ("input_ids", "position_ids", "parents", "node_depths", "cu_num_nodes", "generation_lengths",
                 "position_offsets", "packed_mask"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape and torch.equal(x.long(), y.long()), name
        assert not dtypes or x.dtype == y.dtype, name


@pytest.mark.parametrize("cost", [None, COST])
def test_a_step_with_no_budget_beyond_the_roots(host_backend, cost):
    """budget == B: nobody drafts; the host library's policy selects the roots alone, as the oracle does, and
    reads no estimate (no refit moved)."""
    config = ECHO_CASES[0]
    roots = torch.tensor([3, 7, 1])
    table = markov_draft_fn(40, seed=1).table
    reference, host = make_policy(config, cost), make_policy(config, cost)
    kernels.install_host(host)
    for p in (reference, host):
        got = draft_tree_batched(p, roots, MarkovLevels(table, roots, p.max_children), 3, context=50.0)
        assert got.selected.total_nodes == 3 and got.state.frontier_sizes == []
        assert p.acceptance._fit_version == reference.acceptance._fit_version


def test_a_policy_that_decides_otherwise_is_replayed_in_torch(host_backend):
    class Mine(EchoPolicy):
        def observe(self, level, state):
            super().observe(level, state)

    policy = Mine(EchoConfig(policy="echo", beam_width=2, top_k=2, max_depth=4, k_max=20))
    kernels.install_host(policy)
    assert policy.level_replayer is not None and not policy.replays_on_host
    plain = make_policy(EchoConfig(policy="echo", beam_width=2, top_k=2, max_depth=4, k_max=20))
    kernels.install_host(plain)
    assert plain.replays_on_host
    plain.observe = lambda level, state: None  # an override on the instance counts too
    assert not plain.replays_on_host
    other = make_policy(EchoConfig(policy="echo", beam_width=2, top_k=2, max_depth=4, k_max=20),
                        COST)
    kernels.install_host(other)
    calls = []

    def mine(*a, **k):  # a policy given its own allocator selects with it, not with the library's
        calls.append(1)
        return allocate_budget(*a, **k)
    other.allocator = mine
    roots = torch.tensor([3, 7])
    draft_tree_batched(other, roots, MarkovLevels(markov_draft_fn(40, seed=2).table, roots, other.max_children), 22,
                       context=50.0)
    assert other.selector is not None and calls


def _args(**change):
    """A valid one-level call (two requests, one row each drafting two slots of two children), with changes."""
    args = dict(prev_request_ids=torch.tensor([0, 1]), prev_path_probs=torch.tensor([1.0, 1.0]),
                prev_slots=torch.tensor([0, 0]), slot_width=1, front=torch.zeros(2, 1, dtype=torch.long),
                fvalid=torch.ones(2, 1, dtype=torch.bool), probs=torch.tensor([[[0.6, 0.3]], [[0.5, 0.4]]]),
                tokens=torch.tensor([[[3, 4]], [[5, 6]]]), row_of=torch.tensor([0, 1]), depth=1, tau=0.55,
                budget_spare=4, table=None, gain_row=0, active=torch.ones(2, dtype=torch.bool),
                spine_depth=torch.zeros(2, dtype=torch.long), failed_at=torch.zeros(2, dtype=torch.long),
                history=torch.zeros(3, 2))
    args.update(change)
    return args


def test_one_level_by_hand(host_backend):
    replay = kernels.host_level_replayer()
    a = _args()
    slot_of, ints, floats, active, n, claimed, gain, nxt = replay(*a.values())
    assert nxt is None  # not asked for (next_width 0)
    assert slot_of.tolist() == [0, 0]
    assert ints.tolist() == [[0, 0, 1, 1], [0, 0, 1, 1], [3, 4, 5, 6], [0, 1, 0, 1], [0, 1, 0, 1]]
    assert torch.allclose(floats, torch.tensor([[0.6, 0.3, 0.5, 0.4]] * 2))
    assert active.tolist() == [True, False] and (n, claimed, gain) == (1, 3, 0.0)  # 0.5 fails tau = 0.55
    assert a["failed_at"].tolist() == [0, 1] and a["spine_depth"].tolist() == [1, 0]
    assert torch.allclose(a["history"][0], torch.tensor([0.6, 0.5]))
    # the gate is strict: a confidence equal to tau fails it
    assert replay(*_args(tau=0.5, budget_spare=8).values())[3].tolist() == [True, False]


def test_the_next_frontier_by_hand(host_backend):
    """Level 2 of three requests, one row each with two frontier nodes of two children: row 0's four slots score
    0.5 x (0.6, 0.4) and 0.25 x (0.6, 0.0) -> 0.3, 0.2, 0.15, 0 (a valid slot); row 1's second node is padding
    (fvalid False: its slots score -1) and its first has tied children; request 2 fails the gate. The best two
    slots of each kept row, in slot order, with their scores, tokens and parents' frontier slots (slot // 2)."""
    probs = torch.tensor([[[0.6, 0.4], [0.6, 0.0]], [[0.5, 0.5], [0.9, 0.1]], [[0.1, 0.1], [0.1, 0.1]]])
    tokens = torch.arange(12).reshape(3, 2, 2)
    a = _args(prev_request_ids=torch.tensor([0, 0, 1, 1, 2]), prev_path_probs=torch.tensor([0.5, 0.25, 0.8, 0.1, 0.1]),
              prev_slots=torch.tensor([0, 1, 0, 1, 0]), slot_width=2, front=torch.tensor([[0, 1], [0, 1], [0, 1]]),
              fvalid=torch.tensor([[True, True], [True, False], [True, True]]), probs=probs, tokens=tokens,
              row_of=torch.tensor([0, 1, 2]), depth=2, tau=0.05, budget_spare=64,
              active=torch.ones(3, dtype=torch.bool), spine_depth=torch.zeros(3, dtype=torch.long),
              failed_at=torch.zeros(3, dtype=torch.long), history=torch.zeros(3, 3))
    parent_path = torch.tensor([[0.5, 0.25], [0.8, 0.1], [0.1, 0.1]])
    out = kernels.host_level_replayer()(*a.values(), parent_path=parent_path, next_width=2)
    keep, front, fvalid, path, toks, parents = out[7]
    assert out[3].tolist() == [True, True, False]  # request 2: confidence 0.01 fails tau 0.05
    assert keep.tolist() == [0, 1]
    assert front.tolist() == [[0, 1], [0, 1]]  # row 1: the tied 0.4s, lowest slots first; padding's -1 last
    assert torch.equal(path, torch.tensor([[0.5 * 0.6, 0.5 * 0.4], [0.8 * 0.5, 0.8 * 0.5]]))
    assert fvalid.tolist() == [[True, True], [True, True]]
    assert toks.tolist() == [[0, 1], [4, 5]] and parents.tolist() == [[0, 0], [0, 0]]
    # wider than the level: every slot, the padding's invalid; nobody active: no next level
    wide = kernels.host_level_replayer()(*_args(**{**a, "active": torch.ones(3, dtype=torch.bool),
                                                   "spine_depth": torch.zeros(3, dtype=torch.long),
                                                   "failed_at": torch.zeros(3, dtype=torch.long)}).values(),
                                         parent_path=parent_path, next_width=8)[7]
    assert wide[1].tolist() == [[0, 1, 2, 3]] * 2 and wide[2].tolist() == [[True] * 4, [True, True, False, False]]
    assert wide[3][0, 3] == 0 and wide[3][1, 3] == -1
    gone = kernels.host_level_replayer()(*_args(**{**a, "tau": 0.99, "active": torch.ones(3, dtype=torch.bool),
                                                   "spine_depth": torch.zeros(3, dtype=torch.long),
                                                   "failed_at": torch.zeros(3, dtype=torch.long)}).values(),
                                         parent_path=parent_path, next_width=2)
    assert gone[4] == 0 and gone[7] is None
    with pytest.raises(ValueError, match="parent_path must be \\(R, W\\)"):
        kernels.host_level_replayer()(*_args().values(), parent_path=torch.ones(3), next_width=2)


def test_the_budget_stop_by_hand(host_backend):
    """Level 2 of two requests: confidences 0.9, 0.2 at level 1 and 0.6, 0.5 now; with 3 tokens spare the bar is
    the 3rd best of the four (0.5): both go on; with 1 spare the bar is 0.9: both stop; with 4 nobody is ranked."""
    replay = kernels.host_level_replayer()
    for spare, want in ((3, [True, True]), (2, [True, False]), (1, [False, False]), (4, [True, True])):
        history = torch.zeros(3, 2)
        history[0] = torch.tensor([0.9, 0.2])
        a = _args(depth=2, tau=None, budget_spare=spare, history=history)
        assert replay(*a.values())[3].tolist() == want, spare
        assert a["spine_depth"].tolist() == [2, 2]  # the spine grows before the budget stop


@pytest.mark.parametrize("change, message", [
    (dict(front=torch.tensor([[1], [0]])), "front\\[0\\] = 1 is outside"),
    (dict(row_of=torch.tensor([0, 3])), "row_of\\[1\\] = 3 is outside"),
    (dict(prev_request_ids=torch.tensor([0, 2])), "prev_request_ids\\[1\\] = 2 is outside"),
    (dict(prev_slots=torch.tensor([0, -1])), "prev_slots\\[1\\] = -1 is outside"),
    (dict(depth=4), "depth must be in \\[1, max_levels = 3\\]"),
    (dict(budget_spare=-1), "budget_spare must be >= 0"),
])
def test_bad_arrays_are_refused_by_name(host_backend, change, message):
    with pytest.raises(kernels.PluginError, match=message):
        kernels.host_level_replayer()(*_args(**change).values())


def _root_and_child(roots: list[int], probs: list[float], tokens: list[int]):
    """Level 0 of these roots and level 1: one child of each, of this probability and token."""
    from echo_trtllm.core.tree import DraftTopK, expand_level, root_level

    root = root_level(torch.tensor(roots))
    child = DraftTopK(torch.tensor(probs)[:, None], torch.tensor(tokens)[:, None])
    return root, expand_level(root, torch.arange(len(roots)), child, 1)


def test_the_budget_rule_keeps_the_smaller_budget_on_a_tie(host_backend):
    """One request, its root and one child of path probability 0.5 estimated at 0.5 (no evidence yet: the draft's
    own probability); verifying it takes 1.5x the root's seconds: both budgets give 1 token per second, and the
    rule keeps the smaller (`choose_budget`: the first maximum). A floor of taken nodes (a probe's) keeps that many
    where the rule keeps none, at most what the allocation took, and changes nothing where the rule keeps some."""
    from echo_trtllm.core.acceptance import OnlineAcceptance
    from echo_trtllm.core.tree import SuperTree

    tree = SuperTree.from_levels(list(_root_and_child([7], [0.5], [3])))
    online = OnlineAcceptance(2)
    assert float(online.estimate(torch.tensor([0.5]), 1)) == 0.5
    for seconds, floor, kept in (([1.0, 1.5], 0, 0), ([1.0, 1.4], 0, 1), ([1.0, 1.5], 1, 1), ([1.0, 1.5], 5, 1),
                                 ([1.0, 9.0], 1, 1), ([1.0, 1.4], 5, 1)):
        alloc = kernels.allocate_budget(tree, torch.tensor([1]), 2, backend="host",
                                        choose=(online._segments_table(), 2, torch.tensor(seconds), floor))
        assert alloc.order.numel() == kept and alloc.num_nodes.tolist() == [1 + kept], (seconds, floor)
        assert alloc.selected.tolist() == [True, bool(kept)] and alloc.phase.tolist() == [0, 1 if kept else -1]
    # two children (path probabilities 0.5 and 0.3, each its own estimate): the floor only where the rule keeps none
    from echo_trtllm.core.tree import DraftTopK, expand_level, root_level

    root = root_level(torch.tensor([7]))
    two = SuperTree.from_levels([root, expand_level(root, torch.arange(1), DraftTopK(
        torch.tensor([[0.5, 0.3]]), torch.tensor([[3, 4]])), 2)])
    for seconds, floor, kept in (([1.0, 1.4, 9.0], 2, 1), ([1.0, 9.0, 9.5], 0, 0), ([1.0, 9.0, 9.5], 1, 1),
                                 ([1.0, 9.0, 9.5], 2, 2)):
        alloc = kernels.allocate_budget(two, torch.tensor([1]), 3, backend="host",
                                        choose=(online._segments_table(), 2, torch.tensor(seconds), floor))
        assert alloc.order.numel() == kept and alloc.num_nodes.tolist() == [1 + kept], (seconds, floor)


@pytest.mark.parametrize("max_depth, seconds, message", [
    (2, [1.0], "seconds must hold one entry per taken count 0 .. min\\(num_nodes, budget\\) - batch_size = 1, got 1"),
    (3, [1.0, 1.4], "max_depth must be >= 1 with 2 \\* max_depth <= the fit's rows \\(4\\), got 3"),
    (0, [1.0, 1.4], "max_depth must be >= 1"),
    (2, [1.0, 1.4, -1], "min_taken must be >= 0 \\(0: the budget rule alone\\), got -1"),
])
def test_bad_selection_arguments_are_refused_by_name(host_backend, max_depth, seconds, message):
    from echo_trtllm.core.acceptance import OnlineAcceptance
    from echo_trtllm.core.tree import SuperTree

    tree = SuperTree.from_levels(list(_root_and_child([7], [0.5], [3])))
    seconds, floor = seconds[:2], [int(x) for x in seconds[2:]]  # a third entry: the floor of taken nodes
    with pytest.raises(kernels.PluginError, match=message):
        kernels.allocate_budget(tree, torch.tensor([1]), 2, backend="host",
                                choose=(OnlineAcceptance(2)._segments_table(), max_depth, torch.tensor(seconds),
                                        *floor))
    with pytest.raises(ValueError, match="choose= runs on the host library only"):
        kernels.allocate_budget(tree, torch.tensor([1]), 2, backend="torch",
                                choose=(OnlineAcceptance(2)._segments_table(), 2, torch.tensor(seconds)))


@pytest.mark.parametrize("seed", range(4))
def test_the_acceptance_counts_update_as_numpy_does(host_backend, seed):
    """`OnlineAcceptance.observe_nodes` on the host library (`kernels.host_acceptance_counter`) against its NumPy
    path (`observe`): the same decayed counts, bit for bit, step after step; roots skipped, depths past the table's
    clamped, confidences outside [0, 1] clamped."""
    from echo_trtllm.core.acceptance import OnlineAcceptance

    gen = torch.Generator().manual_seed(seed)
    depth = 2 + seed
    host, numpy_ = OnlineAcceptance(depth, half_life=7.0 + seed), OnlineAcceptance(depth, half_life=7.0 + seed)
    host.counter = kernels.host_acceptance_counter()
    assert host.counter is not None and numpy_.counter is None
    for step in range(15):
        m = int(torch.randint(0, 40, (1,), generator=gen))  # step 0 may verify roots only
        depths = torch.randint(0, depth + 3, (m,), generator=gen)
        conf = torch.rand(m, generator=gen) * 1.2 - 0.1
        greedy = torch.rand(m, generator=gen) < 0.5
        accepted = torch.nonzero(torch.rand(m, generator=gen) < 0.4, as_tuple=True)[0]
        for online in (host, numpy_):
            online.observe_nodes(depths, conf, greedy, accepted)
        for name in ("n", "k", "csum"):
            assert torch.equal(getattr(host, name), getattr(numpy_, name)), (step, name)
        assert host.version == numpy_.version == step + 1
    assert float(host.n.sum()) > 0


def test_an_accepted_id_outside_the_tree_is_refused(host_backend):
    from echo_trtllm.core.acceptance import OnlineAcceptance

    online = OnlineAcceptance(2)
    online.counter = kernels.host_acceptance_counter()
    with pytest.raises(kernels.PluginError, match="accepted_ids\\[1\\] = 3 is outside \\[0, 3\\)"):
        online.observe_nodes(torch.tensor([0, 1, 2]), torch.tensor([1.0, 0.5, 0.2]), torch.tensor([True] * 3),
                             torch.tensor([0, 3]))


def _same_tree(a, b):
    for name in ("token_ids", "parents", "depths", "draft_probs", "path_probs", "ranks", "cu_num_nodes",
                 "source_index", "request_ids", "global_parents", "on_greedy_path"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name


@pytest.mark.parametrize("config", ECHO_CASES[:4], ids=lambda c: f"{c.policy}-k{c.k_max}")
@pytest.mark.parametrize("batch_size", [1, 6])
def test_the_tree_from_levels_is_the_cores(host_backend, config, batch_size):
    """`kernels.host_tree_builder` against `SuperTree.from_levels` (its derived tensors included) on the levels of
    real drafting steps, and the runtime's drafting with it installed equal to the core's."""
    from echo_trtllm.core.tree import SuperTree

    build = kernels.host_tree_builder()
    table = markov_draft_fn(40, seed=batch_size).table
    gen = torch.Generator().manual_seed(batch_size)
    for step in range(4):
        roots = torch.randint(0, 40, (batch_size,), generator=gen)
        reference, host = make_policy(config, COST), make_policy(config, COST)
        kernels.install_host(host)
        assert host.tree_builder is not None
        want = draft_tree_batched(reference, roots, MarkovLevels(table, roots, reference.max_children),
                                  batch_size + config.k_max, context=80.0, sync_every_level=True)
        got = draft_tree_batched(host, roots, MarkovLevels(table, roots, host.max_children),
                                 batch_size + config.k_max, context=80.0, sync_every_level=True)
        same_result(got, want)
        _same_tree(got.candidates, want.candidates)
        _same_tree(got.selected, want.selected)
    # level by level with the core's loop, a few levels deep: the same tree from the same levels
    from echo_trtllm.core.policies import DraftLoop
    from echo_trtllm.core.tree import DraftTopK
    loop = DraftLoop(make_policy(config), roots)
    while (frontier := loop.frontier()) is not None:
        loop.feed(DraftTopK.of(table[loop.levels[-1].token_ids[frontier]], loop.policy.max_children))
    _same_tree(build(loop.levels), SuperTree.from_levels(loop.levels))


def test_bad_levels_are_refused_by_name(host_backend):
    build = kernels.host_tree_builder()
    root, child = _root_and_child([5, 6], [0.5, 0.4], [1, 2])
    bad = dataclasses.replace(child, parent_ids=torch.tensor([0, 2]))
    with pytest.raises(kernels.PluginError, match="parent_ids\\[3\\] = 2 is outside level 0's 2 nodes"):
        build([root, bad])
    crossed = dataclasses.replace(child, parent_ids=torch.tensor([1, 0]))
    with pytest.raises(kernels.PluginError, match="node 2 of request 0 has a parent of request 1"):
        build([root, crossed])
    with pytest.raises(ValueError, match="start with the root level"):
        build([child])
    stranger = dataclasses.replace(child, request_ids=torch.tensor([0, 2]))
    with pytest.raises(kernels.PluginError, match="request_ids\\[3\\] = 2 is outside \\[0, 2\\)"):
        build([root, stranger])
    swapped = dataclasses.replace(root, request_ids=torch.tensor([1, 0]))
    with pytest.raises(kernels.PluginError, match="the root level must be request i's root at i"):
        build([swapped, child])
    short = dataclasses.replace(child, ranks=torch.tensor([0]))
    with pytest.raises(ValueError, match="level 1's fields must be 1-D with one entry per node \\(2\\)"):
        build([root, short])
    # levels of other dtypes are not the drafting loop's own: the library declines them, the core builds the tree
    for field, other in (("path_probs", torch.float64), ("ranks", torch.int32), ("token_ids", torch.int32),
                         ("draft_probs", torch.bfloat16)):
        odd = dataclasses.replace(child, **{field: getattr(child, field).to(other)})
        assert kernels._level_arrays([root, odd], "tree") is None
    assert kernels._level_arrays([root, child], "tree") is not None


@pytest.mark.parametrize("seed", range(3))
def test_the_refits_isotonic_fits_are_the_cores(host_backend, seed):
    """`kernels.host_isotonic` against `_weighted_isotonic` row by row (ties, runs of violators, one column), and
    an online acceptance refitted with it reads the same estimates as one refitted in Python."""
    from echo_trtllm.core.acceptance import _weighted_isotonic
    from tests.helpers import random_online_acceptance

    iso = kernels.host_isotonic()
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 5, (9, 15), generator=gen).double().numpy() / 4  # ties and violators
    w = torch.rand(9, 15, generator=gen, dtype=torch.float64).numpy() + 0.1
    want = [_weighted_isotonic(y[i], w[i]) for i in range(9)]
    got = iso(y, w)
    assert all(np.array_equal(got[i], want[i]) for i in range(9))
    assert np.array_equal(iso(y[:, :1], w[:, :1]), y[:, :1])
    with pytest.raises(kernels.PluginError, match="weights must be > 0, w\\[2\\] = 0"):
        iso(y[:1, :4], np.array([[1.0, 1.0, 0.0, 1.0]]))
    host, _ = random_online_acceptance(seed, 4, seed % 2 == 1, 2.0, 20.0, 1)
    python, gen = random_online_acceptance(seed, 4, seed % 2 == 1, 2.0, 20.0, 1)
    host.isotonic = iso
    probe = torch.rand(200, generator=gen, dtype=torch.float64)
    for step in range(6):
        d = torch.randint(1, 5, (30,), generator=gen)
        c = torch.rand(30, generator=gen)
        acc = torch.rand(30, generator=gen) < c
        g = torch.rand(30, generator=gen) < 0.5
        for online in (host, python):
            online.observe(d, c, acc, g)
        for depth in range(1, 5):
            assert torch.equal(host.estimate(probe, depth), python.estimate(probe, depth))
            assert torch.equal(host.estimate(probe, depth, False), python.estimate(probe, depth, False))


OTHER_POLICIES = [
    EchoConfig(policy="static", static_choices=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))),
    EchoConfig(policy="eagle2", top_k=3, max_depth=4, total_tokens=12),
    EchoConfig(policy="ddd", top_k=3, max_depth=6, total_tokens=16, ddd_threshold=-1.0, ddd_check_every=2),
    EchoConfig(policy="chain", num_draft_tokens=4),
]


@pytest.mark.parametrize("config", OTHER_POLICIES, ids=lambda c: c.policy)
@pytest.mark.parametrize("batch_size", [1, 5])
def test_every_policy_builds_its_tree_on_the_host_as_the_core_does(host_backend, config, batch_size):
    """The builder is installed on every policy: the level-by-level loop (`draft_tree`, `DraftLoop.result`) and the
    batched one give the core's candidates, selection and derived tensors with it."""
    from echo_trtllm.core import draft_tree

    table = markov_draft_fn(40, seed=batch_size).table
    roots = torch.randint(0, 40, (batch_size,), generator=torch.Generator().manual_seed(batch_size))
    reference, host = make_policy(config), make_policy(config)
    kernels.install_host(host)
    assert host.tree_builder is not None and reference.tree_builder is None
    assert host.tree_selector is not None and reference.tree_selector is None
    fn = lambda level, frontier: table[level.token_ids[frontier]]  # noqa: E731
    want, got = draft_tree(reference, roots, fn), draft_tree(host, roots, fn)
    same_result(got, want)
    _same_tree(got.candidates, want.candidates)
    _same_tree(got.selected, want.selected)
    if reference.beam_frontier:
        want = draft_tree_batched(reference, roots, MarkovLevels(table, roots, reference.max_children))
        got = draft_tree_batched(host, roots, MarkovLevels(table, roots, host.max_children))
        same_result(got, want)
        _same_tree(got.candidates, want.candidates)
        _same_tree(got.selected, want.selected)


class WiderLevels(MarkovLevels):
    """A drafter that hands back one more child per node than the policy expands (the loops keep the first k)."""

    def __init__(self, table, roots, k):
        super().__init__(table, roots, k + 1)


class OwnSelect(EchoPolicy):
    """A subclass with its own selection (the same rule, reached through an override)."""

    def select(self, tree, state):
        return super().select(tree, state)


@pytest.mark.parametrize("case", ["max_levels", "probe_floor", "own_select", "wider_top_k"])
def test_the_one_call_paths_where_they_apply_and_decline(host_backend, case):
    """The CPU's one-call paths (a level's replay with the next frontier; the drafting result with its packing) as
    the runtime installs them, against the torch loop: with drafting capped below max_depth, with a probe's floor
    (taken by the result in one call too), with a subclass's own `select` (declines: the four calls select), and
    with a drafter that returns more children than the policy expands."""
    config, vocab, b = ECHO_CASES[0], 40, 5
    table = markov_draft_fn(vocab, seed=3).table
    cls = OwnSelect if case == "own_select" else EchoPolicy
    reference, host = cls(config, COST), cls(config, COST)
    kernels.install_host(host)
    reference.acceptance.reader, reference.acceptance.refitter = host.acceptance.reader, host.acceptance.refitter
    drafter = WiderLevels if case == "wider_top_k" else MarkovLevels
    gen = torch.Generator().manual_seed(3)
    kw = {"max_levels": 2} if case == "max_levels" else {}
    floor = b + 3 if case == "probe_floor" else 0
    for step in range(6):
        roots = torch.randint(0, vocab, (b,), generator=gen)
        ctx = torch.randint(50, 90, (b,), generator=gen)
        want = draft_tree_batched(reference, roots, drafter(table, roots, reference.max_children), b + config.k_max,
                                  context=100.0, sync_every_level=True, min_tokens=floor, **kw)
        got = draft_tree_batched(host, roots, drafter(table, roots, host.max_children), b + config.k_max,
                                 context=100.0, sync_every_level=True, min_tokens=floor, context_lengths=ctx, **kw)
        same_result(got, want)
        if case == "max_levels":
            assert int(got.candidates.depths.max()) <= 2
        assert (got.packed is None) == (case == "own_select") or step == 0  # (a first refit)
        if got.packed is not None:
            _same_packed(got.packed, kernels.pack(want.selected, ctx, backend="host"), dtypes=True)
        _learn((reference, host), want, gen)


def test_the_drafting_result_in_one_call_refuses_or_declines_by_name(host_backend):
    """`kernels.host_draft_resulter`: levels the library does not read (other dtypes) decline (None: the four calls
    run); per-request arrays of another length are refused by name."""
    result = kernels.host_draft_resulter()
    root, child = _root_and_child([5, 6], [0.5, 0.4], [1, 2])
    table = make_policy(ECHO_CASES[0], COST).acceptance._segments_table()  # the fit as it starts
    seconds = torch.full((3,), 0.1, dtype=torch.float64)
    narrow = dataclasses.replace(child, path_probs=child.path_probs.double())
    two = torch.zeros(2, dtype=torch.long)
    assert result([root, narrow], two, 4, None, table, 5, seconds, torch.tensor([10, 10])) is None
    with pytest.raises(ValueError, match="spine_depth and context_lengths need one entry per request \\(2\\)"):
        result([root, child], torch.zeros(3, dtype=torch.long), 4, None, table, 5, seconds, torch.tensor([10, 10]))
    candidates, allocation, selected, packed = result([root, child], two, 4, None, table, 5, seconds,
                                                      torch.tensor([10, 12]))
    assert candidates.total_nodes == 4 and allocation.selected.dtype == torch.bool
    assert packed.position_ids[:selected.total_nodes].min() >= 10  # the nodes sit after each request's context


def test_levels_of_other_dtypes_are_built_by_the_core(host_backend):
    from echo_trtllm.core.tree import SuperTree

    root, child = _root_and_child([5, 6], [0.5, 0.4], [1, 2])
    narrow = dataclasses.replace(child, request_ids=child.request_ids.int(), path_probs=child.path_probs.double())
    _same_tree(kernels.host_tree_builder()([root, narrow]), SuperTree.from_levels([root, narrow]))


@pytest.mark.parametrize("seed", range(6))
def test_the_selected_tree_is_the_cores(host_backend, seed):
    """`kernels.host_tree_selector` against `SuperTree.select` on drafted trees and random ancestor-closed masks
    (each node kept with its parent at random; none, all), with and without the greedy flags computed; masks that
    drop a root or orphan a node are refused with the core's words; trees or masks the drafting loop never makes
    (other dtypes, another mask shape) go to the core."""
    from echo_trtllm.core.tree import SuperTree

    select = kernels.host_tree_selector()
    gen = torch.Generator().manual_seed(seed)
    table = markov_draft_fn(40, seed=seed).table
    batch_size = 1 + seed % 4 * 3
    roots = torch.randint(0, 40, (batch_size,), generator=gen)
    policy = make_policy(ECHO_CASES[seed % 3], COST)
    tree = draft_tree_batched(policy, roots, MarkovLevels(table, roots, policy.max_children), batch_size + 40,
                              context=80.0, sync_every_level=True).candidates
    for trial in range(8):
        keep = torch.rand(tree.total_nodes, generator=gen) < (0.1 + 0.12 * trial)
        mask = torch.zeros(tree.total_nodes, dtype=torch.bool)
        for i, p in enumerate(tree.global_parents.tolist()):  # parents precede children
            mask[i] = p < 0 or (bool(mask[p]) and bool(keep[i]))
        if trial == 7:
            mask[:] = True
        fresh = SuperTree(**{f: getattr(tree, f) for f in ("token_ids", "parents", "depths", "draft_probs",
                                                            "path_probs", "ranks", "cu_num_nodes", "source_index")})
        for t in (tree, fresh):  # fresh: no greedy flags computed yet (the selection computes them on demand)
            had = "on_greedy_path" in t.__dict__
            got, want = select(t, mask), t.select(mask)
            assert ("on_greedy_path" in got.__dict__) == had
            _same_tree(got, want)
    deep = (tree.depths >= 2).nonzero()[:, 0]  # nodes whose parent is no root (seed 0 drafts some)
    assert deep.numel() > 0 or seed != 0
    for child in deep[:1].tolist():
        orphan = torch.ones(tree.total_nodes, dtype=torch.bool)
        orphan[int(tree.global_parents[child])] = False
        with pytest.raises(kernels.PluginError, match=f"not ancestor-closed: node {child} lacks its parent"):
            select(tree, orphan)
        with pytest.raises(ValueError, match=f"not ancestor-closed: node {child} lacks its parent"):
            tree.select(orphan)
    rootless = torch.ones(tree.total_nodes, dtype=torch.bool)
    rootless[0] = False
    with pytest.raises(kernels.PluginError, match="selection must keep every request's root"):
        select(tree, rootless)
    with pytest.raises(ValueError, match="mask must be bool"):
        select(tree, torch.ones(tree.total_nodes + 1, dtype=torch.bool))
    both = rootless.clone()  # a root dropped and a node orphaned: the root is named first, as the core names it
    if deep.numel():
        both[int(tree.global_parents[int(deep[0])])] = False
    with pytest.raises(kernels.PluginError, match="selection must keep every request's root"):
        select(tree, both)
    with pytest.raises(ValueError, match="selection must keep every request's root"):
        tree.select(both)
    narrow = SuperTree(**{**{f: getattr(tree, f) for f in ("token_ids", "parents", "depths", "draft_probs", "ranks",
                                                            "cu_num_nodes", "source_index")},
                          "path_probs": tree.path_probs.double()})
    _same_tree(select(narrow, torch.ones(tree.total_nodes, dtype=torch.bool)),
               narrow.select(torch.ones(tree.total_nodes, dtype=torch.bool)))
    # levels of int32 requests (the core builds their tree, its derived request ids int32): the core selects
    levels = [dataclasses.replace(lv, request_ids=lv.request_ids.int()) for lv in _levels_of(tree)]
    core_built = SuperTree.from_levels(levels)
    assert core_built.request_ids.dtype == torch.int32
    keep_all = torch.ones(core_built.total_nodes, dtype=torch.bool)
    _same_tree(select(core_built, keep_all), core_built.select(keep_all))
    none, nothing = torch.zeros(0, dtype=torch.long), torch.zeros(0)
    empty = SuperTree(token_ids=none, parents=none, depths=none, draft_probs=nothing, path_probs=nothing, ranks=none,
                      cu_num_nodes=torch.zeros(1, dtype=torch.long), source_index=none)
    _same_tree(select(empty, torch.zeros(0, dtype=torch.bool)), empty.select(torch.zeros(0, dtype=torch.bool)))


def _levels_of(tree):
    """A one-request-per-root tree's drafted levels again (depth by depth, request-major within a level)."""
    from echo_trtllm.core.tree import DraftLevel

    levels, index = [], {}
    for d in range(int(tree.depths.max()) + 1):
        nodes = (tree.depths == d).nonzero()[:, 0]
        gp = tree.global_parents[nodes]
        parent_ids = torch.tensor([index[int(p)] if p >= 0 else -1 for p in gp.tolist()], dtype=torch.long)
        index = {int(n): i for i, n in enumerate(nodes.tolist())}
        levels.append(DraftLevel(depth=d, request_ids=tree.request_ids[nodes], parent_ids=parent_ids,
                                 token_ids=tree.token_ids[nodes], ranks=tree.ranks[nodes],
                                 draft_probs=tree.draft_probs[nodes], path_probs=tree.path_probs[nodes]))
    return levels


class _Spy:
    """Counts, on the NumPy oracle, the steps whose update projected the mean (a coefficient went below zero) and
    whose drift hit a coefficient's variance cap: the paths the comparison must cover."""

    def __init__(self):
        self.projected = self.capped = 0

    def wrap(self, kf):
        project, advance = kf._project, kf.advance

        def spy_project():
            self.projected += bool((kf.theta < 0).any())
            project()

        def spy_advance():
            before = kf.steps
            advance()
            self.capped += kf.steps % 4 == 0 and kf.steps != before and bool(
                np.isclose(kf._diagonal, kf._cap, rtol=1e-12).any())
        kf._project, kf.advance = spy_project, spy_advance
        return kf


def _twin_filters(seed, n, drift_common):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(n, n))
    mean, cov = rng.uniform(0.0, 1.0, n), a @ a.T * 0.1 + np.eye(n) * 0.01
    return [KalmanLinear(mean, cov, drift_common=drift_common, drift_each=0.05, channels=2) for _ in range(2)], rng


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("drift_common", [0.02, 0.6])
def test_a_price_filters_step_is_the_numpy_ones(host_backend, seed, drift_common):
    """`kernels.host_kalman_stepper` against `KalmanLinear.advance` + `update` (the oracle) over 300 measurements on
    two channels, some far cheaper than predicted (the projection onto costs >= 0 runs) and, with a large drift, the
    variance cap binding: the same predictions, means, covariances, noise scales and counts, to rounding (the
    library sums the products in its own order, NumPy in BLAS's)."""
    spy = _Spy()
    (oracle, host), rng = _twin_filters(seed, 9, drift_common)
    spy.wrap(oracle)
    host.stepper = kernels.host_kalman_stepper()
    assert host.stepper is not None
    for _ in range(300):
        phi = rng.uniform(0.0, 2.0, 9) * (rng.uniform(size=9) < 0.6)
        y = max(float(phi @ rng.uniform(-0.5, 1.5, 9)) * rng.uniform(0.1, 3.0), 0.0)
        channel = int(rng.integers(0, 2))
        want, got = oracle.step(phi, y, channel), host.step(phi, y, channel)
        assert got == pytest.approx(want, rel=1e-10, abs=1e-15)
        assert host.last_noise_var == pytest.approx(oracle.last_noise_var, rel=1e-10, abs=1e-18)
    np.testing.assert_allclose(host.theta, oracle.theta, rtol=1e-9, atol=1e-12 * np.abs(oracle.theta).max())
    np.testing.assert_allclose(host.cov, oracle.cov, rtol=1e-9, atol=1e-12 * np.abs(oracle.cov).max())
    np.testing.assert_allclose(host.noise, oracle.noise, rtol=1e-10)
    assert (host.steps, host.updates) == (oracle.steps, oracle.updates) == (300, 300)
    assert (host.theta >= 0).all() and np.array_equal(host.theta == 0, oracle.theta == 0)
    assert spy.projected > 10
    assert (spy.capped > 0) == (drift_common > 0.1)


def test_the_step_prices_learn_on_the_host_as_in_numpy(host_backend):
    """A whole-step model with the stepper installed (`install_host(policy, step_cost)`, as the runtime does)
    learns what the NumPy one learns: test_prices' case where a plain step far cheaper than its price drives a
    coefficient to its bound, then a mixed run of shapes."""
    def model():
        return StepCostModel.from_cost_model(CostModel((1, 4096), (1.9015, 1.9 + 0.0015 * 4096), (1, 4096),
                                                       (0.201, 0.2 + 0.001 * 4096)))
    oracle, host = model(), model()
    kernels.install_host(make_policy(EchoConfig(policy="echo")), host)
    assert host.drafting.stepper is not None and host.verification.stepper is not None
    shapes = [StepSample(64, 320, 400.0, (128, 64, 64, 64), 1.48, 2.22), StepSample(64, 64, 400.0, (), 0.002, 0.59),
              StepSample(16, 40, 300.0, (16, 12, 8), 0.02, 0.12, 16), StepSample(1, 5, 90.0, (1, 3, 3), 0.01, 0.05)]
    for i in range(60):
        s = shapes[0] if i < 12 else shapes[i % 4]
        want, got = oracle.observe(s), host.observe(s)
        assert got.seconds == pytest.approx(want.seconds, rel=1e-9)
        for p in shapes:
            assert host.predict_sample(p) == pytest.approx(oracle.predict_sample(p), rel=1e-9)
    assert (oracle.theta_verification == 0).any()  # the bound was reached
    assert np.array_equal(host.theta_verification == 0, oracle.theta_verification == 0)


def test_a_measurement_with_no_variance_is_refused_on_both_paths(host_backend):
    """No prior uncertainty and no noise: the gain is undefined; NumPy and the library refuse it alike."""
    for stepper in (None, kernels.host_kalman_stepper()):
        kf = KalmanLinear(np.ones(3), np.zeros((3, 3)), noise=0.0, noise_floor=0.0)
        kf.stepper = stepper
        with pytest.raises((ValueError, kernels.PluginError), match="innovation's variance must be > 0"):
            kf.step(np.ones(3), 2.0)


def test_bad_price_filter_inputs_are_refused_before_anything_moves(host_backend):
    (kf, _), _ = _twin_filters(0, 4, 0.02)
    kf.stepper = kernels.host_kalman_stepper()
    theta, cov = kf.theta.copy(), kf.cov.copy()
    with pytest.raises(ValueError, match="finite"):
        kf.step(np.ones(4), float("nan"))
    with pytest.raises(ValueError, match=r"kalman_step: phi must be \(4,\)"):
        kf.step(np.ones(5), 1.0)
    with pytest.raises(IndexError):
        kf.step(np.ones(4), 1.0, channel=2)  # two channels
    assert np.array_equal(kf.theta, theta) and np.array_equal(kf.cov, cov) and kf.steps == kf.updates == 0
    lib = kernels.load_library("host")
    out = (ctypes_double * 2)()
    assert lib.echo_kalman_step_host(0, None, None, None, ctypes_double(1.0), None, None, ctypes_double(0.0),
                                     ctypes_double(0.0), 0, ctypes_double(1.0), None, ctypes_double(0.0),
                                     ctypes_double(0.0), ctypes_double(1e-6), out) != 0
    assert b"n must be >= 1" in lib.echo_last_error()


# every verified token as dear as a whole step: the budget rule verifies the roots alone
DEAR = CostModel((1, 8, 16, 32, 64, 128), (0.01, 0.08, 0.16, 0.32, 0.64, 1.28), (1, 8, 64), (0.001, 0.0012, 0.003))


@pytest.mark.parametrize("path", ["torch", "host"])
@pytest.mark.parametrize("batch_size", [1, 6])
def test_a_probes_floor_verifies_the_allocations_first_drafts_where_the_rule_takes_none(host_backend, path,
                                                                                         batch_size):
    """A speculative probe's floor (`Decision.min_tokens`: 2B) on prices under which the rule takes no drafted
    token: the step verifies the roots and the allocation's first B drafted nodes (`allocate_budget` on the same
    candidates and spines, the oracle), on the torch path and where the host library selects; without the floor,
    the roots alone. A floor beyond what was drafted and allowed keeps what the allocation holds."""
    config = EchoConfig(policy="echo", beam_width=2, top_k=3, max_depth=4, k_max=64)
    table = markov_draft_fn(30, seed=batch_size).table
    roots = torch.arange(batch_size) % 30
    for floor, budget in ((0, batch_size + 64), (2 * batch_size, batch_size + 64), (10 ** 6, batch_size + 5)):
        policy = make_policy(config, DEAR)
        if path == "host":
            kernels.install_host(policy)
            assert policy.selector is not None
            counting = Counting(policy.selector)  # the library must be the one that selects, floor included
            counting.allocator = getattr(policy.selector, "allocator", None)
            policy.selector = counting
        got = draft_tree_batched(policy, roots, MarkovLevels(table, roots, policy.max_children), budget,
                                 context=50.0, sync_every_level=True, min_tokens=floor)
        if path == "host":
            assert counting.calls == 1, floor
        alloc = allocate_budget(got.candidates, got.state.spine_depth, budget, config.max_nodes_per_request)
        want = alloc.truncated(min(max(floor, batch_size), alloc.total), got.candidates.request_ids).selected
        assert torch.equal(got.mask, want), (floor, budget)
        assert got.selected.total_nodes == min(max(floor, batch_size), alloc.total) <= budget
        assert (got.selected.total_nodes > batch_size) == (floor > 0)  # the rule alone: the roots


@pytest.mark.parametrize("path", ["torch", "host"])
def test_a_probes_floor_leaves_a_step_where_the_rule_takes_drafted_tokens(host_backend, path):
    """On prices where the rule verifies some drafted tokens, the floor changes nothing: the same selection with and
    without it, step after step (the policies learning the same outcomes), on the torch path and the host
    library's."""
    config = EchoConfig(policy="echo", beam_width=2, top_k=3, max_depth=4, k_max=64)
    batch_size = 6
    table = markov_draft_fn(30, seed=3).table
    plain, floored = make_policy(config, COST), make_policy(config, COST)
    if path == "host":
        kernels.install_host(plain)
        kernels.install_host(floored)
    gen = torch.Generator().manual_seed(3)
    took = 0
    for step in range(8):
        roots = torch.randint(0, 30, (batch_size,), generator=gen)
        want = draft_tree_batched(plain, roots, MarkovLevels(table, roots, plain.max_children), batch_size + 64,
                                  context=50.0, sync_every_level=True)
        got = draft_tree_batched(floored, roots, MarkovLevels(table, roots, floored.max_children), batch_size + 64,
                                 context=50.0, sync_every_level=True, min_tokens=2 * batch_size)
        if want.selected.total_nodes > batch_size:
            took += 1
            same_result(got, want)
        _learn((plain, floored), want, gen)
    assert took >= 4  # the case needs steps where the rule took drafted tokens


def test_the_row_copier_is_index_copy_and_refuses_bad_rows_by_name(host_backend):
    """`kernels.host_row_copier` against `index_copy_` of the gathered rows (bfloat16 rows of a strided view too),
    and out-of-range rows, mismatched tables and index dtypes refused by name before anything is copied."""
    copy = kernels.host_row_copier()
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        src = torch.randn(9, 12, generator=gen).to(dtype)[:, 2:10]  # rows 12 apart, 8 wide
        dst = torch.zeros(20, 8, dtype=dtype)
        want = dst.clone()
        d, s = torch.randperm(20, generator=gen)[:6], torch.randint(0, 9, (6,), generator=gen)
        copy(dst, d, src, s)
        want.index_copy_(0, d, src[s])
        assert torch.equal(dst, want)
        copy(dst, d, src[:6])  # src rows in order
        want.index_copy_(0, d[:6], src[:6])
        assert torch.equal(dst, want)
    before = dst.clone()
    with pytest.raises(kernels.PluginError, match=r"dst_index\[1\] = 20 is outside \[0, 20\)"):
        copy(dst, torch.tensor([0, 20]), src, torch.tensor([0, 1]))
    with pytest.raises(kernels.PluginError, match=r"src_index\[0\] = -1 is outside \[0, 9\)"):
        copy(dst, torch.tensor([0, 1]), src, torch.tensor([-1, 1]))
    assert torch.equal(dst, before)
    with pytest.raises(ValueError, match="one dtype and width"):
        copy(dst.float(), torch.tensor([0]), src, torch.tensor([0]))
    with pytest.raises(ValueError, match="CPU int64"):
        copy(dst, torch.tensor([0], dtype=torch.int32), src, torch.tensor([0]))
    with pytest.raises(ValueError, match="2 destination rows for 1 source rows"):
        copy(dst, torch.tensor([0, 1]), src, torch.tensor([0]))
