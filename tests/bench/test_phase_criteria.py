"""scripts/phase_criteria.py against the arithmetic done by hand on a two-row phases table."""

from pathlib import Path

from tests.helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "phase_criteria.py"


def load():
    return load_script(SCRIPT)


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


def test_rounds_are_read_each_beside_the_same_rounds_ar():
    def summary(total, forward, draft=0.0, forwards=0.0):
        s = {"steps": 4, "total_ms": total, "phases_ms": {"forward": forward, "draft_model": draft},
             "draft_forwards_per_step": forwards, "emitted_per_step": 5.0, "verified_per_step": 6.0,
             "tokens_per_s": 10.0}
        if forwards:
            s["draft_ms_per_forward"] = draft / forwards
        return s
    ar_rounds = [summary(100.0, 96.0), summary(110.0, 100.0)]  # outside 4, then 10
    echo_rounds = [summary(120.0, 105.0, 6.0, 2.0), summary(130.0, 110.0, 6.0, 2.0)]  # outside 15, then 20
    ar = {**summary(105.0, 98.0), "rounds": ar_rounds}
    echo = {**summary(125.0, 107.5, 6.0, 2.0), "rounds": echo_rounds}
    (c,) = load().criteria([row("ar", 16, plain=ar), row("echo pure", 16, spec=echo)], "echo pure")
    assert c["outside_ms"] == 17.5 and c["bound_ms"] == 1.5 * 7.0 + 6.0 and c["within_bound"] is False
    assert [r["bound_ms"] for r in c["rounds"]] == [12.0, 21.0]  # 1.5 x 4 + 6, 1.5 x 10 + 6
    assert [r["within_bound"] for r in c["rounds"]] == [False, True] and c["rounds_within"] == 1
