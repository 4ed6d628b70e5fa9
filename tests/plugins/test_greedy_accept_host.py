"""Greedy verification's acceptance on the plugin's host library (`kernels.host_greedy_acceptor`, which the runtime
passes to `verify_paths` where the target runs on the CPU) against the torch oracle `core.verify._accept_predicted`
on drafted trees packed as the runtime packs them, with the target's choices drawn to accept paths of every length
(ties between siblings included); malformed batches refused by name; the runtime takes the host path."""

import dataclasses

import pytest
import torch

from echo_trtllm import kernels
from echo_trtllm.core import make_policy
from echo_trtllm.core.policies import draft_tree_batched
from echo_trtllm.core.verify import _accept_predicted, verify_paths
from tests.core.test_batched_drafting import COST, MarkovLevels
from tests.helpers import markov_draft_fn
from tests.plugins.test_echo_host import ECHO_CASES


def _packed(seed: int, batch_size: int, backend: str):
    gen = torch.Generator().manual_seed(seed)
    table = markov_draft_fn(40, seed=seed).table
    roots = torch.randint(0, 40, (batch_size,), generator=gen)
    policy = make_policy(ECHO_CASES[seed % 3], COST)
    result = draft_tree_batched(policy, roots, MarkovLevels(table, roots, policy.max_children), batch_size + 40,
                                context=80.0, sync_every_level=True)
    ctx = torch.randint(5, 90, (batch_size,), generator=gen)
    return kernels.pack(result.selected, ctx, backend=backend), gen


def _choices(batch, gen, p_child: float) -> torch.Tensor:
    """The target's top-1 after each node: with probability p_child one of its children's tokens (that child is
    accepted), else a token no child has."""
    pred = torch.full((batch.total_nodes,), 1000, dtype=torch.long)
    gp = batch.global_parents.tolist()
    children: dict[int, list[int]] = {}
    for i, p in enumerate(gp):
        if p >= 0:
            children.setdefault(p, []).append(i)
    for node, kids in children.items():
        if float(torch.rand(1, generator=gen)) < p_child:
            pick = kids[int(torch.randint(0, len(kids), (1,), generator=gen))]
            pred[node] = batch.input_ids[pick]
    return pred


