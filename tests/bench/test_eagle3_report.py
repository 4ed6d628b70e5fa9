"""The EAGLE-3 head's report card (bench.eagle3): per-depth calibration against a naive pairwise AUC, and on the
embedded pair the per-node acceptance agrees with the per-step accepted counts it comes from."""

import itertools
from pathlib import Path

import torch

from echo_trtllm.bench.eagle3 import acceptance_by_depth, calibration_by_depth
from echo_trtllm.models import DEFAULT_EAGLE3, DEFAULT_TARGET
from echo_trtllm.models.eagle3 import load_eagle3
from echo_trtllm.models.loader import load_model


def naive_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_calibration_by_depth_matches_a_pairwise_count():
    gen = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(40):
        c = torch.rand(3, generator=gen).cumprod(0)  # a chain's path probabilities fall with depth
        a = int(torch.randint(0, 4, (1,), generator=gen))
        d = torch.arange(1, 4)
        steps.append((d, c, d <= a))
    got = calibration_by_depth(steps, 4)
    for k in range(1, 4):
        c = [float(s[1][k - 1]) for s in steps]
        y = [bool(s[2][k - 1]) for s in steps]
        assert abs(got["auc_by_depth"][k - 1] - naive_auc(c, y)) < 1e-4
        assert abs(got["accepted_share_by_depth"][k - 1] - sum(y) / len(y)) < 1e-4
        assert abs(got["mean_path_prob_by_depth"][k - 1] - sum(c) / len(c)) < 1e-4
    assert got["auc_by_depth"][3] is None and got["accepted_share_by_depth"][3] is None  # no depth-4 nodes


def test_the_report_on_the_embedded_pair_agrees_with_its_accepted_counts():
    target, tok = load_model(DEFAULT_TARGET)
    head = load_eagle3(DEFAULT_EAGLE3, target)
    acc = acceptance_by_depth(target, head, tok, ["def fib(n):\n", "HAMLET:\n"], depth=3, max_tokens=24)
    reach = acc["reach_by_depth"]
    assert reach[0] == acc["steps"] > 0
    # a node at depth d is accepted exactly when its step accepted d drafts or more
    for d in range(1, 4):
        assert abs(acc["accepted_share_by_depth"][d - 1] - reach[d] / reach[0]) < 1e-3
        assert acc["auc_by_depth"][d - 1] is None or 0.0 <= acc["auc_by_depth"][d - 1] <= 1.0
    assert all(0 < p <= 1 for p in acc["mean_path_prob_by_depth"])
    bands = acc["by_position"]
    assert sum(b["steps"] for b in bands.values()) == acc["steps"] and set(bands) <= {"0-31", "32-63", "64+"}
    assert sum(b["target_tokens"] for b in bands.values()) == 2 * 24
    assert all(0.0 <= b["in_draft_vocab"] <= 1.0 for b in bands.values())


def test_the_position_bands_against_counts_by_hand():
    """by_position: steps split by the completion tokens before them, alpha_1 and accepted length per band, and the
    target's tokens inside the draft vocabulary (d2t maps draft id i to target id i + d2t[i])."""
    from types import SimpleNamespace

    from echo_trtllm.bench.eagle3 import by_position

    head = SimpleNamespace(d2t=torch.tensor([0, 0, 5]))  # drafts target ids 0, 1, 7
    accepted = [2, 0, 1, 3, 0]
    positions = [0, 3, 31, 32, 70]
    outputs = [[0] * 32 + [1, 7, 9, 9] + [2] * 30 + [7] * 10]  # one completion of 76 tokens
    got = by_position(accepted, positions, outputs, head)["by_position"]
    assert got["0-31"] == {"steps": 3, "alpha_1": round(2 / 3, 4), "mean_accepted_length": 2.0,
                           "target_tokens": 32, "in_draft_vocab": 1.0}
    assert got["32-63"] == {"steps": 1, "alpha_1": 1.0, "mean_accepted_length": 4.0, "target_tokens": 32,
                            "in_draft_vocab": round(2 / 32, 4)}
    assert got["64+"] == {"steps": 1, "alpha_1": 0.0, "mean_accepted_length": 1.0, "target_tokens": 12,
                          "in_draft_vocab": round(10 / 12, 4)}
