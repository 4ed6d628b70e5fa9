"""ECHO around an engine's own level-by-level draft runner (backends/levels.py), driven by a scripted engine that
behaves as vLLM's draft-model speculation does: each step verifies every row's query (its last token and its
drafts), then the draft reads the step's tokens (and what a lagging row missed) and drafts level after level for
every row. The engine keeps its own ground truth of which positions the draft has read, a modelled clock, and a
synthetic target / draft pair. References: `draft_tree` with the same distributions (the chains), the engine's
ground truth (the catch-up), the engine's own count (acceptance), the modelled costs (prices)."""

import pytest
import torch

from echo_trtllm import EchoConfig
from echo_trtllm.backends.levels import LevelSpeculator
from echo_trtllm.core import draft_tree
from echo_trtllm.core.controller import Decision
from echo_trtllm.core.cost import CostModel
from echo_trtllm.core.tree import DraftTopK

V = 97


def target_next(ctx: list[int]) -> int:
    return (ctx[-1] * 7 + ctx[-2] * 3 + 1) % V


def draft_next(ctx: list[int]) -> tuple[int, float]:
    """The draft's greedy token and its probability: right three times in four, and less sure when wrong."""
    t = target_next(ctx)
    if (ctx[-1] + 2 * len(ctx)) % 4 == 0:
        return (t + 1) % V, 0.35
    return t, 0.6 + 0.1 * (ctx[-1] % 4)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Engine:
    """vLLM's step loop in miniature (module docstring). verify(B, T), level_seconds and read_seconds (per token
    of the draft's first forward: the step's tokens, one sampled token per row, what lagging rows missed): the
    modelled clock."""

    def __init__(self, spec: LevelSpeculator, k: int, clock: Clock | None = None, verify=lambda b, t: 0.0,
                 level_seconds: float = 0.0, capacity: int | None = None, draft=draft_next,
                 prompts: list[list[int]] = (), read_seconds: float = 0.0) -> None:
        self.spec, self.k, self.clock, self.verify, self.draft = spec, k, clock or Clock(), verify, draft
        self.level_seconds, self.capacity, self.read_seconds = level_seconds, capacity, read_seconds
        self.produced = 0  # tokens the target emitted (accepted drafts and one of its own per row and step)
        self.rows: dict[str, list[int]] = {}  # request -> committed tokens
        self.pending: dict[str, tuple[int, int]] = {}  # request -> (first position of its next query, its length)
        self.chains: dict[str, list[int]] = {}
        self.read: dict[str, int] = {}  # request -> positions the draft has read (ground truth)
        self.violations: list[str] = []
        self.accepted = self.drafted = self.catch_up = self.levels = 0
        self.oracle: list[tuple[list[list[int]], list[list[int]]]] = []
        for i, p in enumerate(prompts):
            self.add(f"r{i}", p)

    def add(self, req: str, prompt: list[int], cached: int = 0) -> None:
        """A request arrives; its first `cached` positions come from a prefix cache (the draft never read them)."""
        self.rows[req] = list(prompt)
        self.pending[req] = (cached, len(prompt) - cached)

    def remove(self, req: str) -> None:
        for d in (self.rows, self.pending, self.chains, self.read):
            d.pop(req, None)

    def step(self, oracle: bool = False) -> None:
        reqs = list(self.rows)
        starts, lengths, rejected = [], [], []
        b = len(reqs)
        verified = sum(self.pending[r][1] for r in reqs)
        self.clock.t += self.verify(b, verified)
        for r in reqs:  # the target's step: verify each row's query
            s, q = self.pending[r]
            chain = self.chains.get(r, [])
            ctx = self.rows[r]
            a = 0
            if q == len(chain) + 1 and s + q == len(ctx) + len(chain):  # a decode row: its last token + its chain
                while a < len(chain) and chain[a] == target_next(ctx + chain[:a]):
                    a += 1
                ctx.extend(chain[:a])
                self.accepted += a
                self.drafted += len(chain)
            ctx.append(target_next(ctx))
            self.produced += a + 1
            starts.append(s)
            lengths.append(q)
            rejected.append(len(chain) - a if q == len(chain) + 1 else 0)
        expected = None
        if oracle:
            expected = self._oracle(reqs, starts, lengths)
        plan = self.spec.begin(reqs, starts, lengths, rejected, capacity=self.capacity)
        out = [[] for _ in reqs]
        if plan.speculate:
            self.clock.t += self.read_seconds * (sum(lengths) + b + sum(starts[i] - s for i, s in plan.prepend.items()))
            for i, r in enumerate(reqs):  # the draft's first forward: the step's tokens, a lagging row's missed ones
                start = plan.prepend.get(i, starts[i])
                if i in plan.prepend:
                    self.catch_up += starts[i] - start
                if self.read.get(r, 0) < start and plan.drafting[i]:
                    self.violations.append(f"{r}: drafted with positions {self.read.get(r, 0)}..{start} unread")
                if self.read.get(r, 0) >= start or plan.drafting[i]:
                    self.read[r] = len(self.rows[r])
            drafted = [list(self.rows[r]) for r in reqs]
            for depth in range(1, self.k + 1):
                if depth > 1:
                    self.clock.t += self.level_seconds
                self.levels += 1
                toks, probs = zip(*(self.draft(c) for c in drafted))
                for c, t in zip(drafted, toks):
                    c.append(t)
                if not self.spec.level(torch.tensor(toks), torch.tensor(probs)):
                    break
            out = self.spec.finish(len(reqs))
            if expected is not None:
                self.oracle.append((out, expected))
        else:
            self.spec.finish(len(reqs))
        for r, chain in zip(reqs, out):
            self.chains[r] = chain
            self.pending[r] = (len(self.rows[r]) - 1, len(chain) + 1)

    def _oracle(self, reqs, starts, lengths) -> list[list[int]]:
        """draft_tree on the same distributions, with the speculator's policy as it stands now."""
        ctxs = [list(self.rows[r]) for r in reqs]

        def draft_fn(level, frontier):
            probs, toks = [], []
            for f in frontier.tolist():
                node, path = f, []
                lv = level
                # walk up to the root: the chain of tokens drafted so far for this node's row
                while lv.depth > 0:
                    path.append(int(lv.token_ids[node]))
                    node = int(lv.parent_ids[node])
                    lv = levels[lv.depth - 1]
                t, p = self.draft(ctxs[int(level.request_ids[f])] + path[::-1])
                toks.append([t])
                probs.append([p])
            return DraftTopK(torch.tensor(probs), torch.tensor(toks))

        levels = []
        orig = draft_fn

        def recording(level, frontier):
            while len(levels) <= level.depth:
                levels.append(None)
            levels[level.depth] = level
            return orig(level, frontier)

        context = sum(s + q for s, q in zip(starts, lengths)) / len(reqs)
        budget = None if self.spec.k_max is None else max(self.spec.k_max, len(reqs))
        result = draft_tree(self.spec.policy, torch.zeros(len(reqs), dtype=torch.long), recording, budget=budget,
                            context=context)
        chains = [[] for _ in reqs]
        sel = result.selected
        for k in range(sel.total_nodes):
            if int(sel.depths[k]) > 0:
                chains[int(sel.request_ids[k])].append((int(sel.depths[k]), int(sel.token_ids[k])))
        return [[t for _, t in sorted(c)] for c in chains]


