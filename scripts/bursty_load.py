"""Run a command while CPU-bound processes compete for the cores in bursts: each load process is busy, then idle,
for random fractions of a second (steady load alone did not disturb wall-clock decisions the way bursts do).

    python3 scripts/bursty_load.py [--procs 2] [--max-burst 0.5] [--seed 0] -- bash scripts/test.sh

Exits with the command's exit code; the load processes end with it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import subprocess
import sys
import time


def burn(seed: int, max_burst: float) -> None:
    rng = random.Random(seed)
    while True:
        end = time.monotonic() + rng.uniform(0.02, max_burst)
        while time.monotonic() < end:
            pass
        time.sleep(rng.uniform(0.02, max_burst))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=2, help="load processes (default 2: one per core here)")
    ap.add_argument("--max-burst", type=float, default=0.5, help="longest busy or idle spell, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command to run after --")
    procs = [mp.Process(target=burn, args=(args.seed + i, args.max_burst), daemon=True) for i in range(args.procs)]
    for p in procs:
        p.start()
    try:
        return subprocess.call(command)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join()


if __name__ == "__main__":
    sys.exit(main())
