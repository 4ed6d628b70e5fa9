"""scripts/echo_trace_summary.py on a hand-written trace: the per-batch counts, the pairing of each call with the
vLLM step that follows it (recorded at the next call), and the drafting steps grouped by their longest chain,
against values read off the trace by hand."""

import json
from pathlib import Path

import pytest

from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[2]


def _module():
    return load_script(ROOT / "scripts" / "echo_trace_summary.py")


def _step(lengths, decision, propose, step, catch_up=0, spec=None):
    return {"rows": len(lengths), "live": len(lengths), "lengths": lengths, "decision": decision,
            "estimate": {"spec_seconds": spec, "plain_seconds": 0.05}, "propose_seconds": propose,
            "step_seconds": step, "drafting": sum(1 for n in lengths if n), "catch_up": catch_up, "stats": {"steps": 1}}


def test_drafting_steps_are_grouped_by_their_longest_chain(tmp_path):
    steps = [_step([0, 0], "plain", 0.001, None),
             _step([4, 2], "probe", 0.200, 0.050, catch_up=30, spec=0.15),  # followed by a 0.300 s step
             _step([4, 4], "exploit", 0.100, 0.300, spec=0.17),  # followed by 0.070
             _step([1, 0], "exploit", 0.030, 0.070, spec=0.16),  # followed by 0.060
             _step([0, 0], "plain", 0.001, 0.060)]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(s) for s in steps))
    out = _module().summarise(path)["by_live_rows"]["2"]
    assert out["steps"] == 5 and out["drafting_steps"] == 3 and out["drafted_tokens"] == 15
    assert out["decisions"] == {"plain": 2, "probe": 1, "exploit": 2}
    deep = out["by_longest_chain"]["4"]
    assert deep["steps"] == 2
    assert deep["propose_ms_median"] == pytest.approx(150.0)
    assert deep["vllm_step_ms_median"] == pytest.approx((300.0 + 70.0) / 2)
    assert deep["predicted_spec_ms_median"] == pytest.approx(160.0)
    assert deep["catch_up_tokens_median"] == 15
    assert out["by_longest_chain"]["1"]["vllm_step_ms_median"] == pytest.approx(60.0)