PROMPTS = [[5, 9, 2, 11, 40], [1, 2, 3], [60, 61, 62, 63, 64, 65, 66], [7, 7], [30, 20, 10, 5]]


def test_chains_equal_draft_tree():
    spec = LevelSpeculator(EchoConfig(), 4, prices=False)
    engine = Engine(spec, 4, prompts=PROMPTS)
    for _ in range(12):
        engine.step(oracle=True)
    assert engine.oracle and all(out == expected for out, expected in engine.oracle)
    lengths = {len(c) for out, _ in engine.oracle for c in out}
    assert len(lengths) > 1  # each request its own depth
    assert engine.violations == []


def test_the_policy_ends_the_engines_draft_loop():
    """A draft unsure of every token fails the first gate everywhere: the engine's loop ends after one level."""
    spec = LevelSpeculator(EchoConfig(), 4, prices=False)
    engine = Engine(spec, 4, draft=lambda ctx: (draft_next(ctx)[0], 0.2), prompts=PROMPTS)
    for _ in range(6):
        engine.step(oracle=True)
    assert all(out == expected for out, expected in engine.oracle)
    assert engine.levels == spec.stats["stopped_early"] == spec.stats["speculative_steps"] == 6


def test_budget_is_global_across_the_batch():
    spec = LevelSpeculator(EchoConfig(), 4, k_max=len(PROMPTS) + 3, prices=False)
    engine = Engine(spec, 4, prompts=PROMPTS)
    for _ in range(10):
        engine.step(oracle=True)
        assert sum(len(c) for c in engine.chains.values()) <= 3
    assert all(out == expected for out, expected in engine.oracle)


