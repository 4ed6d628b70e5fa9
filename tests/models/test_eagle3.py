"""The EAGLE-3 head, its loader and the target's feature capture, each against an independent reference: HF
`transformers` hidden states for the capture, a per-request dense-attention implementation written from the
published layout for the head, and round trips through checkpoints named as EAGLE / SpecForge / vLLM name them."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from echo_trtllm.models import DEFAULT_TARGET
from echo_trtllm.models.eagle3 import EAGLE3_ARCHITECTURE, Eagle3Config, Eagle3Head, load_eagle3
from echo_trtllm.models.loader import load_model
from echo_trtllm.models.llama import rope_cos_sin
from echo_trtllm.runtime.inputs import chain_batch

DRAFT_VOCAB = 512


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    model, _ = load_model(DEFAULT_TARGET, dtype="float32")
    return model


def head_config_json(target, **overrides) -> dict:
    c = target.config
    cfg = {"architectures": [EAGLE3_ARCHITECTURE], "model_type": "llama", "hidden_size": c.hidden_size,
           "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
           "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
           "vocab_size": c.vocab_size, "draft_vocab_size": DRAFT_VOCAB, "tie_word_embeddings": False}
    cfg.update(overrides)
    return cfg


def random_head(target, seed=0, **overrides) -> Eagle3Head:
    gen = torch.Generator().manual_seed(seed)
    head = Eagle3Head(Eagle3Config.from_hf(head_config_json(target, **overrides)), target.model.embed_tokens)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen) if "norm" in name
                    else torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        used = torch.randperm(target.config.vocab_size, generator=gen)[:DRAFT_VOCAB].sort().values
        head.d2t.copy_(used - torch.arange(DRAFT_VOCAB))
    return head.eval()


def rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate(x, pos, theta=10000.0):
    """RoPE on (L, H, d) at positions pos (L,), rotate-half convention."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None].float(), torch.cat([ang.sin(), ang.sin()], -1)[:, None].float()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def naive_head(head, ids, feats):
    """One request, whole sequence at positions 0..L-1, dense causal attention: the published EAGLE-3 layer.
    feats: target features (3h, fused by fc) or already fused / the head's own outputs (h, used as they are)."""
    sd = {k: v.float() for k, v in head.state_dict().items()}
    L = ids.numel()
    f = feats.float() @ sd["fc.weight"].T if feats.shape[-1] != sd["fc.weight"].shape[0] else feats.float()
    e = head.embed_tokens.weight[ids].float()
    x = torch.cat([rms(e, sd["midlayer.input_layernorm.weight"]), rms(f, sd["midlayer.hidden_norm.weight"])], -1)
    H, Hkv, d = 4, 2, 64
    q = rotate((x @ sd["midlayer.self_attn.q_proj.weight"].T).view(L, H, d), torch.arange(L))
    k = rotate((x @ sd["midlayer.self_attn.k_proj.weight"].T).view(L, Hkv, d), torch.arange(L))
    v = (x @ sd["midlayer.self_attn.v_proj.weight"].T).view(L, Hkv, d)
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(L, H * d)
    y = f + att @ sd["midlayer.self_attn.o_proj.weight"].T
    z = rms(y, sd["midlayer.post_attention_layernorm.weight"])
    y = y + (F.silu(z @ sd["midlayer.mlp.gate_proj.weight"].T) * (z @ sd["midlayer.mlp.up_proj.weight"].T)) \
        @ sd["midlayer.mlp.down_proj.weight"].T
    return rms(y, sd["norm.weight"]) @ sd["lm_head.weight"].T, y


def test_target_captures_the_inputs_of_the_eagle3_layers_like_transformers_hidden_states(target):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(DEFAULT_TARGET), dtype=torch.float32).eval()
    ids = torch.tensor([5, 17, 300, 42, 7, 1000, 3])
    layers = target.eagle3_layers()
    assert layers == (2, 3, 3)  # a 6-layer target: 2, 6 // 2, 6 - 3
    cache = target.allocate_cache(1, 16)
    logits, feats = target(chain_batch([ids], torch.tensor([0]), torch.tensor([0]), "all"), cache, capture=layers)
    with torch.no_grad():
        out = hf(ids[None], output_hidden_states=True)
    want = torch.cat([out.hidden_states[i][0] for i in layers], -1)  # hidden_states[i] is the input of layer i
    torch.testing.assert_close(feats, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, out.logits[0], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="capture layers must be in"):
        target(chain_batch([ids], torch.tensor([0]), torch.tensor([0])), cache, capture=(7,))


