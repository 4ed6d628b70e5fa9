"""echo-trtllm bench and simulate end to end on the tiny pair, and the oracle against exact cases."""

import json
import math

import pytest

from echo_trtllm.bench.run import METRICS, ar_at_end, ar_spread_warnings, machine_info, make_engine, run_cell
from echo_trtllm.cli import main
from echo_trtllm.core import EchoConfig


def cell(default_pair, prompts, policy, batch_size=4, **kw):
    """One bench cell through the public API; no cost model, so every method speculates every step."""
    target, draft, tok = default_pair
    with make_engine(target, draft, tok, EchoConfig(policy=policy, k_max=64, **kw), batch_size, 256,
                     cost_model=None) as llm:
        return run_cell(llm, prompts, batch_size, max_tokens=16, temperature=0.0)


def test_oracle_equals_a_method_that_verifies_every_draft(default_pair, prompts):
    """A chain verifies all it drafts, so the hindsight oracle with its budget can do no better: ratio exactly 1.
    A static tree verifies a subset of its drafted levels' children, so its ratio is at most 1."""
    chain = cell(default_pair, prompts, "chain")
    assert chain["mat_vs_oracle"] == 1.0
    static = cell(default_pair, prompts, "static")
    assert 0.0 < static["mat_vs_oracle"] <= 1.0
    ar = cell(default_pair, prompts, "ar")
    assert ar["mat_vs_oracle"] == 1.0 and ar["mat"] == 1.0 and ar["acceptance_rate"] == 0.0


def test_waves_run_waves_times_the_batch_through_its_slots(default_pair, prompts):
    """waves x B requests through an engine of B slots (in-flight batching refills a slot as a request finishes):
    every request's tokens are those of its own closed-batch run (the same prompt and place in the rotation), and
    the cell counts all of them."""
    target, draft, tok = default_pair
    with make_engine(target, draft, tok, EchoConfig(policy="chain", k_max=64), 2, 256, cost_model=None) as llm:
        waves = run_cell(llm, prompts, 2, max_tokens=8, temperature=0.0, seed=1, waves=3)
        closed = [run_cell(llm, prompts, 2, max_tokens=8, temperature=0.0, seed=1 + 2 * i) for i in range(3)]
    assert waves["tokens"] == 3 * 2 * 8 and len(waves["token_ids"]) == 6
    assert waves["token_ids"] == [ids for cell in closed for ids in cell["token_ids"]]
    # the slots are refilled: no more steps than the three closed batches took one after another
    assert waves["mat"] > 1.0 and waves["steps"] <= sum(cell["steps"] for cell in closed)


def test_the_full_batch_rate_counts_only_the_steps_with_every_slot_busy(default_pair, prompts):
    """full_batch_*: recomputed from the cell's own step reports (tokens from each request's kept tokens, not the
    reports' totals). AR in a closed batch never drains early, so all of its steps are full-batch steps."""
    target, draft, tok = default_pair
    for policy, waves in (("ar", 1), ("chain", 3)):
        with make_engine(target, draft, tok, EchoConfig(policy=policy, k_max=64), 2, 256, cost_model=None) as llm:
            seen = []
            get_stats = llm.get_stats
            llm.get_stats = lambda: seen.extend(get_stats()) or list(seen)
            row = run_cell(llm, prompts, 2, max_tokens=8, temperature=0.0, seed=1, waves=waves)
        full = [r for r in seen if r.batch_size == 2]
        seconds = sum(r.timings.total for r in full)
        assert row["full_batch_time_share"] == pytest.approx(seconds / sum(r.timings.total for r in seen))
        assert row["full_batch_tokens_per_s"] == pytest.approx(sum(sum(r.emitted) for r in full) / seconds)
        if policy == "ar":
            assert row["full_batch_time_share"] == 1.0
            assert row["full_batch_tokens_per_s"] == pytest.approx(row["tokens_per_s"])
        else:
            assert len(full) < len(seen)  # the last wave's requests leave one by one


