"""The EAGLE-3 head's sharded data and training resume after a kill (build_scripts/eagle3_data.py,
train_eagle3.py --data) on the embedded target: a process that dies in the middle of writing a shard, the manifest
or a training checkpoint loses at most that piece, and running again ends with exactly what an uninterrupted run
makes."""

import json
import shutil
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

# runs a script's main in a process that dies (os._exit, as a kill leaves it) at the n-th os.replace: the real
# writers run, so a shard, manifest or checkpoint is fully written under its temporary name and not yet renamed
# (a writer that wrote in place would not reach the n-th replace, and the process would not die)
_DYING = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {scripts!r})
    import eagle3_data, train_eagle3
    real, calls = os.replace, [0]
    def dying(src, dst, *args, **kwargs):
        calls[0] += 1
        if calls[0] == {n}:
            os._exit(9)
        return real(src, dst, *args, **kwargs)
    os.replace = dying
    sys.exit({main}.main({argv!r}))
""")


def run_dying(main: str, argv: list[str], n: int) -> int:
    code = _DYING.format(scripts=str(SCRIPTS), n=n, main=main, argv=argv)
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


@pytest.mark.parametrize("n,leftover", [
    (4, ".partial"),   # the manifest's first write, shard 1, its manifest, then killed renaming shard 2
    (5, ".tmp"),       # shard 2 renamed, killed renaming the manifest that lists it
])
def test_a_data_run_killed_anywhere_resumes_to_the_uninterrupted_result(tmp_path, reference, n, leftover):
    data = tmp_path / "data"
    assert run_dying("eagle3_data", [*DATA_ARGS, "--data", str(data)], n) == 9
    assert list(data.glob(f"*{leftover}"))  # it died with a whole file under its temporary name
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


def test_more_windows_add_shards_and_keep_the_old_ones(tmp_path, reference, data_module):
    small = data_module.plan([("stdlib", "text", 40)])
    large = data_module.plan([("stdlib", "text", 100)])
    assert set(small) <= set(large)  # same names, same windows: their draws are seeded by name
    assert len(large) == 4 + 1 and all(s.windows == 32 for s in large)
    data = tmp_path / "data"
    shutil.copytree(reference, data)
    more = [a if a != "stdlib=40" else "stdlib=70" for a in DATA_ARGS]
    done = run("eagle3_data.py", [*more, "--data", str(data)])
    assert done.returncode == 0, done.stderr
    assert "5 of 6 shards already made" in done.stdout
    got, want = shards(data), shards(reference)
    assert set(got) == set(want) | {"stdlib-text-train-00002"}
    for name in want:
        assert all(torch.equal(got[name][k], want[name][k]) for k in want[name])


def test_the_split_is_by_file_fixed_and_disjoint(data_module):
    files = data_module.source_files("stdlib")
    held = {n for n, _ in files if data_module.held_out(n)}
    assert 0.03 < len(held) / len(files) < 0.2
    tok = type("Tok", (), {"encode": staticmethod(lambda text: [0])})()
    train_docs = {n for n, _ in data_module.Documents(tok, "stdlib", "train").files}
    held_docs = {n for n, _ in data_module.Documents(tok, "stdlib", "heldout").files}
    assert not train_docs & held_docs and train_docs | held_docs == {n for n, _ in files} and held_docs == held
    # vendored copies of the standard library are not read at all
    assert not any("/_distutils/" in n or "/_vendor/" in n for n, _ in data_module.source_files("site-packages"))


def test_humaneval_shaped_prompts_end_after_a_docstring(data_module):
    text = 'import x\n\ndef add(a, b):\n    """Add two numbers.\n\n    >>> add(1, 2)\n    3\n    """\n    return a + b\n'
    cuts = data_module.docstring_cuts(text)
    assert [text[:c].rstrip().endswith('"""') for c in cuts] == [True]
    assert text[cuts[0]:] == "    return a + b\n"


