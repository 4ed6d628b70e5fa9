"""A draft's few-row products through int8 weights (`LLM(draft_quantization="w8a16")`: weight-only int8, 16-bit
activations, TensorRT-LLM's W8A16).

A one-row speculative step runs the draft's forwards on a handful of rows each (an EAGLE-3 head's first forward of
the step reads the pending chain, one to three tokens; its levels the frontier's few nodes), where the products
stream the weights from memory and their bytes set the time. The step's first head forward comes right after the
target's, which has streamed the target's weights through the caches: on the 2-core AMD EPYC (AVX512-BF16) it took
3.0-3.9 ms of a tiny head's 7-11 ms draft phase a step, and 2.3-2.8 ms with int8 weights, shorter in every round of
the paired readings, with the tokens emitted a step the same (docs/performance.md, 2026-12-07, eighth;
scripts/head_split.py).

`quantize_w8a16(model)` gives each of a draft's prepacked bfloat16 linears (models/packed.py), and each fused q/k/v
product, an int8 copy of its weight with one scale per output channel (symmetric: a row's largest magnitude maps to
127). A product of 1 to `INT8_ROWS` rows then runs PyTorch's CPU kernel `torch._weight_int8pack_mm` on the int8
copy (its bias, if any, added after; a linear whose input width is not a multiple of `IN_FEATURES_MULTIPLE` keeps
its bfloat16 product: the kernel has no tail for it); a wider product (a batch's levels, a prefill) runs the packed
bfloat16 weight as before, so the draft's numbers at a few rows are those of the rounded weights and at many rows
those of the weights themselves. Only the draft proposes tokens: verification by the target decides every emitted
token, so the output is what plain decoding gives (the tests hold it to AR in batch-invariant mode); the int8 weights
change only which drafts are proposed.

The module's weight is kept (exports and sharding read it): the int8 copy costs half the bfloat16 bytes again. A
weight changed in place or replaced is quantised again at the next few-row call. The draft is switched in place and
stays so (an engine built later on the same loaded draft runs it too; `is_w8a16` reads it).
"""

from __future__ import annotations

import torch
from torch import nn

from .packed import PackedWrapper, _PackedForward, _PackedQKV, fused_projections, prepack_linears, stale

__all__ = ["INT8_ROWS", "IN_FEATURES_MULTIPLE", "SCHEMES", "quantize_w8a16", "is_w8a16", "int8_weight",
           "apply_draft_quantization", "check_draft_quantization"]

INT8_ROWS = 4  # products of 1 .. INT8_ROWS rows read the int8 copy (module docstring)
# the kernel reads the input features in blocks of this many, without a tail: with another width (Qwen's 8,960 and
# 1,536 are multiples; the embedded draft's 344 is not) its results are wrong or it crashes, so such a linear keeps
# its bfloat16 product
IN_FEATURES_MULTIPLE = 16
ALIGN = 64  # bytes: an input not starting at such an address is copied first (PyTorch's allocations are)
SCHEMES = ("w8a16",)  # LLM(draft_quantization=...): int8 weights, bfloat16 activations