def test_ar_at_both_ends_interpolates_ars_rate_at_each_cells_time():
    """A round's cells at times 10..40 between AR at 10 (100 tokens/s) and AR at 40 (130 tokens/s): a cell at 20 is
    compared with 110 (a third of the way), one at 40 with 130; AR's drift over the round is +30 %, and the table
    warns about it."""
    round_cells = {"ar": {"tokens_per_s": 100.0, "full_batch_tokens_per_s": 50.0, "midpoint": 10.0},
                   "chain": {"tokens_per_s": 121.0, "full_batch_tokens_per_s": 60.0, "midpoint": 20.0},
                   "echo": {"tokens_per_s": 130.0, "full_batch_tokens_per_s": 70.0, "midpoint": 40.0}}
    ar_at_end(round_cells, {"tokens_per_s": 130.0, "full_batch_tokens_per_s": 80.0, "midpoint": 40.0})
    assert round_cells["ar"]["ar_drift"] == pytest.approx(0.30)
    assert round_cells["chain"]["ar_reference"] == pytest.approx({"tokens_per_s": 110.0,
                                                                   "full_batch_tokens_per_s": 60.0})
    assert round_cells["echo"]["ar_reference"] == pytest.approx({"tokens_per_s": 130.0,
                                                                  "full_batch_tokens_per_s": 80.0})
    assert "ar_reference" not in round_cells["ar"]
    row = {"method": "ar", "batch_size": 4, "temperature": 0.0, "rounds": 1, "tokens_per_s": 100.0,
           "ar_drift_by_round": [0.30]}
    (warning,) = ar_spread_warnings([row])
    assert "+30%" in warning and "round 1" in warning
    # without AR's own row (methods without "ar") the drift still warns, once per cell, from the other rows
    others = [{"method": m, "batch_size": 4, "temperature": 0.0, "rounds": 2, "tokens_per_s": 1.0,
               "ar_drift_by_round": [0.05, -0.2]} for m in ("chain", "echo")]
    (warning,) = ar_spread_warnings(others)
    assert "-20%" in warning and "round 2" in warning


def test_the_machine_record_names_the_math_libraries_settings(monkeypatch):
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16384")
    monkeypatch.setenv("ECHO_UNRELATED", "x")
    env = machine_info()["env"]
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "16384" and "ECHO_UNRELATED" not in env


