"""The RMS norm and the rotary embedding on the CPU in one pass each (plugins/csrc/echo_cpu_forward.cpp), where the
eager PyTorch code runs a chain of small operations: the norm seven (upcast, square, mean, add, rsqrt, product,
downcast, then the weight's product), the rotary embedding six per tensor (two slices, a negation, a concatenation,
two products and a sum). At a decode step's few rows each operation costs its call and a pass over memory more
than its arithmetic (docs/performance.md measures both; the MLP's silu and product as one pass was measured too and
is slower than PyTorch's two vectorised, threaded operations, so it is not here).

`rms_norm(x, weight, eps)` and `rope_qk(q, k, cos, sin)` return what the eager code returns, or None where the
kernels do not apply (then the caller runs the eager code): a tensor off the CPU, a dtype other than float32 and
bfloat16, gradients wanted, or the library not built (scripts/setup.sh builds it with the C++ compiler; the
environment variable ECHO_CPU_FORWARD_LIB names another build). Each rounds where the eager code rounds. The rotary
embedding equals the eager one to the bit; the norm sums its squares in another order, so its mean can differ in
the last bit (tests/models/test_cpu_kernels.py bounds it and checks float32 generation token for token against the
eager path). A row's result depends on that row alone, however many rows a call has (batch-invariant mode).

`ENABLED` (default: on unless ECHO_CPU_KERNELS=0) switches them off for the eager oracle and the measurements'
control arms; it is read at every call.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["ENABLED", "available", "rms_norm", "rope_qk"]

logger = logging.getLogger(__name__)

ENABLED = os.environ.get("ECHO_CPU_KERNELS", "1") != "0"
LIB_NAME = "libecho_cpu_forward.so"
BUILD_DIR = Path(__file__).resolve().parents[2] / "plugins" / "build"
VERSION = 2
# elements per call from which a call is split over torch's intra-op threads (a thread's start costs about what
# this many elements do)
SPLIT_ELEMENTS = 1 << 18
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_i64, _f32, _i32, _vp = ctypes.c_int64, ctypes.c_float, ctypes.c_int32, ctypes.c_void_p


@functools.cache
def _library() -> ctypes.CDLL | None:
    env = os.environ.get("ECHO_CPU_FORWARD_LIB")
    path = Path(env) if env else BUILD_DIR / LIB_NAME
    if not path.is_file():
        return None
    try:
        lib = ctypes.CDLL(str(path))
        version = lib.echo_cpu_forward_version()
    except (OSError, AttributeError) as e:
        logger.warning("%s is not usable (%s): the eager norm and rotary embedding run instead", path, e)
        return None
    if version != VERSION:
        logger.warning("%s is version %s, this package expects %s: the eager code runs (rebuild: scripts/setup.sh)",
                       path, version, VERSION)
        return None
    if not lib.echo_cpu_forward_supported():  # built with -march=native for another CPU
        logger.warning("%s was built for instruction sets this CPU lacks: the eager code runs (rebuild: "
                       "scripts/setup.sh)", path)
        return None
    lib.echo_rms_norm.argtypes = [_vp, _i64, _vp, _vp, _i64, _i64, _f32, _i32, _i32]
    lib.echo_rope_qk.argtypes = [_vp, _i64, _i64, _vp, _i64, _i64, _vp, _vp, _vp, _vp, _i64, _i64, _i32, _i32]
    return lib


def available() -> bool:
    """The kernels are switched on and built."""
    return ENABLED and _library() is not None


def _applies(*tensors: Tensor) -> bool:
    if not ENABLED:
        return False
    dtype = tensors[0].dtype
    if dtype not in _DTYPES or any(t.device.type != "cpu" or t.dtype != dtype for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)) and _library() is not None


def _threads(elements: int) -> int:
    return torch.get_num_threads() if elements >= SPLIT_ELEMENTS else 1


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor | None:
    """RMSNorm.forward of x (..., D) with weight (D,) in x's dtype, or None where the kernel does not apply."""
    d = x.shape[-1]
    if not _applies(x, weight) or weight.shape != (d,) or not weight.is_contiguous() or d == 0:
        return None
    rows = x if x.ndim == 2 else x.reshape(-1, d)  # a view where it can be (no call where it is one already)
    if rows.stride(1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < d):  # strided columns, overlapping rows
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device="cpu")
    n = rows.shape[0]
    if n == 0:
        return out
    rc = _library().echo_rms_norm(rows.data_ptr(), rows.stride(0) if n > 1 else d, weight.data_ptr(),
                                  out.data_ptr(), n, d, eps, _DTYPES[x.dtype], _threads(n * d))
    return out if rc == 0 else None  # refused (never for the checked arguments): the eager code


def _heads(x: Tensor) -> tuple[int, int] | None:
    """(token stride, heads) of x (T, H, D) whose heads are contiguous within a token, else None."""
    t, h, d = x.shape
    if h < 1 or x.stride(2) != 1 or (h > 1 and x.stride(1) != d) or (t > 1 and x.stride(0) < h * d):
        return None
    return (x.stride(0) if t > 1 else h * d), h


def rope_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor] | None:
    """apply_rope of q (T, Hq, D) and of k (T, Hk, D) with cos, sin (T, D), or None where the kernel does not
    apply."""
    if q.ndim != 3 or k.ndim != 3 or not _applies(q, k, cos, sin):
        return None
    t, hq, d = q.shape
    if k.shape[0] != t or k.shape[2] != d or d < 2 or d % 2 or cos.shape != (t, d) or sin.shape != (t, d):
        return None
    qs, ks = _heads(q), _heads(k)
    if qs is None or ks is None or not cos.is_contiguous() or not sin.is_contiguous():
        return None
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device="cpu"), torch.empty(k.shape, dtype=k.dtype, device="cpu")
    if t == 0:
        return q_out, k_out
    rc = _library().echo_rope_qk(q.data_ptr(), qs[0], qs[1], k.data_ptr(), ks[0], ks[1], cos.data_ptr(),
                                 sin.data_ptr(), q_out.data_ptr(), k_out.data_ptr(), t, d, _DTYPES[q.dtype],
                                 _threads(t * (hq + ks[1]) * d))
    return (q_out, k_out) if rc == 0 else None

