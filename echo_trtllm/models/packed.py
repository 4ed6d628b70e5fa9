"""bfloat16 linears prepacked once for the CPU's matrix kernels (oneDNN), the weight kept as it was.

A one-token forward of Qwen2.5-Coder-1.5B in bfloat16 spends 92 % of its time in `torch.nn.functional.linear`,
which reorders each weight for oneDNN on every call. Packed once at load (`torch.ops.mkldnn._reorder_linear_weight`)
and run by `torch.ops.mkldnn._linear_pointwise`, the same products (on the same rows) give bit-identical logits and
the forward takes 56 ms instead of 151 at one token, 107 instead of 182 at 16 and 292 instead of 376 at 64 (2-core
AMD EPYC with AVX512-BF16; docs/vllm.md, run K). float32 linears are left to PyTorch (the eager float32 path stays the
tests' oracle).

oneDNN lays the packed weight out for a batch-size hint (`PACK_ROWS`). Packed for one row, a 1,499-token prefill's
MLP products took 20.3-23.1 ms against 16.2-18.4 packed for 16-128 rows, and 64 rows' gate 1.85 ms against 1.39-1.49,
while one and 16 rows ran alike (2-core AMX Xeon; docs/performance.md); from 33 rows up the one-row layout also
parted from PyTorch's own linear in the last bit where the wider ones matched it. vLLM's CPU path packs for 32 rows,
and so does this one.

An attention's q, k and v products are packed as one linear (their weights stacked), read in one pass: Qwen's k and v
products (256 x 1536) streamed at about half the speed of the larger ones (72 us each at 16 rows against 250 for q's
six times larger weight). The three modules keep their own weights and forwards (`Attention` calls the fused product
and falls back to the three where it does not apply).

A product of fewer rows than `ROW_FLOOR` runs on that many, the rest zero rows, and returns its own rows. oneDNN's
kernel for a packed weight is not fastest at one row: on the 2-core AMD EPYC (AVX512-BF16), Qwen2.5-Coder-1.5B's
28 layers of linears took 108.8 ms on one row, 119.2 on two and 92.7-97.7 on three to six (their weights streamed
from memory, not cache), its LM head 16.7 ms on one row and 14.3-16.4 on three to six (scripts/row_floor_probe.py,
docs/bench/row-floor-probe-qwen-epyc.json); AR's one-row decode step 141.6 ms before, 125.8 after (medians of
three rounds in fresh processes, docs/performance.md, 2026-12-07, seventh). Four is the least of the fast row
counts: the fewest zero rows of compute on a CPU whose matrix units would not hide them (measured on that EPYC
only: `scripts/row_floor_probe.py` reads another CPU's table). A row's products in a padded call are not those of
a one-row call in the last bit (nor are they in a 16-row call: only `LLM(batch_invariant=True)` promises that, and
its tiles always give the kernel 16 rows); the tests hold the padded product to PyTorch's linear on the same
padded rows.

The module's `weight` stays what it was (exports, sharding and FP8 calibration read it), so packed linears cost
their weights' memory twice. A weight changed in place, replaced, or converted to another dtype after packing is
seen at the next call: the linear is repacked, or runs PyTorch's own path.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["prepack_linears", "prepack_available", "PackedWrapper", "PACK_ROWS", "ROW_FLOOR"]

PACK_ROWS = 32  # the batch-size hint oneDNN packs each weight for (module docstring)
ROW_FLOOR = 4  # a packed product of fewer rows runs on this many, zero rows added (module docstring; 1: never)
FUSE_QKV = True  # an attention's q, k and v as one packed product (module docstring; False: scripts' control arm)


def prepack_available() -> bool:
    """oneDNN is built in and the CPU runs its bfloat16 kernels."""
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class _PackedForward:
    """A linear's forward through its prepacked weight (module docstring)."""

    def __init__(self, module: nn.Linear, lazy: bool = False) -> None:
        """lazy: pack at the first call (a fused attention's q, k and v: only batch-invariant tiles call them)."""
        self.module = module
        self.weight = self.version = None
        if not lazy:
            self._pack()

    def _pack(self) -> None:
        w = self.module.weight
        self.weight, self.version = w, w._version
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        w = m.weight
        if w.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or w.device.type != "cpu" or w.requires_grad \
                and torch.is_grad_enabled():
            return nn.functional.linear(x, w, m.bias)
        if w is not self.weight or w._version != self.version:
            self._pack()
        return _product(x, self.packed, m.bias)


class PackedWrapper:
    """A linear's forward around its packed one (`inner`, a `_PackedForward`), kept as it is when the model is packed
    again (models/weight_int8.py: a draft's int8 copy for few-row products)."""

    inner: _PackedForward


