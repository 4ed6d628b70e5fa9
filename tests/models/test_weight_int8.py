"""A draft's few-row products through int8 weights (models/weight_int8.py, `LLM(draft_quantization="w8a16")`):
the int8 product against float32 arithmetic on the dequantised weights, wider products unchanged (the packed
bfloat16 product bit for bit), weights changed in place followed, the engine's output held to plain decoding, and
every bad use refused by name."""

import pytest
import torch

from echo_trtllm import LLM, EchoConfig, SamplingParams
from echo_trtllm.cli import main as cli_main
from echo_trtllm.models import DEFAULT_EAGLE3, DEFAULT_TARGET
from echo_trtllm.models.eagle3 import load_eagle3
from echo_trtllm.models.loader import load_model
from echo_trtllm.models.packed import prepack_available, prepack_linears
from echo_trtllm.models import weight_int8
from echo_trtllm.models.weight_int8 import (INT8_ROWS, Int8Forward, Int8QKV, int8_weight, is_w8a16,
                                            quantize_w8a16)

pytestmark = pytest.mark.skipif(not prepack_available(), reason="oneDNN's bfloat16 kernels are not available here")


@pytest.fixture
def int8_calls(monkeypatch):
    """Counts the int8 kernel's calls (each still runs the kernel)."""
    calls = [0]
    kernel = torch._weight_int8pack_mm

    def counted(*args):
        calls[0] += 1
        return kernel(*args)

    monkeypatch.setattr(torch, "_weight_int8pack_mm", counted)
    return calls


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 arithmetic on the dequantised weight: x (..., in) @ (int8 * scale).T + bias."""
    w8, scale = int8_weight(weight)
    y = x.float() @ (w8.float() * scale.float()[:, None]).T
    return y if bias is None else y + bias.float()


def _linear(n_in, n_out, bias=True, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(n_in, n_out, bias=bias).to(torch.bfloat16)


def _quantised_linear(n_in, n_out, bias=True):
    """A bfloat16 linear given its int8 copy (inside a module, as a draft's linears are)."""
    lin = _linear(n_in, n_out, bias)
    module = torch.nn.Module()
    module.proj = lin
    assert quantize_w8a16(module) == 1
    return lin


def test_the_int8_weight_is_the_weight_rounded_per_output_channel():
    w = _linear(96, 40).weight
    w8, scale = int8_weight(w)
    assert w8.dtype == torch.int8 and scale.dtype == torch.bfloat16 and w8.shape == w.shape
    assert (w8.abs().amax(1) >= 126).all()  # each row's largest at 127 but for the scale's rounding
    exact = w.float().abs().amax(1) / 127  # the scale before its rounding to bfloat16 (2^-9 relative at most)
    assert ((scale.float() - exact).abs() <= exact * 2 ** -8).all()
    step = scale.float()[:, None]  # what the kernel multiplies by; an entry is within half of it, or clipped at
    # 127 steps where the rounded scale came out below the exact one (by at most 127 * 2^-9 of a step)
    assert ((w8.float() * step - w.float()).abs() <= 0.75 * step).all()
    zero = torch.zeros(3, 8, dtype=torch.bfloat16)  # an all-zero row stays zero, its scale positive
    z8, zs = int8_weight(zero)
    assert not z8.any() and (zs > 0).all()


@pytest.mark.parametrize("bias", [True, False])
def test_few_row_products_are_the_dequantised_weights_and_wider_ones_unchanged(bias, int8_calls):
    """1 .. INT8_ROWS rows (2-D and 3-D): the int8 kernel, equal to float32 arithmetic on the dequantised weight
    within bfloat16's rounding of the output; INT8_ROWS + 1 rows and zero rows: the packed bfloat16 product, bit
    for bit as an unquantised copy of the same linear gives it."""
    lin, plain = _linear(96, 40, bias), _linear(96, 40, bias)
    module = torch.nn.Module()
    module.proj = lin
    assert prepack_linears(plain) == 1 and quantize_w8a16(module) == 1
    assert isinstance(lin.__dict__["forward"], Int8Forward) and is_w8a16(module) and not is_w8a16(plain)
    with torch.inference_mode():
        for shape in [(1, 96), (2, 96), (INT8_ROWS, 96), (1, 3, 96)]:
            x = torch.randn(*shape, dtype=torch.bfloat16)
            before = int8_calls[0]
            got = lin(x)
            assert int8_calls[0] == before + 1 and got.shape == (*shape[:-1], 40) and got.dtype == torch.bfloat16
            ref = _reference(x, lin.weight, lin.bias)
            assert torch.allclose(got.float(), ref, atol=2e-3, rtol=1e-2), (got.float() - ref).abs().max()
            # and, independent of the quantiser, near the bfloat16 weight's product in float32 arithmetic
            exact = torch.nn.functional.linear(x.float(), lin.weight.float(), None if lin.bias is None else
                                               lin.bias.float())
            assert (got.float() - exact).norm() <= 0.02 * exact.norm()
            # and it is not the bfloat16 weight's product: the rounding to int8 is seen
            assert not torch.equal(got, plain(x))
        for x in (torch.randn(INT8_ROWS + 1, 96, dtype=torch.bfloat16), torch.randn(0, 96, dtype=torch.bfloat16),
                  torch.randn(2, 3, 96, dtype=torch.bfloat16)):
            before = int8_calls[0]
            assert torch.equal(lin(x), plain(x)) and int8_calls[0] == before


def test_a_linear_the_kernel_cannot_take_keeps_its_bfloat16_product(int8_calls):
    """The int8 kernel reads input features in blocks of 16 with no tail (its products at 344 inputs are wrong, at
    100 it crashes): such a linear is not given an int8 copy, and one replaced by such a weight falls back."""
    odd, even = _linear(344, 128), _linear(128, 344)
    module = torch.nn.Module()
    module.odd, module.even = odd, even
    assert quantize_w8a16(module) == 1
    assert not isinstance(odd.__dict__["forward"], Int8Forward) and isinstance(even.__dict__["forward"], Int8Forward)
    x = torch.randn(2, 344, dtype=torch.bfloat16)
    plain = _linear(344, 128)
    prepack_linears(plain)
    even.weight = torch.nn.Parameter(torch.randn(344, 120, dtype=torch.bfloat16))  # now 120 inputs
    with torch.inference_mode():
        assert torch.equal(odd(x), plain(x)) and int8_calls[0] == 0
        y = even(torch.randn(2, 120, dtype=torch.bfloat16))
    assert y.shape == (2, 344) and int8_calls[0] == 0
    only_odd = torch.nn.Module()
    only_odd.proj = _linear(344, 8)
    with pytest.raises(ValueError, match="input widths are multiples of 16; this draft has none"):
        weight_int8.apply_draft_quantization(only_odd, "w8a16")


def test_a_weight_changed_in_place_is_quantised_again(int8_calls):
    lin = _quantised_linear(64, 32)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.mul_(-2.0)
        got = lin(x)
    assert torch.allclose(got.float(), _reference(x, lin.weight, lin.bias), atol=2e-3, rtol=1e-2)
    lin.weight = torch.nn.Parameter(torch.randn(32, 64, dtype=torch.bfloat16) * 0.1)  # replaced
    with torch.no_grad():
        assert torch.allclose(lin(x).float(), _reference(x, lin.weight, lin.bias), atol=2e-3, rtol=1e-2)
    assert int8_calls[0] == 2  # both calls ran the int8 kernel


def test_a_heads_fused_q_k_and_v_run_one_stacked_int8_product(int8_calls):
    """The embedded EAGLE-3 head in bfloat16: its attention's q, k and v come from one int8 product whose three
    parts are float32 arithmetic on each projection's dequantised rows (stacked, each row keeps its own scale);
    quantising again gives nothing new, packing again keeps the int8 forwards (an engine built later on the same
    head)."""
    target, _ = load_model(DEFAULT_TARGET, dtype="bfloat16", with_tokenizer=False)
    head = load_eagle3(DEFAULT_EAGLE3, target)
    n = quantize_w8a16(head)
    attn = head.midlayer.self_attn
    assert isinstance(attn.__dict__["_fused_qkv"], Int8QKV)
    linears = [m for m in head.modules() if type(m) is torch.nn.Linear]
    assert n == len(linears) - 3 + 1  # every linear but q, k and v, and the fused product
    assert quantize_w8a16(head) == 0 and prepack_linears(head) == 0 and is_w8a16(head)
    assert not is_w8a16(load_eagle3(DEFAULT_EAGLE3, target).float())  # never quantised
    converted = load_eagle3(DEFAULT_EAGLE3, target)
    quantize_w8a16(converted)
    assert not is_w8a16(converted.float())  # converted since: no int8 product runs
    assert all(isinstance(m.__dict__["forward"], Int8Forward) for m in linears
               if m not in (attn.q_proj, attn.k_proj, attn.v_proj))
    x = torch.randn(3, attn.q_proj.in_features, dtype=torch.bfloat16)
    with torch.inference_mode():
        q, k, v = attn._fused_qkv(x, attn.q_proj, attn.k_proj, attn.v_proj)
    assert int8_calls[0] == 1
    for got, m in zip((q, k, v), (attn.q_proj, attn.k_proj, attn.v_proj)):
        assert torch.allclose(got.float(), _reference(x, m.weight, m.bias), atol=2e-3, rtol=1e-2)
    wide = torch.randn(INT8_ROWS + 1, attn.q_proj.in_features, dtype=torch.bfloat16)
    with torch.inference_mode():
        parts = attn._fused_qkv(wide, attn.q_proj, attn.k_proj, attn.v_proj)
    assert int8_calls[0] == 1 and [p.shape[-1] for p in parts] == [m.out_features for m in (attn.q_proj, attn.k_proj,
                                                                                             attn.v_proj)]
    with torch.enable_grad():  # weights that want gradients: the packed path's answer, never the int8 copy
        for m in (attn.q_proj, attn.k_proj, attn.v_proj):
            m.weight.requires_grad_(True)
        assert attn._fused_qkv(x, attn.q_proj, attn.k_proj, attn.v_proj) is None and int8_calls[0] == 1
        for m in (attn.q_proj, attn.k_proj, attn.v_proj):
            m.weight.requires_grad_(False)
    attn.q_proj.register_forward_hook(lambda *a: None)  # hooked: the fused product declines, as the packed one does
    with torch.inference_mode():
        assert attn._fused_qkv(x, attn.q_proj, attn.k_proj, attn.v_proj) is None


def test_echo_with_an_int8_head_decodes_as_plain_decoding(int8_calls):
    """Batch-invariant engines (bfloat16's output then the same under any policy): ECHO with the int8 head, every
    step speculative, emits AR's tokens; the head's int8 products ran; a second engine on the same loaded head
    reads it as quantised."""
    prompts = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n"]
    sp = SamplingParams(max_tokens=24, temperature=0.0)
    echo = LLM(dtype="bfloat16", draft_quantization="w8a16", batch_invariant=True, fallback=False)
    try:
        assert echo.draft_quantization == "w8a16"
        before = int8_calls[0]
        got = [o.outputs[0].token_ids for o in echo.generate(prompts, sp)]
        assert int8_calls[0] > before
        again = LLM(echo.target, echo.draft, tokenizer=echo.tokenizer, dtype="bfloat16", batch_invariant=True)
        assert again.draft_quantization == "w8a16"
        again.shutdown()
        ar = LLM(echo.target, None, tokenizer=echo.tokenizer, dtype="bfloat16", batch_invariant=True,
                 speculative_config=EchoConfig(policy="ar"))
        want = [o.outputs[0].token_ids for o in ar.generate(prompts, sp)]
        ar.shutdown()
    finally:
        echo.shutdown()
    assert got == want
    plain = LLM(dtype="bfloat16")
    try:
        assert plain.draft_quantization is None
    finally:
        plain.shutdown()


@pytest.mark.parametrize("kwargs, words", [
    (dict(draft_quantization="int4"), "draft_quantization must be None or one of 'w8a16'"),
    (dict(draft_quantization=True), "draft_quantization must be None or one of 'w8a16'"),
    (dict(draft_quantization="w8a16", speculative_config=EchoConfig(policy="ar")), "policy 'ar' runs none"),
    (dict(draft_quantization="w8a16", tensor_parallel_size=2), "tensor_parallel_size must be 1"),
    (dict(draft_quantization="w8a16", dtype="float32"), "dtype must be 'bfloat16' or 'auto', got 'float32'"),
])
def test_bad_draft_quantization_is_refused_by_name(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        LLM(**kwargs)


def test_the_cli_takes_draft_quantization_and_refuses_other_schemes(capsys):
    with pytest.raises(SystemExit):
        cli_main(["generate", "--prompt", "x", "--draft-quantization", "int4"])
    assert "--draft-quantization" in capsys.readouterr().err
    assert cli_main(["generate", "--prompt", "def f(x):", "--max-tokens", "4", "--dtype", "bfloat16",
                     "--draft-quantization", "w8a16"]) == 0
    assert "draft_quantization=w8a16 dtype=bfloat16/bfloat16" in capsys.readouterr().out
    assert cli_main(["generate", "--prompt", "x", "--max-tokens", "2", "--dtype", "float32",
                     "--draft-quantization", "w8a16"]) != 0  # refused by name, not a traceback
    assert "draft_quantization='w8a16'" in capsys.readouterr().err


def test_the_clis_choices_are_the_llms_schemes():
    from echo_trtllm.cli import bench, generate, serve

    for command in (generate, serve, bench):
        action = next(a for a in command.build_parser()._actions if a.dest == "draft_quantization")
        assert tuple(action.choices) == weight_int8.SCHEMES and action.default is None


def test_an_input_at_an_odd_offset_is_copied_before_the_kernel(int8_calls):
    """A row view one element into a larger tensor (not 64-byte aligned) gives the same product as a fresh copy."""
    lin = _quantised_linear(64, 32)
    big = torch.randn(2, 65, dtype=torch.bfloat16)
    view = big[:1, 1:]  # contiguous, at an offset of 2 bytes
    assert view.is_contiguous() and view.data_ptr() % 64
    with torch.inference_mode():
        assert torch.equal(lin(view), lin(view.clone())) and int8_calls[0] == 2


def test_a_draft_sharing_the_targets_weights_or_a_quantised_target_is_refused():
    """Only the draft's products may change: a draft that is the target (or shares its weights) is refused, and so
    is a model quantised as a draft and then given as a target."""
    model, tok = load_model(DEFAULT_TARGET, dtype="bfloat16")
    with pytest.raises(ValueError, match="shares .* weights with the target"):
        LLM(model, model, tokenizer=tok, draft_quantization="w8a16")
    assert not is_w8a16(model)
    quantize_w8a16(model)
    with pytest.raises(ValueError, match="model: its few-row products run int8 copies"):
        LLM(model, None, tokenizer=tok, speculative_config=EchoConfig(policy="ar"))


def test_a_cuda_device_is_refused_before_loading(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="device must be 'cpu', got 'cuda'"):
        LLM(draft_quantization="w8a16", device="cuda")
    with pytest.raises(ValueError, match="device must be 'cpu', got 'cuda'"):  # the default device on a GPU machine
        LLM(draft_quantization="w8a16")


def test_bench_quantises_its_one_draft_or_refuses_by_name(capsys, tmp_path):
    """`bench --draft-quantization w8a16` runs every method on the quantised draft and records it; a float32 draft
    is refused by name."""
    assert cli_main(["bench", "--dtype", "float32", "--draft-quantization", "w8a16", "--methods", "echo",
                     "--batch-sizes", "1", "--max-tokens", "2", "--rounds", "1", "--warmup-rounds", "0"]) != 0
    assert "draft_quantization='w8a16'" in capsys.readouterr().err
    out = tmp_path / "bench.json"
    assert cli_main(["bench", "--dtype", "bfloat16", "--draft-quantization", "w8a16", "--methods", "ar,echo",
                     "--batch-sizes", "1", "--max-tokens", "4", "--rounds", "1", "--warmup-rounds", "0",
                     "--json", str(out)]) == 0
    import json

    doc = json.loads(out.read_text())
    assert doc["draft_quantization"] == "w8a16" and {r["method"] for r in doc["results"]} >= {"ar", "echo"}
