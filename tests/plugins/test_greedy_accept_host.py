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
    assert host._acceptor is not None and host._logits_reader is not None
    calls, reads = [], []
    real, reader = host._acceptor, host._logits_reader
    host._acceptor = lambda *a: (calls.append(1), real(*a))[1]
    host._logits_reader = lambda *a: (reads.append(a[0].total_nodes > a[0].batch_size), reader(*a))[1]
    oracle._acceptor = oracle._logits_reader = None
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
    assert any(reads) and accepted > 0  # the reader took the steps that verify drafts
    assert [r.output_token_ids for r in requests[0]] == [r.output_token_ids for r in requests[1]]


def _planted(batch, pred: torch.Tensor, vocab: int, gen, dtype) -> torch.Tensor:
    """Logits whose top-1 in row i is pred[i] (each row's maximum raised above the rest)."""
    logits = torch.randn(batch.total_nodes, vocab, generator=gen)
    logits[torch.arange(batch.total_nodes), pred % vocab] = logits.max() + 1.0 + torch.rand(batch.total_nodes,
                                                                                             generator=gen)
    return logits.to(dtype)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("batch_size", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_logits_reader_accepts_as_the_oracle_reading_only_the_rows_it_needs(host_backend, seed, batch_size,
                                                                                  dtype):
    """`host_greedy_logits_acceptor` against `_accept_predicted` over the argmax of every row (`verify_paths`
    without a reader), on logits whose top-1 accepts paths of every length; the rows it read are exactly the
    accepted paths' nodes (each path's last node gives the bonus), and each read row's top-1 is torch.argmax's."""
    read = kernels.host_greedy_logits_acceptor()
    assert read is not None
    batch, gen = _packed(seed, batch_size, "host")
    deepest = int(batch.node_depths.max())
    for p_child in (0.0, 0.5, 1.0):
        logits = _planted(batch, _choices(batch, gen, p_child), 1000 + 7 * seed, gen, dtype)
        want = verify_paths(batch, logits, max_depth=deepest)
        pred = torch.empty(batch.total_nodes, dtype=torch.long)
        _same(read(batch, logits, deepest, pred), want)
        on_path = set(want.nodes[want.nodes >= 0].tolist())
        full = logits.argmax(-1)  # every row's top-1: which nodes lie on an accepted path (ok), as the oracle walks
        gp, ids = batch.global_parents.tolist(), batch.input_ids.tolist()
        ok = []
        for j, p in enumerate(gp):
            ok.append(p < 0 or (ok[p] and ids[j] == int(full[p])))
        rows_read = set(torch.nonzero(pred >= 0).flatten().tolist())
        assert on_path <= rows_read <= {j for j in range(len(ok)) if ok[j]}
        rows = sorted(rows_read)
        assert torch.equal(pred[rows], logits[rows].argmax(-1))
        _same(verify_paths(batch, logits, max_depth=deepest, reader=read), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_logits_readers_top1_is_torch_argmax_on_ties_nans_infinities_and_tails(host_backend, dtype):
    """One request whose root's row is each hard case in turn (a vocabulary of 1, 15, 16, 17, 1000 and 151,936
    entries: no full lane block, one, and a tail): ties (the first index), a NaN (its first), infinities, all -inf
    (index 0); the bonus token is torch.argmax of the row."""
    from echo_trtllm.core.tree import SuperTree

    read = kernels.host_greedy_logits_acceptor()
    batch = kernels.pack(SuperTree.from_parents([torch.tensor([-1])], [torch.tensor([3])]), torch.tensor([10]),
                         backend="torch")
    gen = torch.Generator().manual_seed(0)
    for vocab in (1, 15, 16, 17, 1000, 151_936):
        rows = [torch.randn(vocab, generator=gen), torch.zeros(vocab), torch.full((vocab,), -float("inf"))]
        tie = torch.randn(vocab, generator=gen)
        tie[vocab // 3] = tie[vocab - 1] = 50.0
        nan = torch.randn(vocab, generator=gen)
        nan[vocab // 2] = float("nan")
        nan[vocab - 1] = float("nan")
        inf = torch.randn(vocab, generator=gen)
        inf[vocab // 4] = float("inf")
        inf[0] = -float("inf")
        for row in (*rows, tie, nan, inf):
            x = row.to(dtype)[None]
            assert read(batch, x, 0).tokens.tolist() == [[int(x[0].argmax())]], (vocab, row[:4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_logits_readers_top1_is_torch_argmax_where_a_higher_lane_holds_the_earlier_index(host_backend, dtype):
    """The vectorised pass keeps a maximum per lane (index mod 16); on a tie between lanes the earliest index wins,
    not the lowest lane: index 18 (lane 2) against 33 (lane 1), and random rows of few distinct values (+-0, +-inf,
    1, 2, NaN: ties everywhere) over vocabularies of 1-70 entries, read from rows of a wider tensor (a row stride
    beyond the vocabulary), each against torch.argmax."""
    from echo_trtllm.core.tree import SuperTree

    read = kernels.host_greedy_logits_acceptor()
    roots = 3
    batch = kernels.pack(SuperTree.from_parents([torch.tensor([-1])] * roots, [torch.tensor([3])] * roots),
                         torch.full((roots,), 10), backend="torch")
    x = torch.zeros(roots, 64)
    x[0, 18] = x[0, 33] = 50.0
    x[1, 1] = x[1, 16] = x[1, 63] = 7.0  # lane 1 first, lane 0 later, lane 15 last
    x[2, 47] = x[2, 2] = float("nan")
    got = read(batch, x.to(dtype), 0).tokens[:, 0].tolist()
    assert got == [18, 1, 2] == x.to(dtype).argmax(-1).tolist()
    gen = torch.Generator().manual_seed(5)
    values = torch.tensor([0.0, -0.0, 1.0, 2.0, float("inf"), -float("inf"), float("nan")])
    for vocab in range(1, 71):
        for _ in range(4):
            wide = values[torch.randint(0, len(values) - (vocab % 3 == 0), (roots, vocab + 5), generator=gen)]
            rows = wide.to(dtype)[:, :vocab]  # stride vocab + 5
            assert read(batch, rows, 0).tokens[:, 0].tolist() == rows.argmax(-1).tolist(), (vocab, rows)


def test_the_logits_reader_leaves_what_it_cannot_read_to_the_argmax(host_backend):
    """float16 logits, a strided vocabulary and GPU-less fallbacks: None, so `verify_paths` takes every row's argmax
    and the acceptor; a malformed batch is refused by name before any row is read."""
    read = kernels.host_greedy_logits_acceptor()
    batch, gen = _packed(1, 4, "host")
    logits = torch.randn(batch.total_nodes, 64, generator=gen)
    assert read(batch, logits.half(), None) is None
    assert read(batch, torch.randn(64, batch.total_nodes).T, None) is None  # rows not contiguous in the vocabulary
    one = torch.randn(1, 64, generator=gen).expand(batch.total_nodes, 64)  # every row the same memory
    assert read(batch, one, None) is None
    _same(verify_paths(batch, one, reader=read), verify_paths(batch, one))
    _same(verify_paths(batch, logits.half(), reader=read), verify_paths(batch, logits.half()))
    bad = dataclasses.replace(batch, parents=torch.cat([batch.parents[:1], batch.parents[:1], batch.parents[2:]]))
    with pytest.raises(kernels.PluginError, match="a request's first node is its root"):
        read(bad, logits, None)
    with pytest.raises(ValueError, match="pred must be a contiguous int64"):
        read(batch, logits, None, torch.empty(3, dtype=torch.long))


def test_plain_steps_of_many_rows_take_every_rows_argmax(host_backend, prompts):
    """The runtime's rule (`executor.READER_PLAIN_ROWS`): a plain step of up to 32 rows is accepted by the logits
    reader, one of more rows by every row's argmax and the acceptor; both emit what AR emits."""
    from echo_trtllm.core import EchoConfig
    from echo_trtllm.models import DEFAULT_TARGET
    from echo_trtllm.models.loader import load_model
    from echo_trtllm.runtime.executor import READER_PLAIN_ROWS, Executor
    from echo_trtllm.runtime.request import SamplingParams

    target, tok = load_model(DEFAULT_TARGET, dtype="float32")
    outputs = {}
    for rows in (READER_PLAIN_ROWS, READER_PLAIN_ROWS + 1):
        ex = Executor(target, None, tok, EchoConfig(policy="ar"), max_batch_size=rows, max_seq_len=128)
        calls = {"reader": 0, "acceptor": 0}
        reader, acceptor = ex._logits_reader, ex._acceptor
        ex._logits_reader = lambda *a: (calls.__setitem__("reader", calls["reader"] + 1), reader(*a))[1]
        ex._acceptor = lambda *a: (calls.__setitem__("acceptor", calls["acceptor"] + 1), acceptor(*a))[1]
        reqs = [ex.make_request(prompts[i % len(prompts)], SamplingParams(max_tokens=3, temperature=0,
                                                                           ignore_eos=True)) for i in range(rows)]
        for r in reqs:
            ex.submit(r)
        while ex.has_work:
            ex.step()
        assert (calls["reader"] > 0, calls["acceptor"] > 0) == ((True, False) if rows <= READER_PLAIN_ROWS
                                                                 else (False, True)), (rows, calls)
        outputs[rows] = [r.output_token_ids for r in reqs]
    # the same prompts in both runs: the shared requests emit the same tokens either way
    assert outputs[READER_PLAIN_ROWS] == outputs[READER_PLAIN_ROWS + 1][:READER_PLAIN_ROWS]


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


def test_the_in_engine_ab_writes_both_arms(host_backend, tmp_path):
    """scripts/accept_reader_ab.py on the embedded pair: a row per method and batch size with both arms' acceptance
    times and rows verified (timings are the machine's: not checked), and the runtime's rule restored after."""
    import json
    from pathlib import Path

    import echo_trtllm.runtime.executor as executor_mod
    from tests.helpers import load_script

    out = tmp_path / "ab.json"
    script = Path(__file__).resolve().parents[2] / "scripts" / "accept_reader_ab.py"
    assert load_script(script).main(["--batch-sizes", "1,3", "--steps", "4", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["batch_size"]) for r in rows] == [("ar", 1), ("ar", 3), ("echo", 1), ("echo", 3)]
    assert all(r["steps_per_arm"] == 2 and r["reader_accept_ms"] > 0 and r["argmax_accept_ms"] > 0 for r in rows)
    assert all(r["reader_verified"] == r["argmax_verified"] == r["batch_size"] for r in rows[:2])  # AR: roots
    assert executor_mod.READER_PLAIN_ROWS == 32


def test_the_in_engine_frontier_ab_writes_both_arms(host_backend, tmp_path):
    """scripts/step_ab.py --change frontier on the embedded pair: a row per batch size with both arms' control, draft
    and host times and rows verified (timings are the machine's: not checked), and AR refused by name."""
    import json
    from pathlib import Path

    from tests.helpers import load_script

    out = tmp_path / "ab.json"
    script = load_script(Path(__file__).resolve().parents[2] / "scripts" / "step_ab.py")
    assert script.main(["--change", "frontier", "--batch-sizes", "1,3", "--steps", "4", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["change"], r["method"], r["batch_size"]) for r in rows] == [("frontier", "echo", b) for b in (1, 3)]
    for r in rows:
        assert r["steps_per_arm"] == 2
        assert all(r[f"{arm}_{k}"] > 0 for arm in ("one_call", "device_loop") for k in ("control_ms", "draft_ms"))
        low, high = r["one_call_control_ms_quartiles"]  # the arm's spread beside its median
        assert low <= r["one_call_control_ms"] <= high
    with pytest.raises(SystemExit):
        script.main(["--change", "frontier", "--methods", "ar,echo"])
    assert script.main(["--change", "result", "--batch-sizes", "2", "--steps", "2", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["change"] == "result" and row["one_call_control_ms"] > 0 and row["four_calls_control_ms"] > 0
