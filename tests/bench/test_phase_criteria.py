"""scripts/phase_criteria.py against the arithmetic done by hand on a two-row phases table."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "phase_criteria.py"


def load():
    spec = importlib.util.spec_from_file_location("phase_criteria", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(method, b, plain=None, spec=None):
    empty = {"steps": 0}
    return {"method": method, "batch_size": b, "plain": plain or empty, "speculative": spec or empty}


def test_the_bound_and_the_share_by_hand():
    ar = {"steps": 16, "total_ms": 100.0, "phases_ms": {"forward": 96.0}, "tokens_per_s": 160.0}
    echo = {"steps": 16, "total_ms": 120.0, "phases_ms": {"forward": 105.0, "draft_model": 6.0},
            "draft_forwards_per_step": 2.0, "draft_ms_per_forward": 3.0, "emitted_per_step": 20.0,
            "verified_per_step": 24.0, "tokens_per_s": 166.0}
    (c,) = load().criteria([row("ar", 16, plain=ar), row("echo pure", 16, spec=echo), row("echo pure", 1, spec=echo)],
                           "echo pure")
    assert c["ar_outside_ms"] == 4.0 and c["outside_ms"] == 15.0 and c["head_ms"] == 6.0
    assert c["bound_ms"] == 1.5 * 4.0 + 6.0 and c["within_bound"] is False  # 15 > 12
    assert c["head_share"] == 0.05
