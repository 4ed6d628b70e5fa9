"""The cost model's predicted-vs-measured report (`python -m echo_trtllm.bench.costmodel`) on the embedded pair:
one row per method and batch size, drafting compared only where a step drafted."""

import json

from echo_trtllm.bench.costmodel import main


def test_predicted_vs_measured_per_method(tmp_path):
    out = tmp_path / "costmodel.json"
    assert main(["--batch-sizes", "2", "--methods", "ar,chain:num_draft_tokens=1,echo", "--max-tokens", "4",
                 "--repeats", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == {"ar", "chain:num_draft_tokens=1", "echo"} and all(r["batch_size"] == 2 for r in rows.values())
    assert rows["ar"]["speculative_steps"] == 0 and rows["ar"]["draft"] is None
    assert rows["ar"]["mean_verified_tokens"] == 2
    chain = rows["chain:num_draft_tokens=1"]
    assert chain["speculative_steps"] == chain["steps"] > 0 and chain["draft"]["predicted_over_measured"] > 0
    assert all(r["verify_side"]["predicted_over_measured"] > 0 and r["step_grid"]["predicted_over_measured"] > 0
               for r in rows.values())
    model = report["cost_model"]
    assert model["grid_seconds"] and model["step_overhead_seconds"] >= 0 and model["draft_level_overhead_seconds"] >= 0
