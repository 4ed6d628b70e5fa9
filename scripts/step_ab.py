"""One change inside the engine measured on the same executor: its steps alternate the two arms (the change's and
the old path's, each pair of steps in a random order), so both arms see the same requests, the same prices and the
same trees, and the machine's drift between minutes falls on both. Per method and batch size: each arm's median
milliseconds a step of the phases the change touches with their first and third quartiles over the arm's steps
(`*_quartiles`), and the rows verified.

    python scripts/step_ab.py --change frontier --model <target> [--head <its EAGLE-3 head>] [--dtype bfloat16]
        [--batch-sizes 1,16,64] [--methods echo] [--steps 40] [--json out.json]

Changes:
- frontier: drafting level by level with one host-library call per level (the replay that also chooses the next
  frontier, `core.policies._draft_on_host`) against the device loop's frontier choice, replay and rows kept in
  torch around the library's replay. Reported: the control phase (`StepTimings.control`: drafting and selection
  less the head's forwards), the draft phase and the step's time outside the target's forward less the draft phase
  (issue 34's host time).
- result: the step's drafting result in one host-library call (the Super-Tree, the selection, the selected tree and
  its packed batch: `EchoPolicy.draft_result_on_host`) against the four calls it replaces. Reported as frontier.
- refit: the online acceptance refit, its compiled segments and the gate's threshold grids in one host-library call
  (`kernels.host_acceptance_refitter`) against NumPy (with the host library's estimate reads, as before). The refit
  runs about one step in GATE_REFRESH, so the arms' means (`*_mean`) are the figures to read. Reported as frontier.
- features: the head's features of the accepted tokens copied from the verification forward's rows into the
  feature store in one host-library call (`kernels.host_row_copier`) against torch's gather then index_copy_.
  Reported as frontier, and the commit phase (`StepTimings.commit`, where the copy runs).
- reader: greedy acceptance with the host library's logits reader (a row's top-1 read only where the accepted paths
  need it) against every verified row's argmax then the tree walk (`scripts/accept_reader_ab.py`). Reported: the
  acceptance phase (`StepTimings.accept`). The runtime's rule for which steps take the reader
  (`executor.READER_PLAIN_ROWS`) is bypassed: the reader's arm takes every step it runs.

ECHO runs pure (every step drafts); `ar` steps verify their roots only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _phases(report) -> dict[str, float]:
    """The milliseconds a step's arms are compared on."""
    t = report.timings
    return {"control_ms": t.control * 1e3, "draft_ms": t.draft_model * 1e3, "accept_ms": t.accept * 1e3,
            "commit_ms": t.commit * 1e3,
            "host_ms": (t.total - t.forward - t.draft_model) * 1e3}


# the changes whose arms set one attribute (the new path) or None (the old one): where it lives, its name, and what
# to say where the path is not there
_SWITCHED = {
    "result": (lambda ex: ex.policy, "draft_resulter",
               "the host library's drafting result in one call is not built, or the policy does not select on it "
               "(scripts/setup.sh builds it; --methods echo)"),
    "features": (lambda ex: ex.drafter, "row_copier",
                 "the host library's row copy is not built, or the drafter keeps no features (scripts/setup.sh "
                 "builds it; an EAGLE-3 head)"),
    "refit": (lambda ex: getattr(ex.policy, "acceptance", None), "refitter",
              "the host library's acceptance refit is not built, or the policy has no online acceptance "
              "(scripts/setup.sh builds it; --methods echo)"),
}


@contextlib.contextmanager
def _arms(change: str, ex):
    """Yields set_arm(new: bool) for the executor `ex`; restores what it changed."""
    import echo_trtllm.runtime.executor as executor_mod

    if change == "reader":
        reader = ex._logits_reader
        if reader is None:
            raise SystemExit("the host library's logits reader is not built (scripts/setup.sh builds it)")
        saved = executor_mod.READER_PLAIN_ROWS
        executor_mod.READER_PLAIN_ROWS = 1 << 30  # the rule bypassed: the reader's arm takes every step it runs
        try:
            yield lambda new: setattr(ex, "_logits_reader", reader if new else None)
        finally:
            executor_mod.READER_PLAIN_ROWS = saved
            ex._logits_reader = reader
    elif change in _SWITCHED:
        where, attr, missing = _SWITCHED[change]
        owner = where(ex)
        value = getattr(owner, attr, None)
        if value is None:
            raise SystemExit(missing)
        try:
            yield lambda new: setattr(owner, attr, value if new else None)
        finally:
            setattr(owner, attr, value)
    else:
        replayer = getattr(ex.policy, "level_replayer", None)
        if replayer is None or not getattr(replayer, "next_frontier", False):
            raise SystemExit("the host library's level replay with the next frontier is not built, or the policy "
                             "does not replay on it (scripts/setup.sh builds it; --methods echo)")
        try:
            yield lambda new: setattr(replayer, "next_frontier", new)
        finally:
            replayer.next_frontier = True


