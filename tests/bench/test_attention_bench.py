"""The split-vs-padded attention report on the embedded target: it runs, and both layouts give the same logits."""

import json

import pytest

from echo_trtllm.bench.attention import main


def test_split_and_padded_layouts_are_timed_and_agree(tmp_path):
    out = tmp_path / "attention.json"
    assert main(["--batch-size", "6", "--context", "9", "--trees", "2", "--nodes", "4", "--repeats", "1",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["tokens"] == 6 + 2 * 3 and report["max_abs_logit_difference"] < 1e-4
    assert set(report["min_seconds"]) == {"split", "padded", "roots_only"}


def test_bad_shapes_are_refused_by_name():
    with pytest.raises(SystemExit):
        main(["--trees", "100", "--batch-size", "4"])
