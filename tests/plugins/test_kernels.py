"""The plugin's kernels against the core: gate decisions, budget allocations (selection, phases, per-request
counts, taken order) and packed masks must be equal exactly on random batches (B up to 257, trees across the
32-bit word boundaries of the mask). Backend "host" is the plugin source compiled for the CPU (runs in CI);
backend "cuda" is the CUDA library on a GPU (runs where one exists, e.g. scripts/gpu_check.sh)."""

import os

import pytest
import torch

from echo_trtllm import kernels
from echo_trtllm.core import EchoConfig, draft_tree, make_policy
from echo_trtllm.core.budget import allocate_budget
from echo_trtllm.core.pack import pack
from echo_trtllm.core.tree import SuperTree
from tests.helpers import markov_draft_fn, random_parents


def random_tree(batch_size: int, max_nodes: int, gen: torch.Generator) -> SuperTree:
    """Random request trees with random (monotone along paths) path probabilities and some exact ties."""
    parents = [random_parents(int(torch.randint(1, max_nodes + 1, (1,), generator=gen)), gen)
               for _ in range(batch_size)]
    tree = SuperTree.from_parents(parents)
    factors = torch.rand(tree.total_nodes, generator=gen)
    factors[torch.rand(tree.total_nodes, generator=gen) < 0.2] = 0.5  # ties
    gp = tree.global_parents
    probs = torch.ones(tree.total_nodes)
    for i in range(tree.total_nodes):  # parents precede children
        if gp[i] >= 0:
            probs[i] = probs[gp[i]] * factors[i]
    tree.path_probs = probs
    return tree


def dev(backend: str):
    return torch.device("cuda" if backend == "cuda" else "cpu")


def drafted_tree(batch_size: int, seed: int):
    policy = make_policy(EchoConfig(k_max=4 * batch_size, max_depth=5, top_k=3, beam_width=3,
                                    max_nodes_per_request=24))
    roots = torch.randint(0, 32, (batch_size,), generator=torch.Generator().manual_seed(seed))
    return draft_tree(policy, roots, markov_draft_fn(32, seed), budget=4 * batch_size)


def assert_same_allocation(got, want, with_order=True):
    assert torch.equal(got.selected.cpu(), want.selected)
    assert torch.equal(got.phase.cpu(), want.phase)
    assert torch.equal(got.num_nodes.cpu(), want.num_nodes)
    if with_order:
        assert torch.equal(got.order.cpu(), want.order)
    else:  # the fused allocation: no taken order
        assert got.order.numel() == 0


def allocations_equal_core(tree, spine, budget, cap, backend):
    """Both plugin paths against the core: the multi-pass allocation (with the taken order) and the fused one
    (without; N <= 16384)."""
    want = allocate_budget(tree, spine, budget, cap)
    for with_order in (True, False) if tree.total_nodes <= 16384 else (True,):
        got = kernels.allocate_budget(tree.to(dev(backend)), spine, budget, cap, backend=backend, with_order=with_order)
        assert_same_allocation(got, want, with_order)