def test_head_forward_over_a_slotted_cache_equals_the_dense_reference(target):
    """Two requests in two chunks each (the second attends the first through the cache) == the whole sequences
    through the naive layer."""
    head = random_head(target)
    gen = torch.Generator().manual_seed(1)
    lengths, split = (7, 5), (4, 2)
    seqs = [torch.randint(0, target.config.vocab_size, (n,), generator=gen) for n in lengths]
    feats = [torch.randn(n, 3 * target.config.hidden_size, generator=gen) for n in lengths]
    cache = head.allocate_cache(2, 16)
    slots = torch.tensor([1, 0])  # out of order on purpose
    got_logits, got_y = [[], []], [[], []]
    for lo, hi in ((torch.zeros(2, dtype=torch.long), torch.tensor(split)), (torch.tensor(split), torch.tensor(lengths))):
        batch = chain_batch([s[a:b] for s, a, b in zip(seqs, lo, hi)], lo, slots, "all")
        logits, y = head(batch, cache, torch.cat([f[a:b] for f, a, b in zip(feats, lo, hi)]))
        rows = torch.split(torch.arange(logits.shape[0]), (hi - lo).tolist())
        for i, r in enumerate(rows):
            got_logits[i].append(logits[r])
            got_y[i].append(y[r])
    for i in range(2):
        ref_logits, ref_y = naive_head(head, seqs[i], feats[i])
        torch.testing.assert_close(torch.cat(got_logits[i]), ref_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.cat(got_y[i]), ref_y, rtol=1e-4, atol=1e-4)
    # the head's own output (width h) is used as the next level's feature without fc
    batch = chain_batch([seqs[0][:1]], torch.tensor([0]), torch.tensor([0]), "all")
    _, y1 = head(batch, head.allocate_cache(1, 4), got_y[0][0][:1])
    assert y1.shape == (1, target.config.hidden_size)


def write_head(tmp_path, head, cfg, rename=lambda k: k, extra=None):
    out = tmp_path / "head"
    out.mkdir(exist_ok=True)
    state = {rename(k): v.contiguous() for k, v in head.state_dict().items()}
    state.update(extra or {})
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("style", ["specforge", "eagle", "vllm"])
def test_a_checkpoint_loads_unchanged_and_computes_the_same(target, tmp_path, style):
    head = random_head(target, seed=3)
    t2d = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    t2d[head.to_target_ids(torch.arange(DRAFT_VOCAB))] = True
    if style == "specforge":
        path = write_head(tmp_path, head, head_config_json(target), extra={"t2d": t2d})
    elif style == "eagle":  # the EAGLE repository's training config names the architecture LlamaForCausalLM
        path = write_head(tmp_path, head, head_config_json(target, architectures=["LlamaForCausalLM"]),
                          extra={"t2d": t2d})
    else:  # `model.` prefix, `layers.0.` for the decoder layer, the target's embedding saved alongside
        path = write_head(tmp_path, head, head_config_json(target),
                          rename=lambda k: "model." + k.replace("midlayer.", "layers.0.") if k != "d2t" else k,
                          extra={"model.embed_tokens.weight": target.model.embed_tokens.weight.detach().clone()})
    loaded = load_eagle3(path, target)
    assert loaded.config.capture_layers == target.eagle3_layers()
    batch = chain_batch([torch.tensor([3, 9, 27])], torch.tensor([0]), torch.tensor([0]), "all")
    feats = torch.randn(3, 3 * target.config.hidden_size, generator=torch.Generator().manual_seed(4))
    want, _ = head(batch, head.allocate_cache(1, 8), feats)
    got, _ = loaded(batch, loaded.allocate_cache(1, 8), feats)
    torch.testing.assert_close(got, want)
    assert torch.equal(loaded.to_target_ids(torch.arange(DRAFT_VOCAB)), torch.nonzero(t2d).flatten())


