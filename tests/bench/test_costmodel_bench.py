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
    # the full batch's phase medians: AR verifies one token per request and drafts nothing; chain 1 verifies two
    assert rows["ar"]["full_batch"]["verified_tokens"] == 2 and rows["ar"]["full_batch"]["draft_forwards_ms"] == 0
    assert rows["ar"]["full_batch"]["emitted_per_request"] == 1.0
    full = chain["full_batch"]
    assert full["verified_tokens"] == 4 and 1.0 <= full["emitted_per_request"] <= 2.0
    assert 0 < full["forward_ms"] <= full["step_ms"] and full["draft_forwards_ms"] > 0
    model = report["cost_model"]
    assert model["grid_seconds"] and model["step_overhead_seconds"] >= 0 and model["draft_level_overhead_seconds"] >= 0