@pytest.mark.parametrize("batch_size", [1, 3, 16, 64, 257])
@pytest.mark.parametrize("seed", [0, 1])
def test_gate_equals_core(backend, batch_size, seed):
    gen = torch.Generator().manual_seed(seed)
    m = 3 * batch_size
    probs = torch.rand(m, generator=gen)
    probs[::5] = 0.25  # exact ties with tau below
    req = torch.sort(torch.randint(0, batch_size, (m,), generator=gen)).values
    active = torch.rand(batch_size, generator=gen) < 0.7
    for tau in (0.0, 0.25, 0.6):
        d = dev(backend)
        got = kernels.gate(probs.to(d), req.to(d), batch_size, active.to(d), tau, backend=backend)
        want = kernels.gate(probs, req, batch_size, active, tau, backend="torch")
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.parametrize("batch_size, max_nodes", [(1, 31), (1, 33), (4, 32), (7, 65), (64, 40), (257, 12)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_allocation_equals_core_on_random_trees(backend, batch_size, max_nodes, seed):
    gen = torch.Generator().manual_seed(1000 * seed + batch_size)
    tree = random_tree(batch_size, max_nodes, gen)
    max_depth = int(tree.depths.max())
    spine = torch.randint(0, max_depth + 2, (batch_size,), generator=gen)  # includes depths with no node
    total = tree.total_nodes
    for budget in (batch_size, batch_size + 1, (batch_size + total) // 2, total + 5):
        for cap in (None, 1, 3, max_nodes):
            allocations_equal_core(tree, spine, budget, cap, backend)


@pytest.mark.parametrize("seed", [0, 1])
def test_allocation_equals_core_on_20k_nodes_with_signed_zeros(backend, seed):
    """N ~ 20k (past CUB's single-pass sort sizes on the device), probabilities with exact zeros of both signs
    (a path through an underflowed draft probability): the same selection and order as the core."""
    gen = torch.Generator().manual_seed(seed)
    tree = random_tree(256, 160, gen)
    assert tree.total_nodes > 15_000
    zero = (torch.rand(tree.total_nodes, generator=gen) < 0.05).tolist()
    sign = (torch.rand(tree.total_nodes, generator=gen) < 0.5).tolist()
    probs, gp = tree.path_probs.tolist(), tree.global_parents.tolist()
    for i in range(tree.total_nodes):  # a zero's descendants are zeros too (parents precede children)
        if gp[i] >= 0 and (zero[i] or probs[gp[i]] == 0.0):
            probs[i] = -0.0 if sign[i] else 0.0
    tree.path_probs = torch.tensor(probs)
    assert bool((tree.path_probs == 0).any()) and bool(torch.signbit(tree.path_probs).any())
    spine = torch.randint(0, 4, (256,), generator=gen)
    for budget, cap in ((256 + tree.total_nodes // 3, None), (2048, 16)):
        want = allocate_budget(tree, spine, budget, cap)
        got = kernels.allocate_budget(tree.to(dev(backend)), spine, budget, cap, backend=backend)
        assert_same_allocation(got, want)
        if backend == "host":  # no order wanted past the fused path's 16384 nodes: the multi-pass path runs
            got = kernels.allocate_budget(tree, spine, budget, cap, backend=backend, with_order=False)
            assert_same_allocation(got, want, with_order=False)


@pytest.mark.parametrize("batch_size, max_nodes", [(256, 120), (1, 6000), (3, 5000)])
def test_fused_allocation_at_its_size_limits(backend, batch_size, max_nodes):
    """The fused allocation near its 16384-node limit and with requests too large for a shared-memory sort (the
    CUDA kernel then sorts in global memory): equal to the core."""
    gen = torch.Generator().manual_seed(max_nodes)
    tree = random_tree(batch_size, max_nodes, gen)
    while tree.total_nodes > 16384:
        tree = random_tree(batch_size, max_nodes, gen)
    spine = torch.randint(0, 6, (batch_size,), generator=gen)
    for budget, cap in ((batch_size + tree.total_nodes // 3, None), (batch_size + 2048, 16), (batch_size + 7, 3)):
        allocations_equal_core(tree, spine, budget, cap, backend)


def test_gate_orders_signed_zeros_as_the_core(backend):
    probs = torch.tensor([-0.0, 0.0, 0.0, -0.0, 0.3])
    req = torch.tensor([0, 0, 1, 1, 2])
    active = torch.ones(3, dtype=torch.bool)
    d = dev(backend)
    got = kernels.gate(probs.to(d), req.to(d), 3, active.to(d), 0.0, backend=backend)
    want = kernels.gate(probs, req, 3, active, 0.0, backend="torch")
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.parametrize("batch_size", [1, 5, 64, 257])
def test_allocation_equals_core_on_drafted_trees(backend, batch_size):
    drafted = drafted_tree(batch_size, seed=batch_size)
    tree, state = drafted.candidates, drafted.state
    for budget in (batch_size, 2 * batch_size, 4 * batch_size, tree.total_nodes):
        allocations_equal_core(tree, state.spine_depth, budget, 24, backend)


def assert_same_pack(got, want):
    for field in ("input_ids", "position_ids", "parents", "node_depths", "cu_num_nodes", "generation_lengths",
                  "position_offsets", "packed_mask"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.shape == b.shape and torch.equal(a.cpu().long(), b.long()), field


@pytest.mark.parametrize("batch_size, max_nodes", [(1, 31), (1, 32), (1, 33), (3, 64), (2, 65), (9, 100),
                                                   (257, 8)])
@pytest.mark.parametrize("seed", [0, 1])
def test_pack_equals_core(backend, batch_size, max_nodes, seed):
    gen = torch.Generator().manual_seed(seed * 7 + max_nodes)
    tree = random_tree(batch_size, max_nodes, gen)
    ctx = torch.randint(0, 500, (batch_size,), generator=gen)
    d = dev(backend)
    assert_same_pack(kernels.pack(tree.to(d), ctx.to(d), backend=backend), pack(tree, ctx))
    assert_same_pack(kernels.pack(tree.to(d), backend=backend), pack(tree))
    # a selection: the allocator's (ancestor-closed by construction)
    alloc = allocate_budget(tree, torch.ones(batch_size, dtype=torch.long), batch_size + tree.total_nodes // 3)
    assert_same_pack(kernels.pack(tree.to(d), ctx.to(d), selected=alloc.selected.to(d), backend=backend),
                     pack(tree.select(alloc.selected), ctx))


def test_design_example_is_bit_exact(backend):
    tree = SuperTree.from_parents([torch.tensor([-1, 0, 0, 1])]).to(dev(backend))
    out = kernels.pack(tree, backend=backend)
    assert out.packed_mask.tolist() == [[1], [3], [5], [11]]
    assert out.position_offsets.tolist() == [[0, 1, 1, 2]] and out.generation_lengths.tolist() == [4]


def test_bad_inputs_get_clear_errors(host_backend):
    tree = SuperTree.from_parents([torch.tensor([-1, 0]), torch.tensor([-1])])
    with pytest.raises(ValueError, match="below the batch size"):
        kernels.allocate_budget(tree, torch.zeros(2, dtype=torch.long), 1, backend=host_backend)
    bad = SuperTree.from_parents([torch.tensor([-1, 0, 1])])
    bad.path_probs = torch.tensor([1.0, 1.5, 0.2])
    with pytest.raises(kernels.PluginError, match=r"path_probs\[1\] = 1.5 is not a probability"):
        kernels.allocate_budget(bad, torch.zeros(1, dtype=torch.long), 3, backend=host_backend)
    with pytest.raises(kernels.PluginError, match="not ancestor-closed"):
        kernels.pack(bad, selected=torch.tensor([True, False, True]), backend=host_backend)
    with pytest.raises(kernels.PluginError, match=r"outside \[0, 2\)"):
        kernels.gate(torch.tensor([0.5]), torch.tensor([2]), 2, torch.tensor([True, True]), 0.1, backend=host_backend)
    with pytest.raises(kernels.PluginError, match=r"tau must be in \[0, 1\]"):
        kernels.gate(torch.tensor([0.5]), torch.tensor([0]), 1, torch.tensor([True]), 1.5, backend=host_backend)
    with pytest.raises(ValueError, match="backend 'cuda' needs CUDA tensors"):
        kernels.pack(tree, backend="cuda")


def test_backend_choice_without_a_gpu(host_backend):
    assert kernels.backend_for("cpu") == "host"  # the host library is built (the fixture)
    env = os.environ.pop("ECHO_PLUGIN_HOST_LIB")
    try:
        kernels.load_library.cache_clear()
        missing = kernels.BUILD_DIR / "libecho_host.so"
        assert kernels.backend_for("cpu") == ("host" if missing.is_file() else "torch")
    finally:
        os.environ["ECHO_PLUGIN_HOST_LIB"] = env
        kernels.load_library.cache_clear()
