"""A compact Llama-family transformer (Llama, Qwen2) for this runtime.

One forward serves every phase: it takes ragged per-request token sets (a prompt chunk, a draft level, or a whole
packed Super-Tree), writes their K/V into each request's cache slot at given positions, and attends each request's
own cache through a boolean mask. Module names follow HF transformers' `LlamaForCausalLM` so checkpoints load by
name.

KV cache layout: per layer, K and V of shape (slots, H_kv, C, hd); a request owns one slot for its lifetime.
New tokens are written at `write_pos`; `compact` moves accepted tree nodes down to the end of the committed
context, which drops the rejected ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cpu_kernels
from .invariant import invariant_attention, visible_keys

__all__ = ["ModelConfig", "KVCache", "ForwardBatch", "CausalLM", "eagle3_layers"]

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    rope_scaling: dict | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model architecture {self.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope scaling {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """From an HF config.json dict (LlamaForCausalLM / Qwen2ForCausalLM)."""
        model_type = cfg.get("model_type")
        arch = {"llama": "llama", "qwen2": "qwen2"}.get(model_type)
        if arch is None:
            archs = cfg.get("architectures") or [model_type]
            raise ValueError(
                f"model type {model_type!r} ({', '.join(map(str, archs))}) is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        # transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_theta` + `rope_scaling`.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta") or rope.pop("rope_theta", None) or 10000.0
        rope.pop("rope_theta", None)
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "qwen2"),
            rope_scaling=rope or None,
            eos_token_ids=tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos])),
            bos_token_id=cfg.get("bos_token_id"),
        )

    def to_hf(self) -> dict:
        """An HF config.json dict that `from_hf` reads back to this config (for checkpoints this project writes)."""
        model_type = self.architecture
        cfg = {
            "architectures": ["LlamaForCausalLM" if model_type == "llama" else "Qwen2ForCausalLM"],
            "model_type": model_type, "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings, "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias, "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.rope_scaling:
            cfg["rope_scaling"] = dict(self.rope_scaling)
        return cfg


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse frequencies (hd/2,) including the scaling schemes Llama-family checkpoints use."""
    hd = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_ctx / low, old_ctx / high
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.float()


