"""Models: a compact Llama-family transformer, loaders (HF directories, GGUF), the embedded default pair."""

from pathlib import Path

DEFAULT_MODELS_DIR = Path(__file__).parent / "default"
DEFAULT_TARGET = DEFAULT_MODELS_DIR / "target"
DEFAULT_DRAFT = DEFAULT_MODELS_DIR / "draft"

__all__ = ["DEFAULT_TARGET", "DEFAULT_DRAFT", "DEFAULT_MODELS_DIR"]
