"""Drafting with an EAGLE-3 head in the executor.

- Lossless: every policy with the head emits exactly plain AR greedy's tokens, requests joining and leaving
  mid-flight, and the committed head's drafts are accepted; seeded sampling emits exactly what plain AR sampling
  emits with the same seeds (each position's token drawn from that position's uniform), drafts accepted.
- The head's state is right, step after step: every distribution the drafter hands the drafting loop (the root
  and every chain level) equals a dense recomputation from scratch, the target's features of the whole sequence
  taken from a fresh target forward and the naive EAGLE-3 layer of tests/models (the reference that the head's
  own forward is tested against). This covers the features carried with pending tokens, the re-read of accepted
  drafts with the target's features, the KV kept up to the root, and re-priming from a bounded feature window.
- `LLM(draft_model=<eagle3 dir>)` and an engine directory carry the head; `build` with no models bundles it (it is
  what `LLM()` drafts with).
"""

import pytest
import torch

from echo_trtllm import LLM, kernels
from echo_trtllm.core import POLICY_NAMES, EchoConfig
from echo_trtllm.models import DEFAULT_EAGLE3, DEFAULT_TARGET
from echo_trtllm.models.eagle3 import Eagle3Head, load_eagle3
from echo_trtllm.models.loader import load_model
from echo_trtllm.runtime.executor import Executor
from echo_trtllm.runtime.inputs import chain_batch
from echo_trtllm.runtime.request import SamplingParams
from tests.helpers import run_greedy as run
from tests.helpers import run_seeded_sampling
from tests.models.test_eagle3 import naive_head


@pytest.fixture(scope="module")
def fp32_pair():
    target, tok = load_model(DEFAULT_TARGET, dtype="float32")
    return target, load_eagle3(DEFAULT_EAGLE3, target), tok


@pytest.fixture(scope="module")
def ar_reference(fp32_pair, prompts):
    target, _, tok = fp32_pair
    lengths = [8 + (7 * i) % 25 for i in range(len(prompts))]
    outs, _, _ = run(target, None, tok, "ar", prompts, 1, lengths)
    return lengths, outs


@pytest.mark.parametrize("batch_size", [1, 16])
@pytest.mark.parametrize("policy", [p for p in POLICY_NAMES if p != "ar"])
def test_every_policy_with_the_head_equals_ar_greedy(fp32_pair, prompts, ar_reference, policy, batch_size):
    target, head, tok = fp32_pair
    lengths, expected = ar_reference
    outs, reqs, sizes = run(target, head, tok, policy, prompts, batch_size, lengths,
                            k_max={1: 24, 16: 96}[batch_size])
    for i, (got, exp) in enumerate(zip(outs, expected)):
        assert got == exp, f"prompt {i} ({prompts[i]!r}) diverged from AR under {policy} with the EAGLE-3 head"
    if batch_size > 1:
        assert max(sizes) == batch_size and min(sizes) < batch_size
    steps = sum(r.stats.steps for r in reqs)
    assert steps < 0.8 * sum(lengths), f"{policy}: the head's drafts were hardly accepted ({steps} steps)"


@pytest.mark.parametrize("policy", [p for p in POLICY_NAMES if p != "ar"])
def test_seeded_sampling_with_the_head_equals_ar_sampling_token_for_token(fp32_pair, prompts, policy):
    """Sampling verification with the head's drafts (temperature, top-p, top-k): a seeded request emits exactly
    the tokens plain AR sampling emits with the same seed, and drafts are accepted (it is still speculation)."""
    target, head, tok = fp32_pair
    ar, ar_steps = run_seeded_sampling(target, None, tok, "ar", prompts[:8])
    spec, spec_steps = run_seeded_sampling(target, head, tok, policy, prompts[:8])
    assert len(spec) == len(ar) == 8
    for i, (got, exp) in enumerate(zip(spec, ar)):
        assert got == exp, f"prompt {i}: {policy} with the EAGLE-3 head sampled other tokens than AR"
    assert spec_steps < ar_steps, f"{policy}: the head's drafts were never accepted while sampling"


@torch.no_grad()
def dense_reference(target, head, tokens, offset, chain):
    """The head's distribution after token list `tokens` (root last) read from `offset`, then after each drafted
    chain token: recomputed from scratch (fresh target forward for the features, naive dense head)."""
    n = len(tokens)
    cache = target.allocate_cache(1, n)
    ids = torch.tensor(tokens)
    _, feats = target(chain_batch([ids[: n - 1]], torch.tensor([0]), torch.tensor([0]), "none"), cache,
                      capture=tuple(head.config.capture_layers))
    entry_ids = ids[offset + 1 :]
    fused = feats[offset:].float() @ head.fc.weight.float().T
    out = []
    for d in range(len(chain) + 1):
        logits, y = naive_head(head, entry_ids, fused)
        probs = torch.zeros(target.config.vocab_size)
        probs[head.to_target_ids(torch.arange(head.config.draft_vocab_size))] = logits[-1].softmax(-1)
        out.append(probs)
        if d < len(chain):
            entry_ids = torch.cat([entry_ids, torch.tensor([chain[d]])])
            fused = torch.cat([fused, y[-1:]])
    return out


