"""scripts/controller_steps.py (docs/performance.md's step-by-step reading of ECHO as shipped on a closed batch): its
summary against a hand computation, and a run on the embedded pair whose steps account for every token (timings
are the machine's: not checked)."""

import json
from pathlib import Path

from echo_trtllm.models import DEFAULT_EAGLE3, DEFAULT_TARGET
from tests.helpers import load_script

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _row(rows, speculated, ms, emitted):
    return {"rows": rows, "speculated": speculated, "ms": ms, "emitted": emitted}


def test_the_summary_splits_the_first_step_the_full_batch_and_the_drain():
    script = load_script(SCRIPTS / "controller_steps.py")
    steps = [_row(2, False, 1000.0, 2), _row(2, True, 100.0, 5), _row(2, False, 50.0, 2), _row(2, True, 100.0, 3),
             _row(1, True, 40.0, 2)]
    s = script.summary(steps, 2)
    assert s["all"] == {"steps": 5, "tokens": 14, "tokens_per_s": round(14 / 1290 * 1e3, 2), "ms_per_step": 258.0}
    assert s["without_first_step"]["tokens"] == 12 and s["without_first_step"]["steps"] == 4
    assert s["full_batch_speculative"] == {"steps": 2, "tokens": 8, "tokens_per_s": 40.0, "ms_per_step": 100.0}
    assert s["full_batch_plain"] == {"steps": 1, "tokens": 2, "tokens_per_s": 40.0, "ms_per_step": 50.0}
    assert s["drain"] == {"steps": 1, "tokens": 2, "tokens_per_s": 50.0, "ms_per_step": 40.0}
    assert script.summary(steps[:1], 2)["drain"] == {"steps": 0, "tokens": 0, "tokens_per_s": None,
                                                     "ms_per_step": None}


def test_a_run_on_the_embedded_pair_accounts_for_every_token(tmp_path):
    script = load_script(SCRIPTS / "controller_steps.py")
    out = tmp_path / "steps.json"
    assert script.main(["--model", str(DEFAULT_TARGET), "--head", str(DEFAULT_EAGLE3), "--dtype", "float32",
                        "--batch-size", "3", "--max-tokens", "12", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    steps = doc["steps"]
    assert sum(r["emitted"] for r in steps) == 3 * 12 == doc["summary"]["all"]["tokens"]
    assert steps[0]["rows"] == 3 and all(0 < r["rows"] <= 3 for r in steps)
    assert all(r["verified"] >= r["rows"] and (r["speculated"] or r["verified"] == r["rows"]) for r in steps)
    assert doc["command"].startswith("python scripts/controller_steps.py --model")
