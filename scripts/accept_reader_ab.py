"""Greedy acceptance inside the engine with the host library's logits reader against every verified row's argmax
then the tree walk, on the same executor, its steps alternating the two: `scripts/step_ab.py --change reader` (its
docstring says what is measured).

    python scripts/accept_reader_ab.py --model <target> [--head <its EAGLE-3 head>] [--dtype bfloat16]
        [--batch-sizes 1,16,64] [--methods ar,echo] [--steps 40] [--json out.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_ab import main as _main  # noqa: E402


def main(argv=None) -> int:
    return _main(argv, change="reader")


if __name__ == "__main__":
    raise SystemExit(main())
