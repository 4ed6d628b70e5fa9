"""Load a draft for a target: a separate draft model (same tokenizer) or an EAGLE-3 head, told apart by the
directory's config.json (`models.eagle3.is_eagle3_dir`)."""

from __future__ import annotations

from pathlib import Path

from .eagle3 import Eagle3Head, is_eagle3_dir, load_eagle3
from .llama import CausalLM
from .loader import Tokenizer, check_same_vocabulary, load_model

__all__ = ["load_draft", "draft_kind"]


def draft_kind(draft: CausalLM | Eagle3Head) -> str:
    """"eagle3" or "model" (for reports and engine metadata)."""
    return "eagle3" if isinstance(draft, Eagle3Head) else "model"


def load_draft(source: str | Path | CausalLM | Eagle3Head, target: CausalLM, dtype: str = "auto",
               device: str | None = None, tokenizer: Tokenizer | None = None) -> CausalLM | Eagle3Head:
    """A loaded draft (returned as is), an EAGLE-3 head directory (loaded for `target`, in its dtype and on its
    device), or a draft model (HF directory / .gguf) whose tokenizer must equal `tokenizer` when one is given."""
    if isinstance(source, (CausalLM, Eagle3Head)):
        return source
    if is_eagle3_dir(source):
        return load_eagle3(source, target)
    draft, draft_tok = load_model(source, dtype=dtype, device=device or str(target.device),
                                  with_tokenizer=tokenizer is not None)
    if tokenizer is not None and draft_tok is not None:
        check_same_vocabulary(tokenizer, draft_tok)
    return draft
