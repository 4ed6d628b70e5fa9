"""The CPU's one-pass RMS norm and rotary embedding (models/cpu_kernels.py) against the eager PyTorch code they
replace: the rotary embedding bit for bit, the norm within its last bit, each row's result the same alone and inside
any number of rows, and float32 generation through the engine token for token as the eager path generates it."""

import pytest
import torch

from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET, cpu_kernels
from echo_trtllm.models.llama import RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq
from echo_trtllm.models.loader import load_model
from tests.helpers import run_greedy

pytestmark = pytest.mark.skipif(cpu_kernels._library() is None,
                                reason="the CPU forward library is not built (scripts/setup.sh)")

DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    """The kernels on whatever ECHO_CPU_KERNELS says (the variable switches the engine to the eager oracle)."""
    monkeypatch.setattr(cpu_kernels, "ENABLED", True)


@pytest.fixture
def eager(monkeypatch):
    """A context in which the kernels are off (the eager oracle)."""
    def off():
        monkeypatch.setattr(cpu_kernels, "ENABLED", False)
        return monkeypatch
    return off


def _norm(dim: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    n = RMSNorm(dim, 1e-6).to(dtype)
    with torch.no_grad():
        n.weight.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(seed)))
    return n


def _eager_norm(n: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + n.eps)).to(x.dtype) * n.weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16, 64, 300])
def test_the_norm_equals_the_eager_norm_within_its_last_bit(dtype, rows):
    n = _norm(1536, dtype, rows)
    x = (torch.randn(rows, 1536, generator=torch.Generator().manual_seed(7)) * 4).to(dtype)
    with torch.inference_mode():
        ref = _eager_norm(n, x)
        got = cpu_kernels.rms_norm(x, n.weight, n.eps)
        assert got is not None and got.dtype == dtype and got.shape == x.shape
        assert torch.equal(n(x), got)  # the module runs the kernel
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -22
    torch.testing.assert_close(got.float(), ref.float(), rtol=2 * ulp, atol=1e-30)
    assert (got != ref).float().mean() < 0.5  # the same rounding: most elements equal to the bit


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_norm_is_the_same_alone_and_among_any_number_of_rows(dtype):
    n = _norm(896, dtype, 1)
    x = torch.randn(700, 896, generator=torch.Generator().manual_seed(2)).to(dtype)  # 700 rows: split over threads
    with torch.inference_mode():
        whole = cpu_kernels.rms_norm(x, n.weight, n.eps)
        for i in (0, 5, 699):
            assert torch.equal(cpu_kernels.rms_norm(x[i:i + 1], n.weight, n.eps), whole[i:i + 1])
        assert torch.equal(cpu_kernels.rms_norm(x[10:26], n.weight, n.eps), whole[10:26])
        # a view whose rows are not adjacent (a slice of a wider tensor)
        wide = torch.cat([x, x], dim=1)[:, 896:]
        assert torch.equal(cpu_kernels.rms_norm(wide, n.weight, n.eps), whole)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 16, 400])
def test_the_rotary_embedding_equals_the_eager_one_bit_for_bit(dtype, tokens):
    # q, k and v as slices of one fused product (models/packed.py), as the attention reads them
    gen = torch.Generator().manual_seed(tokens)
    qkv = (torch.randn(tokens, (12 + 2 + 2) * 64, generator=gen) * 3).to(dtype)
    q, k = qkv[:, :768].view(tokens, 12, 64), qkv[:, 768:896].view(tokens, 2, 64)
    inv = rope_inv_freq(type("C", (), {"head_dim": 64, "rope_theta": 1e6, "rope_scaling": None})())
    cos, sin = rope_cos_sin(inv, torch.randint(0, 4000, (tokens,), generator=gen), dtype)
    with torch.inference_mode():
        got = cpu_kernels.rope_qk(q, k, cos, sin)
        assert got is not None
        assert torch.equal(got[0], apply_rope(q, cos, sin)) and torch.equal(got[1], apply_rope(k, cos, sin))
        assert got[0].is_contiguous() and got[1].is_contiguous()