def rope_cos_sin(inv_freq: Tensor, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin (T, head_dim) of the positions, for `apply_rope`."""
    freqs = position_ids.float()[:, None] * inv_freq[None, :]  # (T, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def as_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t.to(dtype) without the call where it would return t itself: on the hot paths of few-row forwards each
    operation dispatched costs microseconds, more with the caches cold from the target's weights
    (docs/performance.md), a no-op conversion about as much as a real one."""
    return t if t.dtype == dtype else t.to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (T, H, hd) rotated by per-token cos/sin (T, hd) in the rotate-half convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@dataclass
class KVCache:
    """Per-layer K/V of shape (slots, H_kv, C, hd) (a tensor-parallel rank's own KV heads only)."""

    keys: list[Tensor]
    values: list[Tensor]
    # a tensor-parallel group's leader replays compactions on the other ranks through this (models/tp.py); its id
    mirror: object | None = field(default=None, repr=False)
    mirror_id: int = -1
    # (2 L, slots, H_kv, C, hd): every layer's keys then values in one tensor, of which `keys` and `values` are
    # views (`allocate`): a compaction moves the entries of every layer in one gather and one write, where one
    # per layer and tensor cost 2 L small operations a step. None: the per-layer lists only (the oracle)
    store: Tensor | None = field(default=None, repr=False)

    @classmethod
    def allocate(cls, config: ModelConfig, slots: int, capacity: int, dtype: torch.dtype, device) -> "KVCache":
        shape = (slots, config.num_key_value_heads, capacity, config.head_dim)
        n = config.num_hidden_layers
        store = torch.zeros((2 * n, *shape), dtype=dtype, device=device)
        return cls(list(store[:n].unbind(0)), list(store[n:].unbind(0)), store=store)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def compact(self, slots: Tensor, src: Tensor, dst: Tensor) -> None:
        """Move cache entries (slot, src) -> (slot, dst) in every layer; all reads happen before the writes."""
        # slots, src, dst: (M,)
        if slots.numel() == 0:
            return
        if self.mirror is not None:
            self.mirror.run(lambda: self.mirror.compact(self, slots, src, dst), lambda: self._compact(slots, src, dst))
        else:
            self._compact(slots, src, dst)

    def _compact(self, slots: Tensor, src: Tensor, dst: Tensor) -> None:
        dev = self.keys[0].device
        if slots.device != dev:  # the indices cross once, not once per layer (each a wait for the device there)
            slots, src, dst = torch.stack([slots, src, dst]).to(dev, non_blocking=True).unbind(0)
        if self.store is not None:
            self.store[:, slots, :, dst] = self.store[:, slots, :, src]  # (M, 2 L, H_kv, hd) read, then written
            return
        for cache in (*self.keys, *self.values):
            cache[slots, :, dst] = cache[slots, :, src]


@dataclass
class ForwardBatch:
    """New tokens of B requests (T in all), flat, request-major."""

    # (T,) int64
    input_ids: Tensor
    # (T,) int64: RoPE positions
    position_ids: Tensor
    # (B,) int64: cache slot of each request
    slots: Tensor
    # (T,) int64: request index (0..B-1) and index within the request's new tokens
    token_request: Tensor
    token_local: Tensor
    # (T,) int64: cache position each token's K/V is written to
    write_pos: Tensor
    # (B, N_max, L_max) bool: new token (b, r) attends cache position p of its own slot
    attn_mask: Tensor
    # (S,) rows of the T tokens whose logits are needed (None: all)
    logits_index: Tensor | None = field(default=None)
    # logits in float32 (the forward's contract); False: in the model's dtype, for a caller that converts them
    # itself or needs only their argmax (the runtime's verification: a bfloat16 model then makes no float32 copy
    # of every vocabulary row, 13 ms of a 64-row Qwen step on the CPU; docs/performance.md)
    float_logits: bool = field(default=True)

    def to(self, device: torch.device) -> "ForwardBatch":
        return ForwardBatch(*(None if t is None else t.to(device, non_blocking=True) for t in
                              (self.input_ids, self.position_ids, self.slots, self.token_request, self.token_local,
                               self.write_pos, self.attn_mask, self.logits_index)), float_logits=self.float_logits)

    def visible_keys(self) -> tuple[Tensor, Tensor]:
        """Each token's visible cache positions in order, padded (models/invariant.visible_keys); once per batch."""
        if "_visible_keys" not in self.__dict__:
            self._visible_keys = visible_keys(self.attn_mask[self.token_request, self.token_local])
        return self._visible_keys

    def dense(self) -> bool:
        """Whether every request has N_max new tokens, request-major and in order (T = B x N_max: a decode step, a
        drafting level, one request's prefill chunk): attention then views its queries and output in the padded
        layout instead of scattering and gathering them in every layer. On the CPU only (reading the layout on a
        device would wait for it). Worked out once per batch, unless the builder stated it (`laid_out_dense`)."""
        if "_dense" not in self.__dict__:
            b, n, _ = self.attn_mask.shape
            req, local = self.token_request, self.token_local
            if req.numel() != b * n or req.device.type != "cpu":
                self._dense = False
            else:
                want_req, want_local = dense_layout(b, n, req.device)
                self._dense = torch.equal(req, want_req) and torch.equal(local, want_local)
        return self._dense

    def laid_out_dense(self) -> "ForwardBatch":
        """The builder's word that the tokens are request-major, in order, N_max per request (a draft level, chains
        of one length): `dense` then reads nothing (its two comparisons and the index tensors they compare with are
        a one-layer head's forward's own cost, every forward). Returns self."""
        self._dense = self.token_request.device.type == "cpu"
        return self

    def grouped_mask(self, groups: int, dtype: torch.dtype) -> Tensor:
        """The mask as attention hands it to the kernel: (B, 1, groups x N_max, L_max) for `groups` query heads per
        KV head, rows in the cache's slot order where attention reads the cache in place (`slot_block`), additive
        (0 or -inf) in the queries' dtype, which is what the kernel makes of a boolean mask. With one new token per
        request (a decode step, a one-wide draft level) the g rows are that token's and the mask is (B, 1, 1,
        L_max), broadcast over them by the kernel rather than copied g times. Once per batch, not per layer (the
        same result: tests/models/test_attention_layout.py)."""
        if self.__dict__.get("_grouped_key") != (groups, dtype):
            b, n, l_max = self.attn_mask.shape
            if n == 1:
                mask = self.attn_mask[:, None]
            else:
                mask = self.attn_mask[:, None, None].expand(b, 1, groups, n, l_max).reshape(b, 1, groups * n, l_max)
            block = self.slot_block()
            if block is not None and block[2] is not None:
                mask = mask[block[2]]
            additive = torch.full(mask.shape, float("-inf"), dtype=dtype, device=mask.device)
            self._grouped = additive.masked_fill_(mask, 0.0)
            self._grouped_key = (groups, dtype)
        return self._grouped

    def slot_block(self) -> tuple[int, Tensor | None, Tensor | None] | None:
        """(first, rows, order) when the B slots are first .. first + B - 1 in some order and on the CPU: attention
        then reads those cache rows in place instead of gathering a copy per layer (a full batch's slots are
        always such a block). rows[i] = slots[i] - first, order = its inverse (the request at cache row r); both
        None when the slots are already in order. None for a batch with gaps, or on a device, where reading the
        slots would wait for it. Worked out once per batch."""
        if "_slot_block" not in self.__dict__:
            self._slot_block = _slot_block(self.slots)
        return self._slot_block


def dense_layout(b: int, n: int, device) -> tuple[Tensor, Tensor]:
    """(token_request, token_local) of b requests with n tokens each, request-major: (0, 0), (0, 1), .. (b-1, n-1)
    (arange's quotient and remainder, cheaper than the repeats they equal)."""
    flat = torch.arange(b * n, device=device)
    return flat.div(n, rounding_mode="floor"), flat.remainder_(n)


def _slot_block(slots: Tensor):
    if slots.device.type != "cpu" or slots.numel() == 0:
        return None
    if slots.numel() == 1:  # one request: a block in order (no list read back)
        return int(slots), None, None
    ids = slots.tolist()
    first, b = min(ids), len(ids)
    if max(ids) - first + 1 != b or len(set(ids)) != b:
        return None
    if ids == list(range(first, first + b)):
        return first, None, None
    rows = slots - first
    order = torch.empty_like(rows)
    order[rows] = torch.arange(b)
    return first, rows, order


class RMSNorm(nn.Module):
    row_wise = True  # each row on its own (models/invariant.py tiles it)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        fused = cpu_kernels.rms_norm(x, self.weight, self.eps)  # one pass on the CPU (models/cpu_kernels.py)
        if fused is not None:
            return fused
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, in_features: int | None = None) -> None:
        """in_features: width of the attention input (default hidden_size; an EAGLE-3 head's layer takes 2x)."""
        super().__init__()
        self.layer = layer
        self.h, self.h_kv, self.hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        bias = config.attention_bias
        d_in = in_features or config.hidden_size
        self.q_proj = nn.Linear(d_in, self.h * self.hd, bias=bias)
        self.k_proj = nn.Linear(d_in, self.h_kv * self.hd, bias=bias)
        self.v_proj = nn.Linear(d_in, self.h_kv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.h * self.hd, config.hidden_size, bias=False)
        self.batch_invariant = False  # models/invariant.py switches it on

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, batch: ForwardBatch, cache: KVCache) -> Tensor:
        t = x.shape[0]
        fused = self.__dict__.get("_fused_qkv")  # the three products as one prepacked linear (models/packed.py)
        qkv = None if fused is None else fused(x, self.q_proj, self.k_proj, self.v_proj)
        q, k, v = qkv or (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q, k = q.view(t, self.h, self.hd), k.view(t, self.h_kv, self.hd)
        # (T, H, hd), (T, H_kv, hd); both in one pass on the CPU (models/cpu_kernels.py)
        q, k = cpu_kernels.rope_qk(q, k, cos, sin) or (apply_rope(q, cos, sin), apply_rope(k, cos, sin))
        v = v.view(t, self.h_kv, self.hd)
        ck, cv = cache.keys[self.layer], cache.values[self.layer]
        tok_slot = batch.slots[batch.token_request]  # (T,)
        ck[tok_slot, :, batch.write_pos] = as_dtype(k, ck.dtype)
        cv[tok_slot, :, batch.write_pos] = as_dtype(v, cv.dtype)
        if self.batch_invariant:
            out = invariant_attention(q, ck, cv, tok_slot, *batch.visible_keys())
            return self.o_proj(out.reshape(t, self.h * self.hd))
        b, n_max, l_max = batch.attn_mask.shape
        block = batch.slot_block()
        if block is None:  # a copy of each request's rows, in the batch's order
            keys = as_dtype(ck[batch.slots, :, :l_max], q.dtype)  # (B, H_kv, L_max, hd)
            values = as_dtype(cv[batch.slots, :, :l_max], q.dtype)
            rows = order = None
        else:  # the cache's own rows, in slot order
            first, rows, order = block
            keys = as_dtype(ck[first:first + b, :, :l_max], q.dtype)
            values = as_dtype(cv[first:first + b, :, :l_max], q.dtype)
        dense = batch.dense()
        if dense:  # the tokens are the padded layout already
            qp = q.view(b, n_max, self.h, self.hd)
        else:
            qp = q.new_zeros(b, n_max, self.h, self.hd)
            qp[batch.token_request, batch.token_local] = q
        # grouped-query attention as one query block per KV head: the g = H / H_kv query heads that share a KV
        # head become g x N_max query rows of it, so the kernel reads each KV head once and needs no broadcast of
        # K/V across heads (PyTorch's CPU kernel with enable_gqa takes its slow path at one query row: 6x slower
        # at 16 rows of Qwen2.5-1.5B, 45 % of the step; docs/performance.md)
        g = self.h // self.h_kv
        qg = qp.transpose(1, 2).reshape(b, self.h_kv, g * n_max, self.hd)
        if order is not None:
            qg = qg[order]
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=batch.grouped_mask(g, qg.dtype))
        if rows is not None:
            out = out[rows]  # (B, H_kv, g * N_max, hd)
        # reshape, not view: CUDA's memory-efficient kernel returns a transposed (non-contiguous) output
        out = out.reshape(b, self.h, n_max, self.hd).transpose(1, 2)
        out = out.reshape(t, self.h, self.hd) if dense else out[batch.token_request, batch.token_local]  # (T, H, hd)
        return self.o_proj(out.reshape(t, self.h * self.hd))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    # tensor parallel: sums the ranks' partial o_proj / down_proj outputs (row-parallel layers); identity alone
    reduce = staticmethod(lambda t: t)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, batch: ForwardBatch, cache: KVCache) -> Tensor:
        x = x + self.reduce(self.self_attn(self.input_layernorm(x), cos, sin, batch, cache))
        return x + self.reduce(self.mlp(self.post_attention_layernorm(x)))


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def eagle3_layers(num_hidden_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default feature layers of an N-layer target: the inputs of decoder layers 2, N // 2 and N - 3 (the
    outputs of layers 1, N // 2 - 1 and N - 4), as the EAGLE and SpecForge checkpoints were trained on."""
    n = num_hidden_layers
    return (2, n // 2, n - 3)


class CausalLM(nn.Module):
    """Llama-family causal LM over a slotted KV cache (see the module docstring)."""

    def __init__(self, config: ModelConfig, tp=None) -> None:
        """tp: this rank's `models.tp.TensorParallel` (its modules are then built for its shard: its KV-head group,
        its slice of the MLP and of the vocabulary); `config` stays the whole model's."""
        super().__init__()
        self.config = config
        self.tp = tp
        self.shard_config = config if tp is None else tp.shard_config(config)
        self.model = Backbone(self.shard_config)
        self.lm_head = nn.Linear(config.hidden_size, self.shard_config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if tp is not None:
            for layer in self.model.layers:
                layer.reduce = tp.all_reduce
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def allocate_cache(self, slots: int, capacity: int) -> KVCache:
        cache = KVCache.allocate(self.shard_config, slots, capacity, self.dtype, self.device)
        mirror = self.tp.mirror if self.tp is not None else None
        if mirror is not None:
            mirror.run(lambda: mirror.allocate(self, cache, slots, capacity), lambda: None)
        return cache

    def eagle3_layers(self) -> tuple[int, int, int]:
        """EAGLE-3's default feature layers (`eagle3_layers`)."""
        return eagle3_layers(self.config.num_hidden_layers)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache, capture: tuple[int, ...] = ()) -> Tensor | tuple[Tensor, Tensor]:
        """Logits (S, V) float32 (in the model's dtype where batch.float_logits is False) of the rows in
        batch.logits_index (all T rows when None), on the model's device
        (a batch built elsewhere, e.g. by the host control plane, is moved there first).

        capture: decoder-layer indices whose *input* hidden states to return too, for every one of the T tokens
        (an EAGLE-3 head's features, taken from the forward that runs anyway); then (logits, features) with
        features (T, len(capture) * hidden) in the order given. Index N (the layer count) is the last layer's
        output, before the final norm."""
        if batch.input_ids.device != self.device:
            batch = batch.to(self.device)
        n = self.config.num_hidden_layers
        if any(not 0 <= i <= n for i in capture):
            raise ValueError(f"capture layers must be in [0, {n}], got {capture}")
        mirror = self.tp.mirror if self.tp is not None else None
        if mirror is not None:  # the other ranks run this forward with us, one mirrored call at a time
            return mirror.run(lambda: mirror.forward(self, batch, cache, capture),
                              lambda: self._forward(batch, cache, capture))
        return self._forward(batch, cache, capture)

    def _forward(self, batch: ForwardBatch, cache: KVCache, capture: tuple[int, ...]):
        n = self.config.num_hidden_layers
        x = self.model.embed_tokens(batch.input_ids) if self.tp is None else \
            self.tp.embed(self.model.embed_tokens, batch.input_ids)  # (T, hidden)
        cos, sin = rope_cos_sin(self.inv_freq, batch.position_ids, x.dtype)
        captured: dict[int, Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in capture:
                captured[i] = x
            x = layer(x, cos, sin, batch, cache)
        if n in capture:
            captured[n] = x
        features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        if batch.logits_index is not None:
            x = x[batch.logits_index]
        logits = self.lm_head(self.model.norm(x))
        if batch.float_logits:
            logits = logits.float()
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits, self.config.vocab_size)
        return (logits, features) if capture else logits

    def truncated(self, num_layers: int) -> "CausalLM":
        """A copy keeping the first `num_layers` decoder layers (a cheap draft sharing the tokenizer)."""
        if self.tp is not None:
            raise ValueError("truncated() copies a whole model; a tensor-parallel shard cannot")
        if not 1 <= num_layers <= self.config.num_hidden_layers:
            raise ValueError(f"num_layers must be in [1, {self.config.num_hidden_layers}], got {num_layers}")
        from dataclasses import replace

        small = CausalLM(replace(self.config, num_hidden_layers=num_layers)).to(self.dtype)
        state = {k: v for k, v in self.state_dict().items() if not k.startswith("model.layers.")
                 or int(k.split(".")[2]) < num_layers}
        small.load_state_dict(state)
        return small.to(self.device)
