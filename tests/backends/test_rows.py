"""ECHO for an engine that hands over rows (backends/rows.py), driven by a scripted engine on the embedded pair:
the engine verifies each row's chain greedily with the target (its own full-context forward), moves, drops and adds
rows, and keeps a modelled clock (no test reads the machine's speed). References: the draft's stateless full-context
forward (the cache), the stateless chain proposer (the chains), the engine's own count (acceptance), the modelled
costs (prices) and plain greedy decoding (the output)."""

import numpy as np
import pytest
import torch

from echo_trtllm import EchoConfig
from echo_trtllm.backends.rows import (
    RowDraftCache,
    RowSpeculator,
    chain_config,
    linear_weights,
    prior_cost_model,
)
from echo_trtllm.backends.trtllm import EchoChainProposer
from echo_trtllm.core.cost import CostModel
from echo_trtllm.runtime.inputs import sequence_logits


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@torch.no_grad()
def _next_tokens(model, ids: list[int]) -> list[int]:
    """The model's greedy next token after every prefix ids[:1], ids[:2], ..."""
    return sequence_logits(model, torch.tensor(ids)).argmax(-1).tolist()


class Engine:
    """Rows of token ids verified greedily by the target: a chain's longest prefix the target agrees with, plus the
    target's own next token. Each step costs verify(B, T) seconds on the clock; each draft forward the speculator
    runs costs draft_level seconds (its cache's reads are wrapped)."""

    def __init__(self, target, speculator: RowSpeculator, clock: Clock, verify=lambda b, t: 0.0,
                 draft_level: float = 0.0) -> None:
        self.target, self.spec, self.clock, self.verify = target, speculator, clock, verify
        self.accepted = self.drafted = 0
        read = speculator.cache.read

        def timed_read(*args):
            clock.t += draft_level
            return read(*args)

        speculator.cache.read = timed_read

    def step(self, rows: list[list[int]], chains: list[list[int]]) -> list[list[int]]:
        out = []
        for ids, chain in zip(rows, chains):
            greedy = _next_tokens(self.target, ids + chain)[len(ids) - 1:]
            a = 0
            while a < len(chain) and chain[a] == greedy[a]:
                a += 1
            self.accepted += a
            self.drafted += len(chain)
            out.append(ids + chain[:a] + [greedy[a]])
        self.clock.t += self.verify(len(rows), len(rows) + sum(len(c) for c in chains))
        return out


def _prompts(tok, prompts, n):
    return [tok.encode(p) for p in prompts[:n]]


def test_cache_reads_equal_the_stateless_forward(default_pair, prompts):
    """Rows that grow, move, leave and arrive: every read's distribution equals the draft's forward over the row's
    whole context in a fresh cache."""
    _, draft, tok = default_pair
    cache = RowDraftCache(draft, slots=4, capacity=128)
    rows = _prompts(tok, prompts, 3)
    rng = np.random.default_rng(0)
    before = [0, 0, 0]  # what each row's slot should hold: its context at the last read
    for step in range(6):
        if step == 3:  # a row leaves, the others move, a new one arrives
            rows, before = [rows[2], rows[0], tok.encode(prompts[5])], [before[2], before[0], 0]
        ctxs = [np.array(r) for r in rows]
        slots, held = cache.assign(ctxs)
        starts = [min(h, len(c) - 1) for h, c in zip(held, ctxs)]
        probs = cache.read(slots, [c[p:] for c, p in zip(ctxs, starts)], starts)
        for r, p in zip(rows, probs):
            ref = torch.softmax(sequence_logits(draft, torch.tensor(r), "last")[-1], -1)
            torch.testing.assert_close(p, ref, atol=1e-5, rtol=1e-4)
        assert held == before  # each row found its own slot, moved or not; the new row holds nothing
        before = [len(r) for r in rows]
        rows = [r + [int(t) for t in rng.integers(0, 100, size=1 + step % 2)] for r in rows]


def test_chains_equal_the_stateless_proposer_and_output_is_greedy(default_pair, prompts):
    """Unpriced (every step drafts by the policy's rules), the cached speculator's chains equal the stateless
    proposer's for the same rows, and the engine's output equals plain greedy decoding."""
    target, draft, tok = default_pair
    config = EchoConfig()
    spec = RowSpeculator(draft, config, 4, max_rows=8, capacity=256, prices=False)
    oracle = EchoChainProposer(draft, config, 4)
    oracle.policy.acceptance = spec.policy.acceptance  # the same learnt estimates drive both (the gate reads them)
    clock = Clock()
    engine = Engine(target, spec, clock)
    rows = _prompts(tok, prompts, 4)
    start = [list(r) for r in rows]
    for _ in range(8):
        chains = spec.propose(rows)
        assert chains == oracle.propose(rows)
        assert all(len(c) <= 4 for c in chains)
        rows = engine.step(rows, chains)
    assert engine.drafted > 0 and engine.accepted > 0
    for s, r in zip(start, rows):  # plain greedy decoding of the target gives the same tokens
        ids = list(s)
        while len(ids) < len(r):
            ids.append(_next_tokens(target, ids)[-1])
        assert ids == r


