"""FP8 quality, memory and speed of a model against its bfloat16 self (docs/fp8.md).

    python -m echo_trtllm.bench.fp8 [--model DIR_OR_GGUF] [--prompts 32] [--max-tokens 32] [--json out.json]
    python -m echo_trtllm.bench.fp8 --invariance 4 [--model ...]     # decode step vs whole-sequence logits only

Variants: bfloat16 (the reference), float32, FP8 per tensor (static activation scales) and FP8 per channel
(per-token activations), each FP8 one calibrated on HumanEval's calibration split and measured on its evaluation
split only:
- weight bytes as held in memory (e4m3 projections, embeddings / norms / head in float32 here);
- held-out loss: mean next-token cross-entropy over the evaluation prompts' text, and its delta to bfloat16;
- greedy agreement with bfloat16: of `--prompts` evaluation prompts decoded greedily for `--max-tokens`, the share
  whose tokens equal bfloat16's exactly, and the mean share of tokens before the first divergence;
- speed: plain AR decoding tokens/s at batch 8 on this machine. On a CPU FP8 runs through torch's emulating
  `_scaled_mm` kernels: this number says what the emulation costs here, not what an H100's FP8 units do.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from echo_trtllm.api import LLM
from echo_trtllm.bench.prompts import load_prompts
from echo_trtllm.bench.run import report_meta
from echo_trtllm.core.config import EchoConfig
from echo_trtllm.models import DEFAULT_TARGET
from echo_trtllm.models.fp8 import weight_bytes
from echo_trtllm.quantize import quantize_source
from echo_trtllm.models.loader import load_model
from echo_trtllm.runtime.inputs import sequence_logits
from echo_trtllm.runtime.request import SamplingParams


@torch.no_grad()
def heldout_loss(model, tok, texts: list[str], max_len: int = 512) -> float:
    """Mean next-token cross-entropy (nats) over the texts, each scored alone."""
    total, count = 0.0, 0
    for text in texts:
        ids = torch.tensor(tok.encode(text)[:max_len])
        if ids.numel() < 2:
            continue
        logits = sequence_logits(model, ids).float()
        total += float(torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum"))
        count += ids.numel() - 1
    return total / count


def greedy(model, tok, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy tokens per prompt (plain AR, batch 8) and the tokens/s it ran at."""
    with LLM(model, None, tokenizer=tok, speculative_config=EchoConfig(policy="ar"), cost_model=None,
             max_batch_size=8) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                            use_tqdm=False)
        wall = time.perf_counter() - t0
    tokens = [o.token_ids for o in outs]
    return tokens, sum(map(len, tokens)) / wall


@torch.no_grad()
def decode_vs_sequence(model, tok, text: str, tail: int = 8) -> dict:
    """How batch-invariant the model is: the logits of each of the text's last `tail` tokens computed by one decode
    step (a 1-row forward after the rest is cached, as AR runs it) against the same rows of one whole-sequence
    forward (as a verification forward runs them). Returns the max |difference| and how many argmaxes differ."""
    from echo_trtllm.runtime.inputs import chain_batch

    ids = tok.encode(text)
    whole = sequence_logits(model, torch.tensor(ids)).float()
    cache = model.allocate_cache(1, len(ids) + 1)
    zero = torch.zeros(1, dtype=torch.long)
    start = len(ids) - tail
    model(chain_batch([torch.tensor(ids[:start])], zero, zero), cache)
    rows = [model(chain_batch([torch.tensor([ids[i]])], torch.tensor([i]), zero), cache)[-1].float()
            for i in range(start, len(ids))]
    dec = torch.stack(rows)
    ref = whole[start:]
    return {"max_abs_logit_diff": float((dec - ref).abs().max()),
            "argmax_differs": int((dec.argmax(-1) != ref.argmax(-1)).sum()), "rows": tail}


