"""Batch-invariant forwards: every token's logits the same bits whatever else is in the batch and however many
tokens a step verifies (`LLM(batch_invariant=True)`, `--batch-invariant`; vLLM's `VLLM_BATCH_INVARIANT`,
SGLang's `--enable-deterministic-inference`).

Why a default forward is not: a matrix kernel picks its blocking, and so the order of each dot product's additions,
from the number of rows it is given (scripts/batch_invariance_probe.py: row 0 of a 1.5B model's MLP product alone and
inside 2-64 rows differs in its last bits, float32 and bfloat16), and attention reduces over a key length that is the
batch's longest context, padded; a tree's tokens see their ancestors at other cache positions than the plain
decode's tokens saw theirs. Here:

- **linears** (every `nn.Linear` and FP8 linear: projections, MLP, LM head) and the **RMS norms** run their rows in
  fixed tiles of `ROW_TILE` rows, the last tile padded with zero rows, through whatever forward the module had (the
  prepacked bfloat16 kernel, PyTorch's, the FP8 product): the kernel always sees the same shape (a GPU's reduction
  picks its split from the number of rows too), and a row's products never meet another row's;
- **attention** gathers, for every new token, exactly the cache positions it may see, in position order (the
  prompt, then its ancestors by depth: the order plain decoding wrote them in), pads that list with masked entries to
  a multiple of `KEY_BLOCK`, and reduces in float32 with elementwise products: sums over the head dimension (a fixed
  length), and over the keys one `KEY_BLOCK` block at a time, the blocks added in order, so padding adds exact
  zeros and no reduction's grouping depends on the batch's longest context or on the other tokens.

Other row-wise operations (RoPE, activations, the embedding, softmax over the vocabulary) already are invariant. What
it costs is measured in docs/performance.md; the tests (tests/runtime/test_batch_invariant.py) compare one request
alone, inside batches, and under speculative policies, bit for bit in bfloat16 and float32 (on a CPU; on an H200
with the embedded pair).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["ROW_TILE", "KEY_BLOCK", "make_batch_invariant", "is_batch_invariant", "invariant_attention",
           "visible_keys", "TiledForward"]

ROW_TILE = 16  # rows per linear call
KEY_BLOCK = 64  # attention's key lists are padded to a multiple of this
TOKEN_CHUNK = 16  # new tokens per attention pass (bounds the (tokens, heads, keys, head_dim) products' memory)


class TiledForward:
    """A row-wise module's forward (a linear's, a norm's) run on fixed tiles of ROW_TILE rows (module docstring).
    `inner` is the forward it wraps (models/packed.py replaces it by the prepacked kernel when it packs a linear
    later)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.inner = module.__dict__.get("forward") or module.__class__.forward.__get__(module)

    def __call__(self, x: Tensor) -> Tensor:
        lead, d = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, d)
        m = rows.shape[0]
        if m == 0:
            return self.inner(x)
        pad = -m % ROW_TILE
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, d)])
        out = torch.cat([self.inner(rows[i:i + ROW_TILE]) for i in range(0, m + pad, ROW_TILE)])
        return out[:m].reshape(*lead, out.shape[-1])


def _row_wise(m: nn.Module) -> bool:
    """A module that maps each row on its own: nn.Linear, or a class that says so (`row_wise = True`: the RMS norm,
    the FP8 linear)."""
    return type(m) is nn.Linear or getattr(type(m), "row_wise", False)


def make_batch_invariant(model: nn.Module) -> int:
    """Switch `model` (a CausalLM) to batch-invariant forwards, in place (it stays so); returns how many linears and
    norms were tiled now (a second call tiles none again)."""
    n = 0
    for m in model.modules():
        if _row_wise(m) and not isinstance(m.__dict__.get("forward"), TiledForward):
            m.forward = TiledForward(m)
            n += 1
        if hasattr(m, "batch_invariant"):
            m.batch_invariant = True
    return n


def is_batch_invariant(model: nn.Module) -> bool:
    return any(isinstance(m.__dict__.get("forward"), TiledForward) for m in model.modules())


def visible_keys(visible: Tensor) -> tuple[Tensor, Tensor]:
    """(positions (T, W), live (T, W)): each token's visible cache positions first, ascending, then filler up to W,
    the longest list rounded up to a multiple of KEY_BLOCK. visible: (T, L_max) bool. Worked out once per batch."""
    t = visible.shape[0]
    counts = visible.sum(-1)  # (T,)
    width = max(KEY_BLOCK, -(-int(counts.max()) // KEY_BLOCK) * KEY_BLOCK) if t else KEY_BLOCK
    order = torch.sort((~visible).to(torch.int8), dim=-1, stable=True).indices  # (T, L_max)
    if order.shape[1] < width:
        order = torch.cat([order, order.new_zeros(t, width - order.shape[1])], dim=1)
    return order[:, :width], torch.arange(width, device=visible.device)[None, :] < counts[:, None]


def _block_sum(x: Tensor, dim: int) -> Tensor:
    """x summed over `dim` (a multiple of KEY_BLOCK long) one KEY_BLOCK block at a time, the blocks added in order:
    the same grouping whatever the length."""
    blocks = x.unflatten(dim, (-1, KEY_BLOCK)).sum(dim + 1 if dim >= 0 else dim)  # (..., nblk, ...)
    out = blocks.select(dim, 0)
    for i in range(1, blocks.shape[dim]):
        out = out + blocks.select(dim, i)
    return out


def invariant_attention(q: Tensor, keys: Tensor, values: Tensor, tok_slot: Tensor, pos: Tensor, live: Tensor) -> Tensor:
    """Attention of T new tokens, each over exactly the cache positions it sees (module docstring).

    q: (T, H, hd); keys, values: the layer's cache (S, H_kv, L, hd); tok_slot: (T,) each token's cache slot;
    pos, live: `visible_keys` of the batch. Returns (T, H, hd) in q's dtype."""
    t, h, hd = q.shape
    h_kv = keys.shape[1]
    g = h // h_kv
    scale = hd ** -0.5
    out = q.new_empty(t, h, hd)
    for s in range(0, t, TOKEN_CHUNK):
        e = min(t, s + TOKEN_CHUNK)
        k = keys[tok_slot[s:e, None], :, pos[s:e]].float()  # (C, W, H_kv, hd)
        v = values[tok_slot[s:e, None], :, pos[s:e]].float()
        qc = q[s:e].float().view(e - s, h_kv, g, 1, hd)
        scores = (qc * k.permute(0, 2, 1, 3)[:, :, None]).sum(-1) * scale  # (C, H_kv, g, W)
        scores = scores.masked_fill(~live[s:e, None, None, :], float("-inf"))
        weights = torch.exp(scores - scores.amax(-1, keepdim=True))  # (a maximum: exact in any order)
        den = _block_sum(weights, -1)[..., None]  # (C, H_kv, g, 1)
        o = _block_sum(weights[..., None] * v.permute(0, 2, 1, 3)[:, :, None], -2) / den  # (C, H_kv, g, hd)
        out[s:e] = o.reshape(e - s, h, hd).to(q.dtype)
    return out
