"""Every request ends and returns its slot: faults injected in each phase, cancellation, abandoned streams,
submission while a step runs, interpreter exit. After each fault the engine serves the reference output."""

import asyncio
import subprocess
import sys
import threading
import textwrap
import time

import pytest

from echo_trtllm import LLM, EchoConfig, SamplingParams
from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_TARGET

PROMPTS = ["ROMEO:\nBut soft", "def main():\n    ", "To be, or not", "HAMLET:\n", "import os\n", "KING LEAR:\n",
           "class Parser:\n", "The quality of mercy"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SLOTS = 4


@pytest.fixture(scope="module")
def reference(default_pair):
    """Plain AR outputs of the target for PROMPTS."""
    target, _, tok = default_pair
    with LLM(target, tokenizer=tok, speculative_config=EchoConfig(policy="ar"), max_batch_size=SLOTS) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture
def engine(pair_llm):
    """ECHO without a cost model: every step drafts, so the draft side runs in every phase."""
    with pair_llm(speculative_config=EchoConfig(k_max=64, max_depth=4), max_batch_size=SLOTS, max_seq_len=256,
                  cost_model=None) as llm:
        yield llm


def is_prefill(batch) -> bool:
    return batch.logits_index is not None and batch.logits_index.numel() == 0


def is_tree(batch) -> bool:
    return batch.logits_index is None


def inject(module, when, times=1):
    """Make `module.forward` raise on its first `times` calls where when(batch) holds."""
    real = module.forward
    left = {"n": times}

    def forward(batch, cache):
        if when(batch) and left["n"] > 0:
            left["n"] -= 1
            raise RuntimeError("injected fault")
        return real(batch, cache)

    module.forward = forward
    return lambda: setattr(module, "forward", real)


def settle(handles):
    """Every handle's outcome: token ids, or the error text. None would mean a request never ended."""
    out = []
    for h in handles:
        try:
            out.append(h.result(timeout=120).token_ids)
        except RuntimeError as e:
            out.append(str(e))
    return out


def assert_healthy(llm, reference):
    ex = llm.executor
    assert sorted(ex.free_slots) == list(range(SLOTS)), "a KV slot was not returned"
    assert not ex.running and not ex.waiting
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference


@pytest.mark.parametrize("phase", ["prefill-target", "prefill-draft", "draft-level", "draft-root", "target-forward",
                                   "detokenise"])
def test_a_fault_in_any_phase_ends_every_request_and_returns_every_slot(engine, reference, phase):
    ex = engine.executor
    target, draft = ex.target, ex.drafter.model
    undo = {
        "prefill-target": lambda: inject(target, is_prefill),
        "prefill-draft": lambda: inject(draft, is_prefill),
        "draft-level": lambda: inject(draft, is_tree, times=3),
        "draft-root": lambda: inject(draft, lambda b: not is_prefill(b) and not is_tree(b)),
        "target-forward": lambda: inject(target, is_tree),
    }.get(phase)
    restore = undo() if undo else None
    if phase == "detokenise":
        tok = ex.tokenizer
        real, calls = tok.decode, {"n": 0}

        def decode(ids):
            calls["n"] += 1
            if calls["n"] == 5:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected fault")
            return real(ids)

        tok.decode = decode
        restore = lambda: setattr(tok, "decode", real)  # noqa: E731
    try:
        got = settle([engine.generate_async(p, GREEDY) for p in PROMPTS])
    finally:
        restore()
    failed = [i for i, g in enumerate(got) if isinstance(g, str)]
    for i, g in enumerate(got):
        if i not in failed:
            assert g == reference[i], f"request {i} finished with other tokens after a {phase} fault"
        else:
            assert "injected fault" in g and "failed" in g
    if phase in ("prefill-draft", "draft-level", "draft-root"):
        assert not failed, "a draft-side fault must fall back to AR, not fail requests"
        assert ex.failures, "the fault must have been contained (and counted)"
    elif phase == "detokenise":
        assert len(failed) == 1
    else:
        assert 1 <= len(failed) <= SLOTS, "the failing step's requests fail, the rest are served"
    assert_healthy(engine, reference)


def test_a_failed_prefill_leaves_nothing_behind_in_the_executor(default_pair):
    """Executor level: a request given a slot is running or finished with an error, never neither."""
    from echo_trtllm.runtime.executor import Executor

    target, draft, tok = default_pair
    ex = Executor(target, draft, tok, EchoConfig(k_max=32), max_batch_size=2, max_seq_len=128)
    restore = inject(target, is_prefill)
    reqs = [ex.make_request(p, GREEDY) for p in PROMPTS[:3]]
    for r in reqs:
        ex.submit(r)
    try:
        report = ex.step()
    finally:
        restore()
    assert [r.finish_reason for r in reqs[:2]] == ["error", "error"] and reqs[2].finish_reason is None
    assert [r.request_id for r in report.finished] == [r.request_id for r in reqs[:2]]
    assert sorted(ex.free_slots) == [0, 1]
    while ex.has_work:
        ex.step()
    assert reqs[2].finish_reason == "length" and sorted(ex.free_slots) == [0, 1]


def test_abort_by_handle_and_by_id_frees_the_slot(engine, reference):
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    a = engine.generate_async(PROMPTS[0], long, streaming=True)
    b = engine.generate_async(PROMPTS[1], long)
    first = next(iter(a))
    assert not first.finished
    a.abort()
    engine.abort(b.request_id)
    ra, rb = a.result(timeout=60), b.result(timeout=60)
    assert ra.finish_reason == rb.finish_reason == "abort"
    assert len(ra.token_ids) < 200 and len(rb.token_ids) < 200
    engine.abort(10**9)  # unknown ids are ignored
    a.abort()  # aborting a finished request is a no-op
    assert a.result().finish_reason == "abort"
    assert_healthy(engine, reference)


def test_an_abandoned_stream_is_aborted_sync_and_async(default_pair):
    """One slot: a stream the caller stops reading must not hold it until max_tokens."""
    target, draft, tok = default_pair
    with LLM(target, draft, tokenizer=tok, max_batch_size=1, max_seq_len=2048, cost_model=None) as llm:
        long = SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True)
        h = llm.generate_async("HAMLET:\n", long, streaming=True)
        for snap in h:
            if snap.token_ids:
                break
        out = llm.generate("ROMEO:\n", SamplingParams(max_tokens=4, temperature=0))
        assert len(out.token_ids) == 4
        assert h.result(timeout=60).finish_reason == "abort" and len(h.result().token_ids) < 1500

        async def abandon():
            ha = llm.generate_async("HAMLET:\n", long, streaming=True)
            async for snap in ha:
                if snap.token_ids:
                    break
            return ha

        ha = asyncio.run(abandon())
        assert ha.result(timeout=60).finish_reason == "abort" and len(ha.result().token_ids) < 1500
        assert llm.executor.free_slots == [0]