def test_bench_with_ar_at_both_ends_reports_the_drift(tmp_path):
    """--ar-both-ends through the command line: one AR row (its first cells), its drift per timed round, and every
    method's ratio to AR interpolated in time (the chain's per-round ratio is its tokens/s over that)."""
    out = tmp_path / "d.json"
    assert main(["bench", "--methods", "ar,chain", "--batch-sizes", "2", "--max-tokens", "5", "--warmup-rounds", "0",
                 "--rounds", "2", "--ar-both-ends", "--fallback", "off", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ar_both_ends"] is True
    rows = {r["method"]: r for r in data["results"]}
    assert set(rows) == {"ar", next(m for m in rows if m.startswith("chain"))}
    assert len(rows["ar"]["ar_drift_by_round"]) == 2 and all(math.isfinite(d) for d in rows["ar"]["ar_drift_by_round"])
    chain = next(r for m, r in rows.items() if m != "ar")
    assert all(math.isfinite(x) and x > 0 for x in chain["speedup_vs_ar_by_round"])


def test_bench_with_waves_pairs_every_request_with_ars(tmp_path):
    """--waves 2 through the command line: the JSON says so, every request of every round is paired with AR's
    (float32: token for token), a chain's hindsight oracle is itself, and a round holds 2 x B requests."""
    out = tmp_path / "w.json"
    assert main(["bench", "--methods", "ar,chain", "--batch-sizes", "2", "--max-tokens", "5", "--warmup-rounds", "0",
                 "--rounds", "2", "--waves", "2", "--fallback", "off", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["waves"] == 2
    chain = next(r for r in data["results"] if r["method"].startswith("chain"))
    assert chain["ar_agreement"] == 1.0 and chain["mat_vs_oracle"] == 1.0 and chain["mat"] > 1.0


def test_oracle_is_an_upper_bound_for_echo(default_pair, prompts):
    row = cell(default_pair, prompts, "echo", max_nodes_per_request=8, max_depth=4)
    assert 0.0 < row["mat_vs_oracle"] <= 1.0
    assert row["mat"] > 1.0 and 0 < row["acceptance_rate"] <= 1.0
    # trace records: candidates in priority order, flags 0/1, counts consistent
    for rec in row["trace"]:
        assert rec["probs"] == sorted(rec["probs"], reverse=True)
        assert set(rec["accepted"]) <= {0, 1} and 1 <= rec["emitted"] <= 1 + sum(rec["accepted"])


def test_bench_smoke_writes_every_metric_and_simulate_reads_its_trace(tmp_path, capsys):
    out, trace, md = tmp_path / "b.json", tmp_path / "t.json", tmp_path / "b.md"
    rc = main(["bench", "--methods", "ar,chain,echo,echo-fixed", "--batch-sizes", "1,3", "--temperatures", "0,0.8",
               "--max-tokens", "6", "--max-depth", "3", "--max-nodes-per-request", "8", "--warmup-rounds", "0",
               "--rounds", "2", "--calibration", "in-process", "--json", str(out), "--trace", str(trace), "--markdown", str(md), "--plot", str(tmp_path / "p")])
    assert rc == 0
    data = json.loads(out.read_text())
    rows = data["results"]
    assert {(r["method"], r["batch_size"], r["temperature"]) for r in rows} == {
        (m, b, t) for m in ("ar", "chain", "echo", "echo-fixed") for b in (1, 3) for t in (0.0, 0.8)}
    for r in rows:
        for key in (*METRICS, "speedup_vs_ar"):
            assert key in r
        assert r["tokens_per_s"] > 0 and r["mat"] >= 1.0 and r["latency_p99_s"] >= r["latency_p50_s"] > 0
        assert r["rounds"] == 2 and r["speedup_vs_ar_min"] <= r["speedup_vs_ar"] <= r["speedup_vs_ar_max"]
        assert 0.0 <= r["control_share"] < 1.0 and 0.0 <= r["speculated_share"] <= 1.0
        # the oracle needs greedy outputs: reported at T=0 only
        assert (r["mat_vs_oracle"] is None) == (r["temperature"] > 0)
        # float32 and coupled sampling: every method's tokens equal AR's, greedy and sampled
        assert r["ar_agreement"] == 1.0 and r["ar_prefix_agreement"] == 1.0
    assert next(r for r in rows if r["method"] == "ar")["speedup_vs_ar"] == 1.0
    assert data["command"].startswith("echo-trtllm bench ") and data["machine"]["threads"] >= 1
    assert isinstance(data["machine"]["cpu_flags"], list) and data["calibration_source"] == "in-process"
    assert data["calibration"]["gate"]["max_depth"] == 3
    assert (tmp_path / "p-t0.png").stat().st_size > 1000 and (tmp_path / "p-t0.8.png").is_file()
    assert md.read_text().startswith("| method |") and "| = AR |" in md.read_text()
    traces = json.loads(trace.read_text())["traces"]
    assert set(traces) == {f"{m}/{b}" for m in ("ar", "chain", "echo", "echo-fixed") for b in (1, 3)}
    # every timed round is traced: AR has one record per request and token, over both rounds
    assert len(traces["ar/3"]) == 2 * 3 * 6 and len(traces["ar/1"]) == 2 * 1 * 6
    # calibration and evaluation prompts never overlap, and the JSON says how they were split
    assert data["prompts"]["split"] == "eval" and data["prompts"]["eval"] == 6 and data["prompts"]["calibration"] == 2
    capsys.readouterr()
    sim = tmp_path / "sim.json"
    assert main(["simulate", "--trace", str(trace), "--batch-sizes", "1,64", "--json", str(sim)]) == 0
    assert "SIMULATION" in capsys.readouterr().out
    srows = json.loads(sim.read_text())["rows"]
    assert {r["batch_size"] for r in srows} == {1, 64} and all(r["tokens_per_s"] > 0 for r in srows)
    assert all(math.isclose(r["speedup_vs_ar"], 1.0) for r in srows if r["method"] == "ar")


@pytest.mark.parametrize("argv, message", [
    (["--methods", "ar,medusa"], "unknown ['medusa']"),
    (["--fallback", "off,sometimes"], "--fallback takes distinct auto, on, off"),
    (["--fallback", "on,on"], "--fallback takes distinct"),
    (["--rounds", "0"], "rounds must be an integer >= 1"),
    (["--waves", "0"], "waves must be an integer >= 1"),
    (["--waves", "2", "--hf-assisted", "4"], "hf_assisted runs one request per round"),
    (["--calibration", "missing.json"], "missing.json"),
    (["--batch-sizes", "0"], "integers >= 1"),
    (["--temperatures", "hot"], "comma-separated numbers"),
    (["--hf-assisted", "many"], "'heuristic' or integers"),
    (["--max-nodes-per-request", "0"], "max_nodes_per_request must be an integer >= 1"),
])
def test_bench_rejects_bad_arguments_before_loading(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_calibrate_cli_errors(tmp_path, capsys):
    assert main(["calibrate"]) == 2
    assert "exactly one of --engine-dir" in capsys.readouterr().err
    assert main(["calibrate", "--output", str(tmp_path / "c.json"), "--batch-size", "0"]) == 2
    assert "--batch-size must be >= 1" in capsys.readouterr().err
    assert main(["calibrate", "--engine-dir", str(tmp_path)]) == 2
    assert "engine.json is missing" in capsys.readouterr().err
    assert main(["calibrate", "--output", str(tmp_path / "c.json"), "--cost-tokens", "1,x"]) == 2
    assert "--cost-tokens must be comma-separated integers" in capsys.readouterr().err


def test_agreement_and_the_ar_spread_warning():
    from echo_trtllm.bench.run import agreement, ar_spread_warnings

    assert agreement([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == (0.5, (1.0 + 0.5) / 2)
    assert agreement([[1, 2]], [[1, 2, 3, 4]]) == (0.0, 0.5)
    row = {"method": "ar", "batch_size": 16, "temperature": 0.0, "rounds": 3, "tokens_per_s": 40.0,
           "tokens_per_s_min": 36.0, "tokens_per_s_max": 44.0}
    assert ar_spread_warnings([row]) == ["warning: AR's own tokens/s spread 20% over rounds at B=16, T=0 (> 10%): "
                                         "ratios there carry the machine's noise"]
    assert ar_spread_warnings([{**row, "tokens_per_s_min": 39.0, "tokens_per_s_max": 41.0}]) == []
    assert ar_spread_warnings([{**row, "method": "echo"}]) == []


def test_bench_runs_each_method_pure_and_with_the_fallback(tmp_path, monkeypatch):
    """--fallback off,on: every drafting method twice ("chain pure", "chain +fallback"), AR once; the pure rows
    draft in every step (chain verifies its drafts in every step; ECHO's budget rule, reading prices learned from
    this machine's steps, may verify the roots only); every row still equals AR token for token; traces come from
    the pure rows. The cost curve measured at load is replaced by an injected flat one (it only seeds the prices)."""
    import echo_trtllm.runtime.calibrate as calibrate
    from echo_trtllm.core.cost import CostModel

    flat = CostModel((1, 2, 4, 8, 16, 32, 64, 128), (0.1,) * 8, (1, 2, 4, 8, 16, 32, 64, 128), (0.001,) * 8)
    monkeypatch.setattr(calibrate, "measure_cost_model", lambda *a, **k: flat)
    out, trace = tmp_path / "b.json", tmp_path / "t.json"
    rc = main(["bench", "--methods", "ar,chain,echo", "--batch-sizes", "2", "--max-tokens", "6", "--max-depth", "3",
               "--max-nodes-per-request", "8", "--warmup-rounds", "0", "--rounds", "1", "--fallback", "off,on",
               "--json", str(out), "--trace", str(trace)])
    assert rc == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"ar", "chain pure", "chain +fallback", "echo pure", "echo +fallback"}
    assert rows["chain pure"]["policy"] == "chain" and rows["chain pure"]["fallback"] == "off"
    assert rows["echo pure"]["drafted_share"] == 1.0 and rows["chain pure"]["speculated_share"] == 1.0
    assert all(r["ar_agreement"] == 1.0 for r in rows.values())
    assert set(json.loads(trace.read_text())["traces"]) == {"ar/2", "chain/2", "echo/2"}


def test_one_cell_of_the_table_with_the_committed_eagle3_head(tmp_path):
    """The default pair's table drafts with its committed EAGLE-3 head: one cell, pure rows, every method equals
    AR token for token (float32) and the head's drafts are accepted. Without a cost model (ECHO at its fixed K_max):
    a curve measured at load on a busy machine can make ECHO's budget rule decline every draft."""
    from echo_trtllm.models import DEFAULT_EAGLE3

    out = tmp_path / "b.json"
    rc = main(["bench", "--draft-model", str(DEFAULT_EAGLE3), "--dtype", "float32", "--methods", "ar,eagle2,echo",
               "--batch-sizes", "2", "--max-tokens", "12", "--warmup-rounds", "0", "--rounds", "1",
               "--fallback", "off", "--no-cost-model", "--prompt-set", "code", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    rows = {r["method"]: r for r in data["results"]}
    assert data["draft_kind"] == "eagle3"
    assert set(rows) == {"ar", "eagle2 pure", "echo pure"}
    assert all(r["ar_agreement"] == 1.0 for r in rows.values())
    assert rows["eagle2 pure"]["mat"] > 1.3 and rows["echo pure"]["mat"] > 1.3


def test_the_prompt_split_is_fixed_and_disjoint():
    from echo_trtllm.bench.prompts import load_prompts

    for name in ("mixed", "code", "humaneval"):
        every = load_prompts(name)
        cal, ev = load_prompts(name, "calibration"), load_prompts(name, "eval")
        assert not set(cal) & set(ev) and sorted(cal + ev) == sorted(every)
        assert cal == every[::4]
    assert len(load_prompts("humaneval", "calibration")) == 41 and len(load_prompts("humaneval", "eval")) == 123
    with pytest.raises(ValueError, match="unknown split 'train'"):
        load_prompts("mixed", "train")


def test_method_entries_carry_their_own_shape_and_fallback():
    from echo_trtllm.bench.run import BenchConfig, parse_method

    cfg = BenchConfig(methods=("chain:num_draft_tokens=2", "static:static_nodes=5", "echo", "echo:fallback=on"),
                      batch_sizes=(4,), fallback=("off",))
    assert [label for label, _, _ in cfg.runs()] == ["ar", "chain:num_draft_tokens=2 pure", "static:static_nodes=5 pure",
                                                     "echo pure", "echo +fallback"]
    assert cfg.config_for("chain:num_draft_tokens=2", 4).num_draft_tokens == 2
    assert len(cfg.config_for("static:static_nodes=5", 4).static_choices) == 4
    assert parse_method("eagle2:total_tokens=16:max_depth=4") == ("eagle2", {"total_tokens": 16, "max_depth": 4})
    assert parse_method("echo:probe_floor=off") == ("echo", {"probe_floor": False})
    assert not cfg.config_for("echo:probe_floor=off", 4).probe_floor and cfg.config_for("echo", 4).probe_floor
    for bad, match in [("chain:depth=2", "each ':' option is one of"), ("chain:num_draft_tokens=x", "takes a int"),
                       ("echo:probe_floor=no", "probe_floor takes 'on' or 'off', got 'no'"),
                       ("nope", r"unknown \['nope'\]"), ("echo:fallback=maybe", "fallback=MODE"),
                       ("static:static_nodes=99", "static_nodes takes 2..16")]:
        with pytest.raises(ValueError, match=match):
            BenchConfig(methods=(bad,))
    with pytest.raises(ValueError, match="same label"):
        BenchConfig(methods=("echo", "echo:fallback=off"), fallback=("off",))
