"""Tensor parallelism for the Llama-family model, Megatron style, on torch.distributed (gloo on CPU, NCCL on CUDA).

Each of `world` ranks holds one shard of every decoder layer and of the vocabulary:

    q, k, v          column-parallel by KV-head group: the rank's KV heads and the query heads that share them
    o_proj           row-parallel (the same heads' input columns), then one all-reduce of the layer's output
    gate, up         column-parallel over the MLP's intermediate size
    down_proj        row-parallel over it, then one all-reduce
    embed_tokens     vocabulary-parallel: each rank looks up its rows (others give 0), then one all-reduce
    lm_head          vocabulary-parallel, then an all-gather of the logits (the control plane needs all of them)
    norms            replicated

KV heads are split into groups as evenly as they divide (SmolLM2's 3 KV heads over 2 ranks: 2 + 1, with their 6 + 3
query heads); the MLP likewise; the vocabulary in equal slices (the last padded with zero rows). A rank's KV cache
holds only its KV heads. `load_shard` reads only the rank's slices (safetensors slices; GGUF tensors dequantised one
at a time and sliced), so a rank never holds the whole model.

The ranks run the same forward at the same time: `TensorParallel.mirror` is set on the group's leader (rank 0)
and replays every forward, cache allocation and compaction on the others (runtime/parallel.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from .llama import CausalLM, ModelConfig

__all__ = ["TensorParallel", "TensorParallelError", "load_shard", "load_embedding", "read_config", "check_shardable",
           "check_shardable_source"]


class TensorParallelError(RuntimeError):
    """A rank of the group failed (gone, or stuck past the collectives' timeout); the group cannot run any more."""


def split(n: int, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's part when n items are split over `world` ranks as evenly as possible."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def check_shardable(config: ModelConfig, world: int) -> None:
    """Errors name what cannot be split over `world` ranks."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    if config.num_key_value_heads < world:
        raise ValueError(f"tensor_parallel_size={world} exceeds the model's num_key_value_heads="
                         f"{config.num_key_value_heads}: each rank needs at least one KV head (replicating KV heads "
                         "is not supported)")
    if config.intermediate_size < world:
        raise ValueError(f"tensor_parallel_size={world} exceeds intermediate_size={config.intermediate_size}")


@dataclass
class TensorParallel:
    """One rank's view of its group: the collectives the model calls and the slices it holds."""

    rank: int
    world: int
    group: object | None = None  # torch.distributed ProcessGroup of the data collectives (None: the default group)
    mirror: object | None = None  # on the leader: replays model calls on the other ranks (runtime/parallel.py)
    failed: str | None = None  # set by the first failed collective; every later one fails at once with it
    diagnose: object | None = None  # () -> str: what the leader knows of its ranks (e.g. "rank 1 exited with -9")

    def checked(self, fn):
        """Run a collective; a failure ends the group (see `failed`) with a TensorParallelError."""
        if self.failed is not None:
            raise TensorParallelError(self.failed)
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - DistBackendError / RuntimeError from gloo or NCCL
            known = self.diagnose() if self.diagnose is not None else ""
            first = (str(e).splitlines() or [""])[0][:300]
            self.fail(f"the tensor-parallel group failed ({known or 'a rank is gone or stuck'}; seen by rank "
                      f"{self.rank} of {self.world}): {type(e).__name__}: {first}")
            raise TensorParallelError(self.failed) from None

    def fail(self, message: str) -> None:
        """End the group: the first failure is kept and every later collective raises it at once."""
        if self.failed is None:
            self.failed = message

    # ------------------------------------------------------------------ layout

    def kv_heads(self, config: ModelConfig) -> tuple[int, int]:
        return split(config.num_key_value_heads, self.world, self.rank)

    def q_heads(self, config: ModelConfig) -> tuple[int, int]:
        group = config.num_attention_heads // config.num_key_value_heads
        a, b = self.kv_heads(config)
        return a * group, b * group

    def intermediate(self, config: ModelConfig) -> tuple[int, int]:
        return split(config.intermediate_size, self.world, self.rank)

    def vocab(self, config: ModelConfig) -> tuple[int, int]:
        """[start, end) of the real vocabulary rows; every rank holds `vocab_per_rank` rows (the last padded)."""
        per = self.vocab_per_rank(config)
        return min(self.rank * per, config.vocab_size), min((self.rank + 1) * per, config.vocab_size)

    def vocab_per_rank(self, config: ModelConfig) -> int:
        return math.ceil(config.vocab_size / self.world)

    def shard_config(self, config: ModelConfig) -> ModelConfig:
        """The config this rank's modules are built with (its heads, intermediate and vocabulary slice)."""
        check_shardable(config, self.world)
        q0, q1 = self.q_heads(config)
        k0, k1 = self.kv_heads(config)
        i0, i1 = self.intermediate(config)
        return replace(config, num_attention_heads=q1 - q0, num_key_value_heads=k1 - k0, intermediate_size=i1 - i0,
                       vocab_size=self.vocab_per_rank(config))

    def slice_for(self, name: str, config: ModelConfig) -> tuple[int, int, int] | None:
        """(dim, start, end) of the full checkpoint tensor `name` (HF names) this rank holds; None: all of it."""
        hd = config.head_dim
        leaf = name.rsplit(".", 2)
        proj = leaf[-2] if len(leaf) >= 2 else ""
        if proj == "q_proj":
            a, b = self.q_heads(config)
            return 0, a * hd, b * hd
        if proj in ("k_proj", "v_proj"):
            a, b = self.kv_heads(config)
            return 0, a * hd, b * hd
        if proj == "o_proj":
            a, b = self.q_heads(config)
            return 1, a * hd, b * hd
        if proj in ("gate_proj", "up_proj"):
            return (0, *self.intermediate(config))
        if proj == "down_proj":
            return (1, *self.intermediate(config))
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (0, *self.vocab(config))
        return None

    def take(self, name: str, config: ModelConfig, full: Tensor) -> Tensor:
        """This rank's part of the full tensor `name`."""
        where = self.slice_for(name, config)
        if where is None:
            return full
        dim, a, b = where
        return self.pad(name, config, full.narrow(dim, a, b - a))

    def pad(self, name: str, config: ModelConfig, part: Tensor) -> Tensor:
        """A vocabulary slice padded with zero rows to `vocab_per_rank` (the last rank's may be short)."""
        short = self.vocab_per_rank(config) - part.shape[0]
        if name in ("model.embed_tokens.weight", "lm_head.weight") and short > 0:
            part = torch.cat([part, part.new_zeros(short, *part.shape[1:])])
        return part.contiguous()

    # ------------------------------------------------------------------ collectives (called by the model)

    def all_reduce(self, t: Tensor) -> Tensor:
        import torch.distributed as dist

        self.checked(lambda: dist.all_reduce(t, group=self.group))
        return t

    def embed(self, embedding: torch.nn.Embedding, ids: Tensor) -> Tensor:
        """Vocabulary-parallel lookup: rows outside this rank's slice give 0, the all-reduce fills them in."""
        start = self.rank * embedding.num_embeddings
        local = ids - start
        inside = (local >= 0) & (local < embedding.num_embeddings)
        x = embedding(torch.where(inside, local, 0)) * inside[:, None].to(embedding.weight.dtype)
        return self.all_reduce(x)

    def gather_vocab(self, logits: Tensor, vocab_size: int) -> Tensor:
        """(S, V/world) local logits -> (S, V) on every rank."""
        import torch.distributed as dist

        parts = [torch.empty_like(logits) for _ in range(self.world)]
        self.checked(lambda: dist.all_gather(parts, logits.contiguous(), group=self.group))
        return torch.cat(parts, dim=-1)[:, :vocab_size]


# ---------------------------------------------------------------------------------------------------------- loading


def read_config(path: str | Path) -> ModelConfig:
    """The whole model's config from an HF directory or a .gguf file, without reading weights."""
    path = Path(path)
    if path.is_file():
        from gguf import GGUFReader

        from .loader import gguf_config

        return gguf_config(GGUFReader(str(path)))
    from .loader import read_hf_config

    return read_hf_config(path / "config.json")


def check_shardable_source(path: str | Path, world: int) -> None:
    """Refuse, before any rank starts, the checkpoints `load_shard` does not shard (errors name what to use)."""
    path = Path(path)
    if path.is_dir():
        from echo_trtllm.jsonfile import read_json_object

        from .trtllm_checkpoint import is_trtllm_checkpoint

        if is_trtllm_checkpoint(path):
            raise ValueError("TensorRT-LLM checkpoints are not loaded with tensor_parallel_size > 1 here; use the HF "
                             "directory or .gguf file it was exported from")
        if read_json_object(path / "config.json").get("quantization_config") is not None:
            raise ValueError("quantised (FP8) checkpoints are not supported with tensor_parallel_size > 1 yet; use "
                             "the float model")


def _hf_shards(path: Path, tp: TensorParallel, config: ModelConfig):
    """(name, this rank's part) of every tensor in the directory's safetensors files, read slice by slice."""
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for name in sf.keys():
                where = tp.slice_for(name, config)
                if where is None:
                    yield name, sf.get_tensor(name)
                    continue
                dim, a, b = where
                view = sf.get_slice(name)
                yield name, tp.pad(name, config, view[a:b] if dim == 0 else view[:, a:b])


def load_shard(path: str | Path, tp: TensorParallel, dtype: torch.dtype, device) -> CausalLM:
    """This rank's shard of an HF directory or .gguf file (float checkpoints; FP8 and TensorRT-LLM checkpoints are
    refused with tensor parallelism for now)."""
    from .loader import gguf_tensors, load_state

    path = Path(path)
    config = read_config(path)
    model = CausalLM(config, tp)
    state: dict[str, Tensor] = {}
    if path.is_file():
        from gguf import GGUFReader

        for name, full in gguf_tensors(GGUFReader(str(path)), config):
            state[name] = tp.take(name, config, full).to(dtype)
            del full
    else:
        try:
            check_shardable_source(path, tp.world)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        for name, part in _hf_shards(path, tp, config):
            state[name] = part.to(dtype)
    model = model.to(dtype)
    load_state(model, state, path)  # the one-rank loaders' check: tied head, inv_freq, missing / unexpected
    return model.to(device).eval()


EMBEDDING = "model.embed_tokens.weight"


def load_embedding(path: str | Path, dtype: torch.dtype, device) -> torch.nn.Embedding:
    """The whole token embedding of an HF directory or .gguf file, read alone. The ranks' embeddings are slices of
    the vocabulary, so the leader's EAGLE-3 head, which runs on the leader only, looks its draft tokens up here."""
    path = Path(path)
    weight = None
    if path.is_file():
        from gguf import GGUFReader

        from .loader import gguf_config, gguf_tensors

        reader = GGUFReader(str(path))
        weight = next((w for _, w in gguf_tensors(reader, gguf_config(reader), only={EMBEDDING})), None)
    else:
        from safetensors import safe_open

        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), "pt") as sf:
                if EMBEDDING in sf.keys():
                    weight = sf.get_tensor(EMBEDDING)
                    break
    if weight is None:
        raise ValueError(f"{path}: no token embedding ({EMBEDDING}) to look draft tokens up in")
    return torch.nn.Embedding.from_pretrained(weight.to(dtype=dtype, device=device), freeze=True)