def test_aux_layer_ids_count_layer_outputs(target, tmp_path):
    cfg = head_config_json(target, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 4]})
    loaded = load_eagle3(write_head(tmp_path, random_head(target), cfg), target)
    assert loaded.config.capture_layers == (1, 3, 5)


BAD = [
    ("not eagle3", {"architectures": ["Qwen2ForCausalLM"]}, None, ValueError, "not an EAGLE-3 head"),
    ("two layers", {"num_hidden_layers": 2}, None, ValueError, "num_hidden_layers=2"),
    ("other vocabulary", {"vocab_size": 5000}, None, ValueError, "vocab_size=5000 but the target's is 4096"),
    ("other target width", {"target_hidden_size": 512}, None, ValueError, "features of width 512"),
    ("draft vocab too big", {"draft_vocab_size": 10**6}, None, ValueError, "draft_vocab_size"),
    ("aux ids", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}, None, ValueError,
     "eagle_aux_hidden_state_layer_ids"),
    ("aux ids past the target", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}}, None, ValueError,
     "do not exist in a 6-layer target"),
    ("missing lm_head", {}, lambda s: s.pop("lm_head.weight"), ValueError, r"missing \['lm_head.weight'\]"),
    ("misshapen fc", {}, lambda s: s.update({"fc.weight": torch.zeros(256, 256)}), ValueError,
     r"fc.weight: expected \(256, 768\), got \(256, 256\)"),
    ("unknown weight", {}, lambda s: s.update({"midlayer.extra.weight": torch.zeros(2)}), ValueError,
     "unexpected"),
    ("d2t out of range", {}, lambda s: s.update({"d2t": torch.full((DRAFT_VOCAB,), 10**6)}), ValueError,
     "d2t maps draft ids outside"),
]


@pytest.mark.parametrize("name, cfg_change, state_change, error, message", BAD, ids=[b[0] for b in BAD])
def test_a_head_that_does_not_fit_is_refused_by_name(target, tmp_path, name, cfg_change, state_change, error,
                                                      message):
    head = random_head(target)
    cfg = head_config_json(target, **cfg_change)
    path = write_head(tmp_path, head, cfg)
    if state_change is not None:
        from safetensors.torch import load_file

        state = load_file(str(path / "model.safetensors"))
        state_change(state)
        save_file(state, str(path / "model.safetensors"))
    with pytest.raises(error, match=message):
        load_eagle3(path, target)


def test_a_directory_without_config_or_weights_is_refused(target, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_eagle3(tmp_path, target)
    (tmp_path / "config.json").write_text(json.dumps(head_config_json(target)))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_eagle3(tmp_path, target)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_heads_rotary_table_rows_are_rope_cos_sin_to_the_bit(target, dtype):
    head = random_head(target).to(dtype)
    positions = torch.tensor([0, 5, 63, 1, 5, 62])
    cos, sin = head.rope(positions, 64)
    want_cos, want_sin = rope_cos_sin(head.inv_freq, positions, dtype)
    assert cos.dtype == dtype and torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    beyond = torch.tensor([3, 64, 200])  # past the table: computed as before, the table kept
    cos, sin = head.rope(beyond, 64)
    want_cos, want_sin = rope_cos_sin(head.inv_freq, beyond, dtype)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin) and head._rope_table[0].shape[0] == 64
    head.rope(positions, 128)  # a larger cache: a larger table; another dtype: a new one
    assert head._rope_table[0].shape[0] == 128
    head.to(torch.float32 if dtype == torch.bfloat16 else torch.bfloat16)
    cos, sin = head.rope(positions, 64)
    want_cos, want_sin = rope_cos_sin(head.inv_freq, positions, head.dtype)
    assert cos.dtype == head.dtype and torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    head.inv_freq = head.inv_freq * 0.5  # another rotary base: the table follows it
    assert torch.equal(head.rope(positions, 64)[0], rope_cos_sin(head.inv_freq, positions, head.dtype)[0])
