"""Sparse gate and its calibration against brute-force references."""

import math

import pytest
import torch

from echo_trtllm.core.gating import (
    GateCalibration, GateConfig, best_path_confidence, calibrate_gate, choose_threshold, default_gate, gate, roc_auc,
)  # fmt: skip
from echo_trtllm.core.tree import expand_level, root_level


def naive_auc(scores, labels):
    pos = [s for s, l in zip(scores, labels) if l]
    neg = [s for s, l in zip(scores, labels) if not l]
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def test_roc_auc_matches_pair_counting_with_ties():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 10, (300,), generator=gen).float() / 10  # many ties
    labels = torch.rand(300, generator=gen) < scores
    assert roc_auc(scores, labels) == pytest.approx(naive_auc(scores.tolist(), labels.tolist()))
    assert math.isnan(roc_auc(scores, torch.ones(300, dtype=torch.bool)))


def test_threshold_maximises_net_gain_like_brute_force():
    gen = torch.Generator().manual_seed(1)
    c = torch.rand(400, generator=gen)
    a = torch.rand(400, generator=gen) < c**2
    for lam in (0.1, 0.3, 0.6, 0.9):
        tau = choose_threshold(c, a, lam)
        gain = lambda t: float(((a.double() - lam) * (c > t)).sum())  # noqa: E731
        best = max([gain(float(t)) for t in c] + [0.0])
        assert gain(tau) == pytest.approx(best)


def test_threshold_when_nothing_is_worth_passing():
    c = torch.tensor([0.2, 0.5, 0.9])
    assert choose_threshold(c, torch.zeros(3, dtype=torch.bool), 0.3) == pytest.approx(0.9)


def test_calibration_picks_the_separating_depths_as_sweet_spots():
    gen = torch.Generator().manual_seed(2)
    depths, conf, acc = [], [], []
    for d in range(1, 9):
        n = 500
        c = torch.rand(n, generator=gen) * 0.9**d
        if d in (3, 6):  # these depths separate: acceptance follows confidence
            a = c > 0.5 * 0.9**d
        else:  # the others are noise
            a = torch.rand(n, generator=gen) < 0.5
        depths.append(torch.full((n,), d))
        conf.append(c)
        acc.append(a)
    cal = calibrate_gate(torch.cat(depths), torch.cat(conf), torch.cat(acc), max_depth=8, num_sweet_spots=2)
    assert cal.gate_depths == [1, 3, 6, 8]
    assert cal.auc[3] == pytest.approx(1.0) and cal.auc[6] == pytest.approx(1.0)
    assert cal.thresholds[1] == pytest.approx(0.5 * 0.9**3, abs=0.01)
    assert len(cal.dense_thresholds) == 8
    assert cal.dense_gate_config().depths == tuple(range(1, 9))
    assert set(cal.fixed_gate_config().thresholds) == {cal.fixed_threshold}


def test_calibration_json_round_trip(tmp_path):
    gen = torch.Generator().manual_seed(3)
    d = torch.randint(1, 6, (600,), generator=gen)
    c = torch.rand(600, generator=gen)
    a = torch.rand(600, generator=gen) < c
    cal = calibrate_gate(d, c, a, max_depth=5, num_sweet_spots=1)
    cal.save(tmp_path / "gate.json")
    again = GateCalibration.load(tmp_path / "gate.json")
    assert again.gate_depths == cal.gate_depths and again.thresholds == cal.thresholds
    assert again.auc.keys() == cal.auc.keys()
    assert all((math.isnan(x) and math.isnan(again.auc[k])) or x == again.auc[k] for k, x in cal.auc.items())
    with pytest.raises(ValueError, match="lacks fields"):
        GateCalibration.from_json('{"gate_depths": [1]}')


def test_calibration_rejects_bad_input():
    with pytest.raises(ValueError, match="equal length"):
        calibrate_gate(torch.ones(3), torch.ones(2), torch.ones(3, dtype=torch.bool), 4)
    with pytest.raises(ValueError, match=r"lie in \[1, 4\]"):
        calibrate_gate(torch.tensor([5]), torch.ones(1), torch.ones(1, dtype=torch.bool), 4)


def test_gate_is_strict_and_respects_activity():
    c = torch.tensor([0.5, 0.51, 0.9, 0.9])
    active = torch.tensor([True, True, True, False])
    assert gate(c, 0.5, active).tolist() == [False, True, True, False]


def test_confidence_is_the_best_path_probability_per_request():
    level0 = root_level(torch.tensor([0, 1, 2]))
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.4, 0.35, 0.25]])
    level1 = expand_level(level0, torch.tensor([0, 2]), probs, 2)
    assert best_path_confidence(level1, 3).tolist() == pytest.approx([0.7, 0.0, 0.4])


