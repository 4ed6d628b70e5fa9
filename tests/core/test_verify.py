"""Verification: greedy against a naive per-path loop, sampling against the target distribution."""

import dataclasses

import pytest
import torch

from echo_trtllm.core.pack import pack, pack_from_parents
from echo_trtllm.core.tree import SuperTree
from echo_trtllm.core.verify import SamplingTensors, process_logits, verify, verify_greedy, verify_sampling
from tests.helpers import chi2_critical, chi2_statistic, naive_ancestors, random_parents

# ---------------------------------------------------------------------------------------------------- greedy


def _greedy_case(batch_size, vocab, gen, max_nodes=40):
    parents = [random_parents(int(torch.randint(1, max_nodes, (1,), generator=gen)), gen) for _ in range(batch_size)]
    tokens = [torch.randint(0, vocab, (p.numel(),), generator=gen) for p in parents]
    tree = SuperTree.from_parents(parents, tokens)
    batch = pack(tree)
    logits = torch.randn(batch.total_nodes, vocab, generator=gen)
    gp = batch.global_parents
    for j in torch.randperm(batch.total_nodes, generator=gen).tolist():  # make many drafts the parent's argmax
        if gp[j] >= 0 and torch.rand(1, generator=gen) < 0.6:
            logits[gp[j], batch.input_ids[j]] = 10.0 + torch.rand(1, generator=gen).item()
    return parents, batch, logits


def naive_greedy(parents, batch, logits):
    """Per request: every root path, accepted iff each draft is the argmax at its parent; the deepest wins,
    ties to the lowest node index; then the bonus argmax."""
    out = []
    start = 0
    pred = logits.argmax(-1).tolist()
    toks = batch.input_ids.tolist()
    for p in parents:
        plist = p.tolist()
        best = None
        for j in range(len(plist)):
            path = [start + a for a in naive_ancestors(plist, j)]
            if all(toks[path[t + 1]] == pred[path[t]] for t in range(len(path) - 1)):
                if best is None or len(path) > len(best):
                    best = path
        out.append(([toks[n] for n in best[1:]] + [pred[best[-1]]], best))
        start += len(plist)
    return out


@pytest.mark.parametrize("batch_size, vocab", [(1, 5), (3, 37), (64, 50), (257, 33)])
def test_verify_greedy_matches_naive_per_path_loop(batch_size, vocab):
    gen = torch.Generator().manual_seed(batch_size * 7 + vocab)
    parents, batch, logits = _greedy_case(batch_size, vocab, gen)
    result = verify_greedy(batch, logits)
    expected = naive_greedy(parents, batch, logits)
    assert result.token_lists() == [e[0] for e in expected]
    assert result.node_lists() == [e[1] for e in expected]
    assert result.num_accepted_drafts.tolist() == [len(e[0]) - 1 for e in expected]
    assert int(result.num_accepted_drafts.sum()) > 0, "the case must exercise acceptance"


def test_accepted_nodes_form_a_root_path():
    gen = torch.Generator().manual_seed(3)
    parents, batch, logits = _greedy_case(20, 11, gen)
    gp = batch.global_parents.tolist()
    for i, nodes in enumerate(verify_greedy(batch, logits).node_lists()):
        assert nodes[0] == int(batch.cu_num_nodes[i])
        assert all(gp[nodes[t + 1]] == nodes[t] for t in range(len(nodes) - 1))


def test_greedy_rejects_wrong_logits_shape():
    batch = pack_from_parents([torch.tensor([-1, 0])])
    with pytest.raises(ValueError, match="target_logits"):
        verify_greedy(batch, torch.zeros(3, 4))


# ---------------------------------------------------------------------------------------------------- process_logits


def naive_process(row, temperature, top_k, top_p):
    v = row.numel()
    if temperature <= 0:
        return torch.nn.functional.one_hot(row.argmax(), v).float()
    p = torch.softmax(row.double() / temperature, -1)
    order = sorted(range(v), key=lambda t: (-float(p[t]), t))
    keep = order[:top_k] if top_k > 0 else order
    mass = sum(float(p[t]) for t in keep)
    kept, acc = [], 0.0
    for t in keep:
        if acc < top_p * mass:
            kept.append(t)
        acc += float(p[t])
    out = torch.zeros(v, dtype=torch.float64)
    for t in kept:
        out[t] = p[t]
    return (out / out.sum()).float()


