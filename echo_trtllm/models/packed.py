"""bfloat16 linears prepacked once for the CPU's matrix kernels (oneDNN), the weight kept as it was.

A one-token forward of Qwen2.5-Coder-1.5B in bfloat16 spends 92 % of its time in `torch.nn.functional.linear`,
which reorders each weight for oneDNN on every call. Packed once at load (`torch.ops.mkldnn._reorder_linear_weight`)
and run by `torch.ops.mkldnn._linear_pointwise`, the same products give bit-identical logits and the forward
takes 56 ms instead of 151 at one token, 107 instead of 182 at 16 and 292 instead of 376 at 64 (2-core AMD EPYC
with AVX512-BF16; docs/vllm.md, run K). float32 linears are left to PyTorch (the eager float32 path stays the
tests' oracle).

The module's `weight` stays what it was (exports, sharding and FP8 calibration read it), so packed linears cost
their weights' memory twice. A weight changed in place, replaced, or converted to another dtype after packing is
seen at the next call: the linear is repacked, or runs PyTorch's own path.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["prepack_linears", "prepack_available"]


def prepack_available() -> bool:
    """oneDNN is built in and the CPU runs its bfloat16 kernels."""
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class _PackedForward:
    """A linear's forward through its prepacked weight (module docstring)."""

    def __init__(self, module: nn.Linear) -> None:
        self.module = module
        self._pack()

    def _pack(self) -> None:
        w = self.module.weight
        self.weight, self.version = w, w._version
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        w = m.weight
        if w.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or w.device.type != "cpu" or w.requires_grad \
                and torch.is_grad_enabled():
            return nn.functional.linear(x, w, m.bias)
        if w is not self.weight or w._version != self.version:
            self._pack()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, m.bias, "none", [], "")


def prepack_linears(model: nn.Module) -> int:
    """Prepack every bfloat16 `nn.Linear` of `model` on the CPU (module docstring); returns how many were packed now.
    Does nothing where oneDNN's bfloat16 kernels are missing; a second call packs nothing again."""
    if not prepack_available():
        return 0
    from .invariant import TiledForward  # a batch-invariant linear keeps its tiles around the packed kernel

    n = 0
    for m in model.modules():
        if type(m) is nn.Linear and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu":
            fwd = m.__dict__.get("forward")
            if isinstance(fwd, TiledForward) and not isinstance(fwd.inner, _PackedForward):
                fwd.inner = _PackedForward(m)
                n += 1
            elif not isinstance(fwd, (_PackedForward, TiledForward)):
                m.forward = _PackedForward(m)
                n += 1
    return n
