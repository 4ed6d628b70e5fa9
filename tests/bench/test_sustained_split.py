"""scripts/sustained_split.py (docs/performance.md's in-process split of sustained serving into admission and decode
steps): its summary against a hand computation, the load kept at its concurrency on the embedded pair with the
window bounded by an injected clock (the steps' own timings are the machine's: not checked), and bad arguments
named before anything loads."""

import itertools

import pytest

from echo_trtllm.bench.serve import request_max_tokens
from echo_trtllm.models import DEFAULT_EAGLE3, DEFAULT_TARGET
from echo_trtllm.models.eagle3 import load_eagle3
from echo_trtllm.models.loader import load_model
from tests.bench.test_controller_steps import SCRIPTS
from tests.helpers import load_script


def _row(speculated, wall, step, emitted, verified, reason=None, finished=0):
    return {"rows": 2, "speculated": speculated, "wall_s": wall, "step_s": step, "emitted": emitted,
            "verified": verified, "reason": reason, "finished": finished, "credit": None}


def test_the_summary_splits_admission_from_speculative_and_plain_steps():
    script = load_script(SCRIPTS / "sustained_split.py")
    rows = [_row(False, 0.5, 0.2, 2, 2, "plain"), _row(True, 0.4, 0.4, 6, 9, "exploit", finished=1),
            _row(True, 0.3, 0.2, 4, 7, "probe")]
    parts = {"admission": 0.35, "target prefill": 0.25, "draft prefill": 0.05, "prompt_tokens": 100}
    s = script.summary(rows, parts, 1.25)
    assert s["tokens"] == 12 and s["tokens_per_s"] == round(12 / 1.25, 2) and s["finished"] == 1
    assert s["admission_s"] == 0.35 and s["admission_share"] == round(0.35 / 1.25, 4)
    assert s["other_s"] == round(1.2 - 0.8 - 0.35, 3)  # the step calls beyond their totals and the admission
    assert s["prefill_ms_per_prompt_token"] == 2.5 and s["draft_prefill_s"] == 0.05
    assert s["decode"] == {"steps": 3, "seconds": 0.8, "tokens": 12, "tokens_per_s": 15.0}
    assert s["speculative"] == {"steps": 2, "seconds": 0.6, "tokens": 10, "tokens_per_s": round(10 / 0.6, 2)}
    assert s["plain"] == {"steps": 1, "seconds": 0.2, "tokens": 2, "tokens_per_s": 10.0}
    assert s["verified_per_step"] == 6.0 and s["decisions"] == {"plain": 1, "exploit": 1, "probe": 1}
    empty = script.summary([], {}, 1.0)
    assert empty["decode"]["tokens_per_s"] is None and empty["prefill_ms_per_prompt_token"] is None


@pytest.mark.parametrize("method, ratio", [("ar", 0.0), ("echo", 0.5)])
def test_the_load_stays_at_its_concurrency_and_every_step_is_in_the_window(method, ratio):
    script = load_script(SCRIPTS / "sustained_split.py")
    target, tok = load_model(DEFAULT_TARGET, dtype="float32")
    head = load_eagle3(DEFAULT_EAGLE3, target)
    ex = script.engine_for(method, target, head, tok, 4, 256)
    prompts = ["def add(a, b):", "import os\n\ndef main():", "class Stack:", "# sort a list\n"]
    load = script.Load(ex, prompts, 3, 6, ratio, seed=1)
    ticks = itertools.count()  # one second per reading: 3 warm-up steps, then a window of 4 steps
    rows, parts, wall = script.measure(load, 3.5, 4.5, 2, clock=lambda: float(next(ticks)))
    assert len(rows) == 4 and wall == 6.0
    assert all(r["rows"] == 3 for r in rows)  # every finished request was replaced before the next step
    assert len(ex.running) + len(ex.waiting) == 3
    # each request asked for its own length, as bench-serve's clients draw them
    assert all(r.params.max_tokens == request_max_tokens(load.index_of[r.request_id], 6, ratio, 1)
               for r in [*ex.running, *ex.waiting])
    assert all(r["emitted"] >= r["rows"] and r["verified"] >= r["rows"] for r in rows)
    assert method != "echo" or all(isinstance(r["token_ms"], float) for r in rows)  # the rule's price of a token
    assert method == "echo" or not any(r["speculated"] for r in rows)
    assert method == "echo" or all(r["reason"] is None and r["ratio"] is None for r in rows)  # AR: no controller
    assert all(r["ratio"] is None or (r["ratio"] > 0 and (r["low"] or 0) <= r["ratio"]) for r in rows)
    assert (parts.get("target prefill", 0.0) > 0) == (parts["prompt_tokens"] > 0)
    assert parts["admission"] >= parts.get("target prefill", 0.0) + parts.get("draft prefill", 0.0)


