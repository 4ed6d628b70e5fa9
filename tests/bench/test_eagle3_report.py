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
