"""Attention's batch layout work done once per batch (models/llama.py: `ForwardBatch.dense`, `grouped_mask`) against
the per-layer code it replaced, kept here as the oracle: the boolean mask expanded in every layer and the queries
scattered into, and the output gathered out of, the padded layout. Bit for bit, in float32 and bfloat16, on dense
batches (a decode step, a drafting level), ragged ones (chains of different lengths) and slots out of order."""

import pytest
import torch
import torch.nn.functional as F

from echo_trtllm.models import DEFAULT_TARGET, llama
from echo_trtllm.models.loader import load_model
from echo_trtllm.runtime.inputs import chain_batch, level_batch


def old_attention(self, x, cos, sin, batch, cache):
    """Attention.forward before the layout work moved to the batch (also scripts/attention_layout_ab.py's baseline)."""
    t = x.shape[0]
    q = llama.apply_rope(self.q_proj(x).view(t, self.h, self.hd), cos, sin)
    k = llama.apply_rope(self.k_proj(x).view(t, self.h_kv, self.hd), cos, sin)
    v = self.v_proj(x).view(t, self.h_kv, self.hd)
    ck, cv = cache.keys[self.layer], cache.values[self.layer]
    tok_slot = batch.slots[batch.token_request]
    ck[tok_slot, :, batch.write_pos] = k.to(ck.dtype)
    cv[tok_slot, :, batch.write_pos] = v.to(cv.dtype)
    b, n_max, l_max = batch.attn_mask.shape
    block = batch.slot_block()
    if block is None:
        keys = ck[batch.slots, :, :l_max].to(q.dtype)
        values = cv[batch.slots, :, :l_max].to(q.dtype)
        rows = order = None
    else:
        first, rows, order = block
        keys = ck[first:first + b, :, :l_max].to(q.dtype)
        values = cv[first:first + b, :, :l_max].to(q.dtype)
    qp = q.new_zeros(b, n_max, self.h, self.hd)
    qp[batch.token_request, batch.token_local] = q
    g = self.h // self.h_kv
    qg = qp.transpose(1, 2).reshape(b, self.h_kv, g * n_max, self.hd)
    mask = batch.attn_mask[:, None, None].expand(b, 1, g, n_max, l_max).reshape(b, 1, g * n_max, l_max)
    if order is not None:
        qg, mask = qg[order], mask[order]
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)
    if rows is not None:
        out = out[rows]
    out = out.reshape(b, self.h, n_max, self.hd).transpose(1, 2)[batch.token_request, batch.token_local]
    return self.o_proj(out.reshape(t, self.h * self.hd))


def _batches(vocab: int, slots: list[int]):
    """(name, prefill batch, batch to compare, whether it is dense) over the given cache slots."""
    gen = torch.Generator().manual_seed(len(slots))
    b, s = len(slots), torch.tensor(slots)
    ctx = [int(n) for n in torch.randint(3, 20, (b,), generator=gen)]
    prefill = chain_batch([torch.randint(0, vocab, (n,), generator=gen) for n in ctx], torch.zeros(b, dtype=torch.long),
                          s, logits="none")
    starts = torch.tensor(ctx)
    decode = chain_batch([torch.randint(0, vocab, (1,), generator=gen) for _ in range(b)], starts, s, logits="all")
    ragged = chain_batch([torch.randint(0, vocab, (1 + i % 3,), generator=gen) for i in range(b)], starts, s,
                         logits="all")
    w = 3
    write = starts[:, None] + torch.arange(w)  # w sibling nodes per request, each seeing the context and itself
    level = level_batch(torch.randint(0, vocab, (b, w), generator=gen), starts[:, None].expand(b, w).contiguous(),
                        write, s, starts.clone(), write[..., None], int(starts.max()) + w + 1)
    return [("decode", prefill, decode, True), ("ragged", prefill, ragged, b == 1), ("level", prefill, level, True)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("slots", [[0, 1, 2, 3], [2, 0, 3, 1], [1, 3], [0]])
def test_attention_equals_the_per_layer_layout_bit_for_bit(dtype, slots, monkeypatch):
    model, _ = load_model(DEFAULT_TARGET, dtype=dtype, with_tokenizer=False)
    for name, prefill, batch, dense in _batches(model.config.vocab_size, slots):
        outs = []
        for attention in (old_attention, llama.Attention.forward):
            monkeypatch.setattr(llama.Attention, "forward", attention)
            cache = model.allocate_cache(4, 64)
            with torch.inference_mode():
                model(prefill, cache)
                outs.append(model(llama.ForwardBatch(*(getattr(batch, f) for f in (
                    "input_ids", "position_ids", "slots", "token_request", "token_local", "write_pos",
                    "attn_mask", "logits_index"))), cache))  # a fresh batch: nothing cached on it
        assert torch.equal(outs[0], outs[1]), (name, slots, dtype)
        assert batch.dense() is dense, name
