"""An EAGLE-3 draft head: one decoder layer on the target's own hidden states, laid out as the public EAGLE-3
checkpoints are (the EAGLE and SpecForge repositories' `LlamaForCausalLMEagle3`), so a head trained there loads
unchanged.

Layout (h = the head's hidden size, h_t = the target's):

    fc                   Linear(3 h_t -> h)      fuses the target's three feature layers
    midlayer             one Llama decoder layer whose q/k/v take 2 h:
                           x = [input_layernorm(embed(token)) ; hidden_norm(feature)]
                           y = feature + o_proj(attention(x));  y = y + mlp(post_attention_layernorm(y))
    norm, lm_head        RMSNorm and Linear(h -> draft_vocab_size)
    d2t                  draft id -> target id offset: target_id = draft_id + d2t[draft_id]

The token embedding is the target's (checkpoints leave it out). The layer's output y, before `norm`, is the
feature of the next draft level. Features come from `CausalLM.forward(..., capture=...)`: the inputs of target
layers (2, N // 2, N - 3) by default, or the `eagle_config.eagle_aux_hidden_state_layer_ids` a checkpoint names
(those ids count layer outputs, so input index = id + 1).

The runtime drafts with it through `runtime.drafter.Eagle3Drafter` (docs/eagle3.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from echo_trtllm.jsonfile import read_json_object

from .llama import (MLP, Attention, CausalLM, ForwardBatch, KVCache, ModelConfig, RMSNorm, as_dtype, eagle3_layers,
                    rope_cos_sin, rope_inv_freq)
from .loader import read_safetensors

__all__ = ["Eagle3Config", "Eagle3Head", "load_eagle3", "read_eagle3_config", "is_eagle3_dir", "EAGLE3_ARCHITECTURE"]

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
_IGNORED_KEYS = ("t2d",)  # target -> draft membership: derivable from d2t, not used here


@dataclass(frozen=True)
class Eagle3Config:
    """The head's layer (as a one-layer Llama ModelConfig), its draft vocabulary and what it expects of the target."""

    layer: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    # target decoder layers whose inputs are the features (None: the target's EAGLE-3 default)
    capture_layers: tuple[int, ...] | None = None

    @classmethod
    def from_hf(cls, cfg: dict) -> "Eagle3Config":
        """From an EAGLE-3 head's config.json dict; ValueError naming the field that does not fit."""
        archs = list(cfg.get("architectures") or [])
        if EAGLE3_ARCHITECTURE not in archs and not ("draft_vocab_size" in cfg and archs == ["LlamaForCausalLM"]):
            raise ValueError(f"not an EAGLE-3 head: architectures={archs}; expected [{EAGLE3_ARCHITECTURE!r}] (or "
                             f"the EAGLE repository's ['LlamaForCausalLM'] with draft_vocab_size)")
        if cfg.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"num_hidden_layers={cfg['num_hidden_layers']}: an EAGLE-3 head has exactly 1 layer")
        layer = ModelConfig.from_hf({**cfg, "model_type": "llama", "num_hidden_layers": 1})
        draft_vocab = cfg.get("draft_vocab_size", layer.vocab_size)
        if not isinstance(draft_vocab, int) or not 1 <= draft_vocab <= layer.vocab_size:
            raise ValueError(f"draft_vocab_size={draft_vocab!r} must be an integer in [1, vocab_size={layer.vocab_size}]")
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and (not isinstance(ids, list) or len(ids) != 3 or not all(isinstance(i, int) for i in ids)):
            raise ValueError(f"eagle_config.eagle_aux_hidden_state_layer_ids={ids!r} must be three layer indices")
        return cls(layer, draft_vocab, cfg.get("target_hidden_size") or layer.hidden_size,
                   None if ids is None else tuple(i + 1 for i in ids))