def test_plain_steps_skip_the_draft_and_rows_read_back_what_they_missed():
    """One speculative step then two plain ones: plain steps run no draft level; every speculative step reads first
    what each row missed (ground truth: no row drafts with unread positions), including a request that arrived in a
    plain step and one whose prompt came from a prefix cache; a request that leaves is forgotten."""
    spec = LevelSpeculator(EchoConfig(), 3, prices=False, cycle=(1, 2))
    engine = Engine(spec, 3, prompts=PROMPTS[:3])
    levels = []
    for step in range(15):
        if step == 4:
            engine.add("late", [3, 1, 4, 1, 5])  # arrives in a plain step
        if step == 7:
            engine.add("cached", [2, 7, 1, 8, 2, 8, 1, 8], cached=6)
        if step == 9:
            engine.remove("r1")
        before = engine.levels
        engine.step()
        levels.append(engine.levels - before)
    assert engine.violations == []
    assert all(n == 0 for i, n in enumerate(levels) if i % 3 != 0)
    assert all(n > 0 for i, n in enumerate(levels) if i % 3 == 0)
    assert spec.stats["catch_up_tokens"] == engine.catch_up > 0
    assert "r1" not in spec.lag and "r1" not in spec.known
    assert engine.accepted > 0


def test_catch_up_is_bounded_by_the_drafts_buffers():
    """A row whose missed positions do not fit the first forward stays behind and drafts nothing, and reads them
    back at a later speculative step where they fit; no row ever drafts over unread positions."""
    spec = LevelSpeculator(EchoConfig(), 3, prices=False, cycle=(1, 3))
    engine = Engine(spec, 3, capacity=3 * 2 + 3 + 6, prompts=PROMPTS[:3])
    behind = 0
    for _ in range(24):
        engine.step()
        behind += sum(1 for r in engine.rows if r in spec.lag)
    assert engine.violations == []
    assert behind > 0 and spec.stats["catch_up_tokens"] == engine.catch_up > 0


def test_acceptance_counted_as_the_engine_counts():
    spec = LevelSpeculator(EchoConfig(), 4, prices=False)
    engine = Engine(spec, 4, prompts=PROMPTS)
    for _ in range(15):
        engine.step()
    engine.step()  # the last chains' outcome is learnt at the next call
    assert spec.stats["drafted"] == engine.drafted > 0
    assert spec.stats["accepted"] == engine.accepted > 0


def _priced(verify, level_seconds, steps=60):
    clock = Clock()
    cost = CostModel((1, 2, 4, 8, 16, 32), (0.05,) * 6, (1, 2, 4, 8, 16, 32), (0.01,) * 6)
    spec = LevelSpeculator(EchoConfig(), 3, cost=cost, clock=clock)
    engine = Engine(spec, 3, clock, verify, level_seconds, prompts=PROMPTS[:4])
    for _ in range(steps):
        engine.step()
    return spec


def test_prices_learnt_from_the_engines_steps():
    """A step of 20 ms + 5 ms per verified token: the plain price is learnt within 15 % from the engine's steps
    (the first, a prefill, is not priced)."""
    spec = _priced(lambda b, t: 0.02 + 0.005 * t, 0.004, steps=40)
    assert spec.stats["priced_steps"] >= 30
    assert spec.step_cost.plain_seconds(4, 40.0) == pytest.approx(0.02 + 0.005 * 4, rel=0.15)


def test_controller_runs_plain_steps_where_verification_is_dear():
    dear = _priced(lambda b, t: 0.05 * t, 0.05)
    cheap = _priced(lambda b, t: 0.05, 0.001)
    assert dear.stats["speculative_steps"] <= 0.25 * dear.stats["steps"]
    assert cheap.stats["speculative_steps"] >= 0.75 * cheap.stats["steps"]


def test_misuse_is_refused_by_name():
    with pytest.raises(ValueError, match="cycle"):
        LevelSpeculator(EchoConfig(), 3, cycle=(0, 1))
    spec = LevelSpeculator(EchoConfig(), 3, prices=False)
    with pytest.raises(ValueError, match="one entry per row"):
        spec.begin(["a", "b"], [0], [1, 1])
    with pytest.raises(RuntimeError, match="begin"):
        spec.level(torch.tensor([1]), torch.tensor([0.5]))
    with pytest.raises(RuntimeError, match="begin"):
        spec.finish(1)


def test_a_step_far_slower_than_predicted_is_not_learnt_from():
    """Once the prices are fitted, a step 10x slower than every other (an engine's first step of a new shape) is
    counted as an outlier and leaves the plain price where the steady steps put it."""
    calls = [0]

    def verify(b, t):
        calls[0] += 1
        return (0.02 + 0.005 * t) * (10 if calls[0] == 12 else 1)

    spec = _priced(verify, 0.004, steps=30)
    assert spec.stats["outliers"] == 1
    assert spec.step_cost.plain_seconds(4, 40.0) == pytest.approx(0.02 + 0.005 * 4, rel=0.15)


