"""Prepacked bfloat16 linears (models/packed.py) against PyTorch's own linear: the same logits bit for bit, the
same greedy tokens through the engine, and a weight changed after packing followed. A packed product of fewer rows
than `ROW_FLOOR` runs on that many (zero rows added): its reference is PyTorch's linear on the same padded rows."""

import functools

import pytest
import torch

from echo_trtllm import LLM, EchoConfig, SamplingParams
from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET
from echo_trtllm.models.loader import load_model
from echo_trtllm.models import packed
from echo_trtllm.models.packed import _PackedForward, prepack_available, prepack_linears
from echo_trtllm.runtime.inputs import chain_batch

pytestmark = pytest.mark.skipif(not prepack_available(), reason="oneDNN's bfloat16 kernels are not available here")


def _padded_linear(m: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """PyTorch's linear on x's rows, zero rows added up to ROW_FLOOR, x's rows of the result."""
    rows = x.reshape(-1, x.shape[-1])
    pad = rows.new_zeros(max(packed.ROW_FLOOR - rows.shape[0], 0), rows.shape[1])
    out = torch.nn.functional.linear(torch.cat([rows, pad]), m.weight, m.bias)[:rows.shape[0]]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _pytorch_padded(model) -> int:
    """The reference: every linear of `model` PyTorch's own, on rows padded as the packed products pad them."""
    for m in model.modules():
        if type(m) is torch.nn.Linear:
            m.forward = functools.partial(_padded_linear, m)
    return 0


def _logits(model, ids, tokens=(1, 16, 96)):
    out = []
    with torch.inference_mode():
        for t in tokens:
            cache = model.allocate_cache(1, 160)
            model(chain_batch([ids[:32]], torch.tensor([0]), torch.tensor([0]), logits="none"), cache)
            out.append(model(chain_batch([ids[32:32 + t]], torch.tensor([32]), torch.tensor([0]), logits="all"),
                             cache))
    return out


@pytest.mark.parametrize("floor", [1, 4])
def test_prepacked_logits_equal_pytorchs_linear_bit_for_bit(floor, monkeypatch):
    # 1, 2, 16 and 96 tokens after a 32-token prefix: packed for one row (PACK_ROWS = 1), 96 tokens parted from
    # PyTorch's linear in the last bit on the AMX Xeon. Floor 1: every product on its own rows, PyTorch's linear
    # unpadded the reference; 4, the default: one and two tokens run on four rows, as the reference does
    monkeypatch.setattr(packed, "ROW_FLOOR", floor)
    model, _ = load_model(DEFAULT_TARGET, dtype="bfloat16", with_tokenizer=False)
    reference, _ = load_model(DEFAULT_TARGET, dtype="bfloat16", with_tokenizer=False)
    _pytorch_padded(reference)
    ids = torch.randint(0, model.config.vocab_size, (128,), generator=torch.Generator().manual_seed(0))
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert prepack_linears(model) == linears and prepack_linears(model) == 0  # packed once
    for a, b in zip(_logits(reference, ids, (1, 2, 16, 96)), _logits(model, ids, (1, 2, 16, 96))):
        assert torch.equal(a, b)


def test_a_product_of_fewer_rows_than_the_floor_runs_on_the_floors_rows(monkeypatch):
    """The packed product of 0-5 rows, 2-D or 3-D, with a bias and without, against PyTorch's linear: on the rows
    padded to ROW_FLOOR below it, on the rows themselves from it (a Qwen2.5-Coder-1.5B MLP's shape: on the AMD EPYC
    one row alone and one row among four part in the last bit); and the shapes the kernel is given."""
    assert packed.ROW_FLOOR == 4
    torch.manual_seed(0)
    for bias in (True, False):
        lin = torch.nn.Linear(1536, 8960, bias=bias, dtype=torch.bfloat16)
        prepack_linears(lin)
        for shape in ((1, 1536), (2, 1536), (3, 1536), (4, 1536), (5, 1536), (0, 1536), (1, 1, 1536), (3, 1, 1536),
                      (2, 3, 1536)):
            x = torch.randn(*shape, dtype=torch.bfloat16)
            with torch.inference_mode():
                got = lin(x)
            assert got.shape == (*shape[:-1], 8960) and torch.equal(got, _padded_linear(lin, x))
    seen = []
    kernel = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda x, *a: seen.append(tuple(x.shape)) or kernel(x, *a))
    with torch.inference_mode():
        lin(torch.randn(1, 1536, dtype=torch.bfloat16))
        lin(torch.randn(2, 3, 1536, dtype=torch.bfloat16))
    assert seen == [(4, 1536), (2, 3, 1536)]


