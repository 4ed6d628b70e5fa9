"""Fixtures every test directory shares: the embedded default pair, loaded once per session, and prompts."""

import pytest
import torch

from echo_trtllm import LLM
from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET
from echo_trtllm.models.loader import load_model


@pytest.fixture(scope="session")
def default_pair():
    torch.manual_seed(0)
    target, tok = load_model(DEFAULT_TARGET)
    draft, draft_tok = load_model(DEFAULT_DRAFT)
    return target, draft, tok


@pytest.fixture(scope="session")
def pair_llm(default_pair):
    """pair_llm(**options): an `LLM` on the embedded pair, the loaded models shared (use it as a context manager)."""
    target, draft, tok = default_pair
    return lambda **options: LLM(target, draft, tokenizer=tok, **options)


@pytest.fixture(scope="session")
def prompts():
    """20+ prompts of different lengths: verse, prose, code."""
    return [
        "ROMEO:\nBut soft, what light",
        "To be, or not to be",
        "def main():\n    ",
        "import os\nimport sys\n\n",
        "KING LEAR:\nBlow, winds",
        "class Parser:\n    def __init__(self",
        "HAMLET:\n",
        "The quality of mercy",
        "for i in range(",
        "Now is the winter of our discontent",
        "    return self.",
        "# Copyright",
        "MACBETH:\nIs this a dagger which I see before me,",
        "Friends, Romans, countrymen",
        "if __name__ == '__main__':",
        "All the world's a stage,\nAnd all the men and women",
        "def _check(value):\n    if not isinstance(value, int):\n        raise",
        "O",
        "JULIET:\nO Romeo, Romeo! wherefore art thou",
        "try:\n    import",
        "What's in a name?",
        "    def __repr__(self):\n        return",
    ]
