"""The two measurement scripts behind docs/performance.md's reading of the head's floor and of a check before
drafting (scripts/head_floor.py, scripts/predraft_bound.py): their arithmetic against hand computations, and a run
on the embedded pair that writes its JSON (timings are the machine's: not checked)."""

import json
from pathlib import Path

import pytest
import torch

from echo_trtllm.core.cost import CostModel
from echo_trtllm.models import DEFAULT_EAGLE3, DEFAULT_TARGET
from tests.helpers import load_script

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def predraft():
    return load_script(SCRIPTS / "predraft_bound.py")


@pytest.fixture(scope="module")
def floor():
    return load_script(SCRIPTS / "head_floor.py")


def test_the_best_case_ratio_is_the_budget_rules_rate_at_its_best_n(predraft):
    """t(T) = 0.1 + 0.01 T, no control: with 4 requests, 1 s of drafting spent and every token at 0.5, rate(n) =
    (4 + 0.5 n) / (1.14 + 0.01 n); its best over n = 1..3 against n = 0, by hand."""
    cost = CostModel.linear(0.1, 0.01)
    rate = [(4 + 0.5 * n) / (1.0 + 0.1 + 0.01 * (4 + n)) for n in range(4)]
    assert predraft.best_case_ratio(cost, 4, 3, 1.0, 0.5, None) == pytest.approx(max(rate[1:]) / rate[0])
    # a token that costs more than it can bring: the ratio stays at or below 1 (a check could skip drafting)
    dear = CostModel.linear(0.0, 1.0)
    assert predraft.best_case_ratio(dear, 4, 3, 0.0, 1.0, None) <= 1.0


def test_the_predraft_reading_runs_on_the_embedded_pair(predraft, tmp_path):
    out = tmp_path / "predraft.json"
    assert predraft.main(["--model", str(DEFAULT_TARGET), "--head", str(DEFAULT_EAGLE3), "--dtype", "float32",
                          "--batch-size", "2", "--steps", "4", "--threads", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["batch_size"] == 2 and doc["summary"]["steps_read"] == len(doc["per_step"])
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
    out = tmp_path / "floor.json"
    assert floor.main(["--model", str(DEFAULT_TARGET), "--head", str(DEFAULT_EAGLE3), "--dtype", "bfloat16",
                       "--rounds", "1", "--threads", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["head_tokens"] for r in doc["rows"]] == list(floor.TOKENS)
    assert 0 < doc["bytes_ratio"] == round(doc["head_weight_bytes"] / doc["target_weight_bytes"], 4)
