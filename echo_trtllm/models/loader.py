"""Load models and tokenizers: HF model directories (config.json + *.safetensors + tokenizer files) and GGUF
files (dequantised with the `gguf` package; tokenizer converted from the GGUF metadata by `transformers`).

    model, tokenizer = load_model("path/to/hf_dir")          # or "path/to/model.gguf"
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from echo_trtllm.jsonfile import read_json_object

from .llama import CausalLM, ModelConfig

__all__ = ["Tokenizer", "load_model", "load_tokenizer", "check_same_vocabulary", "check_model_path", "auto_dtype",
           "resolve_dtype", "DTYPE_CHOICES"]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
# "auto": a rule on the device, the same on every start (auto_dtype)
DTYPE_CHOICES = ("auto", *DTYPES)
# CPU flags of the bf16 matrix instructions under which many-row bfloat16 linears run faster than float32 ones
BF16_MATRIX_FLAGS = ("amx_bf16", "avx512_bf16")
# a model whose MLP matrix (hidden x intermediate) holds fewer weights than this runs faster in float32 on a CPU even
# with those instructions: its linears are too small for the bf16 kernels to pay (the embedded target, 256 x 688:
# `generate` 205 tok/s in float32, 142 in bfloat16); Qwen2.5-Coder 0.5B (896 x 4864) and 1.5B run faster in bf16
AUTO_MIN_MLP_WEIGHTS = 1 << 20


def auto_dtype(device: str | torch.device = "cpu", flags: list[str] | None = None,
               config: ModelConfig | None = None) -> tuple[torch.dtype, str]:
    """What dtype "auto" resolves to on `device` (for the model of `config`, when given), and the rule that chose it:
    bfloat16 on CUDA; on a CPU bfloat16 when it has bf16 matrix instructions (AMX-BF16 or AVX512-BF16: a many-row
    bf16 linear there runs 2-4x faster than fp32) and the model's MLP matrix holds at least AUTO_MIN_MLP_WEIGHTS
    weights, else float32 (an AVX2-only CPU runs bf16 linears ~4x slower; a tiny model's are too small to gain:
    docs/dtype.md). A rule on the CPU's flags (`flags`: injected by tests; default this CPU's) and the model's
    shape, not a timing, so every start of the same machine picks the same dtype and a seed gives the same text
    after a restart."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16, "cuda: bfloat16"
    if flags is None:
        from echo_trtllm.cpu import cpu_flags

        flags = cpu_flags()
    found = [f for f in BF16_MATRIX_FLAGS if f in flags]
    if not found:
        return torch.float32, f"cpu without {' or '.join(BF16_MATRIX_FLAGS)}: float32"
    if config is not None and config.hidden_size * config.intermediate_size < AUTO_MIN_MLP_WEIGHTS:
        return torch.float32, (f"cpu with {' and '.join(found)}, but the model's MLP matrix ({config.hidden_size} x "
                               f"{config.intermediate_size}) is below {AUTO_MIN_MLP_WEIGHTS} weights: float32")
    return torch.bfloat16, f"cpu with {' and '.join(found)}: bfloat16"


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu",
                  config: ModelConfig | None = None) -> torch.dtype:
    """A dtype name (or "auto", resolved for `device` and the model of `config` by `auto_dtype`: the one place it
    is resolved) as a torch dtype; an unknown name is refused naming the choices."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto_dtype(device, config=config)[0]
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPE_CHOICES)}")
    return DTYPES[dtype]


@dataclass
class Tokenizer:
    """The runtime's view of a tokenizer: encode, decode, and the ids that end generation."""

    hf: object  # transformers PreTrainedTokenizerFast
    eos_token_ids: tuple[int, ...]

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def vocabulary(self) -> dict[str, int]:
        return self.hf.get_vocab()


def _hf_tokenizer(path: Path, gguf_file: str | None = None):
    try:
        from transformers import AutoTokenizer
    except ImportError as e:  # pragma: no cover - transformers is a dependency
        raise ImportError("loading tokenizers needs the `transformers` package") from e
    if gguf_file is not None:
        return AutoTokenizer.from_pretrained(str(path), gguf_file=gguf_file)
    return AutoTokenizer.from_pretrained(str(path))


def load_tokenizer(path: str | Path, config: ModelConfig | None = None) -> Tokenizer:
    path = Path(path)
    try:
        hf = _hf_tokenizer(path.parent, path.name) if path.suffix == ".gguf" else _hf_tokenizer(path)
    except Exception as e:  # a missing or corrupted tokenizer.json / GGUF vocabulary
        raise ValueError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
    eos = list(config.eos_token_ids if config else ())
    if hf.eos_token_id is not None and hf.eos_token_id not in eos:
        eos.append(hf.eos_token_id)
    return Tokenizer(hf, tuple(eos))


# ---------------------------------------------------------------------------------------------------------- HF


def read_hf_config(cfg_file: Path, raw: dict | None = None) -> ModelConfig:
    """An HF config.json (or its already-read dict `raw`) as a ModelConfig; errors name the file."""
    raw = read_json_object(cfg_file) if raw is None else raw
    try:
        return ModelConfig.from_hf(raw)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{cfg_file}: {e}") from None


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's *.safetensors files; errors name the directory or the unreadable file."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights (only safetensors checkpoints are supported)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # SafetensorError, OSError: a truncated or corrupted file
            raise ValueError(f"{f}: cannot read the safetensors weights ({type(e).__name__}: {e})") from None
    return state