def test_process_logits_matches_naive():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 37, generator=gen) * 2
    temp = torch.tensor([1.0, 0.5, 0.0, 1.3, 0.8, 1.0])
    top_k = torch.tensor([0, 5, 0, 1, 36, 37])
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0, 0.3, 0.999])
    got = process_logits(logits, temp, top_k, top_p)
    for r in range(6):
        torch.testing.assert_close(got[r], naive_process(logits[r], float(temp[r]), int(top_k[r]), float(top_p[r])),
                                   rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- sampling

VOCAB = 6
TRIALS = 20_000


def _markov_tables(seed):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(VOCAB, VOCAB, generator=gen) * 1.5
    draft = target + torch.randn(VOCAB, VOCAB, generator=gen) * 1.2  # a related but imperfect draft
    return target, draft


def _draft_batch(roots, shape, draft_probs, sampled, gen):
    """Build B trees of the given shape (children per node by level) with drafts from the Markov draft."""
    b = roots.numel()
    levels = [roots[:, None]]  # tokens per level: (B, nodes_at_level)
    parents = [-1]
    for width in shape:
        prev = levels[-1]
        dist = draft_probs[prev.reshape(-1)]  # (B * n_prev, V)
        if sampled:
            child = torch.multinomial(dist, width, replacement=False, generator=gen)
        else:
            child = torch.topk(dist, width, dim=-1).indices
        offset = len(parents) - prev.shape[1]
        parents += [offset + j for j in range(prev.shape[1]) for _ in range(width)]
        levels.append(child.reshape(b, -1))
    tokens = torch.cat(levels, dim=1)  # (B, n) node order = level order, parents before children
    n = tokens.shape[1]
    batch = pack(SuperTree.from_parents([torch.tensor(parents)] * b, list(tokens)))
    assert batch.total_nodes == b * n
    return batch, tokens.reshape(-1)


def _run_two_tokens(shape, sampled, params, claim_sampled=None, seed=0):
    """Emit two tokens per trial (a second step when the first emits one) and return their joint counts and
    the processed target joint distribution."""
    claim_sampled = sampled if claim_sampled is None else claim_sampled
    target_logits, draft_logits = _markov_tables(seed)
    t, k, p = params
    tp = process_logits(target_logits, torch.full((VOCAB,), t), torch.full((VOCAB,), k), torch.full((VOCAB,), p))
    dp = process_logits(draft_logits, torch.full((VOCAB,), t), torch.full((VOCAB,), k), torch.full((VOCAB,), p))
    gen = torch.Generator().manual_seed(1000 + seed)

    def step(roots, salt):
        batch, tokens = _draft_batch(roots, shape, dp, sampled, gen)
        gens = [torch.Generator().manual_seed(salt * 1_000_003 + i) for i in range(roots.numel())]
        return verify_sampling(batch, target_logits[tokens], SamplingTensors.uniform(roots.numel(), t, k, p), gens,
                               dp[tokens] if claim_sampled else None).token_lists()

    first = step(torch.zeros(TRIALS, dtype=torch.long), 1)
    need = [i for i, toks in enumerate(first) if len(toks) == 1]
    second = step(torch.tensor([first[i][0] for i in need], dtype=torch.long), 2) if need else []
    pairs = torch.zeros(VOCAB, VOCAB)
    it = iter(second)
    for toks in first:
        a, b_ = (toks[0], toks[1]) if len(toks) > 1 else (toks[0], next(it)[0])
        pairs[a, b_] += 1
    expected = tp[0][:, None] * tp  # P(a | 0) P(b | a)
    return pairs, expected, first


SHAPES = {"chain": (1, 1, 1), "tree": (3, 2), "wide": (4,)}


@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled-drafts", "topk-drafts"])
def test_sampling_output_matches_target_distribution(shape_name, sampled):
    pairs, expected, first = _run_two_tokens(SHAPES[shape_name], sampled, (1.0, 0, 1.0))
    stat, dof = chi2_statistic(pairs, expected)
    assert stat < chi2_critical(dof), f"chi2 {stat:.1f} >= critical {chi2_critical(dof):.1f} (dof {dof})"
    assert sum(len(t) - 1 for t in first) > TRIALS * 0.2, "drafts must be accepted often enough to matter"


def test_sampling_with_temperature_top_k_top_p_matches_processed_target():
    pairs, expected, _ = _run_two_tokens((3, 2), True, (0.7, 4, 0.9), seed=4)
    assert torch.count_nonzero(expected) < VOCAB * VOCAB, "filters must remove some tokens"
    assert pairs[expected == 0].sum() == 0, "a token filtered out of the target was emitted"
    stat, dof = chi2_statistic(pairs, expected)
    assert stat < chi2_critical(dof)


def test_frequency_test_detects_a_wrong_draft_distribution():
    """Negative control: top-k drafts verified as if they were sampled from q (wrong q) must be caught."""
    pairs, expected, _ = _run_two_tokens((3, 2), sampled=False, params=(1.0, 0, 1.0), claim_sampled=True)
    stat, dof = chi2_statistic(pairs, expected)
    assert stat > chi2_critical(dof)


def test_sampling_is_deterministic_per_seed_and_independent_of_the_batch():
    gen = torch.Generator().manual_seed(8)
    parents, batch, logits = _greedy_case(6, 9, gen)
    sampling = SamplingTensors.uniform(6, 0.9)

    def run(seeds):
        return verify_sampling(batch, logits, sampling, [torch.Generator().manual_seed(s) for s in seeds]).token_lists()

    a, b = run(range(6)), run(range(6))
    assert a == b
    alone = pack(SuperTree.from_parents([parents[2]], [batch.input_ids[int(batch.cu_num_nodes[2]):int(batch.cu_num_nodes[3])]]))
    lo, hi = int(batch.cu_num_nodes[2]), int(batch.cu_num_nodes[3])
    single = verify_sampling(alone, logits[lo:hi], SamplingTensors.uniform(1, 0.9), [torch.Generator().manual_seed(2)])
    assert single.token_lists()[0] == a[2]
    assert run([50 + s for s in range(6)]) != a


def test_greedy_rows_inside_a_sampling_batch_follow_the_argmax():
    gen = torch.Generator().manual_seed(11)
    parents, batch, logits = _greedy_case(8, 401, gen, max_nodes=20)
    sampling = SamplingTensors.uniform(8, 0.0)
    sampling.temperature[::2] = 1.0  # mixed batch: odd rows greedy
    mixed = verify(batch, logits, sampling, [torch.Generator().manual_seed(i) for i in range(8)]).token_lists()
    greedy = verify_greedy(batch, logits).token_lists()
    toks = batch.input_ids.tolist()
    strict = 0
    for i in range(1, 8, 2):
        # Both are prefixes of the target's greedy chain; they are equal unless duplicate sibling tokens let
        # the deepest-path rule of verify_greedy go further than the first matching child.
        assert mixed[i] == greedy[i][: len(mixed[i]) - 1] + [mixed[i][-1]]
        lo, hi = int(batch.cu_num_nodes[i]), int(batch.cu_num_nodes[i + 1])
        plist = parents[i].tolist()
        sibling_keys = [(plist[j], toks[lo + j]) for j in range(1, hi - lo)]
        if len(set(sibling_keys)) == len(sibling_keys):
            assert mixed[i] == greedy[i]
            strict += 1
    assert strict >= 2, "the case must hold rows without duplicate sibling tokens"
    assert verify(batch, logits, SamplingTensors.uniform(8, 0.0)).token_lists() == greedy


def naive_coupled_sampling(parents, batch, probs, u_pos):
    """Per request: walk from the root, drawing the target's token at each position from its uniform
    (inverse CDF), moving to the child that drafted it; the first token no child drafted ends the step."""
    out = []
    toks = batch.input_ids.tolist()
    for i, p in enumerate(parents):
        lo = int(batch.cu_num_nodes[i])
        plist = p.tolist()
        node, emitted = 0, []
        for t in range(len(plist) + 1):
            cdf = torch.cumsum(probs[lo + node].double(), 0)
            s = int(torch.searchsorted(cdf, u_pos[i, t] * cdf[-1], right=True))
            emitted.append(s)
            children = [j for j in range(len(plist)) if plist[j] == node and toks[lo + j] == s]
            if not children:
                break
            node = children[0]
        out.append(emitted)
    return out


@pytest.mark.parametrize("batch_size, vocab", [(1, 5), (7, 9), (64, 50)])
def test_sampling_with_topk_drafts_equals_ar_sampling_with_the_same_uniforms(batch_size, vocab):
    """The runtime's rule: the emitted tokens are the target's own samples at each position (inverse CDF of the
    position's uniform), so they equal plain AR sampling with the same uniforms, whatever the tree."""
    gen = torch.Generator().manual_seed(batch_size + vocab)
    parents, batch, logits = _greedy_case(batch_size, vocab, gen, max_nodes=12)
    # no duplicate sibling tokens: then the accepted path is unique
    toks = batch.input_ids.clone()
    for i, p in enumerate(parents):
        lo = int(batch.cu_num_nodes[i])
        for j in range(1, p.numel()):
            sib = [k for k in range(1, j) if int(p[k]) == int(p[j])]
            while int(toks[lo + j]) in [int(toks[lo + k]) for k in sib]:
                toks[lo + j] = (toks[lo + j] + 1) % vocab
    batch = dataclasses.replace(batch, input_ids=toks)
    sampling = SamplingTensors.uniform(batch_size, 0.8, 0, 0.95)
    u_pos = torch.rand(batch_size, int(batch.node_depths.max()) + 1, generator=gen, dtype=torch.float64)
    got = verify_sampling(batch, logits, sampling, position_uniforms=u_pos)
    probs = process_logits(logits, torch.full((batch.total_nodes,), 0.8), torch.zeros(batch.total_nodes, dtype=torch.long),
                           torch.full((batch.total_nodes,), 0.95))
    assert got.token_lists() == naive_coupled_sampling(parents, batch, probs, u_pos)
    if batch_size > 1:
        assert int(got.num_accepted_drafts.sum()) > 0, "the case must exercise acceptance"


def test_tiny_temperatures_are_the_argmax_not_nan():
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0 - 1e-3], [5.0, -3.0, 0.0, 1.0]])
    for t in (1e-40, 1e-30, 1e-8):
        p = process_logits(logits, torch.full((2,), t), torch.zeros(2, dtype=torch.long), torch.ones(2))
        assert not torch.isnan(p).any()
        assert p.argmax(-1).tolist() == [1, 0] and torch.allclose(p.sum(-1), torch.ones(2))


