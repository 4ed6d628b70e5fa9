"""Tensor parallelism on CPU (gloo, two processes): the shard layout against the whole model's tensors, tp = 2
logits and greedy outputs (AR and ECHO, with a separate draft model or an EAGLE-3 head) against tp = 1 on the
default pair and on SmolLM2-135M (whose 3 KV heads split 2 + 1), per-rank weight memory, bad arguments refused
before any rank starts, and a dead rank (either side) ending the group with a clear error instead of a hang."""

import os
import subprocess
import sys
import time

import pytest
import torch

from echo_trtllm import LLM, EchoConfig, SamplingParams
from echo_trtllm.models import DEFAULT_DRAFT, DEFAULT_EAGLE3, DEFAULT_TARGET
from echo_trtllm.models.llama import ModelConfig
from echo_trtllm.models.loader import load_model
from echo_trtllm.models.tp import TensorParallel, check_shardable, load_shard, split
from echo_trtllm.runtime.inputs import sequence_logits

GREEDY = SamplingParams(max_tokens=24, temperature=0)
TP = dict(dtype="float32", cost_model=None, fallback=False, max_batch_size=4)


def _config(**over) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4,
                max_position_embeddings=2048, tie_word_embeddings=True, attention_bias=False)
    return ModelConfig(**{**base, **over})


