"""Models: a compact Llama-family transformer, loaders (HF directories, GGUF), the embedded default pair."""

from pathlib import Path

DEFAULT_MODELS_DIR = Path(__file__).parent / "default"
DEFAULT_TARGET = DEFAULT_MODELS_DIR / "target"
DEFAULT_DRAFT = DEFAULT_MODELS_DIR / "draft"
DEFAULT_EAGLE3 = DEFAULT_MODELS_DIR / "eagle3"  # an EAGLE-3 head for the default target (docs/eagle3.md)

__all__ = ["DEFAULT_TARGET", "DEFAULT_DRAFT", "DEFAULT_EAGLE3", "DEFAULT_MODELS_DIR"]