class _PackedQKV:
    """An attention's q, k and v products through one prepacked weight, the three stacked (module docstring)."""

    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear) -> None:
        self.modules = (q, k, v)
        self.packed = None
        self._pack()

    def _state(self) -> list:
        return [(t, t._version) for m in self.modules for t in (m.weight, m.bias) if t is not None]

    def _pack(self) -> None:
        self.state = self._state()
        self.sizes = [m.out_features for m in self.modules]
        weights = [m.weight.detach() for m in self.modules]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat(weights), PACK_ROWS)
        biases = [m.bias for m in self.modules]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])

    def _applies(self, modules: tuple) -> bool:
        """The attention's q, k and v now are still the three packed ones, each a plain bfloat16 linear on the CPU
        run by its own packed forward, unhooked (hooks see the three calls: FP8 calibration's amax, the phase
        profile's timers), their biases all bfloat16 or all absent."""
        if any(a is not b for a, b in zip(modules, self.modules)) or _global_hooks():
            return False
        return _biases_match(modules) and all(
            _cpu_bf16_linear(m) and isinstance(m.__dict__.get("forward"), _PackedForward) and not m._forward_hooks
            and not m._forward_pre_hooks
            for m in modules)

    def __call__(self, x: torch.Tensor, q: nn.Module, k: nn.Module, v: nn.Module) -> tuple[torch.Tensor, ...] | None:
        """(q, k, v) as views of one product of x, or None where it does not apply now and the caller runs the
        attention's current q, k and v modules: one replaced, wrapped (batch-invariant tiles) or hooked, another
        dtype or device, weights that need gradients. Where a module stopped being its packed self the fused weight
        is released (packed again if that changes back)."""
        if x.dtype != torch.bfloat16 or torch.is_grad_enabled() and any(m.weight.requires_grad for m in (q, k, v)):
            return None
        if not self._applies((q, k, v)):
            if any(a is not b for a, b in zip((q, k, v), self.modules)) \
                    or any(not isinstance(m.__dict__.get("forward"), _PackedForward) for m in (q, k, v)):
                self.packed = None  # replaced or wrapped for good: do not keep a third copy of the weights
            return None
        if self.packed is None or stale(self.state, self._state()):
            self._pack()
        return _product(x, self.packed, self.bias).split(self.sizes, dim=-1)


def stale(old: list, new: list) -> bool:
    """Two [(tensor, its version)] readings differ: a tensor replaced or changed in place since `old`."""
    return len(old) != len(new) or any(a is not b or va != vb for (a, va), (b, vb) in zip(old, new))


def _product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x's rows through the packed weight, on at least ROW_FLOOR rows (module docstring)."""
    d = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    if rows >= ROW_FLOOR or rows == 0 or d == 0:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    padded = x.new_zeros(ROW_FLOOR, d)
    padded[:rows] = x.reshape(rows, d)
    out = torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], "")[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _global_hooks() -> bool:
    """Forward hooks registered for every module (torch.nn.modules.module.register_module_forward_hook)."""
    mod = nn.modules.module
    return bool(getattr(mod, "_global_forward_hooks", None) or getattr(mod, "_global_forward_pre_hooks", None))


def _fusable_qkv(m: nn.Module) -> bool:
    """A decoder attention (models/llama.py) whose q, k and v are plain bfloat16 linears on the CPU, with bfloat16
    biases or none, not packed or tiled yet."""
    from .llama import Attention

    if not (FUSE_QKV and isinstance(m, Attention)) or "_fused_qkv" in m.__dict__:
        return False
    mods = (m.q_proj, m.k_proj, m.v_proj)
    return _biases_match(mods) and all(_cpu_bf16_linear(x) and "forward" not in x.__dict__ for x in mods)


def _cpu_bf16_linear(m: nn.Module) -> bool:
    """A plain nn.Linear (not a subclass: FP8, tensor-parallel shards) with bfloat16 weights on the CPU."""
    return type(m) is nn.Linear and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu"


def _biases_match(mods) -> bool:
    """q, k and v all without bias, or all with bfloat16 ones (one stacked bias)."""
    return {None if m.bias is None else m.bias.dtype for m in mods} in ({None}, {torch.bfloat16})


def fused_projections(model: nn.Module) -> set[int]:
    """ids of the q, k and v linears whose attention runs them as one fused product (`_fused_qkv`)."""
    return {id(x) for m in model.modules() if "_fused_qkv" in m.__dict__ for x in m._fused_qkv.modules}


def prepack_linears(model: nn.Module) -> int:
    """Prepack every bfloat16 `nn.Linear` of `model` on the CPU (module docstring); returns how many were given a packed
    forward now (a fused attention's q, k and v count, their own forwards packing only if called). Does nothing where
    oneDNN's bfloat16 kernels are missing; a second call packs nothing again."""
    if not prepack_available():
        return 0
    from .invariant import TiledForward  # a batch-invariant linear keeps its tiles around the packed kernel

    n = 0
    for m in model.modules():
        if _fusable_qkv(m):
            m._fused_qkv = _PackedQKV(m.q_proj, m.k_proj, m.v_proj)
    fused = fused_projections(model)
    for m in model.modules():
        if _cpu_bf16_linear(m):
            fwd = m.__dict__.get("forward")
            if isinstance(fwd, TiledForward) and not isinstance(fwd.inner, (_PackedForward, PackedWrapper)):
                fwd.inner = _PackedForward(m)
                n += 1
            elif not isinstance(fwd, (_PackedForward, TiledForward, PackedWrapper)):
                m.forward = _PackedForward(m, lazy=id(m) in fused)
                n += 1
    return n