def test_a_steps_prefill_is_charged_to_a_probe():
    """vLLM run F at 64 rows: probes in a batch's prefill steps drafted 5-9 s each (the draft's first forward reads
    every prompt token of the step) where the controller had priced them as decode steps. What the draft reads
    beyond steady speculation now includes the step's prefill: rows not yet sampling, and rows whose query is
    longer than a chain's 1 + max_draft_len (finishing their prompt), besides what lagging rows missed."""
    spec = LevelSpeculator(EchoConfig(), 3, cost=CostModel.linear(0.02, 0.005))
    seen = []
    decide = spec.controller.decide
    spec.controller.decide = lambda n, c, extra=0: seen.append(extra) or decide(n, c, extra)
    spec.begin(["a", "b", "c"], [0, 40, 10], [300, 4, 20], live=[False, True, True])
    # "b" verifies a chain of 3 (a decode row); "b" and "c", first seen past position 0, read from 0 as well
    assert seen == [(300 + 20) + (40 + 10)]


def test_the_warm_up_alternates_forced_steps_and_charges_the_controller_nothing():
    """vLLM run G at one row: two probes (one verification stalled 7x) spent the exploration budget and the
    controller ran 58 plain steps on a guess (ratio 1.0, bounds 0.24-4.3). A priced speculator now starts as the
    engine's own warm-up does: its first decode steps alternate speculative and plain ("forced", prefill steps
    not counted), the first of each kind not learnt from, the others priced, the speculative ones the controller's
    first evidence, its exploration budget and step count untouched."""
    clock = Clock()
    spec = LevelSpeculator(EchoConfig(), 3, cost=CostModel.linear(0.02, 0.005), clock=clock, warm_up=6)
    engine = Engine(spec, 3, clock, lambda b, t: 0.02 + 0.005 * t, 0.004, prompts=[p * 3 for p in PROMPTS[:2]])
    credit = spec.controller.credit
    reasons, levels = [], []
    for _ in range(8):
        before = engine.levels
        engine.step()
        reasons.append(spec.last.decision.reason if spec.last.decision else None)
        levels.append(engine.levels - before)
    # step 0 prefills both prompts: the controller's; then six forced steps, speculative first; then the controller's
    assert reasons[1:7] == ["forced"] * 6 and reasons[0] != "forced" and reasons[7] != "forced"
    assert [n > 0 for n in levels[1:7]] == [True, False] * 3
    # the controller observed its own plain step 0 only; the credit grew by what that step emitted
    assert spec.controller.stats.steps == 1 and spec.controller.credit >= credit
    assert spec.controller.records.size == 2  # forced speculative steps 3 and 5 (step 1 paid the one-off costs)
    assert spec.stats["priced_steps"] == 5  # step 0 and forced steps 3-6 (not 1 and 2)
    assert engine.violations == []


def test_no_warm_up_without_prices():
    spec = LevelSpeculator(EchoConfig(), 3, prices=False)
    assert spec.warm_up == 0
    with pytest.raises(ValueError, match="warm_up"):
        LevelSpeculator(EchoConfig(), 3, warm_up=-1)


@pytest.mark.parametrize("reason,floor", [("probe", True), ("exploit", True), ("probe", False)])
def test_a_probe_verifies_a_drafted_token_per_row_where_the_rule_would_verify_none(reason, floor):
    """Verification priced at a whole step per token: the budget rule hands back empty chains. A speculative step
    the controller calls a probe hands back as many drafted tokens as rows (`Decision.min_tokens`), so the
    price of a verified token is measured; an exploit, or a probe with the floor off, keeps the rule's choice. The
    engine's steps cost what the prices say (a modelled clock), so what they learn keeps a token that dear."""
    cost = CostModel((1, 2, 4, 8, 16), (0.05, 0.10, 0.20, 0.40, 0.80), (1, 2, 4, 8, 16), (0.001,) * 5)
    clock = Clock()
    spec = LevelSpeculator(EchoConfig(probe_floor=floor), 3, cost=cost, clock=clock, warm_up=0)
    spec.controller.decide = lambda n, c, extra=0: Decision(True, reason, n)
    engine = Engine(spec, 3, clock, lambda b, t: 0.05 * t, 0.001, prompts=PROMPTS[:4])
    lengths = []
    for _ in range(6):
        engine.step()
        lengths.append([len(engine.chains[r]) for r in sorted(engine.chains)])
    decode = lengths[1:]  # the first step prefills
    if reason == "probe" and floor:
        assert all(sum(row) == len(row) for row in decode), lengths
    else:
        assert all(sum(row) == 0 for row in decode), lengths