def test_acceptance_counted_as_the_engine_counts(default_pair, prompts):
    target, draft, tok = default_pair
    spec = RowSpeculator(draft, EchoConfig(), 3, max_rows=4, capacity=256, prices=False)
    engine = Engine(target, spec, Clock())
    rows = _prompts(tok, prompts, 3)
    for _ in range(6):
        chains = spec.propose(rows)
        rows = engine.step(rows, chains)
    spec.propose(rows)  # the last step's outcome is read at the next call
    assert spec.stats["drafted"] == engine.drafted
    assert spec.stats["accepted"] == engine.accepted


def _run(target, draft, tok, prompts, verify, draft_level, steps, k=4, rows=4):
    clock = Clock()
    cost = CostModel((1, 2, 4, 8, 16, 32), (0.05,) * 6, (1, 2, 4, 8, 16, 32), (0.01,) * 6)
    spec = RowSpeculator(draft, EchoConfig(), k, max_rows=8, capacity=512, cost=cost, clock=clock)
    engine = Engine(target, spec, clock, verify, draft_level)
    ctx = _prompts(tok, prompts, rows)
    for _ in range(steps):
        chains = spec.propose(ctx)
        ctx = engine.step(ctx, chains)
    return spec


def test_prices_learnt_from_the_engines_steps(default_pair, prompts):
    """The modelled engine's step, 20 ms + 5 ms per verified token, is what the cost model predicts after its
    steps (from a prior of 50 ms flat)."""
    target, draft, tok = default_pair
    spec = _run(target, draft, tok, prompts, lambda b, t: 0.02 + 0.005 * t, 0.004, steps=40)
    assert spec.stats["priced_steps"] >= 35
    plain = spec.step_cost.plain_seconds(4, 40.0)
    assert plain == pytest.approx(0.02 + 0.005 * 4, rel=0.15)


def test_controller_runs_plain_steps_where_verification_is_dear(default_pair, prompts):
    """Each verified token costs as much as a whole plain step (and drafting is dear): speculation cannot pay and
    the controller settles on plain steps; with verification flat in tokens and drafting cheap it speculates."""
    target, draft, tok = default_pair
    dear = _run(target, draft, tok, prompts, lambda b, t: 0.05 * t, 0.05, steps=60)
    cheap = _run(target, draft, tok, prompts, lambda b, t: 0.05, 0.001, steps=60)
    assert dear.stats["speculative_steps"] <= 0.25 * dear.stats["steps"]
    assert cheap.stats["speculative_steps"] >= 0.75 * cheap.stats["steps"]


def test_prefill_steps_are_not_priced(default_pair, prompts):
    target, draft, tok = default_pair
    clock = Clock()
    cost = CostModel((1, 2, 4, 8), (0.05,) * 4, (1, 2, 4, 8), (0.01,) * 4)
    spec = RowSpeculator(draft, EchoConfig(), 3, max_rows=4, capacity=256, cost=cost, clock=clock)
    engine = Engine(target, spec, clock, lambda b, t: 0.05)
    rows = _prompts(tok, prompts, 2)
    rows = engine.step(rows, spec.propose(rows))
    chains = spec.propose(rows)  # the step between the two calls is priced here
    assert spec.stats["priced_steps"] == 1
    rows = engine.step(rows, chains)
    chains = spec.propose(rows)
    assert spec.stats["priced_steps"] == 2
    rows = engine.step(rows, chains) + [tok.encode(prompts[7])]  # a row arrives: its prefill ran in the step
    chains = spec.propose(rows)
    assert spec.stats["priced_steps"] == 2
    rows = engine.step(rows, chains)
    chains = spec.propose(rows, clean=False)  # a row still prefilling: its chunk runs in the next step
    rows = engine.step(rows, chains)
    chains = spec.propose(rows)
    assert spec.stats["priced_steps"] == 2
    rows = engine.step(rows, chains)
    spec.propose(rows)
    assert spec.stats["priced_steps"] == 3


def test_settings_refused_by_name(default_pair):
    _, draft, _ = default_pair
    with pytest.raises(ValueError, match="max_draft_len"):
        chain_config(EchoConfig(), 0)
    with pytest.raises(ValueError, match="slots"):
        RowDraftCache(draft, 0, 10)
    with pytest.raises(TypeError, match="CausalLM"):
        RowDraftCache(object(), 1, 10)
    spec = RowSpeculator(draft, EchoConfig(), 2, max_rows=2, capacity=16, prices=False)
    with pytest.raises(ValueError, match="at least one committed token"):
        spec.propose([[]])
    # rows beyond the cache's slots or length draft nothing
    assert spec.propose([[1, 2], [3, 4], [5, 6]])[2] == []
    assert spec.propose([list(range(1, 16))]) == [[]]


def test_prior_scales_the_draft_curve_by_weights(default_pair):
    target, draft, _ = default_pair
    cost = prior_cost_model(draft, target.config, tokens=(1, 4), measure=lambda m, t, r: (0.01, 0.02))
    ratio = linear_weights(target.config) / linear_weights(draft.config)
    assert cost.draft_seconds == (0.01, 0.02)
    assert cost.verify_seconds == pytest.approx((0.01 * ratio, 0.02 * ratio))
    n = sum(p.numel() for name, p in target.named_parameters() if "norm" not in name and "embed" not in name
            and p.dim() == 2)
    if target.config.tie_word_embeddings:
        n += target.config.vocab_size * target.config.hidden_size
    assert linear_weights(target.config) == n
