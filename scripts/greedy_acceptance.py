"""How often verified draft nodes are accepted, by depth, path probability and whether they lie on the draft's
greedy path (every rank from the root 0): the evidence behind the acceptance estimates' two tables.

    .venv/bin/python scripts/greedy_acceptance.py [--model TARGET --draft-model DRAFT] [--policy eagle2]
        [--batch-size 1] [--max-tokens 32] [--prompt-set mixed] [--json out.json]

Runs the policy pure (every step drafts; its own tree shape) over the prompt set's calibration and eval prompts,
greedy, and counts per (depth, on the greedy path, path-probability bin) the verified nodes and the accepted ones.
The policy's trees decide which nodes are verified, so a bin holds what that policy chose to verify.
"""

from __future__ import annotations

import argparse
import json

BINS = (0.0, 0.02, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0001)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--draft-model")
    ap.add_argument("--policy", default="eagle2")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-set", default="mixed")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from echo_trtllm.api import LLM
    from echo_trtllm.bench.prompts import load_prompts
    from echo_trtllm.bench.run import report_meta
    from echo_trtllm.core.config import EchoConfig
    from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET
    from echo_trtllm.runtime.request import SamplingParams

    llm = LLM(args.model or str(DEFAULT_TARGET), args.draft_model or str(DEFAULT_DRAFT), dtype=args.dtype,
              max_batch_size=args.batch_size, max_seq_len=1024, fallback=False,
              speculative_config=EchoConfig(policy=args.policy))
    llm.shutdown()
    ex = llm.executor
    prompts = load_prompts(args.prompt_set, "calibration") + load_prompts(args.prompt_set, "eval")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    counts: dict[tuple[int, bool, int], list[int]] = {}
    for i in range(0, len(prompts), args.batch_size):
        for p in prompts[i:i + args.batch_size]:
            ex.submit(ex.make_request(p, params))
        while ex.has_work:
            r = ex.step()
            if not r.speculated:
                continue
            sel = r.draft.selected
            accepted = set(r.result.accepted_node_ids.tolist())
            greedy = sel.on_greedy_path.tolist()
            for j, (d, c) in enumerate(zip(sel.depths.tolist(), sel.path_probs.tolist())):
                if d == 0:
                    continue
                b = max(k for k in range(len(BINS) - 1) if BINS[k] <= c)
                cell = counts.setdefault((d, greedy[j], b), [0, 0])
                cell[0] += 1
                cell[1] += j in accepted
    rows = [{"depth": d, "greedy_path": g, "path_prob": [BINS[b], min(BINS[b + 1], 1.0)], "verified": n,
             "accepted": a, "rate": round(a / n, 3)} for (d, g, b), (n, a) in sorted(counts.items())]
    meta = report_meta("scripts.greedy_acceptance", argv,  # machine (CPU flags), date, the command
                       runner=".venv/bin/python scripts/greedy_acceptance.py")
    out = {"policy": args.policy, "batch_size": args.batch_size, "prompts": len(prompts),
           "prompt_set": args.prompt_set, "rows": rows, **meta}
    for row in rows:
        print(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
