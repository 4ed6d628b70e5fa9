"""ECHO as a TensorRT-LLM 1.2 user-provided drafter, contract-tested against a stand-in of 1.2's `Drafter`
(tests/backends/standin: its constructor and abstract method as 1.2 declares them) and stand-in requests with the
fields 1.2's drafters use (`get_tokens(0)`, `py_draft_tokens`, `py_end_id`). The chains are checked against the
draft model's own greedy continuation (an independent reference)."""

import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from echo_trtllm import EchoConfig
from echo_trtllm.backends.trtllm import EchoChainProposer, make_drafter
from echo_trtllm.runtime.inputs import chain_batch


@dataclass
class Request:  # the fields of 1.2's LlmRequest a drafter reads and writes
    tokens: list[int]
    py_end_id: int = 2
    py_draft_tokens: list[int] = field(default_factory=list)

    def get_tokens(self, beam: int) -> list[int]:
        assert beam == 0
        return self.tokens


@dataclass
class ScheduledRequests:
    generation_requests: list[Request]
    context_requests: list[Request] = field(default_factory=list)


@torch.no_grad()
def _greedy(draft, ids: list[int], n: int) -> list[int]:
    out = []
    for _ in range(n):
        seq = torch.tensor(ids + out)
        cache = draft.allocate_cache(1, seq.numel() + 1)
        batch = chain_batch([seq], torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
        out.append(int(draft(batch, cache)[-1].argmax()))
    return out


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "standin"))
    for name in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
        del sys.modules[name]  # the stand-in never outlives its test


def test_chains_are_the_drafts_greedy_prefixes_within_the_budget(default_pair, prompts):
    _, draft, tok = default_pair
    contexts = [tok.encode(p) for p in prompts[:6]]
    proposer = EchoChainProposer(draft, EchoConfig(policy="echo", max_depth=4), max_draft_len=4)
    chains = proposer.propose(contexts)
    assert len(chains) == 6 and all(len(c) <= 4 for c in chains)
    for ctx, chain in zip(contexts, chains):
        assert chain == _greedy(draft, ctx, 4)[: len(chain)]
    tight = proposer.propose(contexts, budget=8)  # K counts the roots: 6 roots + 2 drafts for the whole batch
    assert sum(map(len, tight)) <= 2


def test_make_drafter_fills_padded_drafts_through_the_1_2_interface(standin, default_pair, prompts):
    _, draft, tok = default_pair
    drafter = make_drafter(draft, EchoConfig(policy="echo", max_depth=3), max_draft_len=3)
    from tensorrt_llm._torch.speculative.drafter import Drafter

    assert isinstance(drafter, Drafter) and drafter.max_draft_len == 3
    reqs = [Request(tok.encode(p)) for p in prompts[:4]]
    drafter.prepare_draft_tokens(ScheduledRequests(reqs), resource_manager=None)
    for r in reqs:
        assert len(r.py_draft_tokens) == 3  # padded with py_end_id, as 1.2 pads for CUDA graphs
        real = [t for t in r.py_draft_tokens]
        n = len(real) - len([t for t in reversed(real) if t == r.py_end_id])
        assert real[:n] == _greedy(draft, r.tokens, 3)[:n]


def test_without_tensorrt_llm_the_error_says_what_to_install(default_pair, monkeypatch):
    for name in [m for m in sys.modules if m.startswith("tensorrt_llm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)
    _, draft, _ = default_pair
    with pytest.raises(ImportError, match="TensorRT-LLM 1.2"):
        make_drafter(draft)
    with pytest.raises(ValueError, match="max_draft_len"):
        EchoChainProposer(draft, EchoConfig(), max_draft_len=0)
