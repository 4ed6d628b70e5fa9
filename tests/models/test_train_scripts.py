"""The Qwen head script is idempotent: with a head of its recipe in the cache it prints the directory and neither
fetches nor trains; a head of another recipe is not taken for it."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "build_scripts"


@pytest.fixture()
def qwen_script(monkeypatch, tmp_path):
    monkeypatch.setenv("ECHO_MODEL_CACHE", str(tmp_path))
    monkeypatch.syspath_prepend(str(SCRIPTS))
    spec = importlib.util.spec_from_file_location("qwen_eagle3", SCRIPTS / "qwen_eagle3.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_head_of_this_recipe_is_reused_without_fetching_or_training(qwen_script, monkeypatch, capsys):
    out = qwen_script.head_dir()
    out.mkdir(parents=True)
    for name in ("model.safetensors", "config.json"):
        (out / name).write_text("x")
    (out / "training.json").write_text(json.dumps({"recipe": qwen_script.RECIPE}))
    monkeypatch.setattr(qwen_script, "fetch", lambda *a, **k: pytest.fail("fetched"))
    monkeypatch.setattr(qwen_script.train_eagle3, "main", lambda *a, **k: pytest.fail("trained"))
    assert qwen_script.main() == 0
    assert capsys.readouterr().out.strip() == str(out)


def test_a_head_of_another_recipe_is_not_taken(qwen_script):
    out = qwen_script.head_dir()
    out.mkdir(parents=True)
    for name in ("model.safetensors", "config.json"):
        (out / name).write_text("x")
    (out / "training.json").write_text(json.dumps({"recipe": ["--steps", "1"]}))
    assert not qwen_script.is_done(out)


def test_training_refuses_fewer_than_three_ttt_steps(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import train_eagle3

    with pytest.raises(SystemExit):
        train_eagle3.main(["--target", "x", "--out", "y", "--ttt", "2"])