def test_gate_config_validation_and_defaults():
    with pytest.raises(ValueError, match="strictly increasing"):
        GateConfig((3, 1), (0.1, 0.2))
    with pytest.raises(ValueError, match="equal length"):
        GateConfig((1, 2), (0.1,))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        GateConfig((1,), (1.5,))
    g = default_gate(6)
    assert g.depths == (1, 3, 6) and g.thresholds[0] > g.thresholds[-1]
    assert g.threshold_at(2) is None


def test_gate_schedule_sources_and_variants():
    """One GateSchedule per policy: the config's gate wins, then calibration samples, then a cost curve alone
    (tau = the level's cost ratio at B, closed at 1), then the default; each yields sparse, dense and fixed."""
    from echo_trtllm.core import EchoConfig
    from echo_trtllm.core.cost import CostModel, level_cost_ratio
    from echo_trtllm.core.gating import GateSamples, GateSchedule, default_gate

    cfg = EchoConfig(max_depth=6, fixed_threshold=0.25)
    tokens = (1, 2, 4, 8, 16, 32, 64, 128)
    cost = CostModel(tokens, tuple(0.1 + 0.002 * t for t in tokens), tokens, tuple(0.01 + 0.001 * t for t in tokens))

    default = GateSchedule(cfg)
    assert default.source == "default" and default.gate_for(4) == default_gate(6)
    assert set(default.gate_for(4, "fixed").thresholds) == {0.25}
    assert default.gate_for(4, "dense").depths == (1, 2, 3, 4, 5, 6)

    curve = GateSchedule(cfg, cost)
    for b in (1, 16, 128):
        lam = min(1.0, level_cost_ratio(cost, b, cfg.beam_width))
        g = curve.gate_for(b)
        assert curve.source == "cost-curve" and g.depths == default_gate(6).depths and set(g.thresholds) == {lam}
        assert curve.gate_for(b, "dense").thresholds == pytest.approx((lam,) * 6)
    assert curve.gate_for(1).thresholds[0] < curve.gate_for(128).thresholds[0]  # stricter under load

    gen = torch.Generator().manual_seed(0)
    depths = torch.randint(1, 7, (400,), generator=gen)
    conf = torch.rand(400, generator=gen) * 0.7 ** (depths - 1)
    samples = GateSamples(depths, conf, torch.rand(400, generator=gen) < conf, 6)
    calibrated = GateSchedule(cfg, cost, samples)
    assert calibrated.source == "calibration"
    assert calibrated.gate_for(8) == calibrated.calibration_for(8).gate_config()
    assert calibrated.gate_for(8, "fixed") == calibrated.calibration_for(8).fixed_gate_config()

    explicit = GateSchedule(EchoConfig(gate_depths=(2, 6), gate_thresholds=(0.5, 0.1)), cost, samples)
    assert explicit.source == "config" and explicit.gate_for(8).depths == (2, 6)
    with pytest.raises(ValueError, match="variant"):
        explicit.gate_for(8, "sideways")
    with pytest.raises(ValueError, match="max_depth=6 but the config has max_depth=4"):
        GateSchedule(EchoConfig(max_depth=4), cost, samples)


def test_a_depth_with_too_few_rejections_is_not_ranked_and_says_why(caplog):
    """Depth 3 separates perfectly but shows 4 rejections: its AUC of 1.0 must not make it a sweet spot over
    depth 4, which separates less but on 150 rejections. Every ranked depth gets a bootstrap interval that
    contains its AUC."""
    gen = torch.Generator().manual_seed(5)
    depths, conf, acc = [], [], []
    for d, (n, n_rej, noise) in {1: (300, 100, 0.1), 2: (300, 150, 0.5), 3: (300, 4, 0.0), 4: (300, 150, 0.2),
                                 5: (300, 150, 0.5)}.items():
        a = torch.ones(n, dtype=torch.bool)
        a[:n_rej] = False
        c = (a.double() * 0.5 + 0.25 + noise * torch.randn(n, generator=gen, dtype=torch.float64)).clamp(0, 1)
        depths.append(torch.full((n,), d))
        conf.append(c)
        acc.append(a)
    with caplog.at_level("WARNING", logger="echo_trtllm.calibration"):
        cal = calibrate_gate(torch.cat(depths), torch.cat(conf), torch.cat(acc), max_depth=5, num_sweet_spots=1)
    assert cal.gate_depths == [1, 4, 5]
    assert math.isnan(cal.auc[3]) and cal.num_rejected[3] == 4
    assert cal.unranked[3] == "296 accepted and 4 rejected samples; ranking a depth needs 10 of each"
    assert "depth 3 not ranked" in caplog.text
    for d in (1, 2, 4, 5):
        lo, hi = cal.auc_interval[d]
        assert lo <= cal.auc[d] <= hi and hi - lo < 0.2
    assert cal.auc_interval[4][0] > cal.auc_interval[2][1]  # depth 4 separates better, beyond the noise
    again = GateCalibration.from_json(cal.to_json())
    assert again.auc_interval == cal.auc_interval and again.unranked == cal.unranked
    assert again.num_rejected == cal.num_rejected
