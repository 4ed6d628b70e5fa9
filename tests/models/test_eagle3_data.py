"""The EAGLE-3 head's sharded data and training resume after a kill (build_scripts/eagle3_data.py,
train_eagle3.py --data) on the embedded target: a process that dies in the middle of writing a shard, the manifest
or a training checkpoint loses at most that piece, and running again ends with exactly what an uninterrupted run
makes."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "build_scripts"
TARGET = ROOT / "echo_trtllm/models/default/target"
SOURCES = ["--source", "stdlib=40", "--source", "docstrings=8"]  # 2 + 1 text shards of 32, 1 + 1 continued by the target
DATA_ARGS = ["--target", str(TARGET), "--dtype", "float32", "--length", "24", "--prompt-len", "16", "--batch", "8",
             *SOURCES]

# runs a script's main in a process that dies (os._exit, as a kill would leave it) at the n-th call of `func`
# in `module`, after that call has written `fraction` of what it writes
_DYING = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {scripts!r})
    import eagle3_data, train_eagle3
    module = {{"eagle3_data": eagle3_data, "train_eagle3": train_eagle3}}[{module!r}]
    real, calls = getattr(module, {func!r}), [0]
    def dying(path, *args, **kwargs):
        calls[0] += 1
        if calls[0] == {n}:
            partial = path.with_name(path.name + {suffix!r})
            partial.write_bytes(b"half a file")
            os._exit(9)
        return real(path, *args, **kwargs)
    setattr(module, {func!r}, dying)
    sys.exit({main}.main({argv!r}))
""")


def run_dying(main: str, argv: list[str], module: str, func: str, n: int, suffix: str) -> int:
    code = _DYING.format(scripts=str(SCRIPTS), module=module, func=func, n=n, suffix=suffix, main=main, argv=argv)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True).returncode


def run(script: str, argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / script), *argv], cwd=ROOT, capture_output=True, text=True)


def shards(data: Path) -> dict[str, dict[str, torch.Tensor]]:
    manifest = json.loads((data / "manifest.json").read_text())
    return {n: torch.load(data / f"{n}.pt", weights_only=True) for n in manifest["shards"]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted build."""
    data = tmp_path_factory.mktemp("reference") / "data"
    done = run("eagle3_data.py", [*DATA_ARGS, "--data", str(data)])
    assert done.returncode == 0, done.stderr
    return data


@pytest.fixture()
def data_module(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import eagle3_data

    return eagle3_data


def test_the_reference_build_holds_what_was_asked(reference, data_module):
    made = shards(reference)
    assert sorted(made) == sorted(s.name for s in data_module.plan([("stdlib", "text", 40), ("docstrings", "regen", 8)]))
    for shard in made.values():
        n = 32
        assert shard["ids"].shape == (n, 24) and shard["features"].shape == (n, 24, 3 * 256)
        assert shard["last_hidden"].shape == (n, 24, 256) and shard["top1"].shape == (n, 24)
        assert shard["features"][:, :-1].abs().sum(-1).gt(0).all()  # every position but the last was computed


@pytest.mark.parametrize("module,func,n,suffix", [
    ("eagle3_data", "save_atomic", 2, ".partial"),        # killed while writing the second shard
    ("eagle3_data", "write_json_atomic", 3, ".tmp"),      # killed while writing the manifest after the second
])
def test_a_data_run_killed_anywhere_resumes_to_the_uninterrupted_result(tmp_path, reference, module, func, n, suffix):
    data = tmp_path / "data"
    assert run_dying("eagle3_data", [*DATA_ARGS, "--data", str(data)], module, func, n, suffix) == 9
    before = json.loads((data / "manifest.json").read_text())["shards"]
    assert len(before) == 1  # the first shard survived; the second was lost with the kill
    again = run("eagle3_data.py", [*DATA_ARGS, "--data", str(data)])
    assert again.returncode == 0, again.stderr
    assert "1 of 5 shards already made" in again.stdout
    assert not list(data.glob("*.partial")) and not list(data.glob("*.tmp"))
    got, want = shards(data), shards(reference)
    assert sorted(got) == sorted(want)
    for name in want:
        for key in want[name]:
            assert torch.equal(got[name][key], want[name][key]), (name, key)


def test_more_windows_add_shards_and_keep_the_old_ones(data_module):
    small = data_module.plan([("stdlib", "text", 40)])
    large = data_module.plan([("stdlib", "text", 100)])
    assert set(small) <= set(large)  # same names, same windows: their draws are seeded by name
    assert len(large) == 4 + 1 and all(s.windows == 32 for s in large)


def test_the_split_is_by_file_and_fixed(data_module):
    files = data_module.source_files("stdlib")
    held = {n for n, _ in files if data_module.held_out(n)}
    assert 0.03 < len(held) / len(files) < 0.2
    # a file's side does not depend on which other files exist
    assert held == {n for n, _ in files[::-1] if data_module.held_out(n)}
    assert not any(data_module.held_out(n) for n in set(n for n, _ in files) - held)


def test_humaneval_shaped_prompts_end_after_a_docstring(data_module):
    text = 'import x\n\ndef add(a, b):\n    """Add two numbers.\n\n    >>> add(1, 2)\n    3\n    """\n    return a + b\n'
    cuts = data_module.docstring_cuts(text)
    assert [text[:c].rstrip().endswith('"""') for c in cuts] == [True]
    assert text[cuts[0]:] == "    return a + b\n"


def test_the_store_refuses_another_spec_by_name(tmp_path, reference):
    bad = run("eagle3_data.py", [*DATA_ARGS, "--data", str(reference), "--length", "32"])
    assert bad.returncode == 2 and "length=24" in bad.stderr
    assert run("eagle3_data.py", [*DATA_ARGS, "--data", str(tmp_path), "--source", "nope=3"]).returncode == 2


TRAIN_ARGS = ["--target", str(TARGET), "--steps", "6", "--batch", "4", "--checkpoint-every", "2", "--draft-vocab",
              "64", "--intermediate", "64", "--threads", "1"]


def test_training_killed_mid_checkpoint_resumes_to_the_uninterrupted_head(tmp_path, reference):
    from safetensors.torch import load_file

    whole = run("train_eagle3.py", [*TRAIN_ARGS, "--data", str(reference), "--out", str(tmp_path / "whole")])
    assert whole.returncode == 0, whole.stderr
    out = tmp_path / "resumed"
    # killed while writing the second checkpoint (after step 4): the first (step 2) stands
    assert run_dying("train_eagle3", [*TRAIN_ARGS, "--data", str(reference), "--out", str(out)],
                     "train_eagle3", "save_state", 2, ".partial") == 9
    assert torch.load(out / "train-state.pt", weights_only=False)["step"] == 2
    again = run("train_eagle3.py", [*TRAIN_ARGS, "--data", str(reference), "--out", str(out)])
    assert again.returncode == 0, again.stderr
    assert "resuming from step 2" in again.stdout
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    meta = json.loads((out / "training.json").read_text())
    assert meta["train_steps"] == 6 and meta["train_windows"] == 96 and meta["heldout_windows"] == 64
