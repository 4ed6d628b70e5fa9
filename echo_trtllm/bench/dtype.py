"""Which dtype verifies faster on this CPU: the forward cost curve t(T) of a model in each dtype, side by side,
and what `dtype="auto"` chooses on this machine (models.loader.auto_dtype).

A CPU with bf16 matrix instructions (AMX-BF16, AVX512-BF16) runs a many-row bfloat16 linear several times faster
than float32; one without them (AVX2 only) runs it several times slower, while a one-row linear (AR decoding)
is memory-bound either way. Speculation lives on the many-row side: verification of T tokens costs t(T), so the
dtype changes whether speculation can pay at all (docs/dtype.md).
"""

from __future__ import annotations

import torch

from echo_trtllm.models.loader import DTYPES, auto_dtype, load_model
from echo_trtllm.runtime.calibrate import measure_forward_seconds

__all__ = ["dtype_curves"]


def dtype_curves(source, dtypes: list[str], tokens: tuple[int, ...], repeats: int = 3) -> dict:
    """Load `source` once (float32) and time its forward over each T in `tokens` in each dtype, in the order
    given (the weights are converted in place; only times are compared)."""
    model, _ = load_model(source, dtype="float32", with_tokenizer=False)
    chosen, rule = auto_dtype(config=model.config)
    curves = {}
    for name in dtypes:
        model.to(DTYPES[name])
        curves[name] = dict(zip(tokens, measure_forward_seconds(model, tokens, repeats=repeats)))
    return {"config": {"hidden_size": model.config.hidden_size, "intermediate_size": model.config.intermediate_size,
                       "layers": model.config.num_hidden_layers, "vocab_size": model.config.vocab_size},
            "auto": str(chosen).removeprefix("torch."), "auto_rule": rule,
            "seconds": {name: {str(t): s for t, s in c.items()} for name, c in curves.items()},
            "torch_threads": torch.get_num_threads()}
