"""The KV cache's compaction (the accepted path moved to its committed positions after a tree verification): the
one-tensor store that `KVCache.allocate` makes moves every layer in one gather and one write; the per-layer loop
over separate tensors is its oracle."""

from types import SimpleNamespace

import pytest
import torch

from echo_trtllm.models.llama import KVCache


def _moves(gen, slots: int, capacity: int, per_slot: int):
    """Moves (slot, src) -> (slot, dst) as a verification leaves them: per slot, accepted nodes at increasing
    source positions packed down to consecutive destinations (a destination may be another move's source)."""
    s, src, dst = [], [], []
    for slot in range(slots):
        base = int(torch.randint(0, capacity // 2, (1,), generator=gen))
        picked = sorted(torch.randperm(capacity - base, generator=gen)[:per_slot].tolist())
        for t, p in enumerate(picked):
            if p != t:
                s.append(slot)
                src.append(base + p)
                dst.append(base + t)
    return torch.tensor(s, dtype=torch.long), torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_the_store_compacts_every_layer_as_the_per_layer_loop_does(dtype, seed):
    config = SimpleNamespace(num_key_value_heads=2, head_dim=8, num_hidden_layers=3)
    cache = KVCache.allocate(config, slots=4, capacity=32, dtype=dtype, device="cpu")
    assert cache.store is not None and cache.store.shape == (6, 4, 2, 32, 8)
    gen = torch.Generator().manual_seed(seed)
    cache.store.copy_(torch.randn(cache.store.shape, generator=gen).to(dtype))
    oracle = KVCache([k.clone() for k in cache.keys], [v.clone() for v in cache.values])
    assert oracle.store is None
    slots, src, dst = _moves(gen, 4, 32, per_slot=1 + seed * 3)
    assert slots.numel() > 0 or seed == 0
    for c in (cache, oracle):
        c.compact(slots, src, dst)
    for a, b in zip(cache.keys + cache.values, oracle.keys + oracle.values):
        assert torch.equal(a, b)
    # the layers are still views of the store (the model reads and writes them there)
    assert all(k.data_ptr() == cache.store[i].data_ptr() for i, k in enumerate(cache.keys))
    assert all(v.data_ptr() == cache.store[3 + i].data_ptr() for i, v in enumerate(cache.values))


def test_a_chain_of_moves_reads_before_it_writes():
    """Position 2 -> 1 and 3 -> 2: position 2's old entry lands at 1, not the entry moved there."""
    config = SimpleNamespace(num_key_value_heads=1, head_dim=1, num_hidden_layers=2)
    cache = KVCache.allocate(config, slots=1, capacity=4, dtype=torch.float32, device="cpu")
    cache.store.copy_(torch.arange(4.0).expand(4, 1, 1, 4).reshape(4, 1, 1, 4, 1))
    cache.compact(torch.tensor([0, 0]), torch.tensor([2, 3]), torch.tensor([1, 2]))
    for layer in cache.keys + cache.values:
        assert layer.reshape(-1).tolist() == [0.0, 2.0, 3.0, 3.0]
