"""FP8 (e4m3) linear layers for the project's runtime, calibrated the way NVIDIA's ModelOpt does it (amax).

Quantised: every projection of the decoder layers (q, k, v, o, gate, up, down); the embeddings, norms and the
LM head stay in the model's dtype (as ModelOpt's and vLLM's FP8 recipes keep the head). Two schemes:

    per_tensor   weight: one scale per matrix (amax / 448); activation: one static scale per layer, calibrated as
                 the amax of that layer's input over calibration prompts / 448
    per_channel  weight: one scale per output row; activation: one dynamic scale per token (row-wise amax at run time)

Each layer runs one scaled FP8 product (`torch._scaled_mm` on CUDA, the cuBLASLt kernel; on a CPU the same product
from the e4m3 values widened to float32, `_scaled_mm` below), and the layer enforces what the CUDA kernel requires
so the same code runs on an H100: both inner dimensions divisible by 16, the weight column-major as the second
operand (a row-major (out, in) weight transposed), float32 scales (tensor-wise: scalars; row-wise: (M, 1) and
(1, N), output bfloat16).

Calibrating a model end to end (its prompts run through the engine) lives above the models, in
`echo_trtllm/quantize.py`.

Checkpoint layout (what `echo-trtllm build --quantization fp8` writes and the loader reads; the layout vLLM and
HF use for `quant_method: "fp8"` checkpoints): `<proj>.weight` float8_e4m3fn (out, in), `<proj>.weight_scale`
float32 (scalar, or (out, 1) per channel), `<proj>.input_scale` float32 scalar (per tensor only), and in
config.json `"quantization_config": {"quant_method": "fp8", "activation_scheme": "static" | "dynamic",
"weight_scheme": "per_tensor" | "per_channel"}`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["FP8_MAX", "SCHEMES", "Fp8Linear", "quantize_model", "fp8_layers", "calibrate_amax", "quant_config",
           "fits_fp8", "ignored_layers", "quantized_state_dict", "prepare_for_checkpoint",
           "weight_bytes", "fp8_checkpoint_state"]

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
SCHEMES = ("per_tensor", "per_channel")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TINY = 1e-12


def _scaled_mm(qx: Tensor, qw: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """(qx · scale_a) @ (qw · scale_b)^T for e4m3 qx (M, K) and qw (N, K): torch._scaled_mm on a GPU (FP8 tensor
    cores); elsewhere the same product from the exactly widened e4m3 values in float32. On a CPU torch's own
    _scaled_mm is an emulation that took 2.35 s for a 64 x 1536 x 1536 product on an AVX512-FP16 Xeon (7 ms
    through float32), while the results agree to float32 rounding."""
    if qx.device.type == "cuda":
        return torch._scaled_mm(qx, qw.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return ((qx.float() @ qw.float().t()) * scale_a * scale_b).to(out_dtype)


def _quantize(x: Tensor, scale: Tensor) -> Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W stored in e4m3 and x quantised to e4m3 on the way in.

    The e4m3 weight is kept as its bytes (uint8) and the scales as float32 whatever `.to(dtype)` the model gets,
    so casting the model for the rest of its layers never re-rounds them."""

    row_wise = True  # each row on its own (models/invariant.py tiles it)

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: str) -> None:
        super().__init__()
        if scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
        if in_features % 16 or out_features % 16:
            raise ValueError(f"FP8 linear {in_features} -> {out_features}: torch._scaled_mm on CUDA needs both "
                             "dimensions divisible by 16")
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.ones(out_features if scheme == "per_channel" else (),
                                                        dtype=torch.float32))
        self.register_buffer("input_scale", torch.ones((), dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: str, input_amax: float | None) -> "Fp8Linear":
        """Quantise a linear layer: weight scale(s) from its amax; the static input scale from `input_amax` (the
        calibrated amax of its input; required per tensor)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, scheme)
        w = linear.weight.detach().float()
        if scheme == "per_channel":
            scale = w.abs().amax(dim=1).clamp(min=_TINY) / FP8_MAX
            q = _quantize(w, scale[:, None])
        else:
            if input_amax is None:
                raise ValueError("per_tensor FP8 needs the calibrated amax of the layer's input")
            scale = w.abs().amax().clamp(min=_TINY) / FP8_MAX
            q = _quantize(w, scale)
            layer.input_scale.fill_(max(float(input_amax), _TINY) / FP8_MAX)
        layer.qweight.copy_(q.view(torch.uint8))
        layer.weight_scale.copy_(scale)
        if linear.bias is not None:
            layer.bias.data.copy_(linear.bias.detach())
        return layer.to(device=linear.weight.device)

    @property
    def weight_fp8(self) -> Tensor:
        return self.qweight.view(FP8)

    def dequantized_weight(self) -> Tensor:
        """W as float32 (the reference the tests compare with)."""
        s = self.weight_scale[:, None] if self.scheme == "per_channel" else self.weight_scale
        return self.weight_fp8.float() * s

    def _apply(self, fn, recurse: bool = True):
        # a dtype cast of the model must not round the float32 scales (the uint8 weight is never cast); a device
        # move still moves them
        weight_scale, input_scale = self.weight_scale, self.input_scale
        super()._apply(fn, recurse)
        self.weight_scale = weight_scale.to(device=self.weight_scale.device)
        self.input_scale = input_scale.to(device=self.input_scale.device)
        return self

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            return x.new_zeros(*shape[:-1], self.out_features)
        if self.scheme == "per_channel":
            a_scale = x2.detach().abs().amax(dim=1, keepdim=True).float().clamp(min=_TINY) / FP8_MAX  # (M, 1)
            y = _scaled_mm(_quantize(x2, a_scale), self.weight_fp8, a_scale, self.weight_scale[None, :].contiguous(),
                           torch.bfloat16)
        else:
            out_dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
            y = _scaled_mm(_quantize(x2, self.input_scale), self.weight_fp8, self.input_scale, self.weight_scale,
                           out_dtype)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, e4m3, {self.scheme}"


def _projections(model: nn.Module):
    """(parent module, attribute, qualified name) of every decoder-layer projection."""
    for name, module in model.named_modules():
        for attr in PROJECTIONS:
            child = getattr(module, attr, None)
            if isinstance(child, (nn.Linear, Fp8Linear)):
                yield module, attr, f"{name}.{attr}" if name else attr


def fits_fp8(linear: nn.Module) -> bool:
    """The CUDA kernel's shape rule: both dimensions divisible by 16. A projection that breaks it stays in the
    model's dtype (listed as `ignored_layers` in the checkpoint's quantization_config)."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def ignored_layers(model: nn.Module) -> list[str]:
    return [name for parent, attr, name in _projections(model) if not fits_fp8(getattr(parent, attr))]


