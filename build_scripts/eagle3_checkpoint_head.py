"""The head of an EAGLE-3 training checkpoint as it stands, written as a head directory (config.json +
model.safetensors + training.json) that `LLM(draft_model=DIR)`, `bench` and `echo_trtllm.bench.eagle3` load: a run
that has not finished (`train_eagle3.py --data`, `qwen_eagle3.py --recipe v2`) measured at its last checkpoint.
The checkpoint is only read; training resumes from it as before.

    python build_scripts/eagle3_checkpoint_head.py --target <target dir or .gguf> \
        --state <work dir>/train-state.pt --out <head dir>

The head is written exactly as a finished run writes it (`train_eagle3.save_head`: float16 weights, the draft
vocabulary's maps); training.json says it is a checkpoint, its step and the run's planned steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="the target the head was trained for (HF directory or .gguf)")
    ap.add_argument("--state", required=True, help="a training checkpoint (train-state.pt in a run's --out)")
    ap.add_argument("--out", required=True, help="the head directory to write (new, or a head written before)")
    args = ap.parse_args(argv)
    state_path, out = Path(args.state), Path(args.out)
    if not state_path.is_file():
        ap.error(f"--state {state_path}: no such checkpoint file")
    if out.exists() and any(out.iterdir()) and not (out / "training.json").is_file():
        ap.error(f"--out {out}: not empty and not a head directory; give a new directory")

    import torch

    import train_eagle3
    from echo_trtllm.models.loader import load_model

    state = torch.load(state_path, weights_only=False)
    missing = [k for k in ("head", "cfg", "dv_ids", "step") if k not in state]
    if missing:
        ap.error(f"--state {state_path}: not a training checkpoint (no {', '.join(missing)})")
    target, _ = load_model(args.target, dtype="float32", with_tokenizer=False)
    head = train_eagle3.init_head(target, state["cfg"], state["dv_ids"], seed=0)
    head.load_state_dict(state["head"])
    identity = state.get("identity", {})
    meta = {"checkpoint": state_path.name, "checkpoint_step": int(state["step"]),
            "planned_steps": identity.get("flags", {}).get("steps"), "training_minutes": round(float(state.get("seconds", 0)) / 60, 1),
            "train_windows": identity.get("train_windows"), "target": Path(args.target).name,
            "draft_vocab": state["cfg"]["draft_vocab_size"], "intermediate_size": state["cfg"]["intermediate_size"],
            "command": "python build_scripts/eagle3_checkpoint_head.py " + " ".join(
                argv if argv is not None else sys.argv[1:])}
    train_eagle3.save_head(head, state["cfg"], state["dv_ids"], out, meta)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
