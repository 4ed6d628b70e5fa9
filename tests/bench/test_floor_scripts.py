"""The two measurement scripts behind docs/performance.md's reading of the head's floor and of a check before
drafting (scripts/head_floor.py, scripts/predraft_bound.py): their arithmetic against hand computations, and a run
on the embedded pair that writes its JSON (timings are the machine's: not checked)."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from echo_trtllm.core.cost import CostModel
from echo_trtllm.models import DEFAULT_EAGLE3, DEFAULT_TARGET
from echo_trtllm.models.packed import prepack_available
from tests.helpers import load_script

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def predraft():
    return load_script(SCRIPTS / "predraft_bound.py")


@pytest.fixture(scope="module")
def floor():
    return load_script(SCRIPTS / "head_floor.py")


def test_the_best_case_ratio_is_the_budget_rules_rate_at_its_best_n(predraft):
    """t(T) = 0.1 + 0.01 T and 0.05 s of control charged once anything is drafted: with 4 requests, 1 s of drafting
    spent and every token at 0.5, rate(n) = (4 + 0.5 n) / (1.1 + 0.05 [n > 0] + 0.01 (4 + n)), by hand; at 1 token,
    at 4 (one a request) and the best over n = 1..6, each against n = 0."""
    cost = dataclasses.replace(CostModel.linear(0.1, 0.01), control_seconds=0.05)
    rate = [(4 + 0.5 * n) / (1.0 + 0.1 + 0.05 * (n > 0) + 0.01 * (4 + n)) for n in range(7)]
    got = predraft.best_case_ratios(cost, 4, 6, 1.0, 0.5, None)
    assert got == pytest.approx((rate[1] / rate[0], rate[4] / rate[0], max(rate[1:]) / rate[0]))
    # tokens that cost more than they can bring: every ratio below 1 (a check could skip drafting)
    dear = dataclasses.replace(CostModel.linear(0.0, 1.0), control_seconds=0.5)
    assert max(predraft.best_case_ratios(dear, 4, 3, 0.0, 1.0, None)) < 0.95
    assert predraft.best_case_ratios(cost, 4, 0, 1.0, 0.5, None) == (1.0, 1.0, 1.0)  # nothing to draft


def test_the_predraft_reading_runs_on_the_embedded_pair(predraft, tmp_path):
    out = tmp_path / "predraft.json"
    assert predraft.main(["--model", str(DEFAULT_TARGET), "--head", str(DEFAULT_EAGLE3), "--dtype", "float32",
                          "--batch-size", "2", "--steps", "4", "--threads", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["batch_size"] == 2 and doc["per_step"] and doc["summary"]["steps_read"] == len(doc["per_step"])
    for row in doc["per_step"]:
        assert 0.0 <= row["depth1_estimate_at_1"] <= row["best_estimate"] <= 1.0
        assert row["ratio_largest"] >= row["ratio_one_level"] > 0  # sunk drafting favours verifying


def test_the_head_floor_counts_bytes_and_runs_both_heads(floor, tmp_path):
    """The bytes are the parameters' less the embeddings, counted here from the modules; the int8 linear is the
    dense one within its rounding; the script writes one row per token count."""
    lin = torch.nn.Linear(64, 32, bias=True).to(torch.bfloat16)
    q = floor.Int8WeightOnly(lin)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    dense = q(x)
    q.on = True
    assert torch.allclose(q(x).float(), dense.float(), atol=0.1, rtol=0.05)
    model = torch.nn.Module()
    model.embed_tokens, model.proj = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3)
    assert floor.weight_bytes(model) == (4 * 3 + 3) * 4
    model.lm_head = torch.nn.Linear(4, 10, bias=False)
    model.lm_head.weight = model.embed_tokens.weight  # tied: the head reads the whole matrix
    assert floor.weight_bytes(model) == (4 * 3 + 3 + 10 * 4) * 4
    out = tmp_path / "floor.json"
    assert floor.main(["--model", str(DEFAULT_TARGET), "--head", str(DEFAULT_EAGLE3), "--dtype", "bfloat16",
                       "--rounds", "1", "--threads", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["head_tokens"] for r in doc["rows"]] == list(floor.TOKENS)
    assert 0 < doc["bytes_ratio"] == round(doc["head_weight_bytes"] / doc["target_weight_bytes"], 4)


def test_the_load_prices_reading_matches_the_prices_it_reads(tmp_path):
    """scripts/load_prices.py on the embedded pair: one record per build, and its plain step and marginal token
    are what the engine's prices give for that shape (read again here from a model built the same way)."""
    script = load_script(SCRIPTS / "load_prices.py")
    out = tmp_path / "prices.json"
    assert script.main(["--model", str(DEFAULT_TARGET), "--head", str(DEFAULT_EAGLE3), "--dtype", "float32",
                        "--builds", "2", "--batch-size", "4", "--context", "32", "--threads", "1",
                        "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["builds"]) == 2 and doc["warm_up"] and doc["warm_up_learns"] == "constants"
    for b in doc["builds"]:
        assert b["plain_step_ms"] > 0 and len(b["verify_knots_ms"]) == 13
        # the warm-up taught the speculative step's host work and left the forwards and the per-request term held
        # (no grid measured: the attention prior is zero)
        assert b["speculative_host_ms"] > 0 and b["attention_ms"] == 0 and b["per_request_ms"] == 0
    # without the warm-up the prices are the prior the load curve makes: nothing learnt (no attention, no per-request
    # term), and the executor's warm_up is its own again afterwards
    from echo_trtllm.runtime.executor import Executor

    real = Executor.warm_up
    assert script.main(["--model", str(DEFAULT_TARGET), "--head", str(DEFAULT_EAGLE3), "--dtype", "float32",
                        "--builds", "1", "--batch-size", "4", "--context", "32", "--threads", "1", "--no-warm-up",
                        "--json", str(out)]) == 0
    cold = json.loads(out.read_text())
    assert not cold["warm_up"] and cold["command"].endswith("--no-warm-up") and Executor.warm_up is real
    assert cold["warm_up_learns"] is None
    assert cold["builds"][0]["attention_ms"] == 0 and cold["builds"][0]["per_request_ms"] == 0
    from echo_trtllm.core.prices import StepCostModel, StepPrices

    real_observe = StepCostModel.observe
    assert script.main(["--model", str(DEFAULT_TARGET), "--head", str(DEFAULT_EAGLE3), "--dtype", "float32",
                        "--builds", "1", "--batch-size", "4", "--context", "32", "--threads", "1",
                        "--warm-up-learns-all", "--json", str(out)]) == 0
    every = json.loads(out.read_text())
    assert every["warm_up_learns"] == "all" and every["command"].endswith("--warm-up-learns-all")
    assert StepCostModel.observe is real_observe
    with pytest.raises(SystemExit):  # the two are exclusive
        script.main(["--model", "m", "--head", "h", "--no-warm-up", "--warm-up-learns-all"])
    with pytest.raises(SystemExit):  # refused before anything loads
        script.main(["--model", "m", "--head", "h", "--threads", "0"])
    # a prior from t(T) = 10 + 2 T ms with nothing learnt yet (no attention, no per-request term): by hand
    got = script.read_prices(StepPrices(StepCostModel.from_cost_model(CostModel.linear(0.01, 0.002))), 4, 32.0)
    assert got["plain_step_ms"] == pytest.approx(18.0) and got["one_more_token_ms"] == pytest.approx(2.0)
    assert got["attention_ms"] == 0 and got["per_request_ms"] == 0


def test_the_row_floor_probe_times_every_row_count_it_is_given(tmp_path):
    """scripts/row_floor_probe.py on small shapes: one row of the table per row count, in the order given, each with
    its medians inside its spread, and the packing it read (timings are the machine's: not checked)."""
    from echo_trtllm.models.packed import PACK_ROWS, ROW_FLOOR, prepack_available

    probe = load_script(SCRIPTS / "row_floor_probe.py")
    with pytest.raises(SystemExit):
        probe.main(["--rows", "1,x"])
    with pytest.raises(SystemExit):
        probe.main(["--rows", "0,2"])
    if not prepack_available():
        pytest.skip("oneDNN's bfloat16 kernels are not available here")
    out = tmp_path / "probe.json"
    assert probe.main(["--hidden", "64", "--intermediate", "128", "--kv", "16", "--layers", "2", "--vocab", "256",
                       "--rows", "1,3,8", "--rounds", "2", "--threads", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["rows"] for r in doc["rows"]] == [1, 3, 8]
    assert doc["pack_rows"] == PACK_ROWS and doc["row_floor"] == ROW_FLOOR and doc["shapes"]["layers"] == 2
    for r in doc["rows"]:
        assert r["layers_spread_ms"][0] <= r["layers_ms"] <= r["layers_spread_ms"][1]
        assert r["head_spread_ms"][0] <= r["head_ms"] <= r["head_spread_ms"][1]


def test_an_engine_thread_arm_fills_the_fields_it_leaves_out():
    """scripts/engine_thread_ab.py's arms: four fields take the eager kernels and no row floor, five no row floor; a
    zero or non-numeric hint or floor, a flag other than 0 or 1, or another field count is refused by name."""
    ab = load_script(SCRIPTS / "engine_thread_ab.py")
    assert ab.parse_arm("old:1:0:0") == ("old", "1", "0", "0", "0", "1")
    assert ab.parse_arm("k:32:1:1:1") == ("k", "32", "1", "1", "1", "1")
    assert ab.parse_arm("new:32:1:1:1:4") == ("new", "32", "1", "1", "1", "4")
    for bad in ("x:32:1:1:1:0", "x:0:1:1", "x:a:1:1", "x:32:2:1", "x:32:1:1:1:4:9", "x:32:1", "x:32:1:1:1:z"):
        with pytest.raises(ValueError, match="--arms takes NAME:PACK_ROWS:PAD:FUSE\\[:KERNELS\\[:FLOOR\\]\\]"):
            ab.parse_arm(bad)


@pytest.fixture(scope="module")
def head_split():
    return load_script(SCRIPTS / "head_split.py")


def test_the_head_split_summary_by_hand(head_split):
    rows = [{"step_ms": 100.0, "draft_ms": 6.0, "root_ms": 3.0, "levels_ms": 2.0, "top_k_ms": 0.4,
             "bookkeeping_ms": 0.6, "products_ms": 3.0, "attention_ms": 0.5, "forward_rest_ms": 1.5, "forwards": 2,
             "emitted": 2, "verified": 5},
            {"step_ms": 140.0, "draft_ms": 9.0, "root_ms": 4.0, "levels_ms": 4.0, "top_k_ms": 0.5,
             "bookkeeping_ms": 0.5, "products_ms": 5.0, "attention_ms": 0.7, "forward_rest_ms": 2.3, "forwards": 3,
             "emitted": 1, "verified": 6}]
    s = head_split.summarize(rows)
    assert s["step_ms"] == 120.0 and s["root_ms"] == 3.5 and s["forwards_per_step"] == 2.5
    assert s["products_ms"] == 4.0 and s["forward_rest_ms"] == 1.9
    assert s["root_ms_per_forward"] == 3.5 and s["level_ms_per_forward"] == 2.0  # 6 ms over 3 level forwards
    assert s["head_share"] == round(15 / 240, 4) and s["tokens_per_s"] == 12.5
    assert head_split.summarize([]) == {"steps": 0}
    c = head_split.combine([s, {**s, "root_ms": 5.5}, {**s, "root_ms": 1.0}])
    assert c["root_ms"] == {"median": 3.5, "min": 1.0, "max": 5.5}


@pytest.mark.skipif(not prepack_available(), reason="oneDNN's bfloat16 kernels (w8a16's condition) are not here")
def test_the_head_split_runs_both_arms_on_the_embedded_pair(head_split, tmp_path):
    """The parts of the draft phase are each within it, the w8a16 arm's engine runs the quantised head, the report
    says the machine; refused arms are named."""
    out = tmp_path / "split.json"
    assert head_split.main(["--model", str(DEFAULT_TARGET), "--head", str(DEFAULT_EAGLE3), "--arms", "bf16,w8a16",
                            "--batch-size", "1", "--steps", "4", "--rounds", "2", "--threads", "1",
                            "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert "cpu_flags" in doc["machine"] and doc["command"].startswith("python scripts/head_split.py")
    assert doc["arms"]["bf16"]["draft_quantization"] is None and doc["arms"]["w8a16"]["draft_quantization"] == "w8a16"
    for arm in ("bf16", "w8a16"):
        rounds = [r for r in doc["arms"][arm]["rounds"] if r["steps"]]
        assert rounds  # every step is speculative (fallback off): a round records its steps
        for r in rounds:
            assert r["root_ms"] > 0 and r["forwards_per_step"] >= 1
            # each part is within the draft phase step by step, so its median is within the phase's median (the
            # medians of the parts need not add up)
            for part in ("root_ms", "levels_ms", "top_k_ms", "products_ms", "attention_ms", "forward_rest_ms"):
                assert r[part] <= r["draft_ms"] + 1e-6
            assert r["products_ms"] > 0 and r["attention_ms"] > 0 and r["forward_rest_ms"] > 0
            assert r["bookkeeping_ms"] >= -1e-6
    for bad in (["--arms", "fp8"], ["--arms", "bf16,bf16"], ["--arms", "w8a16", "--dtype", "float32"],
                ["--steps", "0"]):
        with pytest.raises(SystemExit):
            head_split.main(["--model", str(DEFAULT_TARGET), "--head", str(DEFAULT_EAGLE3), *bad])


def test_the_control_split_report_says_the_machine(tmp_path):
    """scripts/control_split.py's JSON carries the machine (its CPU flags), the date and the command, as the other
    measurement scripts' do."""
    script = load_script(SCRIPTS / "control_split.py")
    out = tmp_path / "split.json"
    assert script.main(["--split-only", "--batch-sizes", "2", "--steps", "2", "--threads", "1",
                        "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["control_split"][0]["batch_size"] == 2 and "cpu_flags" in doc["machine"]
    shown = str(out).replace(str(Path.home()), "~")  # a report names no one's home directory
    assert doc["command"] == "python scripts/control_split.py --split-only --batch-sizes 2 --steps 2 --threads 1 " \
                             f"--json {shown}"


@pytest.fixture(scope="module")
def cold_forward():
    return load_script(SCRIPTS / "cold_forward.py")


def test_the_cold_forwards_helpers_count_and_cache(cold_forward):
    a, b = torch.ones(3), torch.ones(3)
    assert cold_forward.count_operations(lambda: (a + b) * (a + b)) == {"add": 2, "mul": 1}
    calls = []

    def kernel(x, w, s):
        calls.append(1)
        return x @ w.T.float() * s

    cached = cold_forward.CachedKernel(kernel)
    x, w, s = torch.randn(1, 16), torch.randint(-5, 5, (4, 16), dtype=torch.int8), torch.ones(4)
    first = cached(x, w, s)
    assert torch.equal(cached(torch.randn(1, 16), w, s), first) and len(calls) == 1  # the first output, kept
    cached(torch.randn(2, 16), w, s)  # another shape: computed
    assert len(calls) == 2


@pytest.mark.skipif(not prepack_available(), reason="oneDNN's bfloat16 kernels (w8a16's condition) are not here")
def test_the_cold_forward_runs_its_arms_on_the_embedded_pair(cold_forward, tmp_path):
    out = tmp_path / "cold.json"
    assert cold_forward.main(["--model", str(DEFAULT_TARGET), "--head", str(DEFAULT_EAGLE3), "--draft-quantization",
                              "w8a16", "--position", "20", "--repeats", "2", "--rounds", "2", "--flush-mb", "4",
                              "--threads", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("python scripts/cold_forward.py") and doc["draft_quantization"] == "w8a16"
    assert set(doc["rounds"]) == {"warm", "cold", "cold-no-products"}
    assert all(len(v) == 2 and min(v) > 0 for v in doc["rounds"].values())
    ops = doc["operations"]
    assert ops["embedding"] == 1 and ops["_weight_int8pack_mm"] >= 1 and doc["operations_total"] == sum(ops.values())
    for bad in (["--repeats", "0"], ["--draft-quantization", "w8a16", "--dtype", "float32"],
                ["--draft-quantization", "int4"]):
        with pytest.raises(SystemExit):
            cold_forward.main(["--model", str(DEFAULT_TARGET), "--head", str(DEFAULT_EAGLE3), *bad])
