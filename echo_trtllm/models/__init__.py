"""Models: a compact Llama-family transformer, loaders (HF directories, GGUF), the embedded default pair."""

from pathlib import Path

DEFAULT_MODELS_DIR = Path(__file__).parent / "default"
DEFAULT_TARGET = DEFAULT_MODELS_DIR / "target"
DEFAULT_DRAFT = DEFAULT_MODELS_DIR / "draft"
DEFAULT_EAGLE3 = DEFAULT_MODELS_DIR / "eagle3"  # an EAGLE-3 head for the default target (docs/eagle3.md)

__all__ = ["DEFAULT_TARGET", "DEFAULT_DRAFT", "DEFAULT_EAGLE3", "DEFAULT_MODELS_DIR", "default_drafter"]


def default_drafter() -> Path:
    """What the embedded target drafts with when no draft is named (`LLM()`, and so `generate` and `serve`;
    `build`, `calibrate`): its committed EAGLE-3 head, the paper's drafter (under tensor parallelism too: rank 0
    runs the head whole). The benchmark commands and `export` keep the separate draft model as their default: the
    tables in docs/benchmarks.md name the draft each one ran, and TensorRT-LLM loads an EAGLE-3 head as it is, so
    `export` has nothing to convert for one."""
    return DEFAULT_EAGLE3