def test_layout_splits_by_kv_group_and_pads_the_vocabulary():
    assert [split(10, 3, r) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    cfg = _config()  # SmolLM2-135M's attention: 9 query heads over 3 KV heads
    shards = [TensorParallel(r, 2).shard_config(cfg) for r in range(2)]
    assert [(s.num_attention_heads, s.num_key_value_heads) for s in shards] == [(6, 2), (3, 1)]
    assert sum(s.intermediate_size for s in shards) == 1536
    odd = _config(vocab_size=49153)
    tp1 = TensorParallel(1, 2)
    assert tp1.vocab_per_rank(odd) == 24577 and tp1.vocab(odd) == (24577, 49153)
    short = tp1.take("lm_head.weight", odd, torch.arange(49153.0)[:, None])
    assert short.shape == (24577, 1) and short[-1].item() == 0.0 and short[-2].item() == 49152.0
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        check_shardable(cfg, 4)


def test_shards_are_slices_of_the_whole_model():
    """Loading needs no collectives: both ranks' shards, put side by side, are the whole model's tensors."""
    full, _ = load_model(DEFAULT_TARGET, dtype="float32", with_tokenizer=False)
    shards = [load_shard(DEFAULT_TARGET, TensorParallel(r, 2), torch.float32, "cpu") for r in range(2)]
    f = full.state_dict()
    s = [m.state_dict() for m in shards]
    for name, dim in (("model.layers.0.self_attn.q_proj.weight", 0), ("model.layers.1.self_attn.k_proj.weight", 0),
                      ("model.layers.0.self_attn.o_proj.weight", 1), ("model.layers.0.mlp.up_proj.weight", 0),
                      ("model.layers.1.mlp.down_proj.weight", 1), ("model.embed_tokens.weight", 0),
                      ("lm_head.weight", 0)):
        assert torch.equal(torch.cat([s[0][name], s[1][name]], dim), f[name]), name
    assert torch.equal(s[0]["model.norm.weight"], f["model.norm.weight"])
    assert s[1]["model.layers.0.self_attn.k_proj.weight"].shape[0] == full.config.head_dim  # one KV head each


@pytest.fixture(scope="module")
def tp_echo():
    with LLM(DEFAULT_TARGET, DEFAULT_DRAFT, speculative_config=EchoConfig(policy="echo"), tensor_parallel_size=2,
             **TP) as llm:
        yield llm


@pytest.fixture(scope="module")
def tp1_ar_reference(prompts):
    with LLM(DEFAULT_TARGET, None, speculative_config=EchoConfig(policy="ar"), **TP) as llm:
        return [o.token_ids for o in llm.generate(prompts[:8], GREEDY, use_tqdm=False)]


def test_tp2_logits_equal_the_whole_model(tp_echo):
    """The leader's shard is the runtime's model: a forward through it runs on both ranks (mirrored) and gives the
    whole model's logits up to float32 summation order."""
    full, tok = load_model(DEFAULT_TARGET, dtype="float32")
    ids = torch.tensor(tok.encode("ROMEO:\nBut soft, what light through yonder window breaks?"))
    torch.testing.assert_close(sequence_logits(tp_echo.target, ids), sequence_logits(full, ids), rtol=0, atol=2e-5)


def test_tp2_echo_greedy_equals_tp1_ar(tp_echo, tp1_ar_reference, prompts):
    outs = tp_echo.generate(prompts[:8], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == tp1_ar_reference
    assert sum(o.stats.steps for o in outs) < sum(map(len, tp1_ar_reference)), "nothing was accepted"


def test_each_rank_holds_half_the_weights(tp_echo):
    from echo_trtllm.models.fp8 import weight_bytes

    stats = tp_echo.tensor_parallel_stats
    assert [s["rank"] for s in stats] == [0, 1]
    full = {"target": weight_bytes(load_model(DEFAULT_TARGET, dtype="float32", with_tokenizer=False)[0]),
            "draft": weight_bytes(load_model(DEFAULT_DRAFT, dtype="float32", with_tokenizer=False)[0])}
    for key, whole in full.items():
        parts = [s["weight_bytes"][key] for s in stats]
        assert all(abs(p / whole - 0.5) < 0.02 for p in parts), (key, parts, whole)


def test_one_tensor_parallel_llm_per_process(tp_echo):
    with pytest.raises(ValueError, match="already running in this process"):
        LLM(DEFAULT_TARGET, None, speculative_config=EchoConfig(policy="ar"), tensor_parallel_size=2, **TP)
    assert tp_echo.generate("HAMLET:\n", GREEDY, use_tqdm=False).finish_reason == "length"  # still serving


def test_tp2_ar_greedy_equals_tp1_ar(tp_echo, tp1_ar_reference, prompts):
    tp_echo.shutdown()  # one tensor-parallel LLM per process at a time (the fixture's is done here)
    with LLM(DEFAULT_TARGET, None, speculative_config=EchoConfig(policy="ar"), tensor_parallel_size=2, **TP) as llm:
        assert [o.token_ids for o in llm.generate(prompts[:8], GREEDY, use_tqdm=False)] == tp1_ar_reference


def test_tp2_with_an_eagle3_head_equals_tp1_ar_and_drafts_as_tp1_does(tp_echo, tp1_ar_reference, prompts):
    """The head is not sharded: rank 0 runs it whole on the features of the sharded target's forward, looking draft
    tokens up in its own copy of the target's embedding (the ranks' are vocabulary slices)."""
    tp_echo.shutdown()  # one tensor-parallel LLM per process at a time
    config = EchoConfig(policy="echo")
    with LLM(DEFAULT_TARGET, str(DEFAULT_EAGLE3), speculative_config=config, **TP) as llm:
        tp1 = llm.generate(prompts[:8], GREEDY, use_tqdm=False)
    with LLM(speculative_config=config, tensor_parallel_size=2, **TP) as llm:  # the default pair: target + head
        assert type(llm.draft).__name__ == "Eagle3Head"
        outs = llm.generate(prompts[:8], GREEDY, use_tqdm=False)
        stats = llm.tensor_parallel_stats
    assert [o.token_ids for o in outs] == tp1_ar_reference
    steps = [o.stats.steps for o in outs]
    assert sum(steps) < sum(map(len, tp1_ar_reference)), "nothing was accepted"
    # the same drafts as one process, features equal up to float32 summation order (a near tie at the gate may
    # still move a step): within 10 % of one process's steps (a permuted embedding took 1.6 x as many)
    assert abs(sum(steps) - sum(o.stats.steps for o in tp1)) <= 0.1 * sum(o.stats.steps for o in tp1), (
        steps, [o.stats.steps for o in tp1])
    assert [sorted(s["weight_bytes"]) for s in stats] == [["target"], ["target"]]  # the head is not on the ranks


def test_tp2_with_an_fp8_eagle3_head_equals_tp1_ar(tmp_path, tp_echo, tp1_ar_reference, prompts):
    """FP8 checkpoints are refused for the sharded models, not for a head: rank 0 loads it as one process does (here
    the draft of `build --quantization fp8`, beside the float target)."""
    from echo_trtllm.engine_build import build_engine
    from echo_trtllm.models.fp8 import Fp8Linear

    tp_echo.shutdown()  # one tensor-parallel LLM per process at a time
    out = build_engine(tmp_path / "e", DEFAULT_TARGET, DEFAULT_EAGLE3, EchoConfig(policy="echo"), "float32", "fp8",
                       "per_tensor", prompts[:4])
    with LLM(DEFAULT_TARGET, str(out / "draft"), speculative_config=EchoConfig(policy="echo"), tensor_parallel_size=2,
             **TP) as llm:
        assert isinstance(llm.draft.midlayer.mlp.down_proj, Fp8Linear)
        outs = llm.generate(prompts[:8], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == tp1_ar_reference
    assert sum(o.stats.steps for o in outs) < sum(map(len, tp1_ar_reference)), "nothing was accepted"


def test_the_whole_embedding_is_read_alone_and_a_shards_slice_is_refused_for_a_head():
    from echo_trtllm.models.eagle3 import load_eagle3
    from echo_trtllm.models.tp import load_embedding

    full, _ = load_model(DEFAULT_TARGET, dtype="float32", with_tokenizer=False)
    embed = load_embedding(DEFAULT_TARGET, torch.float32, "cpu")
    assert torch.equal(embed.weight, full.model.embed_tokens.weight)
    shard = load_shard(DEFAULT_TARGET, TensorParallel(0, 2), torch.float32, "cpu")
    with pytest.raises(ValueError, match="tensor-parallel shard's slice"):
        load_eagle3(DEFAULT_EAGLE3, shard)
    head = load_eagle3(DEFAULT_EAGLE3, shard, embed_tokens=embed)
    assert head.embed_tokens is embed


def test_smollm2_tp2_ar_and_echo_equal_tp1():
    """A real GGUF model whose 9 query / 3 KV heads do not split evenly: rank 0 holds 2 KV heads, rank 1 one."""
    from echo_trtllm.models.fetch import fetch

    path = str(fetch())
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(max_tokens=16, temperature=0)
    with LLM(path, None, speculative_config=EchoConfig(policy="ar"), **TP) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        from echo_trtllm.models.tp import load_embedding

        assert torch.equal(load_embedding(path, torch.float32, "cpu").weight, llm.target.model.embed_tokens.weight)
    with LLM(path, None, speculative_config=EchoConfig(policy="ar"), tensor_parallel_size=2, **TP) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
        stats = llm.tensor_parallel_stats
    weights = [s["weight_bytes"]["target"] for s in stats]
    assert weights[0] > weights[1] and 0.4 < weights[1] / sum(weights) < 0.5  # 2 + 1 KV heads, even MLP / vocab
    with LLM(path, path, speculative_config=EchoConfig(policy="echo", max_depth=3), tensor_parallel_size=2,
             **TP) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected


@pytest.mark.parametrize("kwargs, match", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be"),
    (dict(tensor_parallel_size=3), "num_key_value_heads=2"),
    (dict(model=DEFAULT_DRAFT, draft_model=str(DEFAULT_EAGLE3), tensor_parallel_size=2),
     "target features of width 256"),
])
def test_bad_tensor_parallel_arguments_are_refused_before_any_rank_starts(kwargs, match):
    kwargs = {"model": DEFAULT_TARGET, "draft_model": DEFAULT_DRAFT, **kwargs}
    with pytest.raises(ValueError, match=match):
        LLM(**kwargs, **TP)


def test_a_loaded_model_cannot_be_sharded(default_pair):
    target, draft, tok = default_pair
    with pytest.raises(ValueError, match="needs model as a path"):
        LLM(target, None, tokenizer=tok, speculative_config=EchoConfig(policy="ar"), tensor_parallel_size=2, **TP)


def test_a_dead_worker_ends_the_group_with_an_error_not_a_hang(prompts):
    llm = LLM(DEFAULT_TARGET, DEFAULT_DRAFT, speculative_config=EchoConfig(policy="echo"), tensor_parallel_size=2,
              **TP)
    try:
        assert llm.generate(prompts[0], GREEDY, use_tqdm=False).finish_reason == "length"
        llm._tp_group.processes[0].kill()
        for _ in range(2):  # the first failure ends the group; later requests fail at once
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match=r"tensor-parallel group failed \(rank 1 exited"):
                llm.generate(prompts[:4], GREEDY, use_tqdm=False)
            assert time.monotonic() - t0 < 60
    finally:
        llm.shutdown()


def test_a_stuck_worker_ends_the_group_after_the_timeout_not_a_hang(prompts, monkeypatch):
    """A worker that stops answering without closing its sockets (SIGSTOP: no peer-gone error to see): the leader's
    waits, the command group's included, end at ECHO_TP_TIMEOUT_S and the group fails with an error."""
    import signal

    from echo_trtllm.runtime import parallel

    monkeypatch.setattr(parallel, "TIMEOUT_S", 30.0)  # also the ranks' start-up rendezvous: room for a busy machine
    monkeypatch.setenv("ECHO_TP_TIMEOUT_S", "30")
    llm = LLM(DEFAULT_TARGET, DEFAULT_DRAFT, speculative_config=EchoConfig(policy="echo"), tensor_parallel_size=2,
              **TP)
    worker = llm._tp_group.processes[0]
    try:
        assert llm.generate(prompts[0], GREEDY, use_tqdm=False).finish_reason == "length"
        os.kill(worker.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"tensor-parallel group failed \(a rank is gone or stuck"):
            llm.generate(prompts[:4], GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 120  # the earlier code waited here for good
    finally:
        llm.shutdown()
        worker.kill()  # a stopped process ends on SIGKILL too
        worker.wait(timeout=30)


LEADER = """
import sys, time
from echo_trtllm import LLM, EchoConfig
llm = LLM(speculative_config=EchoConfig(policy="ar"), dtype="float32", cost_model=None, tensor_parallel_size=2)
print(llm._tp_group.processes[0].pid, flush=True)
time.sleep(600)
"""


def test_a_dead_leader_ends_its_workers():
    leader = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(leader.stdout.readline())
        leader.kill()
        leader.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                os.kill(worker, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            os.kill(worker, 9)
            pytest.fail("the worker outlived its leader by 60 s")
    finally:
        leader.kill()


@pytest.mark.parametrize("draft", ["eagle3", "draft model"])
def test_torchrun_launch_matches_tp1(tmp_path, draft):
    """`torchrun --nproc-per-node 2 -m echo_trtllm.cli generate --tp-size 2`: rank 1 serves rank 0 from inside
    LLM() and exits 0; rank 0 prints what a single process prints. With the default EAGLE-3 head rank 1 never loads
    the head; with the separate draft model every rank loads its shard."""
    args = ["generate", "--dtype", "float32", "--max-tokens", "16", "--prompt", "ROMEO:", "--prompt", "def f(x):",
            "--no-cost-model", "--fallback", "off"]
    args += ["--draft-model", str(DEFAULT_DRAFT)] if draft != "eagle3" else []
    single = subprocess.run([sys.executable, "-m", "echo_trtllm.cli", *args], capture_output=True, text=True,
                            timeout=180)
    assert single.returncode == 0, single.stderr
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "echo_trtllm.cli", *args, "--tp-size", "2"], capture_output=True, text=True,
                         timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    text = lambda out: [line for line in out.splitlines() if not line.startswith("policy=")]  # noqa: E731
    assert text(run.stdout) == text(single.stdout)


def test_stats_from_another_thread_wait_their_turn_with_the_engine(prompts):
    """The engine thread's mirrored calls and a caller's `tensor_parallel_stats` never interleave on the wire."""
    import threading

    with LLM(DEFAULT_TARGET, DEFAULT_DRAFT, speculative_config=EchoConfig(policy="echo"), tensor_parallel_size=2,
             **TP) as llm:
        handles = [llm.generate_async(p, GREEDY) for p in prompts[:4]]
        seen = []
        t = threading.Thread(target=lambda: [seen.append(llm.tensor_parallel_stats) for _ in range(20)])
        t.start()
        outs = [h.result() for h in handles]
        t.join(60)
    assert len(seen) == 20 and all(len(s) == 2 for s in seen)
    assert all(o.finish_reason == "length" for o in outs)


def test_a_failure_on_the_leader_inside_a_mirrored_call_ends_the_group(prompts, monkeypatch):
    """Rank 0 failing after the workers entered a forward leaves the ranks out of step: the group is ended with
    an error saying so instead of pairing the next command with the old collectives."""
    with LLM(DEFAULT_TARGET, None, speculative_config=EchoConfig(policy="ar"), tensor_parallel_size=2,
             **TP) as llm:
        calls = {"n": 0}
        real = llm.target._forward

        def flaky(*a, **k):
            calls["n"] += 1
            if calls["n"] == 3:
                raise MemoryError("injected")
            return real(*a, **k)

        monkeypatch.setattr(llm.target, "_forward", flaky)
        with pytest.raises(RuntimeError, match="injected"):
            for _ in range(3):
                llm.generate(prompts[:2], GREEDY, use_tqdm=False)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="out of step"):
            llm.generate(prompts[0], GREEDY, use_tqdm=False)
    assert time.monotonic() - t0 < 20  # the worker still waiting inside the old forward is ended, not waited for