def _same(got, want):
    for name in ("nodes", "tokens", "counts"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("batch_size", [1, 4, 16])
def test_the_accepted_paths_are_the_oracles(host_backend, seed, batch_size):
    accept = kernels.host_greedy_acceptor()
    assert accept is not None
    for backend in ("torch", "host"):  # the core's packing and the host library's (the runtime's)
        batch, gen = _packed(seed, batch_size, backend)
        deepest = int(batch.node_depths.max())
        for p_child in (0.0, 0.5, 0.9, 1.0):
            pred = _choices(batch, gen, p_child)
            for max_depth in (None, deepest, deepest + 2):
                _same(accept(batch, pred, max_depth), _accept_predicted(batch, pred, max_depth))
        if p_child == 1.0 and deepest > 0:  # every node's choice is a child's: some request accepts a draft
            assert int(_accept_predicted(batch, pred, None).counts.max()) > 1


def test_siblings_with_the_same_token_accept_the_lowest_index(host_backend):
    """Two children of the root carry the target's choice and both have an accepted child: the deepest path wins,
    and at equal depth the lower index (the oracle's rule)."""
    from echo_trtllm.core.tree import SuperTree

    # one request: root 0 -> 1 (tok 7), 2 (tok 7); 1 -> 3 (tok 8); 2 -> 4 (tok 8)
    tree = SuperTree.from_parents([torch.tensor([-1, 0, 0, 1, 2])], [torch.tensor([3, 7, 7, 8, 8])])
    batch = kernels.pack(tree, torch.tensor([10]), backend="torch")
    pred = torch.tensor([7, 8, 8, 9, 9])
    got = kernels.host_greedy_acceptor()(batch, pred, None)
    _same(got, _accept_predicted(batch, pred, None))
    assert got.nodes.tolist() == [[0, 1, 3]] and got.tokens.tolist() == [[7, 8, 9]] and got.counts.tolist() == [3]


@pytest.mark.parametrize("change, message", [
    ("empty request", "request 0 has no nodes"),
    ("cu past the end", "request 0 has no nodes or runs past num_nodes"),
    ("short parents", "parents must be"),
    ("child first", "parent 2 must come before it"),
    ("depth", "depth 2 must be its parent's \\+ 1"),
    ("too deep", "below width 1"),
    ("pred", "pred must be one CPU entry per node"),
])
def test_malformed_batches_are_refused_by_name(host_backend, change, message):
    batch, gen = _packed(0, 2, "torch")
    pred = torch.zeros(batch.total_nodes, dtype=torch.long)
    max_depth = int(batch.node_depths.max())
    parents, depths, cu = batch.parents.clone(), batch.node_depths.clone(), batch.cu_num_nodes.clone()
    if change == "empty request":
        cu = torch.tensor([0, 0, int(cu[-1])], dtype=cu.dtype)
        batch = dataclasses.replace(batch, generation_lengths=torch.zeros(2, dtype=torch.int32))
    elif change == "cu past the end":  # request 0 claims more nodes than there are: refused before any is read
        cu = torch.tensor([0, int(cu[-1]) + 3, int(cu[-1])], dtype=cu.dtype)
    elif change == "short parents":
        parents = parents[:-1]
    elif change == "child first":
        parents[1] = 2
    elif change == "depth":
        depths[1] = 2
    elif change == "too deep":
        max_depth = 0
        depths[1], parents[1] = 1, 0
    else:
        pred = pred[:-1]
    bad = dataclasses.replace(batch, parents=parents, node_depths=depths, cu_num_nodes=cu)
    with pytest.raises((kernels.PluginError, ValueError), match=message):
        kernels.host_greedy_acceptor()(bad, pred, max_depth)


def test_verification_takes_the_acceptor_it_is_given(host_backend):
    batch, gen = _packed(3, 4, "host")
    logits = torch.randn(batch.total_nodes, 64, generator=gen)
    calls = []

    def counting(*args):
        calls.append(1)
        return kernels.host_greedy_acceptor()(*args)

    got = verify_paths(batch, logits, max_depth=int(batch.node_depths.max()), acceptor=counting)
    _same(got, verify_paths(batch, logits, max_depth=int(batch.node_depths.max())))
    assert calls == [1]


def test_the_runtime_accepts_on_the_host_as_the_oracle_does(host_backend, prompts):
    """Two executors on the embedded pair, one accepting with the host library (what it installs on the CPU), one
    with the torch oracle: the same tokens step after step, drafts accepted, the host path taken."""
    from echo_trtllm.core import EchoConfig
    from echo_trtllm.models import DEFAULT_EAGLE3, DEFAULT_TARGET
    from echo_trtllm.models.eagle3 import load_eagle3
    from echo_trtllm.models.loader import load_model
    from echo_trtllm.runtime.executor import Executor
    from echo_trtllm.runtime.request import SamplingParams

    target, tok = load_model(DEFAULT_TARGET, dtype="float32")
    head = load_eagle3(DEFAULT_EAGLE3, target)
    config = EchoConfig(policy="echo", k_max=48, beam_width=3, top_k=3, max_depth=5)
    runs = [Executor(target, head, tok, config, max_batch_size=4, max_seq_len=256) for _ in range(2)]
    host, oracle = runs
    assert host._acceptor is not None
    calls = []
    real = host._acceptor
    host._acceptor = lambda *a: (calls.append(1), real(*a))[1]
    oracle._acceptor = None
    requests = [[], []]
    for ex, mine in zip(runs, requests):
        for i, p in enumerate(prompts[:6]):
            mine.append(ex.make_request(p, SamplingParams(max_tokens=10 + 3 * i, temperature=0, ignore_eos=True)))
            ex.submit(mine[-1])
    accepted = 0
    while host.has_work or oracle.has_work:
        a, b = host.step(), oracle.step()
        assert not host.failures and not oracle.failures, host.last_error or oracle.last_error
        assert a.request_ids == b.request_ids and a.emitted == b.emitted
        if a.result is not None:
            assert torch.equal(a.result.accepted_token_ids, b.result.accepted_token_ids)
            assert torch.equal(a.result.accepted_node_ids, b.result.accepted_node_ids)
            accepted += int(a.result.num_accepted_drafts.sum())
    assert calls and accepted > 0
    assert [r.output_token_ids for r in requests[0]] == [r.output_token_ids for r in requests[1]]


def test_the_micro_benchmark_writes_its_rows(host_backend, tmp_path):
    """scripts/accept_micro.py runs and writes one row per shape (its timings are the machine's: not checked)."""
    import json
    from pathlib import Path

    from tests.helpers import load_script

    out = tmp_path / "accept.json"
    script = Path(__file__).resolve().parents[2] / "scripts" / "accept_micro.py"
    assert load_script(script).main(["--calls", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["requests"], r["nodes_each"]) for r in rows] == [(1, 6), (16, 2), (64, 1)]
    assert all(r["torch_us"] > 0 and r["host_us"] > 0 for r in rows)