class Eagle3Layer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.self_attn = Attention(config, 0, in_features=2 * h)
        self.mlp = MLP(config)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)

    def forward(self, embeds: Tensor, feature: Tensor, cos: Tensor, sin: Tensor, batch: ForwardBatch,
                cache: KVCache) -> Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feature)], dim=-1)
        y = feature + self.self_attn(x, cos, sin, batch, cache)
        return y + self.mlp(self.post_attention_layernorm(y))


class Eagle3Head(nn.Module):
    """The head over a slotted one-layer KV cache (same batch format as `CausalLM`)."""

    def __init__(self, config: Eagle3Config, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.config = config
        c = config.layer
        self.fc = nn.Linear(3 * config.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("inv_freq", rope_inv_freq(c), persistent=False)
        self._embed = (embed_tokens,)  # the target's, shared: not a parameter of the head

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._embed[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def allocate_cache(self, slots: int, capacity: int) -> KVCache:
        return KVCache.allocate(self.config.layer, slots, capacity, self.dtype, self.device)

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        """Target vocabulary ids of draft-vocabulary ids."""
        return draft_ids + self.d2t[draft_ids]

    def rope(self, position_ids: Tensor, rows: int) -> tuple[Tensor, Tensor]:
        """`rope_cos_sin` of the positions, on the CPU read from a table of positions 0 .. rows - 1 (the cache's,
        which holds every position a head forward writes) made once per dtype, device and inv_freq: the head runs
        one layer, so the six small operations that make the values were paid once per layer. The rows equal
        rope_cos_sin's to the bit (tests/models/test_eagle3.py); a position past the table is computed as before.
        On a device the values are computed as before (an index out of range there is no exception to catch)."""
        if self.device.type != "cpu":
            return rope_cos_sin(self.inv_freq, position_ids, self.dtype)
        table = self.__dict__.get("_rope_table")
        if table is None or table[0].shape[0] < rows or table[0].dtype != self.dtype or table[2] is not self.inv_freq:
            cos, sin = rope_cos_sin(self.inv_freq, torch.arange(rows), self.dtype)
            table = self._rope_table = (cos, sin, self.inv_freq)
        try:
            return table[0].index_select(0, position_ids), table[1].index_select(0, position_ids)
        except IndexError:
            return rope_cos_sin(self.inv_freq, position_ids, self.dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache, features: Tensor) -> tuple[Tensor, Tensor]:
        """(draft logits (S, draft_vocab) float32 of the rows in batch.logits_index, next features (T, h)).

        features (T, 3 h_t): the target's captured features of the token *before* each input token (fused by fc),
        or (T, h): the head's own output for that token at the previous draft level (used as is)."""
        if batch.input_ids.device != self.device:
            batch = batch.to(self.device)
        # no call where the features are the head's already (each call costs, more with cold caches)
        same = features.device == self.device
        feature = as_dtype(features, self.dtype) if same else features.to(self.device, self.dtype)
        if feature.shape[-1] != self.config.layer.hidden_size:
            feature = self.fc(feature)
        embeds = as_dtype(self.embed_tokens(batch.input_ids), self.dtype)
        cos, sin = self.rope(batch.position_ids, cache.capacity)
        y = self.midlayer(embeds, feature, cos, sin, batch, cache)
        rows = y if batch.logits_index is None else y[batch.logits_index]
        return self.lm_head(self.norm(rows)).float(), y


def _checkpoint_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The EAGLE / SpecForge names this module uses: no `model.` prefix, the layer as `midlayer.` (vLLM-style
    `layers.0.` accepted), the embedding and `t2d` dropped."""
    out = {}
    for name, value in state.items():
        key = name.removeprefix("model.")
        if key.startswith("layers.0."):
            key = "midlayer." + key.removeprefix("layers.0.")
        if "embed_tokens" in key or key in _IGNORED_KEYS:
            continue
        out[key] = value
    return out


def is_eagle3_dir(path) -> bool:
    """Whether `path` is a directory whose config.json describes an EAGLE-3 head (the architecture
    `LlamaForCausalLMEagle3`, or the EAGLE repository's Llama config with a `draft_vocab_size`)."""
    cfg_file = Path(path) / "config.json"
    if not (isinstance(path, (str, Path)) and cfg_file.is_file()):
        return False
    try:
        cfg = read_json_object(cfg_file)
    except (ValueError, OSError):
        return False
    return EAGLE3_ARCHITECTURE in (cfg.get("architectures") or []) or "draft_vocab_size" in cfg


def read_eagle3_config(path: str | Path, target: ModelConfig) -> tuple[dict, Eagle3Config]:
    """An EAGLE-3 head directory's config.json (raw, parsed with its feature layers), checked against the target's
    config without reading weights: errors name the file and what differs (vocabulary, feature width, layers)."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path} is not an EAGLE-3 head directory: config.json is missing")
    try:
        raw = read_json_object(cfg_file)
        config = Eagle3Config.from_hf(raw)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{cfg_file}: {e}") from None
    if config.layer.vocab_size != target.vocab_size:
        raise ValueError(f"{cfg_file}: vocab_size={config.layer.vocab_size} but the target's is {target.vocab_size}: "
                         f"the head was trained for another target")
    if config.target_hidden_size != target.hidden_size:
        raise ValueError(f"{cfg_file}: the head expects target features of width {config.target_hidden_size} "
                         f"(target_hidden_size / hidden_size) but the target's hidden_size is {target.hidden_size}")
    n = target.num_hidden_layers
    layers = config.capture_layers or eagle3_layers(n)
    if any(not 0 <= i <= n for i in layers):
        raise ValueError(f"{cfg_file}: feature layers {layers} do not exist in a {n}-layer target")
    return raw, replace(config, capture_layers=tuple(layers))


def load_eagle3(path: str | Path, target: CausalLM, dtype: torch.dtype | None = None,
                embed_tokens: nn.Embedding | None = None) -> Eagle3Head:
    """An EAGLE-3 head directory (config.json + *.safetensors) for this target. Errors name the file and what
    differs: the architecture, the layer count, the target's vocabulary or hidden size, missing, unexpected or
    misshapen weights. embed_tokens: the target's whole token embedding, where the target's own module holds only
    a slice of it (a tensor-parallel shard; `models.tp.load_embedding`)."""
    path = Path(path)
    raw, config = read_eagle3_config(path, target.config)
    t = target.config
    state = _checkpoint_names(read_safetensors(path))
    embed = target.model.embed_tokens if embed_tokens is None else embed_tokens
    if embed.num_embeddings != t.vocab_size:
        raise ValueError(f"{path}: the token embedding has {embed.num_embeddings} rows for a {t.vocab_size}-token "
                         f"target: a tensor-parallel shard's slice (pass the whole embedding)")
    head = Eagle3Head(config, embed)
    if raw.get("quantization_config") is not None:  # an FP8 head (echo-trtllm build --quantization fp8)
        from echo_trtllm.models.fp8 import fp8_checkpoint_state

        state = fp8_checkpoint_state(path, raw["quantization_config"], head, state)
    if "d2t" not in state and config.draft_vocab_size == t.vocab_size:
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)  # full vocabulary: identity
    expected = head.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{k}: expected {tuple(expected[k].shape)}, got {tuple(state[k].shape)}"
              for k in sorted(set(expected) & set(state)) if expected[k].shape != state[k].shape]
    if missing or unexpected or shapes:
        raise ValueError(f"{path}: checkpoint does not match the EAGLE-3 head layout; missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}, misshapen {shapes[:5]}")
    d2t = state["d2t"].long()
    targets = torch.arange(d2t.numel()) + d2t
    if bool(((targets < 0) | (targets >= t.vocab_size)).any()):
        raise ValueError(f"{path}: d2t maps draft ids outside the target's vocabulary [0, {t.vocab_size})")
    state["d2t"] = d2t
    head.load_state_dict(state)
    return head.to(dtype=dtype or target.dtype, device=target.device).eval()