def invariance(model_path: str, prompts: list[str], calib: list[str]) -> dict:
    """`decode_vs_sequence` over `prompts` for the float32 model and its FP8 per-tensor self."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        quantize_source(model_path, Path(tmp) / "fp8", "per_tensor", calib)
        for name, path in (("float32", model_path), ("fp8 per_tensor", Path(tmp) / "fp8")):
            model, tok = load_model(path, dtype=torch.float32)
            cells = [decode_vs_sequence(model, tok, p) for p in prompts]
            out[name] = {"max_abs_logit_diff": max(c["max_abs_logit_diff"] for c in cells),
                         "argmax_differs": sum(c["argmax_differs"] for c in cells),
                         "rows": sum(c["rows"] for c in cells)}
            print(f"{name:>16}: decode vs whole-sequence logits max |diff| {out[name]['max_abs_logit_diff']:.2e}, "
                  f"argmax differs in {out[name]['argmax_differs']} of {out[name]['rows']} rows", flush=True)
            del model
    return out


def agreement(got: list[list[int]], ref: list[list[int]]) -> tuple[float, float]:
    exact = sum(g == r for g, r in zip(got, ref)) / len(ref)
    prefix = []
    for g, r in zip(got, ref):
        n = next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))
        prefix.append(n / max(len(r), 1))
    return exact, sum(prefix) / len(prefix)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_TARGET), help="HF directory or .gguf (default: the embedded target)")
    ap.add_argument("--prompts", type=int, default=32, help="evaluation prompts decoded greedily (default: 32)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--loss-prompts", type=int, default=123, help="evaluation prompts scored for the loss")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--invariance", type=int, metavar="N",
                    help="only measure batch invariance (decode step vs whole-sequence logits, float32 and FP8) on "
                         "N evaluation prompts")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    calib = load_prompts("humaneval", split="calibration")
    evals = load_prompts("humaneval", split="eval")
    if args.invariance:
        res = invariance(args.model, evals[: args.invariance], calib)
        if args.json:
            Path(args.json).write_text(json.dumps({"invariance": res, "model": Path(args.model).name,
                                                   **report_meta("echo_trtllm.bench.fp8", argv)}, indent=2) + "\n")
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        variants = {"bfloat16": (args.model, torch.bfloat16), "float32": (args.model, torch.float32)}
        for scheme in ("per_tensor", "per_channel"):
            out = Path(tmp) / scheme
            quantize_source(args.model, out, scheme, calib)
            variants[f"fp8 {scheme}"] = (out, torch.float32)
        # the same FP8 checkpoint with embeddings, norms, head and activations in bfloat16 (how it would deploy)
        variants["fp8 per_tensor, bf16 rest"] = (Path(tmp) / "per_tensor", torch.bfloat16)
        refs: dict[str, list] = {}
        for name, (path, dtype) in variants.items():
            model, tok = load_model(path, dtype=dtype)
            loss = heldout_loss(model, tok, evals[: args.loss_prompts])
            tokens, tps = greedy(model, tok, evals[: args.prompts], args.max_tokens)
            if name in ("bfloat16", "float32"):
                refs[name] = tokens
            exact, prefix = agreement(tokens, refs["bfloat16"])
            exact32, prefix32 = agreement(tokens, refs["float32"]) if "float32" in refs else (None, None)
            results[name] = {"weight_bytes": weight_bytes(model), "heldout_loss": loss, "greedy_exact_vs_bf16": exact,
                             "greedy_prefix_vs_bf16": prefix, "greedy_exact_vs_fp32": exact32,
                             "greedy_prefix_vs_fp32": prefix32, "ar_tokens_per_s_b8": tps}
            vs32 = f", == fp32 {exact32:.2f} (prefix {prefix32:.2f})" if exact32 is not None else ""
            print(f"{name:>26}: weights {weight_bytes(model) / 2**20:7.2f} MiB  loss {loss:.4f}  "
                  f"greedy == bf16 {exact:.2f} (prefix {prefix:.2f}){vs32}  AR tok/s {tps:.1f}", flush=True)
            del model
    base = results["bfloat16"]
    for r in results.values():
        r["loss_delta_vs_bf16"] = r["heldout_loss"] - base["heldout_loss"]
        r["weights_vs_bf16"] = r["weight_bytes"] / base["weight_bytes"]
    if args.json:
        meta = report_meta("echo_trtllm.bench.fp8", argv)
        Path(args.json).write_text(json.dumps({"results": results, "model": Path(args.model).name,
                                               "calibration_prompts": len(calib), "eval_prompts": len(evals),
                                               **meta}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
