"""Verification that never makes the host wait for the device: given the tree's deepest depth from the host,
greedy acceptance (`verify_paths`) runs without a single read of a tensor's values (no int(), bool(), .tolist(),
.cpu(), nonzero or boolean-mask indexing: on a GPU each is a synchronisation), and its one result, flattened on the
host, equals the naive per-path loop. Host reads are caught on the CPU by a TorchFunctionMode."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from echo_trtllm.core.tree import ancestor_paths
from echo_trtllm.core.verify import SamplingTensors, verify_paths, verify_sampling
from tests.core.test_verify import _greedy_case, naive_greedy

READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy",
         "masked_select", "unique", "unique_consecutive"}


class HostReads(TorchFunctionMode):
    """Records every torch call that needs a tensor's values on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in READS:
            self.seen.append(name)
        if name in ("__getitem__", "__setitem__", "index_put_", "index_put"):
            index = args[1] if len(args) > 1 else None
            parts = index if isinstance(index, (tuple, list)) else (index,)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts):
                self.seen.append(f"{name} with a boolean mask")
        if name == "repeat_interleave" and kwargs.get("output_size") is None:
            self.seen.append("repeat_interleave without output_size")
        if name in ("where",) and len(args) + len(kwargs) == 1:  # torch.where(cond): nonzero
            self.seen.append("where with one argument")
        if name in ("argwhere",) or (name == "bincount" and kwargs.get("minlength") is None):
            self.seen.append(name)
        if name == "to" and any(str(a) == "cpu" for a in [*args[1:], *kwargs.values()]):
            self.seen.append("to cpu")
        return func(*args, **kwargs)


def test_the_detector_sees_reads():
    x = torch.tensor([1, 2, 3])
    with HostReads() as reads:
        bool(x.any()), int(x.max()), x[x > 1], torch.nonzero(x), torch.where(x > 1), torch.bincount(x), x.to("cpu")
    assert len(reads.seen) == 7


@pytest.mark.parametrize("batch_size, vocab", [(1, 5), (3, 37), (64, 50)])
def test_greedy_paths_read_nothing_and_match_the_naive_loop(batch_size, vocab):
    gen = torch.Generator().manual_seed(batch_size + vocab)
    parents, batch, logits = _greedy_case(batch_size, vocab, gen)
    deepest = int(batch.node_depths.max())
    with HostReads() as reads:
        paths = verify_paths(batch, logits, max_depth=deepest)
    assert reads.seen == []
    result = paths.flatten()  # on the host, after the runtime's one read
    expected = naive_greedy(parents, batch, logits)
    assert result.token_lists() == [e[0] for e in expected]
    assert result.node_lists() == [e[1] for e in expected]
    # a deeper bound than the tree's only pads
    assert verify_paths(batch, logits, max_depth=deepest + 3).flatten().token_lists() == result.token_lists()


def test_sampling_paths_with_the_depth_from_the_host_equal_verify_sampling():
    gen = torch.Generator().manual_seed(5)
    parents, batch, logits = _greedy_case(6, 23, gen)
    deepest = int(batch.node_depths.max())
    sampling = SamplingTensors.uniform(6, 0.8, top_k=5)
    u = torch.rand(6, deepest + 1, generator=gen, dtype=torch.float64)
    want = verify_sampling(batch, logits, sampling, position_uniforms=u)
    got = verify_paths(batch, logits, sampling, position_uniforms=u, max_depth=deepest).flatten()
    assert got.token_lists() == want.token_lists() and got.node_lists() == want.node_lists()


def test_ancestor_paths_read_nothing_with_the_depth_given():
    parents = torch.tensor([-1, 0, 0, 1, 3, -1, 5])
    depths = torch.tensor([0, 1, 1, 2, 3, 0, 1])
    nodes = torch.tensor([4, 2, 5, 6])
    want = [[0, 1, 3, 4], [0, 2, -1, -1], [5, -1, -1, -1], [5, 6, -1, -1]]
    with HostReads() as reads:
        got = ancestor_paths(nodes, parents, depths, max_depth=3)
    assert reads.seen == [] and got.tolist() == want
    assert ancestor_paths(nodes, parents, depths).tolist() == want
    assert ancestor_paths(nodes, parents, depths, max_depth=5).tolist() == [r + [-1, -1] for r in want]