def test_a_weight_changed_after_packing_is_followed():
    model, _ = load_model(DEFAULT_TARGET, dtype="bfloat16", with_tokenizer=False)
    prepack_linears(model)
    ids = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(1))
    before = _logits(model, ids, (1,))[0]
    with torch.no_grad():
        model.lm_head.weight.mul_(2)  # in place: its version moves
    reference, _ = load_model(DEFAULT_TARGET, dtype="bfloat16", with_tokenizer=False)
    _pytorch_padded(reference)
    with torch.no_grad():
        reference.lm_head.weight.mul_(2)
    after = _logits(model, ids, (1,))[0]
    assert not torch.equal(before, after) and torch.equal(after, _logits(reference, ids, (1,))[0])
    model.float()  # another dtype: PyTorch's own path
    assert _logits(model, ids, (1,))[0].dtype == torch.float32


@pytest.mark.parametrize("policy", ["echo", "ar"])
def test_llm_in_bfloat16_runs_prepacked_and_decodes_as_unpacked(prompts, policy, monkeypatch):
    """The same LLM with its linears left to PyTorch (on rows padded to ROW_FLOOR, as the packed products run) is the
    reference: the packed products are bit-identical, so every step, drafted, verified or plain, decodes the same
    tokens. (ECHO against plain AR is no such reference in
    bfloat16: verifying several rows at once rounds a logit differently from one row, and the embedded target has
    exact bfloat16 ties among its top logits on these prompts.)"""
    import echo_trtllm.api as api

    def generate():
        with LLM(DEFAULT_TARGET, DEFAULT_DRAFT, speculative_config=EchoConfig(policy=policy), dtype="bfloat16",
                 max_batch_size=4, max_seq_len=256, fallback=False, cost_model=None) as llm:
            packed = isinstance(llm.target.lm_head.__dict__.get("forward"), _PackedForward)
            return packed, [o.token_ids for o in llm.generate(prompts[:4], SamplingParams(
                max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)]
    packed, got = generate()
    monkeypatch.setattr(api, "prepack_linears", _pytorch_padded)
    unpacked, ref = generate()
    assert packed and not unpacked and got == ref


def test_an_attentions_q_k_and_v_run_as_one_packed_product_and_follow_their_weights():
    """Prepacking fuses each attention's q, k and v into one product (the three modules keep their own weights and
    pack only if called on their own); the logits equal PyTorch's linears (above), and a k weight changed in place
    after packing is followed, as a model changed the same way before packing computes it."""
    model, _ = load_model(DEFAULT_TARGET, dtype="bfloat16", with_tokenizer=False)
    prepack_linears(model)
    attns = [m for m in model.modules() if hasattr(m, "q_proj")]
    calls = []
    for a in attns:
        fused = a.__dict__["_fused_qkv"]
        a._fused_qkv = lambda x, *mods, f=fused: calls.append(1) or f(x, *mods)
    ids = torch.randint(0, model.config.vocab_size, (128,), generator=torch.Generator().manual_seed(2))
    before = _logits(model, ids, (1, 16))
    assert len(calls) == 2 * 2 * len(attns)  # every layer, every forward (prefix and tokens, twice)
    assert all(a.q_proj.__dict__["forward"].weight is None for a in attns)  # never packed on its own
    with torch.no_grad():
        attns[0].k_proj.weight.mul_(2)
    reference, _ = load_model(DEFAULT_TARGET, dtype="bfloat16", with_tokenizer=False)
    _pytorch_padded(reference)
    with torch.no_grad():
        [m for m in reference.modules() if hasattr(m, "q_proj")][0].k_proj.weight.mul_(2)
    after = _logits(model, ids, (1, 16))
    assert not torch.equal(before[1], after[1])
    assert all(torch.equal(a, b) for a, b in zip(after, _logits(reference, ids, (1, 16))))


def test_a_fused_attention_tiled_later_runs_its_three_packed_linears():
    """Batch-invariant tiles put on after packing (as LLM does): the fused product steps aside and q, k and v run
    inside their tiles through their own packed weights, packed at their first call."""
    from echo_trtllm.models.invariant import make_batch_invariant

    model, _ = load_model(DEFAULT_TARGET, dtype="bfloat16", with_tokenizer=False)
    prepack_linears(model)
    attn = next(m for m in model.modules() if hasattr(m, "q_proj"))
    x = torch.randn(3, attn.q_proj.in_features, dtype=torch.bfloat16)
    qkv = attn.q_proj, attn.k_proj, attn.v_proj
    with torch.inference_mode():
        assert attn._fused_qkv(x, *qkv) is not None
        make_batch_invariant(model)
        assert attn._fused_qkv(x, *qkv) is None and attn._fused_qkv.packed is None  # stepped aside, weight released
        out = attn.k_proj(x)
    inner = attn.k_proj.__dict__["forward"].inner
    assert isinstance(inner, _PackedForward) and inner.weight is attn.k_proj.weight
    assert torch.equal(out, torch.nn.functional.linear(x, attn.k_proj.weight, attn.k_proj.bias))


def test_a_hooked_projection_sees_its_call_through_a_fused_attention():
    """FP8 calibration records each projection's input with a forward hook (models/fp8.py calibrate_amax): on a
    packed bfloat16 model every q, k and v still reports its input, and the logits stay those of PyTorch's linears."""
    from echo_trtllm.models.fp8 import calibrate_amax

    model, _ = load_model(DEFAULT_TARGET, dtype="bfloat16", with_tokenizer=False)
    ids = torch.randint(0, model.config.vocab_size, (128,), generator=torch.Generator().manual_seed(3))
    eager = _logits(model, ids, (16,))
    prepack_linears(model)
    got = []
    amax = calibrate_amax(model, lambda: got.extend(_logits(model, ids, (16,))))
    names = [n for n, m in model.named_modules() if n.endswith(("q_proj", "k_proj", "v_proj"))]
    assert names and all(amax.get(n, 0.0) > 0 for n in names)
    assert torch.equal(got[0], eager[0])


def test_a_projection_replaced_after_packing_is_the_one_that_runs():
    """A k projection replaced after packing (as FP8 quantisation replaces modules) and packed by a second call: the
    attention runs the new one, as a model given the same module before packing does."""
    model, _ = load_model(DEFAULT_TARGET, dtype="bfloat16", with_tokenizer=False)
    reference, _ = load_model(DEFAULT_TARGET, dtype="bfloat16", with_tokenizer=False)
    ids = torch.randint(0, model.config.vocab_size, (128,), generator=torch.Generator().manual_seed(4))
    prepack_linears(model)
    for m in (model, reference):
        attn = next(a for a in m.modules() if hasattr(a, "q_proj"))
        new = torch.nn.Linear(attn.k_proj.in_features, attn.k_proj.out_features, bias=attn.k_proj.bias is not None,
                              dtype=torch.bfloat16)
        with torch.no_grad():
            new.weight.copy_(attn.k_proj.weight * 2)
            if new.bias is not None:
                new.bias.copy_(attn.k_proj.bias)
        attn.k_proj = new
    _pytorch_padded(reference)
    prepack_linears(model)  # packs the new module on its own (the attention is fused already)
    assert isinstance(next(a for a in model.modules() if hasattr(a, "q_proj")).k_proj.__dict__["forward"],
                      _PackedForward)
    assert all(torch.equal(a, b) for a, b in zip(_logits(model, ids, (1, 16)), _logits(reference, ids, (1, 16))))