def test_the_store_refuses_another_spec_by_name(tmp_path, reference):
    bad = run("eagle3_data.py", [*DATA_ARGS, "--data", str(reference), "--length", "32"])
    assert bad.returncode == 2 and "--length 24" in bad.stderr


@pytest.mark.parametrize("extra,named", [
    (["--source", "nope=3"], "--source"),
    (["--source", "stdlib=8"], "--source"),              # stdlib twice
    (["--source", "stdlib-pkgs=0"], "--source"),
    (["--prompt-len", "30"], "--prompt-len"),            # not below --length 24
    (["--time-limit", "0"], "--time-limit"),
])
def test_bad_options_are_refused_by_name_before_loading(tmp_path, extra, named):
    bad = run("eagle3_data.py", [*DATA_ARGS, "--data", str(tmp_path / "d"), *extra])
    assert bad.returncode == 2 and named in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "d").exists()


TRAIN_ARGS = ["--target", str(TARGET), "--steps", "6", "--batch", "4", "--checkpoint-every", "2", "--draft-vocab",
              "64", "--intermediate", "64", "--threads", "1"]


def test_training_killed_mid_checkpoint_resumes_to_the_uninterrupted_head(tmp_path, reference):
    from safetensors.torch import load_file

    whole = run("train_eagle3.py", [*TRAIN_ARGS, "--data", str(reference), "--out", str(tmp_path / "whole")])
    assert whole.returncode == 0, whole.stderr
    out = tmp_path / "resumed"
    # killed renaming the second checkpoint (after step 4): the first (step 2) stands
    assert run_dying("train_eagle3", [*TRAIN_ARGS, "--data", str(reference), "--out", str(out)], 2) == 9
    assert (out / "train-state.pt.partial").is_file()
    assert torch.load(out / "train-state.pt", weights_only=False)["step"] == 2
    again = run("train_eagle3.py", [*TRAIN_ARGS, "--data", str(reference), "--out", str(out)])
    assert again.returncode == 0, again.stderr
    assert "resuming from step 2" in again.stdout
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    meta = json.loads((out / "training.json").read_text())
    assert meta["train_steps"] == 6 and meta["train_windows"] == 96 and meta["heldout_windows"] == 64


def test_a_checkpoint_is_written_as_a_head_the_runtime_loads(tmp_path, reference):
    """eagle3_checkpoint_head.py on a run killed after its first checkpoint (step 2 of 6): the head directory holds
    the checkpoint's weights in float16 (compared one by one with the checkpoint), the draft vocabulary's map of
    the checkpoint, says which step it is, loads with the runtime's loader and drafts; the checkpoint is left as
    it was (training resumes from it)."""
    from safetensors.torch import load_file

    from echo_trtllm.models.eagle3 import load_eagle3
    from echo_trtllm.models.loader import load_model

    work = tmp_path / "work"
    assert run_dying("train_eagle3", [*TRAIN_ARGS, "--data", str(reference), "--out", str(work)], 2) == 9
    state_file = work / "train-state.pt"
    before = state_file.read_bytes()
    state = torch.load(state_file, weights_only=False)
    done = run("eagle3_checkpoint_head.py", ["--target", str(TARGET), "--state", str(state_file),
                                             "--out", str(tmp_path / "head")])
    assert done.returncode == 0, done.stderr
    assert state_file.read_bytes() == before
    written = load_file(tmp_path / "head" / "model.safetensors")
    for name, value in state["head"].items():
        want = value if name == "d2t" else value.to(torch.float16)
        assert torch.equal(written[name], want), name
    assert torch.equal(torch.nonzero(written["t2d"]).flatten(), state["dv_ids"].sort().values)
    meta = json.loads((tmp_path / "head" / "training.json").read_text())
    assert meta["checkpoint_step"] == 2 and meta["planned_steps"] == 6
    target, _ = load_model(TARGET, with_tokenizer=False)
    head = load_eagle3(tmp_path / "head", target)
    assert head.config.draft_vocab_size == 64
    bad = run("eagle3_checkpoint_head.py", ["--target", str(TARGET), "--state", str(tmp_path / "none.pt"),
                                            "--out", str(tmp_path / "x")])
    assert bad.returncode == 2 and "--state" in bad.stderr


