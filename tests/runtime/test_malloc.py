"""glibc's allocation thresholds (echo_trtllm.cpu.keep_freed_memory): a large block comes from fresh mapped pages
before the call and from the heap after it, in a fresh process (the thresholds are process-wide and glibc moves
them as blocks are freed, so the test's own process is no control), and for a thread started after it (the top pad);
the environment can leave them alone; and an executor on the CPU sets them."""

import os
import platform
import subprocess
import sys

import pytest
import torch

from echo_trtllm.core import EchoConfig
from echo_trtllm.runtime import executor as executor_mod

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's mallopt")

_PROBE = """
import ctypes, sys
from echo_trtllm.cpu import keep_freed_memory

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def in_heap(size):
    p = libc.malloc(size)
    with open("/proc/self/maps") as f:
        spans = [line.split()[0].split("-") for line in f if line.rstrip().endswith("[heap]")]
    inside = any(int(a, 16) <= p < int(b, 16) for a, b in spans)
    libc.free(p)
    return inside

before = in_heap(16 << 20)
kept = keep_freed_memory()
print(before, kept, in_heap(24 << 20), in_heap(256 << 20))
"""

# A thread started after the call (as the engine's is) holds three 24 MiB blocks (more than its arena's first 64 MiB
# heap), then frees the third and takes it again three times: the minor page faults of touching it each time.
# argv[1] "0" leaves glibc's top pad (cpu.TOP_PAD = 0: the thresholds alone).
_THREAD_PROBE = """
import ctypes, resource, sys, threading
import echo_trtllm.cpu as cpu

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
size, faults, out = 24 << 20, lambda: resource.getrusage(resource.RUSAGE_THREAD).ru_minflt, []
if sys.argv[1] == "0":
    cpu.TOP_PAD = 0
kept = cpu.keep_freed_memory()

def work():
    blocks = [libc.malloc(size) for _ in range(3)]
    for p in blocks:
        libc.memset(p, 1, size)
    for _ in range(3):
        libc.free(blocks[2])
        blocks[2] = libc.malloc(size)
        before = faults()
        libc.memset(blocks[2], 1, size)
        out.append(faults() - before > 1000)  # 24 MiB is 6,144 pages of 4 KiB

t = threading.Thread(target=work)
t.start()
t.join()
print(kept, *out)
"""


def _probe(env=None, code=_PROBE, args=()) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES", "LD_PRELOAD")}
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True,
                         env={**base, **(env or {})})
    return out.stdout.split()


def _huge_pages_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


def test_large_blocks_come_from_the_heap_once_kept():
    # a first 16 MiB block is mapped afresh by glibc's defaults (freeing it raises the threshold to 16 MiB: a 24 MiB
    # block is mapped afresh again), both come from the heap after the call; 256 MiB: above glibc's largest threshold
    # and more than the heap's free top (the 24 MiB block and the 64 MiB top pad)
    assert _probe() == ["False", "True", "True", "False"]


@pytest.mark.skipif(_huge_pages_always(), reason="transparent huge pages fault a thread's heap in by 2 MiB pages")
def test_a_threads_freed_heap_is_kept_once_kept():
    # the engine steps on its own thread: with the top pad at a heap its freed block is taken again without faults;
    # with the thresholds alone glibc unmaps the thread's second heap at every free, with its defaults once
    assert _probe(code=_THREAD_PROBE, args=["1"]) == ["True", "False", "False", "False"]
    assert _probe(code=_THREAD_PROBE, args=["0"]) == ["True", "True", "True", "True"]
    assert _probe({"ECHO_KEEP_FREED_MEMORY": "0"}, code=_THREAD_PROBE, args=["1"]) == ["False", "True", "False",
                                                                                "False"]


def test_the_environment_leaves_glibcs_defaults():
    assert _probe({"ECHO_KEEP_FREED_MEMORY": "0"}) == ["False", "False", "False", "False"]


def test_an_executor_on_the_cpu_keeps_freed_memory(default_pair, monkeypatch):
    target, _, tok = default_pair
    calls = []
    monkeypatch.setattr(executor_mod, "keep_freed_memory", lambda: calls.append(1) or True)
    executor_mod.Executor(target, None, tok, EchoConfig(policy="ar", k_max=4), max_batch_size=2, max_seq_len=64)
    assert calls == [1]


def test_heap_tokens_keeps_an_activation_within_the_largest_heap_block():
    from echo_trtllm.cpu import MMAP_THRESHOLD, heap_tokens

    row = 8960 * 2  # Qwen2.5-Coder-1.5B's MLP intermediate row in bfloat16
    assert heap_tokens(row, 2048) == MMAP_THRESHOLD // row == 1872 and 1872 * row <= MMAP_THRESHOLD < 1873 * row
    assert heap_tokens(row, 1024) == 1024 and heap_tokens(10**9, 2048) == 256 and heap_tokens(10**9, 100) == 100
    with pytest.raises(ValueError, match="row_bytes"):
        heap_tokens(0, 2048)


def test_prefill_runs_in_chunks_of_prefill_chunk_and_decodes_the_same(default_pair, prompts):
    """An executor's prefill chunks never exceed its prefill_chunk (the widest activation's heap limit on the CPU;
    forced small here), and greedy outputs equal those of prompts prefilled whole."""
    from echo_trtllm.cpu import heap_tokens
    from echo_trtllm.runtime.request import SamplingParams

    target, _, tok = default_pair
    outs = []
    for chunk in (None, 5):
        ex = executor_mod.Executor(target, None, tok, EchoConfig(policy="ar", k_max=4), max_batch_size=4,
                                   max_seq_len=256)
        widest = max(m.out_features for m in target.modules() if isinstance(m, torch.nn.Linear)
                     and m is not target.lm_head)  # the embedded target's linears are all nn.Linear
        assert ex.prefill_chunk == heap_tokens(widest * target.dtype.itemsize, ex.max_num_tokens)
        sizes = []
        run = ex._prefill_target
        ex._prefill_target = lambda group: sizes.append(sum(n for _, n in group)) or run(group)
        if chunk is not None:
            ex.prefill_chunk = chunk
        reqs = [ex.make_request(p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)) for p in prompts[:4]]
        for r in reqs:
            ex.submit(r)
        while ex.has_work:
            ex.step()
        assert max(sizes) <= (chunk or ex.max_num_tokens) and (chunk is None or len(sizes) > 4)
        outs.append([r.output_token_ids for r in reqs])
    assert outs[0] == outs[1]