def test_a_request_that_does_not_fit_the_context_is_counted_and_the_next_one_sent():
    script = load_script(SCRIPTS / "sustained_split.py")
    target, tok = load_model(DEFAULT_TARGET, dtype="float32")
    ex = script.engine_for("ar", target, None, tok, 4, 64)
    prompts = ["def add(a, b):", "x " * 200, "class Stack:"]  # the second prompt alone overflows 64 tokens
    load = script.Load(ex, prompts, 2, 8)
    load.submit(2)
    assert load.rejected == 1 and load.submitted == 3 and len(ex.waiting) == 2
    assert sorted(load.index_of.values()) == [0, 2]
    with pytest.raises(ValueError, match="the context holds 64"):  # nothing fits: the engine's own message
        script.Load(ex, ["x " * 200], 1, 8).submit(1)


def test_bad_arguments_are_named_before_anything_loads():
    script = load_script(SCRIPTS / "sustained_split.py")
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        script.main(["--methods", "ar,nope"])
    for bad in (["--concurrency", "65"], ["--duration", "0"], ["--max-tokens-range-ratio", "1"],
                ["--token-price-scale", "0"]):
        with pytest.raises(SystemExit):
            script.main(bad)


def test_prefill_is_compared_on_the_prompts_both_runs_prefilled():
    script = load_script(SCRIPTS / "sustained_split.py")
    base = [(0, 100, 0.2), (1, 50, 0.1), (2, 80, 0.2)]
    other = [(1, 50, 0.15), (2, 80, 0.25), (3, 60, 0.1), (0, 40, 0.1)]  # prompt 0 only partly: not compared
    p = script.paired_prefill(base, other)
    assert p == {"prompts": 2, "tokens": 130, "ratio": round(0.4 / 0.3, 4),
                 "base_ms_per_token": round(0.3 / 130 * 1e3, 3), "ms_per_token": round(0.4 / 130 * 1e3, 3)}
    assert script.paired_prefill(base, [(7, 10, 0.1)]) is None


def test_a_scaled_token_price_keeps_the_first_token_and_multiplies_each_one_after():
    script = load_script(SCRIPTS / "sustained_split.py")
    from echo_trtllm.core.cost import CostModel

    cost = CostModel((1, 2, 4), (0.1, 0.12, 0.2), (1, 4), (0.01, 0.02))
    assert script.scaled_token_price(cost, 5.0).verify_seconds == pytest.approx((0.1, 0.2, 0.6))
    assert script.scaled_token_price(cost, 1.0) == cost
    assert script.scaled_token_price(cost, 5.0).draft_seconds == cost.draft_seconds
    grid = CostModel((1, 2), (0.1, 0.2), grid_tokens=(1, 2), grid_contexts=(8, 16), grid_seconds=((0.1, 0.1), (0.2, 0.2)))
    with pytest.raises(ValueError, match="without a context grid"):
        script.scaled_token_price(grid, 5.0)
