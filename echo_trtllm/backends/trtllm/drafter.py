"""ECHO's chain proposer and its TensorRT-LLM 1.2 `Drafter` wrapper.

TensorRT-LLM 1.2 takes only linear drafts from a user-provided drafter (`request.py_draft_tokens`, one chain per
generation request) and pads them to `max_draft_len` for CUDA graphs. What of ECHO survives there: the step's
drafting loop with the echo policy restricted to chains (one child per node, one node per level): sparse
confidence gating at the calibrated depths and the elastic budget's global cut across the batch, so each request
gets its own chain length and the batch's drafts stay within K_max. What does not: trees (width), and the
compute saving of short chains when TensorRT-LLM pads every chain to `max_draft_len` for CUDA graphs (the padding
is verified too). A dynamic-tree mode (TensorRT-LLM's EAGLE `use_dynamic_tree`) is what ECHO's trees need.

The proposer is independent of TensorRT-LLM (its own tests run here); `make_drafter` subclasses TensorRT-LLM's
`Drafter` lazily.
"""

from __future__ import annotations

import torch

from echo_trtllm.backends.rows import chain_config, chains_of
from echo_trtllm.core import EchoConfig, draft_tree, make_policy
from echo_trtllm.models.llama import CausalLM
from echo_trtllm.runtime.inputs import sequence_logits

__all__ = ["EchoChainProposer", "make_drafter"]


class EchoChainProposer:
    """Chains for a batch of contexts: the echo drafting loop with width 1, a separate draft model scoring each
    frontier node over its whole context (stateless: no KV kept between steps, so it follows TensorRT-LLM's
    requests exactly, at the cost of re-reading the context each level)."""

    def __init__(self, draft: CausalLM, config: EchoConfig, max_draft_len: int) -> None:
        if not isinstance(draft, CausalLM):
            raise TypeError(f"draft must be a CausalLM (echo_trtllm.models), got {type(draft).__name__}")
        chain = chain_config(config, max_draft_len)
        self.config, self.policy = chain, make_policy(chain)
        self.draft, self.max_draft_len = draft, max_draft_len

    def propose(self, contexts: list[list[int]], budget: int | None = None) -> list[list[int]]:
        """One chain per context (lengths 0 .. max_draft_len), within `budget` draft tokens for the batch
        (default: the config's k_max less one root per request)."""
        if not contexts:
            return []
        roots = torch.tensor([c[-1] for c in contexts], dtype=torch.long)
        tails = [c[:-1] for c in contexts]
        # each level's nodes extend a path; keep the drafted tokens per request as the loop goes
        drafted: dict[int, list[int]] = {i: [] for i in range(len(contexts))}

        def draft_fn(level, frontier):
            probs = []
            for node in frontier.tolist():
                req = int(level.request_ids[node])
                ids = torch.tensor(tails[req] + [int(roots[req])] + drafted[req], dtype=torch.long)
                probs.append(torch.softmax(sequence_logits(self.draft, ids, "last").float()[-1], -1))
            out = torch.stack(probs)
            for node, row in zip(frontier.tolist(), out):
                drafted[int(level.request_ids[node])].append(int(row.argmax()))
            return out

        k = budget if budget is not None else self.config.k_max
        result = draft_tree(self.policy, roots, draft_fn, budget=k)
        return [[t for t, _ in chain] for chain in chains_of(result.selected, len(contexts), self.max_draft_len)]


def make_drafter(draft: CausalLM, config: EchoConfig | None = None, max_draft_len: int = 4):
    """A TensorRT-LLM 1.2 `Drafter` whose `prepare_draft_tokens` sets each generation request's `py_draft_tokens`
    to its ECHO chain, padded with the request's end id to `max_draft_len` (1.2 pads drafts for CUDA graphs).
    Needs tensorrt_llm (imported here, never by the package)."""
    try:
        from tensorrt_llm._torch.speculative.drafter import Drafter
    except ImportError as e:
        raise ImportError("make_drafter needs TensorRT-LLM 1.2 (pip install 'tensorrt_llm~=1.2.0' on a GPU machine); "
                          f"import failed: {e}") from None
    proposer = EchoChainProposer(draft, config or EchoConfig(), max_draft_len)

    class EchoDrafter(Drafter):
        def __init__(self) -> None:
            super().__init__(max_draft_len=max_draft_len, max_total_draft_tokens=max_draft_len)
            self.proposer = proposer

        def prepare_draft_tokens(self, scheduled_requests, resource_manager=None) -> None:
            requests = list(scheduled_requests.generation_requests)
            chains = self.proposer.propose([list(r.get_tokens(0)) for r in requests])
            for r, chain in zip(requests, chains):
                r.py_draft_tokens = chain + [r.py_end_id] * (max_draft_len - len(chain))

    return EchoDrafter()