def test_a_checkpoint_of_other_flags_is_refused_by_name(tmp_path, reference):
    out = tmp_path / "head"
    first = run("train_eagle3.py", [*TRAIN_ARGS, "--data", str(reference), "--out", str(out)])
    assert first.returncode == 0, first.stderr
    other = run("train_eagle3.py", [*[a if a != "6" else "8" for a in TRAIN_ARGS], "--data", str(reference),
                                    "--out", str(out)])
    assert other.returncode != 0 and "--steps" in other.stderr


def test_training_on_some_sources_evaluates_every_source_held_out(tmp_path, reference):
    """--sources: the training rows are those sources' shards (counted from the manifest), and each source's
    held-out files are evaluated on their own beside the whole held-out set."""
    manifest = json.loads((reference / "manifest.json").read_text())["shards"].values()
    out = tmp_path / "stdlib-only"
    done = run("train_eagle3.py", [*TRAIN_ARGS, "--data", str(reference), "--out", str(out), "--sources", "stdlib"])
    assert done.returncode == 0, done.stderr
    meta = json.loads((out / "training.json").read_text())
    assert meta["sources"] == ["stdlib"]
    assert meta["train_windows"] == sum(s["windows"] for s in manifest if s["split"] == "train"
                                        and s["source"] == "stdlib")
    held_sources = {s["source"] for s in manifest if s["split"] == "heldout"}
    assert set(meta["heldout_top1_by_source"]) == held_sources == {"stdlib", "docstrings"}
    assert all(len(v) == 4 and all(0 <= a <= 1 for a in v) for v in meta["heldout_top1_by_source"].values())
    bad = run("train_eagle3.py", [*TRAIN_ARGS, "--data", str(reference), "--out", str(tmp_path / "x"),
                                  "--sources", "stdlib,nope"])
    assert bad.returncode != 0 and "--sources nope" in bad.stderr and "stdlib" in bad.stderr


