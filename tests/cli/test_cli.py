import argparse
import json

import pytest

from echo_trtllm.cli import main
from echo_trtllm.models import DEFAULT_DRAFT


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


def test_generate_with_no_models_runs_echo_with_the_committed_eagle3_head(capsys):
    """The README's first command: `echo-trtllm generate` on the embedded target drafts with its EAGLE-3 head; with
    --draft-model the separate draft model, with policy ar no draft. Each run's text equals the others (greedy,
    float32: speculation is lossless)."""
    texts = {}
    for extra, kind in (([], "eagle3"), (["--draft-model", str(DEFAULT_DRAFT)], "model"),
                        (["--policy", "ar"], "none")):
        assert main(["generate", "--dtype", "float32", "--max-tokens", "16", "--fallback", "off", *extra]) == 0
        out = capsys.readouterr().out
        summary = out.strip().splitlines()[-1]
        assert f" draft={kind} " in summary and "tokens=16 " in summary
        texts[kind] = out.split("[finish_reason=")[0]
    assert texts["eagle3"] == texts["model"] == texts["none"]


def test_generate_says_what_the_fallback_did(capsys):
    """With the AR fallback the last line counts the steps that speculated and the controller's estimate, and a
    run that stayed plain says how to speculate every step (from `LLM.speculation_stats`'s own keys)."""
    import re

    from echo_trtllm.cli.generate import fallback_line

    assert main(["generate", "--dtype", "float32", "--max-tokens", "8"]) == 0  # the README's command, fallback auto
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.match(r"fallback: (\d+) of (\d+) steps speculative \(probes (\d+), plain probes (\d+)\)", last)
    assert m and int(m[1]) <= int(m[2]) <= 8 and int(m[3]) <= int(m[1]), last

    spec = {"steps": 64, "speculative_steps": 1, "probes": 1, "plain_probes": 0,
            "last_estimate": {"batch_size": 1, "ratio": 0.68, "low": 0.24, "high": 1.95}}
    line = fallback_line(spec)
    assert line.startswith("fallback: 1 of 64 steps speculative (probes 1, plain probes 0)")
    assert "estimate at 1 request: speculative 0.68x plain tokens/s (0.24-1.95)" in line
    assert "--fallback off" in line
    spec.update(speculative_steps=64, probes=0, last_estimate=None)
    assert fallback_line(spec) == "fallback: 64 of 64 steps speculative (probes 0, plain probes 0)"


def test_bench_serve_turns_each_method_into_serve_flags_and_refuses_what_serve_cannot_run(capsys):
    from echo_trtllm.cli.bench_serve import method_flags

    assert method_flags("echo") == ["--policy", "echo"]
    assert method_flags("chain:num_draft_tokens=2:fallback=on") == ["--policy", "chain", "--num-draft-tokens", "2",
                                                                      "--fallback", "on"]
    assert method_flags("static:static_nodes=3") == ["--policy", "static", "--static-nodes", "3"]
    for bad, message in (("echo-fixed:fixed_threshold=0.2", "serve has no flag for fixed_threshold"),
                         ("nope", "unknown policy"), ("chain:num_draft_tokens=x", "takes a int")):
        assert main(["bench-serve", "--methods", bad, "--duration", "5"]) == 2
        assert message in capsys.readouterr().err
    for args, message in ((["--duration", "0"], "--duration must be > 0"),
                          (["--request-rate", "0"], "--request-rate"),
                          (["--warmup-seconds", "-1"], "--warmup-seconds"),
                          (["--max-tokens-range-ratio", "1"], "--max-tokens-range-ratio must lie in [0, 1)")):
        assert main(["bench-serve", "--methods", "ar", *args]) == 2
        assert message in capsys.readouterr().err


def test_static_nodes_sets_the_static_tree_and_is_checked():
    from echo_trtllm.cli import options
    from echo_trtllm.core.config import DEFAULT_STATIC_CHOICES

    ap = argparse.ArgumentParser()
    options.add_speculation_options(ap)
    assert options.echo_config(ap.parse_args(["--static-nodes", "3"])).static_choices == DEFAULT_STATIC_CHOICES[:2]
    assert options.echo_config(ap.parse_args([])).static_choices == DEFAULT_STATIC_CHOICES
    with pytest.raises(ValueError, match="--static-nodes takes 2"):
        options.echo_config(ap.parse_args(["--static-nodes", "1"]))
