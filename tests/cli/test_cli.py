import json

import pytest

from echo_trtllm.cli import main


def test_bench_control_smoke_writes_json(tmp_path, capsys):
    out = tmp_path / "control.json"
    assert main(["bench-control", "--batch-sizes", "1,4", "--k-max-values", "2,16", "--steps", "2", "--warmup", "0",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "skipped: K_max below the batch size" in text
    rows = json.loads(out.read_text())["results"]
    assert {(r["batch_size"], r["k_max"]) for r in rows} == {(1, 2), (1, 16), (4, 16)}
    assert all(r["verified"] <= r["k_max"] and r["control_ms_median"] > 0 and r["levels_ms_median"] > 0 for r in rows)
    assert all(r["device_nodes"] >= r["candidates"] for r in rows)  # the batched loop drafts at least the tree


def test_unknown_command_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        main(["frobnicate"])
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
