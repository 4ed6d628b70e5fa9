"""The Qwen head script is idempotent: with a head of its recipe in the cache it prints the directory and neither
fetches nor trains; a head of another recipe is not taken for it. The default recipe is v2."""

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import load_script

SCRIPTS = Path(__file__).resolve().parents[2] / "build_scripts"


@pytest.fixture()
def qwen_script(monkeypatch, tmp_path):
    monkeypatch.setenv("ECHO_MODEL_CACHE", str(tmp_path))
    monkeypatch.syspath_prepend(str(SCRIPTS))
    return load_script(SCRIPTS / "qwen_eagle3.py")


def _head(out: Path, recipe: list[str]) -> None:
    out.mkdir(parents=True)
    for name in ("model.safetensors", "config.json"):
        (out / name).write_text("x")
    (out / "training.json").write_text(json.dumps({"recipe": recipe}))


@pytest.mark.parametrize("argv, recipe", [([], "v2"), (["--recipe", "v2"], "v2"), (["--recipe", "v1"], "v1")])
def test_a_head_of_the_asked_recipe_is_reused_without_fetching_or_training(qwen_script, monkeypatch, capsys, argv,
                                                                          recipe):
    """The default is v2; each recipe's head is found in its own directory by its own arguments."""
    out = qwen_script.head_dir(recipe)
    _head(out, qwen_script.V2_DATA + qwen_script.V2_TRAIN if recipe == "v2" else qwen_script.RECIPE)
    monkeypatch.setattr(qwen_script, "fetch", lambda *a, **k: pytest.fail("fetched"))
    monkeypatch.setattr(qwen_script.train_eagle3, "main", lambda *a, **k: pytest.fail("trained"))
    assert qwen_script.main(argv) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.name == {"v1": "eagle3-qwen2.5-coder-1.5b", "v2": "eagle3-qwen2.5-coder-1.5b-v2"}[recipe]


def test_a_head_of_another_recipe_is_not_taken(qwen_script):
    out = qwen_script.head_dir()
    _head(out, ["--steps", "1"])
    assert not qwen_script.is_done(out)
    v1_in_v2s_place = qwen_script.head_dir("v2").with_name("other")
    _head(v1_in_v2s_place, qwen_script.RECIPE)  # a v1 head is not the default recipe's
    assert not qwen_script.is_done(v1_in_v2s_place)
    assert qwen_script.is_done(v1_in_v2s_place, qwen_script.RECIPE)


def test_a_v2_run_that_leaves_shards_to_make_asks_for_another_and_keeps_its_minutes(qwen_script, monkeypatch, tmp_path):
    import eagle3_data

    monkeypatch.setattr(qwen_script, "fetch", lambda *a, **k: tmp_path / "target.gguf")
    asked = []
    monkeypatch.setattr(eagle3_data, "main", lambda argv: asked.append(argv) or 0)  # made nothing in its minutes
    monkeypatch.setattr(eagle3_data, "read_manifest", lambda data: {"shards": {}})
    monkeypatch.setattr(qwen_script.train_eagle3, "main", lambda *a, **k: pytest.fail("trained without the data"))
    assert qwen_script.main(["--recipe", "v2", "--minutes", "30"]) == 3
    argv = asked[0]
    assert argv[argv.index("--time-limit") + 1].startswith("29.") or argv[argv.index("--time-limit") + 1] == "30.00"
    ledger = json.loads((qwen_script.head_dir("v2").with_name(qwen_script.V2_HEAD_DIR + ".work") / "budget.json")
                        .read_text())
    assert [r["stage"] for r in ledger["runs"]] == ["data"]
    assert not qwen_script.head_dir("v2").exists()


def test_the_v2_ledger_counts_a_run_while_it_is_inside_a_stage(qwen_script, monkeypatch, tmp_path):
    """A stage lasts hours: the ledger is rewritten every LEDGER_EVERY seconds during it, so a run killed there
    keeps what it spent (on clocks the test moves: 12 minutes and 21 CPU minutes pass inside the data stage; the
    CPU minutes are the run's own, which wall minutes cannot tell from pauses and other processes)."""
    import threading
    import time

    import eagle3_data

    clock = {"t": 1000.0, "cpu": 50.0}
    monkeypatch.setattr(qwen_script, "_now", lambda: clock["t"])
    monkeypatch.setattr(qwen_script, "_cpu", lambda: clock["cpu"])
    monkeypatch.setattr(qwen_script, "LEDGER_EVERY", 0.01)
    monkeypatch.setattr(qwen_script, "fetch", lambda *a, **k: tmp_path / "target.gguf")
    ledger = qwen_script.head_dir("v2").with_name(qwen_script.V2_HEAD_DIR + ".work") / "budget.json"
    seen = threading.Event()

    def data_stage(argv):  # 12 minutes pass; the stage waits until the ledger shows them, then ends
        clock["t"] += 12 * 60
        clock["cpu"] += 21 * 60  # both cores busy most of the time
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            runs = json.loads(ledger.read_text())["runs"]
            if runs[-1] == {"stage": "started", "minutes": 12.0, "cpu_minutes": 21.0}:
                seen.set()
                break
            time.sleep(0.01)
        return 0

    monkeypatch.setattr(eagle3_data, "main", data_stage)
    monkeypatch.setattr(eagle3_data, "read_manifest", lambda data: {"shards": {}})
    assert qwen_script.main(["--recipe", "v2", "--minutes", "30"]) == 3
    assert seen.is_set()  # written mid-stage, by the run's own timer
    assert json.loads(ledger.read_text())["runs"] == [{"stage": "data", "minutes": 12.0, "cpu_minutes": 21.0}]


def test_training_refuses_fewer_than_three_ttt_steps(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import train_eagle3

    with pytest.raises(SystemExit):
        train_eagle3.main(["--target", "x", "--out", "y", "--ttt", "2"])


def test_text_windows_capture_what_the_generating_forward_captures_for_the_same_tokens(monkeypatch):
    """A text window read in one forward gives the features, last hidden states and top-1 that the generating
    path's prompt forward gives for the same tokens (two code paths, one meaning)."""
    import torch

    monkeypatch.syspath_prepend(str(SCRIPTS))
    import train_eagle3
    from echo_trtllm.models.loader import load_model

    target, tok = load_model(str(Path(__file__).resolve().parents[2] / "echo_trtllm/models/default/target"))
    layers = target.eagle3_layers()
    gen = torch.Generator().manual_seed(0)
    docs = train_eagle3.corpus_documents("stdlib")
    windows = train_eagle3.prompt_windows(tok, docs, 3, 12, gen, held_out=False)
    ids, feats, lasts, tops = train_eagle3.capture_text(target, layers, windows, batch=2)
    assert ids.tolist() == windows
    g_ids, g_feats, g_lasts, g_tops = train_eagle3.generate_and_capture(target, layers, windows, 4, 0, batch=3)
    assert torch.equal(g_ids[:, :12], ids)
    # the generating path's prompt forward covers tokens 0 .. 11; the text path reads tokens 0 .. 10 (the last
    # token's features are never used)
    torch.testing.assert_close(feats[:, :11], g_feats[:, :11], atol=1e-4, rtol=1e-4)  # other batch shapes
    torch.testing.assert_close(lasts[:, :11], g_lasts[:, :11], atol=1e-4, rtol=1e-4)
    assert torch.equal(tops[:, :11], g_tops[:, :11])
    assert not feats[:, 11].any()