@pytest.mark.parametrize("max_features", [512, 10])
def test_the_heads_drafts_equal_a_dense_recomputation_every_step(fp32_pair, prompts, max_features):
    """Chain policy (every level has one node per request, whose ancestors are the levels before): each level's
    distribution == the dense reference. With max_features=10 and no head prefill (as when the cost curve says
    speculation cannot pay at admission), the head meets whole prompts at their first step and re-primes from the
    10-token window of features it kept."""
    target, head, tok = fp32_pair
    ex = Executor(target, head, tok, EchoConfig(policy="chain", num_draft_tokens=4), max_batch_size=4,
                  max_seq_len=256)
    ex.drafter.max_features = max_features
    # the features stored by the host library where it is built (`kernels.host_row_copier`): what this test reads
    assert (ex.drafter.row_copier is not None) == (kernels.backend_for("cpu") == "host")
    if max_features < 100:
        ex._draft_prefill = lambda batch_size: False
    records = []  # (tokens, offset, chain so far, probs) per request and level
    d = ex.drafter
    real_roots, real_level = d.expand_roots, d.expand_level

    def spy_roots(rows):  # the batched loop's level 0 (what the runtime runs for the chain policy)
        top = real_roots(rows)
        d._record = {}
        for row, b in enumerate(rows.tolist()):
            if not bool(d._read[b]):
                continue  # a one-token prompt at its first step: nothing to read the root with
            r = d._requests[b]
            records.append([list(r.all_token_ids), r.draft_offset, [], [(top.probs[row], top.tokens[row])]])
            d._record[b] = records[-1]
        return top

    def spy_level(depth, tokens, parents):
        top = real_level(depth, tokens, parents)
        for row, b in enumerate(d._rows.tolist()):
            if b in d._record:
                rec = d._record[b]
                rec[2].append(int(tokens[row, 0]))
                rec[3].append((top.probs[row, 0], top.tokens[row, 0]))
        return top

    d.expand_roots, d.expand_level = spy_roots, spy_level
    partial = []  # steps where some requests ended and the others' features were stored (executor._observe)
    real_observe = ex._observe

    def spy_observe(reqs, ctx, result, keep, features):
        partial.append(0 < sum(keep) < len(keep))
        return real_observe(reqs, ctx, result, keep, features)
    ex._observe = spy_observe
    long = ["def _check(value):\n    if not isinstance(value, int):\n        raise TypeError(value)\n    return value\n\n",
            "MACBETH:\nIs this a dagger which I see before me,\nThe handle toward my hand? Come, let me clutch thee.\n"]
    reqs = [ex.make_request(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
            for p in prompts[:8] + long]
    for r in reqs:
        ex.submit(r)
    while ex.has_work:
        ex.step()
    assert not ex.failures, ex.last_error
    assert len(records) > 30
    assert any(partial), "no step stored the features of some requests while others ended"
    if max_features == 10:
        assert any(rec[1] > 0 for rec in records), "no request was re-primed"
    for tokens, offset, chain, got in records:
        want = dense_reference(target, head, tokens, offset, chain)
        for d, (g, w) in enumerate(zip(got, want)):
            # the drafter hands back its top-k: the reference's probabilities at those tokens, and its own top-k
            top_p, top_ids = g
            assert top_ids.numel() == ex.policy.max_children
            torch.testing.assert_close(top_p, w[top_ids], rtol=0, atol=2e-4, msg=lambda m: f"level {d} of {tokens}: {m}")
            torch.testing.assert_close(top_p, torch.topk(w, top_ids.numel()).values, rtol=0, atol=2e-4)


def test_the_llm_api_and_an_engine_directory_carry_the_head(tmp_path, prompts):
    from echo_trtllm.engine_build import build_engine

    with LLM(DEFAULT_TARGET, DEFAULT_EAGLE3, dtype="float32", max_batch_size=4) as llm:
        assert isinstance(llm.draft, Eagle3Head)
        outs = llm.generate(prompts[:4], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    with LLM(DEFAULT_TARGET, dtype="float32", speculative_config=EchoConfig(policy="ar")) as ar:
        ref = ar.generate(prompts[:4], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    engine = build_engine(tmp_path / "engine", DEFAULT_TARGET, DEFAULT_EAGLE3, EchoConfig(), "float32")
    with LLM(engine_dir=engine) as llm:
        assert isinstance(llm.draft, Eagle3Head)
        again = llm.generate(prompts[:4], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in ref]


def test_build_with_no_models_bundles_the_head_that_llm_drafts_with(tmp_path):
    """`echo-trtllm build` with no models bundles the embedded target's EAGLE-3 head, the draft `LLM()` uses (under
    tensor parallelism too: tests/runtime/test_tensor_parallel.py)."""
    from echo_trtllm.cli import main
    from echo_trtllm.engine_dir import read_engine
    from echo_trtllm.models.eagle3 import is_eagle3_dir

    assert main(["build", "--output", str(tmp_path / "engine")]) == 0
    assert is_eagle3_dir(read_engine(tmp_path / "engine").draft)


def test_a_head_for_another_target_is_refused(fp32_pair):
    """The default draft model (hidden size 128) is not the head's target (256)."""
    from echo_trtllm.models import DEFAULT_DRAFT

    draft, _ = load_model(DEFAULT_DRAFT, dtype="float32")
    with pytest.raises(ValueError, match="target features of width 256"):
        load_eagle3(DEFAULT_EAGLE3, draft)
    with pytest.raises(ValueError, match="draft_model"):
        LLM(DEFAULT_TARGET, DEFAULT_EAGLE3 / "config.json")


@pytest.mark.parametrize("given_as", ["rows", "indexed", "indexed-host", "rows-host"])
def test_the_feature_store_equals_a_list_of_rows_per_request(given_as):
    """Three requests' windows in one store (width 16: rings that wrap), written a few rows at a time, some writes
    longer than the width (a prefill chunk), windows restarted after a gap and dropped at random, every read of a
    request's kept tokens against a plain dict of the rows each was given. The rows given as a table of their own
    (rows) or as indices into a shuffled table (indexed: the verification forward's rows of the accepted tokens),
    copied by torch or by the host library (-host, `kernels.host_row_copier`, as the executor installs it on the
    CPU)."""
    from echo_trtllm.runtime.drafter import FeatureSpan, FeatureStore

    copier = kernels.host_row_copier() if given_as.endswith("-host") else None
    if given_as.endswith("-host") and copier is None:
        pytest.skip("the host library is not built")

    gen = torch.Generator().manual_seed(0)
    store = FeatureStore(3, 16)
    given: list[dict[int, torch.Tensor]] = [{}, {}, {}]
    spans = [FeatureSpan(0, 0) for _ in range(3)]
    nxt = [5, 0, 40]
    for step in range(150):
        slots = [s for s in range(3) if torch.rand(1, generator=gen) < 0.7] or [1]
        starts, counts, rows = [], [], []
        for s in slots:
            n = int(torch.randint(1, 6, (1,), generator=gen)) if step % 17 else 21  # longer than the ring
            if torch.rand(1, generator=gen) < 0.05:
                nxt[s] += 3  # a gap: the window restarts
            feats = torch.randn(n, 4, generator=gen)
            starts.append(nxt[s])
            counts.append(n)
            rows.append(feats)
            if spans[s].end != nxt[s]:
                spans[s] = FeatureSpan(nxt[s], nxt[s])
                given[s] = {}
            given[s].update({nxt[s] + j: feats[j] for j in range(n)})
            spans[s].end += n
            spans[s].drop_before(spans[s].end - 16)
            if torch.rand(1, generator=gen) < 0.3:
                spans[s].drop_before(spans[s].start + int(torch.randint(0, 20, (1,), generator=gen)))
            nxt[s] += n
        table, index = torch.cat(rows), None
        if given_as.startswith("indexed"):  # the same rows, scattered in a larger table with other rows
            index = torch.randperm(table.shape[0] + 3, generator=gen)[:table.shape[0]]
            table, shuffled = torch.randn(table.shape[0] + 3, 4, generator=gen), table
            table[index] = shuffled
        store.write(slots, starts, counts, table, lambda t: t, index, copier)
        reads = [(s, spans[s].start, spans[s].end - 1) for s in range(3) if spans[s].end > spans[s].start]
        want = torch.stack([given[s][t] for s, lo, hi in reads for t in range(lo, hi + 1)])
        assert torch.equal(store.read(reads, lambda t: t), want)
        for s, lo, hi in reads:  # and any part of a window alone
            mid = (lo + hi) // 2
            assert torch.equal(store.read([(s, mid, hi)], lambda t: t),
                               torch.stack([given[s][t] for t in range(mid, hi + 1)]))
    # empty ranges (a count of 0, a window read from its end): no rows, wherever they fall in the ring
    assert store.read([(0, 16, 15), (1, 5, 4)], lambda t: t).shape == (0, 4)
    before = store.rows.clone()
    store.write([0, 1], [32, 7], [0, 0], torch.zeros(0, 4), lambda t: t)
    assert torch.equal(store.rows, before)
    with pytest.raises(ValueError, match="slot 3 is outside 0 .. 2"):
        store.write([3], [0], [1], torch.zeros(1, 4), lambda t: t)
    with pytest.raises(ValueError, match="2 feature rows for counts summing to 1"):
        store.write([0], [0], [1], torch.zeros(2, 4), lambda t: t)