def fp8_layers(model: nn.Module) -> dict[str, Fp8Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


@torch.no_grad()
def calibrate_amax(model: nn.Module, run) -> dict[str, float]:
    """The amax of every projection's input while `run()` pushes calibration data through `model`."""
    amax: dict[str, float] = {}
    hooks = []
    for parent, attr, name in _projections(model):
        def hook(_m, args, _out, name=name):
            amax[name] = max(amax.get(name, 0.0), float(args[0].detach().abs().max()))
        hooks.append(getattr(parent, attr).register_forward_hook(hook))
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return amax


@torch.no_grad()
def quantize_model(model: nn.Module, scheme: str = "per_tensor", amax: dict[str, float] | None = None,
                   empty: bool = False) -> nn.Module:
    """Replace every decoder-layer projection that fits the kernel (`fits_fp8`) by its Fp8Linear (in place; returns
    the model). amax: calibrated input amax per projection (per_tensor; `calibrate_amax`); unused per_channel.
    empty: create the layers without quantising the current weights (to load a checkpoint into)."""
    if scheme not in SCHEMES:
        raise ValueError(f"FP8 scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    for parent, attr, name in list(_projections(model)):
        linear = getattr(parent, attr)
        if isinstance(linear, Fp8Linear) or not fits_fp8(linear):
            continue
        if empty:
            layer = Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None, scheme)
        else:
            if scheme == "per_tensor" and name not in (amax or {}):
                raise ValueError(f"no calibrated amax for {name}: the calibration run never reached it")
            layer = Fp8Linear.from_linear(linear, scheme, amax.get(name) if amax else None)
        setattr(parent, attr, layer.to(device=linear.weight.device))
    return model


def quant_config(scheme: str, ignored: list[str] | None = None) -> dict:
    """config.json's `quantization_config` for a checkpoint quantised with `scheme`."""
    return {"quant_method": "fp8", "weight_scheme": scheme,
            "activation_scheme": "static" if scheme == "per_tensor" else "dynamic", "ignored_layers": ignored or []}


def quantized_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The model's tensors in the checkpoint layout: `<proj>.weight` as float8_e4m3fn, `.weight_scale` ((out, 1)
    per channel), `.input_scale` (per tensor), everything else as it is."""
    out = {}
    layers = fp8_layers(model)
    for key, t in model.state_dict().items():
        prefix, _, leaf = key.rpartition(".")
        layer = layers.get(prefix)
        if layer is None:
            out[key] = t
        elif leaf == "qweight":
            out[f"{prefix}.weight"] = t.view(FP8)
        elif leaf == "weight_scale":
            out[key] = t.float()[:, None] if layer.scheme == "per_channel" else t.float()
        elif leaf == "input_scale":
            if layer.scheme == "per_tensor":
                out[key] = t.float()
        else:
            out[key] = t
    return out


def prepare_for_checkpoint(state: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """The inverse of `quantized_state_dict` for a model whose projections are (empty) Fp8Linear layers."""
    state = dict(state)
    for prefix, layer in fp8_layers(model).items():
        w = state.pop(f"{prefix}.weight", None)
        if w is None:
            raise ValueError(f"FP8 checkpoint lacks {prefix}.weight")
        if w.dtype != FP8:
            raise ValueError(f"{prefix}.weight is {w.dtype}; an FP8 checkpoint stores float8_e4m3fn")
        state[f"{prefix}.qweight"] = w.view(torch.uint8)
        scale = state.get(f"{prefix}.weight_scale")
        if scale is None:
            raise ValueError(f"FP8 checkpoint lacks {prefix}.weight_scale")
        state[f"{prefix}.weight_scale"] = scale.float().reshape(-1) if layer.scheme == "per_channel" \
            else scale.float().reshape(())
        if layer.scheme == "per_tensor":
            if f"{prefix}.input_scale" not in state:
                raise ValueError(f"FP8 checkpoint (static activations) lacks {prefix}.input_scale")
            state[f"{prefix}.input_scale"] = state[f"{prefix}.input_scale"].float().reshape(())
        else:
            state[f"{prefix}.input_scale"] = torch.ones(())
    return state


def fp8_checkpoint_state(path, quant, model: nn.Module, state: dict) -> dict:
    """A checkpoint with a `quantization_config` (a model or an EAGLE-3 head): the model's projections become empty Fp8Linear layers and the state is
    put in their layout. Any other quantisation is refused by name."""
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(f"{path}/config.json: quantization_config quant_method {method!r} is not supported; "
                         "supported: 'fp8' (echo-trtllm build --quantization fp8)")
    scheme = quant.get("weight_scheme", "per_tensor")
    if scheme not in SCHEMES or quant.get("activation_scheme") != ("static" if scheme == "per_tensor" else "dynamic"):
        raise ValueError(f"{path}/config.json: FP8 quantization_config {quant} is not one this runtime runs: "
                         "weight_scheme per_tensor with activation_scheme static, or per_channel with dynamic")
    quantize_model(model, scheme, empty=True)
    try:
        return prepare_for_checkpoint(state, model)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers as they are held (e4m3 weights: one byte each)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
