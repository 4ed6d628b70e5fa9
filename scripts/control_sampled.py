"""Where a speculative step's host time goes, read by a sampling profiler instead of timers around functions:
ECHO steps (pure: every step drafts) of a target with its EAGLE-3 head, at one batch size, under `py-spy record`,
and the samples folded into milliseconds a step per function (inclusive: the function and what it calls; self:
the line running when sampled). Nothing in the engine is wrapped, so what a function costs between two forwards
that have flushed the caches is what is counted (`control_split.py` wraps each part in a timer; its own calls
and the warm cache of a repeated microbenchmark are not in these numbers).

    python scripts/control_sampled.py [--model <target> --head <its EAGLE-3 head> --dtype bfloat16]
        [--batch-size 1] [--steps 300] [--rate 400] [--py-spy py-spy] [--json out.json]

py-spy is a tool of this measurement only (`pip install py-spy` in any environment; --py-spy names its binary),
never a dependency of the project. Only the samples of the measured steps count (those under
`_measured_steps`); the engine's warm-up steps and the model's loading are not sampled into the table.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile

MARK = "_measured_steps"


def _measured_steps(executor, steps: int, refill) -> dict:
    """The steps the table counts (its frame marks their samples); returns the engine's own step timings."""
    control = total = 0.0
    for n in range(steps):
        report = executor.step()
        control += report.timings.control
        total += report.timings.total
        if not executor.has_work:
            refill(n)
    return {"steps": steps, "step_ms": round(total / steps * 1e3, 3), "control_ms": round(control / steps * 1e3, 3)}


def run_steps(args) -> dict:
    """The sampled child: the pair loaded, the steps control_split.py measures set up its way, then measured."""
    import torch

    from control_split import pure_echo  # this script's folder is the child's first import path
    from echo_trtllm.bench.prompts import load_prompts
    from echo_trtllm.models import DEFAULT_EAGLE3, DEFAULT_TARGET
    from echo_trtllm.models.eagle3 import load_eagle3
    from echo_trtllm.models.loader import load_model

    torch.set_num_threads(args.threads)
    target, tok = load_model(args.model or DEFAULT_TARGET, dtype=args.dtype)
    head = load_eagle3(args.head or DEFAULT_EAGLE3, target)
    with torch.no_grad():  # not inference mode: a bfloat16 model's prepacked weights track their tensors' versions
        ex, submit = pure_echo(target, head, tok, args.batch_size, 400, load_prompts("humaneval"))
        return _measured_steps(ex, args.steps, submit)


def fold(raw_lines, rate: float, steps: int, top: int = 200) -> dict:
    """py-spy's raw output (one `frame;frame;... count` line per stack) folded into ms a step: inclusive per
    function (counted once a stack), self per line; only the stacks under MARK."""
    inclusive, own = collections.Counter(), collections.Counter()
    total = 0
    for line in raw_lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        at = next((i for i, f in enumerate(frames) if f.startswith(MARK + " ")), None)
        if at is None:
            continue
        frames, n = frames[at + 1:], int(count)
        total += n
        seen = set()
        for f in frames:
            name = _function(f)
            if name not in seen:
                inclusive[name] += n
                seen.add(name)
        if frames:
            own[_function(frames[-1], line=True)] += n
    ms = lambda n: round(n / rate * 1e3 / steps, 3)  # noqa: E731
    return {"sampled_ms_per_step": ms(total),
            "inclusive_ms_per_step": {k: ms(v) for k, v in inclusive.most_common(top)},
            "self_ms_per_step": {k: ms(v) for k, v in own.most_common(top)}}


def _function(frame: str, line: bool = False) -> str:
    """`name (path/file.py:line)` -> `name (file.py)`, or with line: `name (file.py:line)`."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rsplit("/", 1)[-1]
    return f"{name} ({where if line else where.split(':')[0]})" if where else name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target (HF directory or .gguf; default: the embedded target)")
    ap.add_argument("--head", default=None, help="its EAGLE-3 head directory (default: the embedded head)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rate", type=int, default=400, help="samples a second")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--py-spy", default="py-spy", help="the py-spy binary")
    ap.add_argument("--json", default=None)
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)  # the sampled child: its timings go to this file
    args = ap.parse_args(argv)
    if (args.model is None) != (args.head is None):
        ap.error("--model and --head go together (a head is trained for its target)")
    for name in ("batch_size", "steps", "rate", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.run:
        with open(args.run, "w") as f:
            json.dump(run_steps(args), f)
        return 0
    spy = shutil.which(args.py_spy)
    if spy is None:
        ap.error(f"--py-spy {args.py_spy}: not found (install py-spy in any environment and name its binary)")
    own_argv = sys.argv[1:] if argv is None else list(argv)
    with tempfile.TemporaryDirectory() as tmp:
        raw, own = os.path.join(tmp, "raw.txt"), os.path.join(tmp, "timings.json")
        child = [sys.executable, os.path.abspath(__file__), *own_argv, "--run", own]
        done = subprocess.run([spy, "record", "-r", str(args.rate), "-f", "raw", "--nonblocking", "-o", raw, "--",
                               *child], capture_output=True, text=True)
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-4000:])
            return done.returncode
        with open(own) as f:
            timings = json.load(f)
        with open(raw) as f:
            folded = fold(f, args.rate, args.steps)
    result = {"batch_size": args.batch_size, **timings, "rate": args.rate, **folded,
              "command": "python scripts/control_sampled.py " + " ".join(own_argv), "threads": args.threads}
    if args.json:  # before printing: a reader that stops reading the table early does not lose the JSON
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(f"B={args.batch_size}: step {timings['step_ms']} ms, control {timings['control_ms']} ms (the engine's "
          f"timers); sampled {folded['sampled_ms_per_step']} ms a step")
    for k, v in list(folded["inclusive_ms_per_step"].items())[:60]:
        print(f"   {v:8.3f}  {k}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