def load_hf(path: Path, dtype: torch.dtype, device) -> CausalLM:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path} is not a model directory: config.json is missing")
    state = read_safetensors(path)
    raw = read_json_object(cfg_file)
    config = read_hf_config(cfg_file, raw)
    model = CausalLM(config)
    quant = raw.get("quantization_config")
    if quant is not None:
        from echo_trtllm.models.fp8 import fp8_checkpoint_state

        state = fp8_checkpoint_state(path, quant, model, state)
    load_state(model, state, path)
    return model.to(dtype=dtype, device=device).eval()


def load_state(model: CausalLM, state: dict, path, what: str = "checkpoint") -> None:
    """Load `state` into `model` (a tied head is the embedding; stored rotary inv_freq is recomputed); anything
    missing or unexpected is refused, naming `path` and the first names."""
    tied = model.config.tie_word_embeddings
    if tied:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    unexpected = [u for u in unexpected if not u.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise ValueError(f"{path}: {what} does not match the {model.config.architecture} layout; missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}")


# ---------------------------------------------------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}  # fmt: skip


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return value


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation for the `llama` architecture (GGML rotates adjacent pairs, HF
    rotates halves)."""
    out = w.shape[0]
    return w.reshape(heads, out // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: llama, qwen2")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = next(int(t.shape[-1]) for t in reader.tensors if t.name == "token_embd.weight")
    scaling = None
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        scaling = {"rope_type": kind, "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        rope_scaling=scaling,
        eos_token_ids=() if eos is None else (int(eos),),
        bos_token_id=None if bos is None else int(bos),
    )


def gguf_tensors(reader, config: ModelConfig, only: set[str] | None = None):
    """(HF name, float32 tensor) of each weight in a GGUF file, dequantised one at a time (Q/K rows of the `llama`
    architecture put back in HF's order); only: these HF names, the others skipped before dequantising."""
    from gguf.quants import dequantize

    for t in reader.tensors:
        if t.name in _GGUF_NAMES:
            name = _GGUF_NAMES[t.name]
        else:
            parts = t.name.split(".")  # blk.N.attn_q.weight
            if parts[0] != "blk" or parts[2] not in _GGUF_BLOCK:
                continue  # e.g. rope_freqs: recomputed from the config
            name = f"model.layers.{parts[1]}.{_GGUF_BLOCK[parts[2]]}.{parts[3]}"
        if only is not None and name not in only:
            continue
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims fastest-first
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(shape)
        if config.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute(w, config.num_attention_heads)
        elif config.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute(w, config.num_key_value_heads)
        yield name, w


def load_gguf(path: Path, dtype: torch.dtype, device) -> CausalLM:
    try:
        from gguf import GGUFReader
    except ImportError as e:  # pragma: no cover - gguf is a dependency
        raise ImportError("loading GGUF files needs the `gguf` package") from e
    try:
        reader = GGUFReader(str(path))
        config = gguf_config(reader)
    except ValueError as e:
        if "not supported" in str(e):
            raise ValueError(f"{path}: {e}") from None
        raise ValueError(f"{path}: cannot read the GGUF file ({e})") from None
    except Exception as e:  # struct / numpy errors from a truncated or corrupted file
        raise ValueError(f"{path}: cannot read the GGUF file ({type(e).__name__}: {e})") from None
    state = {name: w.to(dtype) for name, w in gguf_tensors(reader, config)}
    model = CausalLM(config).to(dtype)
    load_state(model, state, path, "GGUF tensors")
    return model.to(device).eval()


def load_model(path: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
               with_tokenizer: bool = True) -> tuple[CausalLM, Tokenizer | None]:
    """Load an HF model directory or a .gguf file (and its tokenizer). dtype "auto": see `auto_dtype` (read in
    float32, then converted to what the rule picks for the model's shape)."""
    path = Path(path)
    auto = dtype == "auto"
    dt = torch.float32 if auto else resolve_dtype(dtype, device)
    check_model_path(path)
    from echo_trtllm.models.trtllm_checkpoint import is_trtllm_checkpoint, load_checkpoint

    if path.is_file():
        model = load_gguf(path, dt, device)
    elif is_trtllm_checkpoint(path):  # echo-trtllm export --format trtllm
        model = load_checkpoint(path, dt, device)
    else:
        model = load_hf(path, dt, device)
    if auto:
        model = model.to(resolve_dtype("auto", device, model.config))
    return model, (load_tokenizer(path, model.config) if with_tokenizer else None)


def check_model_path(path: str | Path, name: str = "model") -> None:
    """Cheap checks before anything is loaded: the path exists and is a .gguf file or a directory."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{name} path {str(path)!r} does not exist (expected an HF model directory or a "
                                ".gguf file)")
    if not (path.is_dir() or (path.is_file() and path.suffix == ".gguf")):
        raise ValueError(f"{name} path {str(path)!r} is neither an HF model directory nor a .gguf file")
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"{name} path {str(path)!r} is not an HF model directory: config.json is missing")


def check_same_vocabulary(target: Tokenizer, draft: Tokenizer) -> None:
    """A draft must tokenise exactly like its target: same token strings at the same ids."""
    tv, dv = target.vocabulary(), draft.vocabulary()
    if tv != dv:
        only_t = len(tv.keys() - dv.keys())
        only_d = len(dv.keys() - tv.keys())
        moved = sum(1 for k in tv.keys() & dv.keys() if tv[k] != dv[k])
        raise ValueError(
            f"the draft's vocabulary differs from the target's ({len(dv)} vs {len(tv)} tokens; {only_t} only in the "
            f"target, {only_d} only in the draft, {moved} with different ids): speculative decoding needs one tokenizer"
        )
