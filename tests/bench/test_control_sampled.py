"""scripts/control_sampled.py's folding of py-spy's raw stacks, against counts done by hand."""

from pathlib import Path

import pytest

from tests.helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "control_sampled.py"


def load():
    return load_script(SCRIPT)


def test_only_the_measured_steps_count_and_a_function_counts_once_a_stack():
    m = load()
    raw = [
        "<module> (s.py:1);load_model (loader.py:9);read (io.py:3) 500\n",  # loading: not under the mark
        "<module> (s.py:1);_measured_steps (/x/s.py:30);step (/x/runtime/executor.py:480);forward (/x/llama.py:400) 80\n",
        "<module> (s.py:1);_measured_steps (s.py:30);step (executor.py:480);_replay (policies.py:850);"
        "_replay (policies.py:860) 12\n",  # a recursive or re-entered frame: once in inclusive
        "<module> (s.py:1);_measured_steps (s.py:30);step (executor.py:500) 8\n",
    ]
    out = m.fold(raw, rate=100, steps=2)
    # 100 samples over 2 steps at 100 a second: 1 s -> 500 ms a step
    assert out["sampled_ms_per_step"] == 500.0
    inc = out["inclusive_ms_per_step"]
    assert inc["step (executor.py)"] == 500.0 and inc["forward (llama.py)"] == 400.0
    assert inc["_replay (policies.py)"] == 60.0 and "read (io.py)" not in inc
    assert out["self_ms_per_step"]["_replay (policies.py:860)"] == 60.0
    assert out["self_ms_per_step"]["step (executor.py:500)"] == 40.0


def test_bad_options_are_refused_by_name():
    m = load()
    with pytest.raises(SystemExit):
        m.main(["--steps", "0"])
    with pytest.raises(SystemExit):
        m.main(["--model", "x"])  # a target without its head
    with pytest.raises(SystemExit):
        m.main(["--py-spy", "/nonexistent/py-spy"])