def test_a_head_started_from_another_keeps_its_weights_until_it_trains(tmp_path, reference):
    """--init: a run of 0 steps from a head writes that head again (its weights, float16 both ways, and draft
    vocabulary, compared entry by entry; the same held-out agreement), a run of 2 steps moves it and records what it
    started from; a head of another shape is refused by the key that differs."""
    from safetensors.torch import load_file

    first = tmp_path / "first"
    done = run("train_eagle3.py", [*TRAIN_ARGS, "--data", str(reference), "--out", str(first)])
    assert done.returncode == 0, done.stderr
    base = [a if a != "6" else "0" for a in TRAIN_ARGS]
    same = run("train_eagle3.py", [*base, "--data", str(reference), "--out", str(tmp_path / "same"), "--init", str(first)])
    assert same.returncode == 0, same.stderr
    a, b = load_file(first / "model.safetensors"), load_file(tmp_path / "same" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    meta_a = json.loads((first / "training.json").read_text())
    meta_b = json.loads((tmp_path / "same" / "training.json").read_text())
    assert meta_b["heldout_top1_per_ttt_step"] == meta_a["heldout_top1_per_ttt_step"]
    assert meta_b["init"] == {"head": "first", "data": meta_a["data"], "train_steps": 6,
                              "heldout_top1_per_ttt_step": meta_a["heldout_top1_per_ttt_step"]}
    moved = run("train_eagle3.py", [*[a if a != "6" else "2" for a in TRAIN_ARGS], "--data", str(reference),
                                    "--out", str(tmp_path / "moved"), "--init", str(first)])
    assert moved.returncode == 0, moved.stderr
    c = load_file(tmp_path / "moved" / "model.safetensors")
    assert torch.equal(c["d2t"], a["d2t"]) and not torch.equal(c["fc.weight"], a["fc.weight"])
    other = run("train_eagle3.py", [*[a if a != "64" else "32" for a in TRAIN_ARGS], "--data", str(reference),
                                    "--out", str(tmp_path / "other"), "--init", str(first)])
    assert other.returncode != 0 and "draft_vocab_size" in other.stderr and "Traceback" not in other.stderr
    missing = run("train_eagle3.py", [*TRAIN_ARGS, "--data", str(reference), "--out", str(tmp_path / "x"),
                                      "--init", str(tmp_path / "nowhere")])
    assert missing.returncode == 2 and "--init" in missing.stderr


def test_a_larger_draft_vocabulary_grows_the_head_it_starts_from(tmp_path, reference):
    """--init with a larger --draft-vocab: the head's tokens (from one source's shards) keep their lm_head rows, the
    most frequent tokens of all the training data it lacks join with the target's rows (counted here from the
    store's training shards, ties by id), every other weight is the head's; the record names the size it grew from,
    and a smaller --draft-vocab stays refused."""
    from safetensors.torch import load_file

    from echo_trtllm.models.loader import load_model

    first = tmp_path / "first"  # its vocabulary from the docstring shards alone; it grows on every source's
    done = run("train_eagle3.py", [*TRAIN_ARGS, "--data", str(reference), "--out", str(first),
                                   "--sources", "docstrings"])
    assert done.returncode == 0, done.stderr
    grow = [a if a != "6" else "0" for a in TRAIN_ARGS]
    grow[grow.index("--draft-vocab") + 1] = "96"
    grown = run("train_eagle3.py", [*grow, "--data", str(reference), "--out", str(tmp_path / "grown"),
                                    "--init", str(first)])
    assert grown.returncode == 0, grown.stderr
    a, b = load_file(first / "model.safetensors"), load_file(tmp_path / "grown" / "model.safetensors")
    old_ids = (torch.arange(64) + a["d2t"].long()).tolist()
    new_ids = (torch.arange(96) + b["d2t"].long()).tolist()
    assert new_ids == sorted(new_ids) and set(old_ids) <= set(new_ids)
    assert torch.nonzero(b["t2d"]).flatten().tolist() == new_ids
    counts: dict[int, int] = {}
    for name, shard in shards(reference).items():
        if "-train-" in name:
            for t in shard["ids"].flatten().tolist():
                counts[t] = counts.get(t, 0) + 1
    target, _ = load_model(str(TARGET), dtype="float32")
    by_count = sorted(range(target.config.vocab_size), key=lambda t: (-counts.get(t, 0), t))
    assert set(old_ids) != set(by_count[:64])  # the head's own tokens are not the whole data's most frequent
    joined = [t for t in by_count if t not in set(old_ids)][:32]
    assert set(new_ids) == set(old_ids) | set(joined)
    for row, t in enumerate(new_ids):
        want = a["lm_head.weight"][old_ids.index(t)] if t in old_ids else target.lm_head.weight[t].detach().half()
        assert torch.equal(b["lm_head.weight"][row], want), t
    assert all(torch.equal(a[k], b[k]) for k in a if k not in ("lm_head.weight", "d2t", "t2d"))
    meta = json.loads((tmp_path / "grown" / "training.json").read_text())
    assert meta["draft_vocab"] == 96 and meta["init"]["draft_vocab"] == 64
    refused = run("train_eagle3.py", [*TRAIN_ARGS, "--data", str(reference), "--out", str(tmp_path / "s"),
                                      "--init", str(tmp_path / "grown")])  # 64 draft tokens from a head of 96
    assert refused.returncode != 0 and "draft_vocab_size" in refused.stderr and "Traceback" not in refused.stderr