def run(target, head, tok, change: str, method: str, batch_size: int, steps: int, prompts: list[str]) -> dict:
    from echo_trtllm.bench.run import make_engine
    from echo_trtllm.core import EchoConfig
    from echo_trtllm.runtime.request import SamplingParams

    llm = make_engine(target, head if method != "ar" else None, tok, EchoConfig(policy=method), batch_size, 1024,
                      fallback="off")
    llm.shutdown()
    ex = llm.executor
    params = SamplingParams(max_tokens=8 * steps + 64, temperature=0, ignore_eos=True)
    for i in range(batch_size):
        ex.submit(ex.make_request(prompts[i % len(prompts)], params))
    names = ("new", "old")
    arms = {a: {"verified": []} for a in names}
    # each pair of steps runs both arms in a random order: work the engine does every few steps (the gate's
    # refresh every GATE_REFRESH steps) then falls on both arms alike, where a fixed alternation gives it to one
    order = random.Random(batch_size)
    schedule = [a for _ in range(steps // 2 + 2) for a in order.sample(names, 2)]
    with _arms(change, ex) as set_arm:
        for i, arm in enumerate(schedule):
            set_arm(arm == "new")
            r = ex.step()
            if i >= 4 and r.result is not None:
                for k, v in _phases(r).items():
                    arms[arm].setdefault(k, []).append(v)
                arms[arm]["verified"].append(r.verified_tokens)
    label = {"reader": ("reader", "argmax"), "frontier": ("one_call", "device_loop"),
             "result": ("one_call", "four_calls"), "refit": ("one_call", "numpy"),
             "features": ("one_call", "torch")}[change]
    out = {"change": change, "method": method, "batch_size": batch_size}
    for arm, d in arms.items():
        for k, v in d.items():
            if not v:
                continue
            key = f"{label[names.index(arm)]}_{k}"
            out[key] = round(statistics.mean(v), 1) if k == "verified" else round(statistics.median(v), 3)
            if k != "verified":  # work done every few steps shows in the mean, not the median
                out[f"{key}_mean"] = round(statistics.mean(v), 3)
            if k != "verified" and len(v) >= 2:  # the spread over the arm's steps: first and third quartiles
                q = statistics.quantiles(v, n=4, method="inclusive")
                out[f"{key}_quartiles"] = [round(q[0], 3), round(q[2], 3)]
    out["steps_per_arm"] = min(len(d["verified"]) for d in arms.values())
    return out


def main(argv=None, change: str | None = None) -> int:
    import torch

    from echo_trtllm.bench.prompts import load_prompts
    from echo_trtllm.bench.run import write_report
    from echo_trtllm.models import DEFAULT_EAGLE3, DEFAULT_TARGET
    from echo_trtllm.models.eagle3 import load_eagle3
    from echo_trtllm.models.loader import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    if change is None:
        ap.add_argument("--change", choices=("frontier", "result", "refit", "features", "reader"), required=True)
    ap.add_argument("--model", default=str(DEFAULT_TARGET))
    ap.add_argument("--head", default=str(DEFAULT_EAGLE3))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--methods", default="ar,echo" if change == "reader" else "echo")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    change = change or args.change
    if args.steps < 2:
        ap.error(f"--steps must be >= 2 (one a step per arm), got {args.steps}")
    if change != "reader" and "ar" in args.methods.split(","):
        ap.error(f"--change {change}: AR steps draft nothing; use --methods echo")
    target, tok = load_model(args.model, dtype=args.dtype)
    head = load_eagle3(args.head, target) if "echo" in args.methods else None
    prompts = load_prompts("humaneval")
    rows = []
    for method in args.methods.split(","):
        for b in (int(x) for x in args.batch_sizes.split(",")):
            row = run(target, head, tok, change, method, b, args.steps, prompts)
            rows.append(row)
            print(json.dumps(row))
    if args.json:
        write_report(args.json, "step_ab" if change != "reader" else "accept_reader_ab", argv, rows=rows,
                     threads=torch.get_num_threads())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
