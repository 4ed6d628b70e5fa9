"""An EAGLE-3 head's report card: acceptance per draft depth on held-out prompts, and its cost per draft level as a
share of a target AR step at the same batch size.

    python -m echo_trtllm.bench.eagle3 --model T --head H [--prompt-set humaneval --split eval] \\
        [--depth 6 --max-tokens 64 --batch-sizes 1,16 --context 256] [--json out.json]

Acceptance: greedy, chain policy of `--depth` draft tokens (the head's top-1 at every level), one request at a time.
For each speculative step the number of accepted drafts a is recorded (before stop conditions cut anything);
alpha_d = P(a >= d | a >= d - 1) is the acceptance of depth d given its parent was accepted, and the mean accepted
length is 1 + E[a] tokens per step. Calibration, what ECHO's gate and budget read: per depth, the ROC-AUC of each
drafted node's path probability (the head's probabilities multiplied along its chain) against whether the target
accepted it (`core.gating.roc_auc`), and the mean path probability beside the rate accepted. By position: the
same per band of the completion's tokens (0-31, 32-63, 64+), with the share of the target's tokens there that the
head's draft vocabulary holds (a ceiling on its acceptance).

Cost: B requests, each with `--context` tokens cached; the target's AR step (B new tokens, logits of all) against
one head level over B frontier nodes, the head's forward alone and with what the drafter does after it (the
draft-vocabulary softmax scattered to target ids and copied to the host). Fastest of `--repeats` runs each.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from torch import Tensor

from echo_trtllm.core import DraftTopK, EchoConfig
from echo_trtllm.core.gating import roc_auc
from echo_trtllm.models.eagle3 import Eagle3Head
from echo_trtllm.models.llama import CausalLM
from echo_trtllm.runtime.calibrate import fastest_seconds
from echo_trtllm.runtime.executor import Executor
from echo_trtllm.runtime.inputs import chain_batch
from echo_trtllm.runtime.request import SamplingParams

__all__ = ["acceptance_by_depth", "by_position", "calibration_by_depth", "level_cost"]


def acceptance_by_depth(target: CausalLM, head: Eagle3Head, tokenizer, prompts: list[str], depth: int = 6,
                        max_tokens: int = 64, max_seq_len: int = 2048) -> dict:
    ex = Executor(target, head, tokenizer, EchoConfig(policy="chain", num_draft_tokens=depth), max_batch_size=1,
                  max_seq_len=max_seq_len)
    accepted: list[int] = []
    positions: list[int] = []  # per step: the completion's tokens before it
    outputs: list[list[int]] = []
    nodes: list[tuple[Tensor, Tensor, Tensor]] = []  # per step: depths, path probabilities, accepted
    for p in prompts:
        req = ex.make_request(p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        ex.submit(req)
        while ex.has_work:
            report = ex.step()
            if report.speculated and report.result is not None:
                a = torch.diff(report.result.cu_accepted) - 1
                accepted += a.tolist()
                positions.append(report.positions[0])
                tree = report.draft.selected  # one request: its chain
                nodes.append((tree.depths.cpu(), tree.path_probs.cpu(), tree.depths.cpu() <= int(a[0])))
        outputs.append(list(req.output_token_ids))
    if ex.failures:
        raise RuntimeError(f"the run had failures: {ex.last_error}")
    a = torch.tensor(accepted)
    reach = [int((a >= d).sum()) for d in range(depth + 1)]
    alpha = [reach[d] / reach[d - 1] if reach[d - 1] else 0.0 for d in range(1, depth + 1)]
    return {"steps": len(accepted), "prompts": len(prompts), "depth": depth, "max_tokens": max_tokens,
            "alpha_by_depth": [round(x, 4) for x in alpha], "reach_by_depth": reach,
            "mean_accepted_length": round(1 + float(a.float().mean()), 4) if accepted else 1.0,
            **by_position(accepted, positions, outputs, head), **calibration_by_depth(nodes, depth)}


POSITION_BANDS = ((0, 32), (32, 64), (64, None))  # tokens of the completion before a step


def by_position(accepted: list[int], positions: list[int], outputs: list[list[int]], head: Eagle3Head) -> dict:
    """Per band of completion positions (`POSITION_BANDS`, a step's band: the tokens before it): the steps, the
    depth-1 acceptance and the mean accepted length, and the share of the target's tokens in that band that the head
    can draft at all (inside its draft vocabulary, `d2t`): a ceiling on any depth's acceptance there."""
    drafted = set((torch.arange(head.d2t.numel()) + head.d2t.cpu()).tolist())
    out = {}
    for lo, hi in POSITION_BANDS:
        name = f"{lo}-{hi - 1}" if hi is not None else f"{lo}+"
        steps = [a for a, p in zip(accepted, positions) if p >= lo and (hi is None or p < hi)]
        tokens = [t for o in outputs for t in o[lo:hi]]
        if not steps and not tokens:
            continue
        out[name] = {"steps": len(steps),
                     "alpha_1": round(sum(a >= 1 for a in steps) / len(steps), 4) if steps else None,
                     "mean_accepted_length": round(1 + sum(steps) / len(steps), 4) if steps else None,
                     "target_tokens": len(tokens),
                     "in_draft_vocab": round(sum(t in drafted for t in tokens) / len(tokens), 4) if tokens else None}
    return {"by_position": out}


def calibration_by_depth(nodes: list[tuple[Tensor, Tensor, Tensor]], depth: int) -> dict:
    """Per depth 1..depth: ROC-AUC of the drafted nodes' path probabilities against acceptance (None with one class
    only), their mean path probability and the share accepted (None without nodes)."""
    if not nodes:
        return {"auc_by_depth": [None] * depth, "mean_path_prob_by_depth": [None] * depth,
                "accepted_share_by_depth": [None] * depth}
    d, c, ok = (torch.cat(x) for x in zip(*nodes))
    auc, mean_c, share = [], [], []
    for k in range(1, depth + 1):
        at = d == k
        value = roc_auc(c[at], ok[at]) if bool(at.any()) else float("nan")
        auc.append(None if math.isnan(value) else round(value, 4))
        mean_c.append(round(float(c[at].double().mean()), 4) if bool(at.any()) else None)
        share.append(round(float(ok[at].double().mean()), 4) if bool(at.any()) else None)
    return {"auc_by_depth": auc, "mean_path_prob_by_depth": mean_c, "accepted_share_by_depth": share}


@torch.inference_mode()
def level_cost(target: CausalLM, head: Eagle3Head, batch_size: int, context: int = 256, repeats: int = 5) -> dict:
    """Seconds of a target AR step and of one head level at `batch_size` requests with `context` cached tokens."""
    gen = torch.Generator().manual_seed(0)
    b = batch_size
    vocab = target.config.vocab_size
    slots = torch.arange(b)
    ids = torch.randint(0, vocab, (b, context + 1), generator=gen)
    prefill = chain_batch(list(ids[:, :context]), torch.zeros(b, dtype=torch.long), slots, logits="none")
    step = chain_batch(list(ids[:, context:]), torch.full((b,), context), slots, logits="all")
    t_cache = target.allocate_cache(b, context + 1)
    target(prefill, t_cache)
    h_cache = head.allocate_cache(b, context + 1)
    width = 3 * head.config.target_hidden_size
    head(prefill, h_cache, torch.zeros(b * context, width, dtype=head.dtype))
    y = torch.zeros(b, head.config.layer.hidden_size, dtype=head.dtype, device=head.device)

    def head_level():
        return head(step, h_cache, y)[0]

    dev = target.device
    t = fastest_seconds(lambda: target(step, t_cache), repeats, dev)
    h = fastest_seconds(head_level, repeats, dev)
    # as the drafter runs a level: the head's forward, its top-k (k = the default top_k) mapped to target ids,
    # and those F x k values copied to the host
    def head_level_top_k():
        top = DraftTopK.of(torch.softmax(head_level().float(), dim=-1), EchoConfig().top_k)
        return top.probs.cpu(), head.to_target_ids(top.tokens).cpu()

    h2 = fastest_seconds(head_level_top_k, repeats, dev)
    return {"batch_size": b, "context": context, "target_step_ms": round(t * 1e3, 3),
            "head_level_ms": round(h * 1e3, 3), "head_level_with_top_k_ms": round(h2 * 1e3, 3),
            "head_share": round(h / t, 4), "head_share_with_top_k": round(h2 / t, 4)}


def main(argv=None) -> int:
    from echo_trtllm.bench.prompts import load_prompts
    from echo_trtllm.bench.run import report_meta
    from echo_trtllm.models.eagle3 import load_eagle3
    from echo_trtllm.models.loader import load_model

    ap = argparse.ArgumentParser(prog="python -m echo_trtllm.bench.eagle3", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", required=True, help="EAGLE-3 head directory")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-set", default="humaneval")
    ap.add_argument("--split", default="eval", choices=["eval", "calibration", "all"],
                    help="which side of the prompt set's fixed split (bench.prompts.load_prompts)")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    target, tok = load_model(args.model, dtype=args.dtype)
    head = load_eagle3(args.head, target)
    prompts = load_prompts(args.prompt_set, args.split)
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
    acc = acceptance_by_depth(target, head, tok, prompts, args.depth, args.max_tokens)
    print(f"acceptance per depth (alpha_d, {acc['steps']} steps over {len(prompts)} prompts): "
          + " ".join(f"{a:.3f}" for a in acc["alpha_by_depth"]) + f"; mean accepted length {acc['mean_accepted_length']}")
    print("path probability AUC per depth: " + " ".join("-" if x is None else f"{x:.3f}" for x in acc["auc_by_depth"]))
    for band, row in acc["by_position"].items():
        print(f"completion tokens {band}: {row['steps']} steps, alpha_1 {row['alpha_1']}, mean accepted length "
              f"{row['mean_accepted_length']}; {row['in_draft_vocab']} of the target's {row['target_tokens']} tokens "
              f"inside the draft vocabulary")
    costs = [level_cost(target, head, int(b), args.context, args.repeats) for b in args.batch_sizes.split(",")]
    for c in costs:
        print(f"B={c['batch_size']}: target step {c['target_step_ms']} ms, head level {c['head_level_ms']} ms "
              f"({c['head_share']:.1%}), with its top-k to the host {c['head_level_with_top_k_ms']} ms "
              f"({c['head_share_with_top_k']:.1%})")
    if args.json:
        out = {"acceptance": acc, "level_cost": costs, "prompt_set": args.prompt_set, "split": args.split,
               "dtype": args.dtype, **report_meta("echo_trtllm.bench.eagle3", argv)}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