def test_a_residual_without_mass_falls_back_to_the_target_distribution():
    """Sampled drafts whose q covers p everywhere (draft == target up to rounding, here q = 2p): rejecting both
    children leaves max(p - q, 0) = 0. The bonus must come from the target's distribution, not be an arbitrary id."""
    probs = torch.tensor([0.0, 0.4, 0.3, 0.3, 0.0, 0.0])  # top_k = 3 makes p exactly this
    logits = torch.log(probs.clamp(min=1e-3))[None].repeat(3, 1)  # root and its two children
    batch = pack(SuperTree.from_parents([torch.tensor([-1, 0, 0])], [torch.tensor([0, 1, 2])]))
    q = (2 * probs)[None].repeat(3, 1)
    bonuses = set()
    for seed in range(200):
        res = verify_sampling(batch, logits, SamplingTensors.uniform(1, 1.0, top_k=3),
                              [torch.Generator().manual_seed(seed)], q)
        toks = res.token_lists()[0]
        if len(toks) == 1:  # both children rejected
            bonuses.add(toks[0])
    assert bonuses, "the case must reject both children sometimes"
    assert bonuses <= {1, 2, 3}, f"bonus tokens {bonuses} outside the target's support"


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    """top_p = 1e-46 is 0 in float32: the filter must still keep the argmax (it kept nothing: 0 / 0 = NaN)."""
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5]])
    probs = process_logits(logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([1e-46], dtype=torch.float64))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