def test_nan_and_infinity_pass_through_as_in_the_eager_code():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    x[1, 3], x[2, 0] = float("nan"), float("inf")
    q, k = x.view(4, 1, 64), x.view(4, 1, 64)
    cos, sin = torch.rand(4, 64, dtype=torch.bfloat16), torch.rand(4, 64, dtype=torch.bfloat16)
    n = _norm(64, torch.bfloat16, 0)
    with torch.inference_mode():
        got = cpu_kernels.rope_qk(q, k, cos, sin)
        torch.testing.assert_close(got[0], apply_rope(q, cos, sin), rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(cpu_kernels.rms_norm(x, n.weight, n.eps), _eager_norm(n, x), rtol=0, atol=0,
                                   equal_nan=True)


def test_the_kernels_step_aside_where_they_do_not_apply(eager):
    x = torch.randn(3, 32)
    w = torch.nn.Parameter(torch.ones(32))
    assert cpu_kernels.rms_norm(x, w, 1e-6) is None  # gradients wanted: autograd needs the eager operations
    qk = torch.randn(3, 1, 32, requires_grad=True)
    assert cpu_kernels.rope_qk(qk, qk, x, x) is None
    with torch.no_grad():
        assert cpu_kernels.rms_norm(x, w, 1e-6) is not None
        assert cpu_kernels.rms_norm(x.half(), w.half(), 1e-6) is None  # float16: not a kernel's dtype
        assert cpu_kernels.rms_norm(x, w.double(), 1e-6) is None  # mixed dtypes: the eager code promotes
        assert cpu_kernels.rope_qk(x.view(3, 1, 32), x.view(3, 1, 32), x[:, :16], x[:, :16]) is None  # bad cos
        over = x[:1].expand(3, 32)  # rows that overlap (stride 0): copied, not refused
        assert torch.equal(cpu_kernels.rms_norm(over, w, 1e-6), cpu_kernels.rms_norm(over.contiguous(), w, 1e-6))
        q = torch.randn(1, 4, 32).expand(3, 4, 32)  # tokens that overlap: the eager code runs
        assert cpu_kernels.rope_qk(q, q, x, x) is None
        assert cpu_kernels.rms_norm(x[:0], w, 1e-6).shape == (0, 32)  # no rows: an empty result
        eager()
        assert cpu_kernels.rms_norm(x, w, 1e-6) is None and not cpu_kernels.available()


def test_float32_generation_is_token_for_token_the_eager_paths(prompts, eager, monkeypatch):
    """The embedded pair in float32 (the engine's oracle dtype), plain AR and ECHO: the kernels run in every layer of
    both models and every request decodes as with the eager code."""
    target, tok = load_model(DEFAULT_TARGET, dtype="float32")
    draft, _ = load_model(DEFAULT_DRAFT, dtype="float32", with_tokenizer=False)
    calls = {"rms_norm": 0, "rope_qk": 0}  # calls the kernel ran (not stepped aside)

    def counted(name):
        fn = getattr(cpu_kernels, name)

        def call(*args):
            out = fn(*args)
            calls[name] += out is not None
            return out
        return call
    for name in calls:
        monkeypatch.setattr(cpu_kernels, name, counted(name))
    fused = {p: run_greedy(target, draft, tok, p, prompts[:4], 4, [24] * 4)[0] for p in ("ar", "echo")}
    assert all(calls.values()), calls
    eager()
    for policy, got in fused.items():
        assert got == run_greedy(target, draft, tok, policy, prompts[:4], 4, [24] * 4)[0], policy


def test_bfloat16_logits_with_the_kernels_are_the_eager_ones_within_rounding(eager):
    """The embedded target in bfloat16, 1 and 16 tokens after a prefix: the logits with the kernels against the eager
    code's, within a few bfloat16 roundings (the norm's mean may round apart in its last float32 bit)."""
    from echo_trtllm.runtime.inputs import chain_batch

    model, _ = load_model(DEFAULT_TARGET, dtype="bfloat16", with_tokenizer=False)
    ids = torch.randint(0, model.config.vocab_size, (48,), generator=torch.Generator().manual_seed(5)).tolist()

    def logits():
        out = []
        with torch.inference_mode():
            for t in (1, 16):
                cache = model.allocate_cache(1, 64)
                model(chain_batch([ids[:32]], torch.tensor([0]), torch.tensor([0]), logits="none"), cache)
                out.append(model(chain_batch([ids[32:32 + t]], torch.tensor([32]), torch.tensor([0]), logits="all"),
                                 cache))
        return out
    fused = logits()
    eager()
    for a, b in zip(fused, logits()):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)