def int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight (out, in), per-output-channel scales (out,) in the weight's dtype): symmetric, each row's
    largest magnitude at about 127 (an all-zero row keeps a tiny positive scale). The scale is rounded to the
    weight's dtype first and the weight divided by the rounded one: the kernel multiplies by the rounded scale."""
    w = weight.detach().float()
    scale = (w.abs().amax(1).clamp(min=1e-8) / 127).to(weight.dtype)
    return (w / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def _kernel_takes(weight: torch.Tensor) -> bool:
    """The int8 kernel computes a product with this (out, in) weight correctly (IN_FEATURES_MULTIPLE)."""
    return weight.ndim == 2 and weight.shape[1] > 0 and weight.shape[1] % IN_FEATURES_MULTIPLE == 0


def _few_rows(x: torch.Tensor) -> bool:
    """x's product runs on the int8 copy: 1 .. INT8_ROWS rows of bfloat16, no gradient wanted."""
    d = x.shape[-1] if x.ndim else 0
    rows = x.numel() // d if d else 0
    return 0 < rows <= INT8_ROWS and x.dtype == torch.bfloat16 and x.device.type == "cpu" \
        and not (torch.is_grad_enabled() and x.requires_grad)


def _product(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    flat = x.ndim == 2  # no reshape called where there is none to do (a call costs, cold: docs/performance.md)
    rows = (x if flat else x.reshape(-1, x.shape[-1])).contiguous()
    if rows.data_ptr() % ALIGN:  # a view at an odd offset: the kernel's vector loads want aligned rows
        rows = rows.clone()
    y = torch._weight_int8pack_mm(rows, w8, scale)
    if not flat:
        y = y.reshape(*x.shape[:-1], w8.shape[0])
    return y if bias is None else y + bias


class Int8Forward(PackedWrapper):
    """A packed linear's forward with an int8 copy for few-row products (module docstring). `inner` is the forward
    it wraps (models/packed.py packs it again there when it repacks)."""

    def __init__(self, module: nn.Linear) -> None:
        self.module = module
        self.inner = module.__dict__["forward"]
        self.weight = self.version = None
        self._quantize()

    def _quantize(self) -> None:
        w = self.module.weight
        self.weight, self.version = w, w._version
        self.w8, self.scale = int8_weight(w) if _kernel_takes(w) else (None, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        w = m.weight
        if not _few_rows(x) or w.dtype != torch.bfloat16 or w.device.type != "cpu" \
                or (w.requires_grad and torch.is_grad_enabled()):
            return self.inner(x)
        if w is not self.weight or w._version != self.version:
            self._quantize()
        if self.w8 is None:  # replaced by a weight the kernel cannot take
            return self.inner(x)
        return _product(x, self.w8, self.scale, m.bias)


class Int8QKV:
    """An attention's fused q, k and v product (models/packed.py `_PackedQKV`) with one stacked int8 copy for
    few-row products; where the fused product does not apply now (a module replaced, wrapped or hooked) it answers
    as the fused product does (None: the attention runs its three modules)."""

    def __init__(self, fused) -> None:
        self.inner = fused
        self.modules = fused.modules  # what prepack_linears reads of a fused product
        self.state = None
        self._quantize()

    def _quantize(self) -> None:
        self.state = self.inner._state()  # the three modules' weights and biases with their versions
        w = torch.cat([m.weight for m in self.modules])
        self.w8, self.scale = int8_weight(w) if _kernel_takes(w) else (None, None)
        biases = [m.bias for m in self.modules]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.sizes = [m.weight.shape[0] for m in self.modules]

    def __call__(self, x: torch.Tensor, q: nn.Module, k: nn.Module, v: nn.Module):
        if not _few_rows(x) or not self.inner._applies((q, k, v)) \
                or torch.is_grad_enabled() and any(m.weight.requires_grad for m in (q, k, v)):
            return self.inner(x, q, k, v)
        if stale(self.state, self.inner._state()):
            self._quantize()
        if self.w8 is None:  # replaced by weights the kernel cannot take
            return self.inner(x, q, k, v)
        return _product(x, self.w8, self.scale, self.bias).split(self.sizes, dim=-1)


def quantize_w8a16(model: nn.Module) -> int:
    """Give `model`'s prepacked bfloat16 linears and fused q/k/v products their int8 copies (module docstring), in
    place; returns how many were given one now (a second call gives none again). Packs the model first
    (`prepack_linears`, which does nothing where it already is)."""
    prepack_linears(model)
    n = 0
    fused = fused_projections(model)
    for m in model.modules():
        f = m.__dict__.get("_fused_qkv")
        if isinstance(f, _PackedQKV) and f.packed is not None and _kernel_takes(f.modules[0].weight):
            m._fused_qkv = Int8QKV(f)
            n += 1
    for m in model.modules():
        if type(m) is nn.Linear and id(m) not in fused and isinstance(m.__dict__.get("forward"), _PackedForward) \
                and _kernel_takes(m.weight):
            m.forward = Int8Forward(m)
            n += 1
    return n


def is_w8a16(model: nn.Module) -> bool:
    """`model` runs some of its few-row products on int8 copies: quantize_w8a16 was applied to it and a quantised
    linear still has bfloat16 weights on the CPU (a model converted to another dtype or device since runs none)."""
    def live(w: torch.Tensor) -> bool:
        return w.dtype == torch.bfloat16 and w.device.type == "cpu"

    for m in model.modules():
        f, qkv = m.__dict__.get("forward"), m.__dict__.get("_fused_qkv")
        if isinstance(f, Int8Forward) and live(m.weight) or isinstance(qkv, Int8QKV) and live(qkv.modules[0].weight):
            return True
    return False


def _check_scheme(scheme) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"draft_quantization must be None or one of {', '.join(map(repr, SCHEMES))}, got {scheme!r}")


def check_draft_quantization(scheme, device: str | torch.device | None, dtype: str | None) -> None:
    """What LLM(draft_quantization=scheme) needs, checked before anything loads (ValueError naming the argument):
    a known scheme, the CPU (`device`, resolved), oneDNN's bfloat16 kernels there, a bfloat16 draft (`dtype`: the
    LLM's, "auto" resolving to bfloat16 only on such a CPU)."""
    from .packed import prepack_available

    if scheme is None:
        return
    _check_scheme(scheme)
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"draft_quantization={scheme!r} runs the CPU's int8 kernel: device must be 'cpu', got "
                         f"{str(device)!r}")
    if not prepack_available():
        raise ValueError(f"draft_quantization={scheme!r} wraps oneDNN's packed bfloat16 products, which this CPU "
                         f"lacks (bfloat16 matrix instructions: AVX512-BF16 or AMX-BF16)")
    if dtype in ("float32", "float16"):
        raise ValueError(f"draft_quantization={scheme!r} quantises a bfloat16 draft: dtype must be 'bfloat16' or "
                         f"'auto', got {dtype!r}")


def apply_draft_quantization(draft: nn.Module, scheme: str | None) -> None:
    """LLM(draft_quantization=scheme) on a loaded draft (None: nothing). ValueError naming the argument where the
    draft has no bfloat16 linear on the CPU to quantise."""
    if scheme is None:
        return
    _check_scheme(scheme)
    if quantize_w8a16(draft) == 0 and not is_w8a16(draft):
        dtype = getattr(draft, "dtype", None)
        raise ValueError(f"draft_quantization={scheme!r} quantises a draft's bfloat16 linears on the CPU (oneDNN's "
                         f"packed kernels) whose input widths are multiples of {IN_FEATURES_MULTIPLE}; this draft has "
                         f"none (dtype {dtype}): load it with dtype='bfloat16' on the CPU, or leave "
                         f"draft_quantization=None")