def test_submission_never_waits_for_a_step(engine):
    """While a step is inside the target's forward, generate_async returns (it only queues)."""
    ex = engine.executor
    real = ex.target.forward
    entered, release = threading.Event(), threading.Event()

    def slow(batch, cache):
        if is_tree(batch) and not release.is_set():
            entered.set()
            release.wait(60)
        return real(batch, cache)

    ex.target.forward = slow
    try:
        first = engine.generate_async(PROMPTS[0], GREEDY)
        assert entered.wait(60), "the step never started"
        submitted = []
        t = threading.Thread(target=lambda: submitted.append(engine.generate_async(PROMPTS[1], GREEDY)))
        t.start()
        t.join(timeout=30)
        assert submitted, "generate_async waited for the running step"
    finally:
        release.set()
        ex.target.forward = real
    assert len(first.result(timeout=60).token_ids) == len(submitted[0].result(timeout=60).token_ids) == 12


def test_a_finished_handle_replays_its_stream(engine):
    h = engine.generate_async(PROMPTS[2], GREEDY, streaming=True)
    once = [(s.text, s.token_ids, s.finished) for s in h]
    again = [(s.text, s.token_ids, s.finished) for s in h]
    assert once == again and once[-1][2] and len(once) >= 2

    async def collect():
        return [(s.text, s.token_ids, s.finished) async for s in h]

    assert asyncio.run(collect()) == once
    assert asyncio.run(h.aresult()).token_ids == once[-1][1]


def test_shutdown_ends_waiting_requests_with_an_error(default_pair):
    target, draft, tok = default_pair
    llm = LLM(target, draft, tokenizer=tok, max_batch_size=1, cost_model=None)
    handles = [llm.generate_async(p, SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)) for p in PROMPTS[:3]]
    llm.shutdown()
    for h in handles:
        with pytest.raises(RuntimeError):
            h.result(timeout=60)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("x")


def test_an_error_escaping_the_engine_thread_ends_every_request_instead_of_leaving_it_waiting(pair_llm):
    """The executor contains failures by phase; should something still escape the engine thread (here: the
    executor's own submit), every request it holds ends with the error and new work is refused."""
    llm = pair_llm(max_batch_size=2, max_seq_len=2048, cost_model=None)
    with llm:
        first = llm.generate_async(PROMPTS[0], SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True))
        deadline = time.monotonic() + 60
        while not llm.executor.running and time.monotonic() < deadline:  # the engine has taken `first`
            time.sleep(0.01)
        real = llm.executor.submit

        def broken(request):
            real(request)
            raise RuntimeError("injected: submit")

        llm.executor.submit = broken
        second = llm.generate_async(PROMPTS[1], GREEDY)
        for h in (first, second):
            with pytest.raises(RuntimeError, match="the engine stopped: RuntimeError: injected: submit"):
                h.result(timeout=60)
        with pytest.raises(RuntimeError, match="shut down"):
            llm.generate("x")


def test_abort_takes_request_ids_only(engine):
    h = engine.generate_async(PROMPTS[0], GREEDY)
    for bad in ([h.request_id], h, str(h.request_id), True):
        with pytest.raises(TypeError, match="request_id must be an int"):
            engine.abort(bad)
    assert h.result(timeout=60).finish_reason == "length"  # the engine went on
    assert sorted(engine.executor.free_slots) == list(range(SLOTS))


def test_an_llm_dropped_without_shutdown_stops_its_engine_thread(pair_llm):
    import gc

    llm = pair_llm(max_batch_size=1)
    loop = llm._loop
    handle = llm.generate_async(PROMPTS[0], SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True))
    del llm
    gc.collect()
    loop._thread.join(60)
    assert not loop._thread.is_alive()
    with pytest.raises(RuntimeError, match="shut down"):
        handle.result(timeout=1)


def test_interpreter_exit_with_requests_in_flight_is_clean():
    script = textwrap.dedent(f"""
        from echo_trtllm import LLM, SamplingParams
        llm = LLM({str(DEFAULT_TARGET)!r}, {str(DEFAULT_DRAFT)!r}, max_batch_size=4, dtype="float32")
        hs = [llm.generate_async("HAMLET:", SamplingParams(max_tokens=900, ignore_eos=True), streaming=True)
              for _ in range(6)]
        next(iter(hs[0]))
        print("exiting with requests in flight", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "exiting with requests in flight" in done.stdout
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr
