"""The draft model side of a step: the `draft_fn` the core's drafting loop calls, and the draft KV commit.

Draft KV layout of a request's slot: [0, draft_ctx) committed tokens; then, during a step, its pending chain
(tokens the draft has not seen yet, ending with the root) and after it a scratch area where every expanded tree
node's K/V is written in expansion order. A tree node attends the committed context, the pending chain and its
own expanded ancestors. After verification the accepted path's expanded nodes move down behind the chain
(`KVCache.compact`); accepted tokens the draft never expanded (leaves) and the bonus token become the next
step's pending chain.

Bounded catch-up: after a stretch of plain AR steps the pending chain holds every token since the draft last ran.
`begin(..., max_pending=W)` re-primes a request whose chain is longer than W: the draft restarts from the last W
tokens alone (`Request.draft_offset` tokens are dropped from its view, its positions start again at 0; RoPE
attention depends only on relative positions, so this is the draft prompted with that window). A probe after
1,000 AR steps then costs one draft forward over W tokens per request instead of 1,000. Draft positions are the
request's positions minus `draft_offset`.

Draft probabilities are the draft's softmax at temperature 1: they rank candidates (path probabilities), while
acceptance uses the target's processed distribution, so outputs stay lossless whatever the draft does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from echo_trtllm.core.tree import DraftLevel, SuperTree
from echo_trtllm.core.verify import VerifyResult
from echo_trtllm.models.llama import CausalLM, KVCache

from .clock import Clock, WallClock
from .inputs import chain_batch, make_batch
from .request import Request

__all__ = ["Drafter"]

STEADY_CHAIN = 2  # pending tokens per request in steady speculation: the bonus token and at most one leaf


class Drafter:
    def __init__(self, model: CausalLM, cache: KVCache, clock: Clock | None = None) -> None:
        self.model = model
        self.cache = cache
        self.clock = clock or WallClock(model.device)
        self._requests: list[Request] = []
        self.model_seconds = 0.0  # draft forward time of the current step (the rest of drafting is control)
        self.catch_up_seconds = 0.0  # part of it spent catching up after AR steps (see _expand_roots)

    # ---------------------------------------------------------------- per step

    def begin(self, requests: list[Request], max_pending: int | None = None) -> None:
        """Start a step. max_pending: re-prime requests whose pending chain is longer (module docstring)."""
        if max_pending is not None:
            for r in requests:
                if len(r.all_token_ids) - r.draft_offset - r.draft_ctx > max_pending:
                    r.draft_offset, r.draft_ctx = len(r.all_token_ids) - max_pending, 0
        self._requests = requests
        self.model_seconds = 0.0
        self.catch_up_seconds = 0.0
        b = len(requests)
        self._slots = torch.tensor([r.slot for r in requests], dtype=torch.long)
        self._root_pos = torch.tensor([len(r.all_token_ids) - 1 - r.draft_offset for r in requests], dtype=torch.long)
        self._next_free = self._root_pos + 1  # scratch starts right after the root
        self._expanded_root = torch.zeros(b, dtype=torch.bool)
        # Per drafted level: cache position of each node (-1: never expanded) and, for expanded nodes, the
        # positions it attends beyond the prefix (root .. itself), (M, D+1).
        self._level_pos: list[Tensor] = []
        self._level_visible: list[Tensor] = []

    def draft_fn(self, level: DraftLevel, frontier: Tensor) -> Tensor:
        """(F, V) draft distribution after each frontier node of `level`."""
        t0 = self.clock.now()
        if level.depth == 0:
            logits = self._expand_roots(frontier)
        else:
            logits = self._expand_nodes(level, frontier)
        probs = torch.softmax(logits, dim=-1).cpu()  # the drafting loop (host control plane) reads them
        self.model_seconds += self.clock.now() - t0
        return probs

    def _forward(self, batch) -> Tensor:
        with self.clock.forward("draft", batch.input_ids.numel()):
            return self.model(batch, self.cache)

    def _expand_roots(self, frontier: Tensor) -> Tensor:
        reqs = frontier.tolist()  # level 0: node index == request index
        chains = [torch.tensor(self._requests[i].all_token_ids[self._requests[i].draft_offset + self._requests[i].draft_ctx :])
                  for i in reqs]
        starts = torch.tensor([self._requests[i].draft_ctx for i in reqs], dtype=torch.long)
        t0 = self.clock.now()
        logits = self._forward(chain_batch(chains, starts, self._slots[frontier], logits="last"))
        # Steady speculation feeds the draft 1-2 pending tokens per request; a longer chain is catch-up after
        # AR steps (or a fresh prompt). Its share of this forward beyond STEADY_CHAIN tokens per request is a
        # one-off cost (estimated as proportional to tokens).
        tokens = sum(c.numel() for c in chains)
        steady = STEADY_CHAIN * len(chains)
        if tokens > steady:
            self.catch_up_seconds += (self.clock.now() - t0) * (1 - steady / tokens)
        b = len(self._requests)
        self._expanded_root[frontier] = True
        pos = torch.full((b,), -1, dtype=torch.long)
        pos[frontier] = self._root_pos[frontier]
        self._level_pos = [pos]
        self._level_visible = [pos[:, None].clone()]
        return logits

    def _expand_nodes(self, level: DraftLevel, frontier: Tensor) -> Tensor:
        # The frontier's parents were expanded by the previous call, so levels 0 .. depth-1 are recorded.
        req = level.request_ids[frontier]  # (F,) non-decreasing
        counts = torch.bincount(req, minlength=len(self._requests))
        rank = torch.arange(frontier.numel()) - (torch.cumsum(counts, 0) - counts)[req]
        pos = self._next_free[req] + rank  # (F,)
        self._next_free += counts
        parent_visible = self._level_visible[level.depth - 1][level.parent_ids[frontier]]  # (F, d)
        visible = torch.cat([parent_visible, pos[:, None]], dim=1)  # (F, d+1)
        reqs, token_request = torch.unique_consecutive(req, return_inverse=True)
        batch = make_batch(
            input_ids=level.token_ids[frontier],
            token_request=token_request,
            position_ids=self._root_pos[req] + level.depth,
            write_pos=pos,
            slots=self._slots[reqs],
            prefix_len=self._root_pos[reqs],
            visible=visible,
        )
        logits = self._forward(batch)
        full_pos = torch.full((level.num_nodes,), -1, dtype=torch.long)
        full_pos[frontier] = pos
        full_visible = torch.full((level.num_nodes, visible.shape[1]), -1, dtype=torch.long)
        full_visible[frontier] = visible
        self._level_pos.append(full_pos)
        self._level_visible.append(full_visible)
        return logits

    # ---------------------------------------------------------------- after verification

    def commit(self, selected: SuperTree, num_candidates: int, result: VerifyResult, keep: list[bool]) -> None:
        """Keep the accepted path's expanded nodes in the draft cache of every request with keep[b].

        num_candidates: nodes drafted this step; the deepest levels were never expanded and hold no position.
        The requests' draft_ctx moves only once the cache is compacted: if compaction fails, every request keeps
        its old draft_ctx, whose positions compaction never writes, and the next step catches up from there."""
        flat_pos = torch.full((num_candidates,), -1, dtype=torch.long)
        seen = torch.cat(self._level_pos) if self._level_pos else flat_pos[:0]
        flat_pos[: seen.numel()] = seen
        src, dst, slots, new_ctx = [], [], [], []
        for b, (req, nodes) in enumerate(zip(self._requests, result.node_lists())):
            if not keep[b] or not bool(self._expanded_root[b]):
                continue  # the draft saw nothing new of this request this step
            base = int(self._root_pos[b]) + 1  # the whole pending chain, root included, is now committed
            kept = 0
            for node in nodes[1:]:
                p = int(flat_pos[selected.source_index[node]])
                if p < 0:
                    break  # a leaf the draft never expanded: it goes to the next pending chain
                if p != base + kept:
                    src.append(p)
                    dst.append(base + kept)
                    slots.append(req.slot)
                kept += 1
            new_ctx.append((req, base + kept))
        if src:
            self.cache.compact(torch.tensor(slots), torch.tensor(src), torch.tensor(dst))
        for req, ctx in new_ctx:
            req.draft_ctx = ctx
