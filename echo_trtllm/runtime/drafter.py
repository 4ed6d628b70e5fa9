"""The draft side of a step: the `draft_fn` the core's drafting loop calls, and what is kept after verification.

Two kinds of drafter, one tree bookkeeping:

    Drafter         a separate small draft model (same tokenizer), with its own KV cache
    Eagle3Drafter   an EAGLE-3 head: one decoder layer on the target's own hidden states (models/eagle3.py)

Draft KV layout of a request's slot: [0, draft_ctx) committed entries; then, during a step, its pending chain
(tokens the draft has not seen yet, ending with the root) and after it a scratch area where every expanded tree
node's K/V is written in expansion order. A tree node attends the committed context, the pending chain and its
own expanded ancestors.

Draft model. Entry p is token p. After verification the accepted path's expanded nodes move down behind the chain
(`KVCache.compact`); accepted tokens the draft never expanded (leaves) and the bonus token become the next step's
pending chain.

EAGLE-3 head. Entry p is token p + 1 read with the target's feature of token p (the head predicts the token after
its input, from the state the target had one token earlier); token 0 has no entry. Tree nodes are drafted from
the head's own output at their parent instead of a target feature, so after verification the head keeps only the
entries up to the root and the accepted drafts plus the bonus token become the next pending chain, read again with
the features the verification forward captured for them (SGLang's "draft extend"). The features of the tokens the
target has processed and the head has not read yet are kept in one ring per slot (`FeatureStore`); each request
holds its window's bounds (`Request.features`, a `FeatureSpan`).

Bounded catch-up: after a stretch of plain AR steps the pending chain holds every token since the draft last ran.
`begin(..., max_pending=W)` re-primes a request whose chain is longer than W: the draft restarts from the last W
tokens alone (`Request.draft_offset` tokens are dropped from its view, its positions start again at 0; RoPE
attention depends only on relative positions, so this is the draft prompted with that window). A probe after
1,000 AR steps then costs one draft forward over W tokens per request instead of 1,000. Draft positions are the
request's positions minus `draft_offset`. The head keeps at most `max_features` features per request and
re-primes from the oldest it has when its pending chain reaches further back.

Draft probabilities are the draft's softmax at temperature 1 (the head's over its reduced vocabulary, its top
tokens mapped to target ids through `d2t`): they rank candidates (path probabilities), while acceptance uses the
target's processed distribution, so outputs stay lossless whatever the draft does. They stay where the draft
runs: each level hands the drafting loop only the top `top_k` tokens per frontier node (`DraftTopK`, F x k), never
a vocabulary-sized row.
"""

from __future__ import annotations

import torch
from torch import Tensor

from echo_trtllm.core.policies import DraftResult
from echo_trtllm.core.tree import DraftLevel, DraftTopK
from echo_trtllm.core.verify import VerifyResult
from echo_trtllm.models.eagle3 import Eagle3Head
from echo_trtllm.models.llama import CausalLM, KVCache, as_dtype

from .clock import Clock, WallClock
from .inputs import chain_batch, level_batch, make_batch
from .transfer import HostLink
from .request import Request

__all__ = ["Drafter", "Eagle3Drafter", "FeatureSpan", "FeatureStore", "make_drafter"]

STEADY_CHAIN = 2  # pending tokens per request in steady speculation: the bonus token and at most one leaf
MAX_FEATURES = 512  # target features an EAGLE-3 drafter keeps per request (bounded catch-up)


class FeatureSpan:
    """A request's window of kept target features: those of tokens start, start + 1, ..., end - 1 (their rows are
    in the drafter's `FeatureStore`)."""

    __slots__ = ("start", "end")

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def drop_before(self, token: int) -> None:
        """Forget the features of tokens before `token` (the last one is always kept)."""
        self.start += max(0, min(token - self.start, self.end - self.start - 1))


class FeatureStore:
    """The target features an EAGLE-3 drafter keeps, of every slot in one tensor: slot s's feature of token t at
    row s * width + t % width (a ring of `width` tokens per slot). A step's new features of every request are
    written by one `index_copy_` and a forward's reads are one `index_select`, where a window per request cost a
    copy per request each way. A request's window (`FeatureSpan`) spans at most `width` tokens, so the rows it
    reads are its own; the rows are allocated at the first write (the features' width and dtype are the
    target's)."""

    def __init__(self, slots: int, width: int) -> None:
        if slots < 1 or width < 1:
            raise ValueError(f"FeatureStore needs slots and width >= 1, got {slots} and {width}")
        self.slots, self.width = slots, width
        self.rows: Tensor | None = None

    def _index(self, slot: int, first: int, last: int) -> range | list[int]:
        """Rows of tokens first .. last (inclusive) of a slot."""
        w = self.width
        if last < first:
            return range(0)
        base, lo, hi = slot * w, first % w, last % w
        if last - first < w and lo <= hi:  # no wrap
            return range(base + lo, base + hi + 1)
        return [base + t % w for t in range(first, last + 1)]

    def write(self, slots: list[int], starts: list[int], counts: list[int], feats: Tensor, send,
              rows: Tensor | None = None, copier=None) -> None:
        """feats (sum(counts), F), request-major: request i's rows are the features of tokens starts[i] ..
        starts[i] + counts[i] - 1 of slot slots[i]; of each, the last `width` are kept. send: host indices to the
        features' device. rows (sum(counts),) on the features' device: the tokens' rows are feats[rows] instead (the
        verification forward's rows of the accepted tokens). copier (`kernels.host_row_copier`): the rows copied in
        one call of the host library where both tables are on the CPU, else gathered and copied by torch."""
        total = sum(counts)
        if total != (feats.shape[0] if rows is None else rows.numel()):
            raise ValueError(f"FeatureStore.write: {feats.shape[0] if rows is None else rows.numel()} feature rows "
                             f"for counts summing to {total}")
        if self.rows is None:
            # zeros, not empty memory (a read is bounded by its window, so never reads a row before its write): the
            # pages are touched here, once, not at each step's first write into them, which at 16 rows of the Qwen
            # target cost a step 2-12 ms of page faults until every slot's ring had been written once
            # (docs/performance.md)
            self.rows = feats.new_zeros((self.slots * self.width, feats.shape[1]))
        dst: list[int] = []
        src: list[int] | None = None
        offset = 0
        for slot, start, n in zip(slots, starts, counts):
            if not 0 <= slot < self.slots:
                raise ValueError(f"FeatureStore.write: slot {slot} is outside 0 .. {self.slots - 1}")
            skip = max(0, n - self.width)
            if skip and src is None:
                src = list(range(offset))
            dst.extend(self._index(slot, start + skip, start + n - 1))
            if src is not None:
                src.extend(range(offset + skip, offset + n))
            offset += n
        if src is not None:  # the rows kept, of the tokens' rows
            kept = send(torch.tensor(src, dtype=torch.long))
            rows = kept if rows is None else rows[kept]
        if not dst:
            return
        dst = send(torch.tensor(dst, dtype=torch.long))
        if (copier is not None and feats.device.type == self.rows.device.type == "cpu" and feats.dim() == 2
                and feats.dtype == self.rows.dtype and feats.stride(1) == 1
                and (rows is None or rows.dtype == torch.long)):
            copier(self.rows, dst, feats, None if rows is None else rows.contiguous())
        else:
            self.rows.index_copy_(0, dst, feats if rows is None else feats[rows])

    def read(self, spans: list[tuple[int, int, int]], send) -> Tensor:
        """The features of tokens first .. last (inclusive) of each (slot, first, last), concatenated."""
        idx: list[int] = []
        for slot, first, last in spans:
            idx.extend(self._index(slot, first, last))
        return self.rows.index_select(0, send(torch.tensor(idx, dtype=torch.long)))


def make_drafter(draft: CausalLM | Eagle3Head, target: CausalLM, slots: int, capacity: int,
                 clock: Clock | None = None, max_depth: int = 8, link: HostLink | None = None) -> "Drafter":
    """The drafter for a draft model or an EAGLE-3 head of `target`, with a KV cache of `slots` x `capacity`;
    link: the executor's host <-> device ledger (default: its own)."""
    cache = draft.allocate_cache(slots, capacity)
    if isinstance(draft, Eagle3Head):
        layers = draft.config.capture_layers or target.eagle3_layers()
        return Eagle3Drafter(draft, cache, layers, clock, steady_chain=max_depth + 1, link=link)
    return Drafter(draft, cache, clock, link=link)


class Drafter:
    """A separate draft model (module docstring)."""

    # target layers whose inputs the executor captures for this drafter (none: a draft model reads tokens only)
    capture_layers: tuple[int, ...] = ()

    def __init__(self, model: CausalLM | Eagle3Head, cache: KVCache, clock: Clock | None = None,
                 steady_chain: int = STEADY_CHAIN, link: HostLink | None = None) -> None:
        self.model = model
        self.cache = cache
        self.clock = clock or WallClock(model.device)
        self.link = link or HostLink(model.device)
        self.steady_chain = steady_chain
        self._requests: list[Request] = []
        self.model_seconds = 0.0  # draft forward time of the current step (the rest of drafting is control)
        self.forward_tokens: list[int] = []  # tokens of each draft forward of the current step, in order
        self.catch_up_tokens = 0  # tokens of the level-0 forward beyond steady speculation's (see _expand_roots)

    # ---------------------------------------------------------------- per request, outside steps

    def prefill(self, group: list[tuple[Request, int]]) -> None:
        self.forward_tokens = []  # a prefill's forwards are no step's drafting
        self._prefill(group)

    def _prefill(self, group: list[tuple[Request, int]]) -> None:
        """Read a prefill chunk (n prompt tokens from each request's target_ctx) along with the target, for the
        requests whose draft is level with it (a failed draft prefill leaves a gap that the pending chain of
        their first speculative step fills)."""
        level = [(r, n) for r, n in group if r.draft_offset + r.draft_ctx == r.target_ctx]
        if not level:
            return
        chains = [torch.tensor(r.prompt_token_ids[r.target_ctx : r.target_ctx + n]) for r, n in level]
        starts = torch.tensor([r.target_ctx - r.draft_offset for r, _ in level])
        self._forward(chain_batch(chains, starts, torch.tensor([r.slot for r, _ in level]), logits="none"))
        for r, n in level:
            r.draft_ctx += n

    def observe(self, requests: list[Request], starts: list[int], counts: list[int], features: Tensor,
                rows: Tensor | None = None) -> None:
        """The target processed tokens starts[i] .. starts[i] + counts[i] - 1 of requests[i] with these features
        (rows, request-major; or features[rows], rows given on the features' device; EAGLE-3 only)."""

    def pending(self, r: Request) -> int:
        """Tokens of r the draft has not read yet (its root included)."""
        return r.num_tokens - r.draft_offset - r.draft_ctx

    def _root_position(self, r: Request) -> int:
        return r.num_tokens - 1 - r.draft_offset

    def catch_up(self, requests: list[Request], max_pending: int | None = None) -> int:
        """Tokens the next step's level-0 forward would read beyond steady speculation's (the draft catching up
        after plain steps), each request's chain bounded by max_pending as `begin` bounds it."""
        total = 0
        for r in requests:
            p = self.pending(r) if max_pending is None else min(self.pending(r), max_pending)
            total += max(0, p - self.steady_chain)
        return total

    # ---------------------------------------------------------------- per step

    def begin(self, requests: list[Request], top_k: int, max_pending: int | None = None) -> None:
        """Start a step. top_k: tokens per frontier node each level hands back (the policy's `max_children`);
        max_pending: re-prime requests whose pending chain is longer (module docstring)."""
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be a positive int, got {top_k!r}")
        self.top_k = top_k
        for r in requests:
            offset = self._window_start(r, max_pending)
            if offset is not None:
                r.draft_offset, r.draft_ctx = offset, 0
        self._requests = requests
        self.model_seconds = 0.0
        self.forward_tokens = []
        self.catch_up_tokens = 0
        b = len(requests)
        self._slots = torch.tensor([r.slot for r in requests], dtype=torch.long)
        self._root_pos = torch.tensor([self._root_position(r) for r in requests], dtype=torch.long)
        self._next_free = self._root_pos + 1  # scratch starts right after the root
        self._expanded_root = torch.zeros(b, dtype=torch.bool)
        # Per drafted level: cache position of each node (-1: never expanded) and, for expanded nodes, the
        # positions it attends beyond the prefix (root .. itself), (M, D+1).
        self._level_pos: list[Tensor] = []
        self._level_visible: list[Tensor] = []
        self._level_base: list[int] = []  # the batched loop's scratch offsets (expand_roots starts them)

    def _window_start(self, r: Request, max_pending: int | None) -> int | None:
        """Where r's draft restarts from (its new draft_offset), or None to go on from its draft_ctx."""
        if max_pending is not None and self.pending(r) > max_pending:
            return r.num_tokens - max_pending
        return None

    def draft_fn(self, level: DraftLevel, frontier: Tensor) -> DraftTopK:
        """The draft's top_k next tokens after each frontier node of `level`, chosen on the draft's device; only
        these (F, top_k) come back to the drafting loop (the host control plane)."""
        t0 = self.clock.now()
        if level.depth == 0:
            logits = self._expand_roots(frontier)
        else:
            logits = self._expand_nodes(level, frontier)
        top = DraftTopK(*self.link.read("draft top-k", *self._top_k(logits)))
        self.model_seconds += self.clock.now() - t0
        return top

    def _forward(self, batch, features: Tensor | None = None) -> Tensor:
        self.forward_tokens.append(int(batch.input_ids.numel()))
        batch.float_logits = False  # in the model's dtype: `_top_k` converts the rows it reads (as calibration times it)
        with self.clock.forward("draft", batch.input_ids.numel()):
            return self.model(batch, self.cache)

    def _top_k(self, logits: Tensor) -> DraftTopK:
        return DraftTopK.of(torch.softmax(as_dtype(logits, torch.float32), dim=-1), self.top_k)

    def _chains(self, reqs: list[int]) -> list[list[int]]:
        """Each request's pending chain (token ids; `chain_batch` makes one tensor of them all)."""
        return [r.token_ids(r.draft_offset + r.draft_ctx) for r in (self._requests[i] for i in reqs)]

    def _expand_roots(self, frontier: Tensor) -> Tensor:
        reqs = frontier.tolist()  # level 0: node index == request index
        chains = self._chains(reqs)
        starts = torch.tensor([self._requests[i].draft_ctx for i in reqs], dtype=torch.long)
        logits = self._forward_chains(reqs, chains, starts)
        # Steady speculation feeds the draft a few pending tokens per request; a longer chain is catch-up after
        # AR steps (or a fresh prompt): what this forward reads beyond steady_chain tokens per request
        tokens = sum(len(c) for c in chains)
        steady = self.steady_chain * len(chains)
        self.catch_up_tokens += max(tokens - steady, 0)
        b = len(self._requests)
        self._expanded_root[frontier] = True
        pos = torch.full((b,), -1, dtype=torch.long)
        pos[frontier] = self._root_pos[frontier]
        self._level_pos = [pos]
        self._level_visible = [pos[:, None].clone()]
        return logits

    def _forward_chains(self, reqs: list[int], chains: list[list[int]], starts: Tensor) -> Tensor:
        return self._forward(chain_batch(chains, starts, self._slots[reqs], logits="last"))

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
        logits = self._forward_nodes(batch, level, frontier)
        full_pos = torch.full((level.num_nodes,), -1, dtype=torch.long)
        full_pos[frontier] = pos
        full_visible = torch.full((level.num_nodes, visible.shape[1]), -1, dtype=torch.long)
        full_visible[frontier] = visible
        self._level_pos.append(full_pos)
        self._level_visible.append(full_visible)
        return logits

    def _forward_nodes(self, batch, level: DraftLevel, frontier: Tensor) -> Tensor:
        return self._forward(batch)

    # ---------------------------------------------------------------- whole levels (core.draft_tree_batched)

    def expand_roots(self, rows: Tensor) -> DraftTopK:
        """Level 0 of the batched loop: the rows' pending chains (as `draft_fn` at level 0); the top-k stays on the
        draft's device."""
        t0 = self.clock.now()
        logits = self._expand_roots(rows)
        self._rows = rows
        self._row_root = self.link.send("draft rows", self._root_pos[rows])  # (R,) root positions, on the device
        self._row_slots = self.link.send("draft rows", self._slots[rows])
        self._max_root = int(self._root_pos[rows].max())
        self._visible = self._row_root[:, None, None]  # (R, W, d): positions each frontier node sees past the prefix
        self._scratch = 0  # scratch positions used after the roots
        self._level_base: list[int] = []  # per expanded level d >= 1: scratch offset of its frontier's first slot
        top = self._top_k(logits)
        self.model_seconds += self.clock.now() - t0
        return top

    def expand_level(self, depth: int, tokens: Tensor, parents: Tensor) -> DraftTopK:
        """The (R, W) frontier at level depth - 1 in one fixed-shape forward: frontier slot w of row r is written at
        scratch position root + 1 + base + w and sees its parent's positions and its own."""
        t0 = self.clock.now()
        r, w = tokens.shape
        dev = tokens.device
        base = self._scratch
        self._scratch += w
        self._level_base.append(base)
        pos = self._row_root[:, None] + torch.arange(1 + base, 1 + base + w, device=dev)  # (R, W)
        e = self._visible.shape[2]
        visible = torch.cat([self._visible.gather(1, parents[..., None].expand(r, w, e)), pos[..., None]], dim=2)
        self._visible = visible
        batch = level_batch(tokens, (self._row_root + (depth - 1))[:, None].expand(r, w), pos, self._row_slots,
                            self._row_root, visible, self._max_root + 1 + self._scratch)
        top = self._top_k(self._forward_level(batch, parents))
        self.model_seconds += self.clock.now() - t0
        return DraftTopK(top.probs.reshape(r, w, -1), top.tokens.reshape(r, w, -1))

    def _forward_level(self, batch, parents: Tensor) -> Tensor:
        return self._forward(batch)

    def keep_rows(self, index: Tensor) -> None:
        on_dev = self.link.send("draft rows", index)
        self._rows = self._rows[index]
        self._max_root = int(self._root_pos[self._rows].max())
        self._keep_rows_on_device(on_dev)

    def _keep_rows_on_device(self, index: Tensor) -> None:
        """Per-row device state for the rows kept (index on the draft's device)."""
        self._row_root, self._row_slots, self._visible = self._row_root[index], self._row_slots[index], self._visible[index]

    def _node_positions(self, drafted: DraftResult) -> Tensor:
        """Draft cache position of every candidate (level-major, as `source_index` counts): where its K/V was
        written when it was expanded, -1 for nodes never expanded."""
        state, cand = drafted.state, drafted.candidates
        n = cand.total_nodes
        if state.frontier_slots is None:  # drafted level by level (draft_fn)
            flat = torch.full((n,), -1, dtype=torch.long)
            seen = torch.cat(self._level_pos) if self._level_pos else flat[:0]
            flat[: seen.numel()] = seen
            return flat
        slot = torch.cat(state.frontier_slots)[cand.source_index]  # request-major
        offset = torch.zeros(int(cand.depths.max()) + 1, dtype=torch.long)  # depth -> first position past the root
        for d, base in enumerate(self._level_base, start=1):
            if d < offset.numel():
                offset[d] = 1 + base
        pos = torch.where(slot >= 0, self._root_pos[cand.request_ids] + offset[cand.depths] + slot, -1)
        flat = torch.full((n,), -1, dtype=torch.long)
        flat[cand.source_index] = pos
        return flat

    # ---------------------------------------------------------------- after verification

    def commit(self, drafted: DraftResult, result: VerifyResult, keep: list[bool]) -> None:
        """Keep the accepted path's expanded nodes in the draft cache of every request with keep[b].

        The deepest levels were never expanded and hold no position. The requests' draft_ctx moves only once the
        cache is compacted: if compaction fails, every request keeps its old draft_ctx, whose positions compaction
        never writes, and the next step catches up from there."""
        # host lists read once (an element read of a tensor per request and node is a tensor operation each)
        node_pos = self._node_positions(drafted)[drafted.selected.source_index].tolist()
        expanded, root_pos = self._expanded_root.tolist(), self._root_pos.tolist()
        src, dst, slots, new_ctx = [], [], [], []
        for b, (req, nodes) in enumerate(zip(self._requests, result.node_lists())):
            if not keep[b] or not expanded[b]:
                continue  # the draft saw nothing new of this request this step
            base = root_pos[b] + 1  # the whole pending chain, root included, is now committed
            kept = 0
            for node in nodes[1:]:
                p = node_pos[node]
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


class Eagle3Drafter(Drafter):
    """An EAGLE-3 head (module docstring). Entry p of a request's head cache is token draft_offset + p + 1, read
    with the target feature of token draft_offset + p; the root's entry sits at position (tokens - 2 - offset)."""

    def __init__(self, model: Eagle3Head, cache: KVCache, capture_layers: tuple[int, ...],
                 clock: Clock | None = None, steady_chain: int = 9, max_features: int = MAX_FEATURES,
                 link: HostLink | None = None) -> None:
        super().__init__(model, cache, clock, steady_chain, link)
        self.capture_layers = tuple(capture_layers)
        self._store: FeatureStore | None = None
        self.max_features = max_features
        # the store's writes in one call of the host library (`kernels.host_row_copier`, installed by the executor
        # where the target runs on the CPU); None: torch's gather and index_copy_ (the same rows)
        self.row_copier = None

    @property
    def max_features(self) -> int:
        """Target features kept per request (the feature store's width)."""
        return self._store.width

    @max_features.setter
    def max_features(self, value: int) -> None:
        if self._store is not None and value == self._store.width:
            return
        if self._store is not None and self._store.rows is not None:
            raise ValueError("max_features cannot change once features are stored")
        self._store = FeatureStore(self.cache.keys[0].shape[0], value)

    # ---------------------------------------------------------------- features

    def observe(self, requests: list[Request], starts: list[int], counts: list[int], features: Tensor,
                rows: Tensor | None = None) -> None:
        """Store the target's features of tokens starts[i] .. starts[i] + counts[i] - 1 of requests[i] (features:
        their rows, request-major; or features[rows]). A window that does not continue (a gap left by a failure)
        restarts at the new tokens; at most max_features are kept, never dropping the ones the head still has to
        read unless the window is full. The rows are written first: a write that fails leaves every window as it
        was."""
        self._store.write([r.slot for r in requests], starts, counts, features,
                          lambda t: self.link.send("feature rows", t), rows, self.row_copier)
        for r, start, n in zip(requests, starts, counts):
            w = r.features
            if w is not None and w.end == start:
                w.end += n
            else:
                w = r.features = FeatureSpan(start, start + n)
            needed = r.draft_offset + r.draft_ctx  # the oldest feature the head will read
            w.drop_before(max(min(needed, w.end - 1), w.end - self.max_features))

    def _features(self, spans: list[tuple[Request, int, int]]) -> Tensor:
        """Features of tokens first .. last (inclusive) of each (request, first, last), concatenated."""
        return self._store.read([(r.slot, first, last) for r, first, last in spans],
                                lambda t: self.link.send("feature rows", t))

    def pending(self, r: Request) -> int:
        return r.num_tokens - 1 - r.draft_offset - r.draft_ctx

    def _root_position(self, r: Request) -> int:
        return r.num_tokens - 2 - r.draft_offset

    def _readable(self, r: Request) -> bool:
        """Whether the head can read r's root: the target's feature of the token before it is here."""
        last = r.num_tokens - 2
        return r.features is not None and r.features.start <= last < r.features.end

    def _window_start(self, r: Request, max_pending: int | None) -> int | None:
        start = super()._window_start(r, max_pending)
        if self._readable(r) and r.features.start > (r.draft_offset + r.draft_ctx if start is None else start):
            start = r.features.start  # the features it would need are gone: start from the oldest kept
        return start

    def begin(self, requests: list[Request], top_k: int, max_pending: int | None = None) -> None:
        super().begin(requests, top_k, max_pending)
        self._level_y: list[Tensor] = []
        self._read = torch.zeros(len(requests), dtype=torch.bool)  # requests whose root the head read

    # ---------------------------------------------------------------- the head's forwards

    def _prefill(self, group: list[tuple[Request, int]]) -> None:
        """Read the chunk's tokens up to the last one whose preceding feature the target has produced (the target
        has already run this chunk and `observe` stored its features)."""
        todo = []
        for r, n in group:
            last = r.target_ctx + n - 1  # the chunk's last token; its input feature is that of last - 1
            first = r.draft_offset + r.draft_ctx + 1
            if first <= last and r.features is not None and r.features.start <= first - 1 < r.features.end:
                todo.append((r, first, last))
        if not todo:
            return
        chains = [r.token_ids(first, last + 1) for r, first, last in todo]  # chain_batch makes one tensor
        feats = self._features([(r, first - 1, last - 1) for r, first, last in todo])
        starts = torch.tensor([r.draft_ctx for r, _, _ in todo])
        slots = torch.tensor([r.slot for r, _, _ in todo])
        self._forward(chain_batch(chains, starts, slots, logits="none"), feats)
        for r, first, last in todo:
            r.draft_ctx = last - r.draft_offset

    def _forward(self, batch, features: Tensor | None = None):
        self.forward_tokens.append(int(batch.input_ids.numel()))
        with self.clock.forward("draft", batch.input_ids.numel()):
            return self.model(batch, self.cache, features)

    def _top_k(self, logits: Tensor) -> DraftTopK:
        """Top-k over the draft vocabulary, mapped to target ids (no target-vocabulary row is built)."""
        top = super()._top_k(logits)
        return top._replace(tokens=self.model.to_target_ids(top.tokens))

    def _forward_chains(self, reqs: list[int], chains: list[list[int]], starts: Tensor) -> Tensor:
        """Level 0: each request's pending chain with the target features of the tokens before it. A request whose
        root has no feature (a one-token prompt at its first step) gets uniform logits and a zero output: its
        drafts are arbitrary and verification rejects them."""
        b, h = len(self._requests), self.model.config.layer.hidden_size
        logits = torch.zeros(len(reqs), self.model.config.draft_vocab_size, device=self.model.device)
        y_root = torch.zeros(b, h, dtype=self.model.dtype, device=self.model.device)
        ok = [k for k, i in enumerate(reqs) if self._readable(self._requests[i])]
        if ok:
            sub = [reqs[k] for k in ok]
            rs = [self._requests[i] for i in sub]
            feats = self._features([(r, r.draft_offset + r.draft_ctx, r.num_tokens - 2) for r in rs])
            out, y = self._forward(chain_batch([chains[k] for k in ok], starts[ok], self._slots[sub], logits="last"),
                                   feats)
            lengths = torch.tensor([len(chains[k]) for k in ok])
            send = self.link.send  # host indices cross without waiting (indexing with host ones waits there)
            y_root[send("draft rows", torch.tensor(sub))] = y[send("draft rows", torch.cumsum(lengths, 0) - 1)]
            logits[send("draft rows", torch.tensor(ok))] = out
            self._read[sub] = True
        self._level_y = [y_root]
        return logits

    def _chains(self, reqs: list[int]) -> list[list[int]]:
        # the pending chain: tokens offset + draft_ctx + 1 .. root (the first token of a window has no entry)
        return [r.token_ids(r.draft_offset + r.draft_ctx + 1) for r in (self._requests[i] for i in reqs)]

    def expand_roots(self, rows: Tensor) -> DraftTopK:
        top = super().expand_roots(rows)
        # the previous level's head outputs (B', W, h) and which of its rows each drafting row reads: rows that stop
        # drafting are dropped from this index, never copied out of the outputs (one gather per level reads them)
        self._y = self._level_y[0][:, None]  # (B, 1, h): every request's root output
        self._y_rows = self.link.send("draft rows", rows)
        return top

    def _forward_level(self, batch, parents: Tensor) -> Tensor:
        """Each frontier node reads its parent's head output in place of a target feature."""
        r, w = parents.shape
        slots, h = self._y.shape[1], self._y.shape[-1]
        flat = (self._y_rows[:, None] * slots + parents).reshape(-1)  # (R * W,) rows of the flattened outputs
        logits, y = self._forward(batch, self._y.reshape(-1, h).index_select(0, flat))
        self._y = y.reshape(r, w, h)
        self._y_rows = torch.arange(r, device=y.device)
        return logits

    def _keep_rows_on_device(self, index: Tensor) -> None:
        super()._keep_rows_on_device(index)
        self._y_rows = self._y_rows[index]

    def _forward_nodes(self, batch, level: DraftLevel, frontier: Tensor) -> Tensor:
        """Level d: each frontier node reads its parent's head output in place of a target feature."""
        parents = level.parent_ids[frontier]
        logits, y = self._forward(batch, self._level_y[level.depth - 1][parents.to(self.model.device)])
        full_y = torch.zeros(level.num_nodes, y.shape[-1], dtype=y.dtype, device=y.device)
        full_y[frontier.to(y.device)] = y
        self._level_y.append(full_y)
        return logits

    # ---------------------------------------------------------------- after verification

    def commit(self, drafted: DraftResult, result: VerifyResult, keep: list[bool]) -> None:
        """Keep the head's entries up to the root; the accepted drafts and the bonus token are read next step with
        the target's features (module docstring)."""
        read, root_pos = self._read.tolist(), self._root_pos.tolist()
        for b, req in enumerate(self._requests):
            if keep[b] and read[b]:
                req.draft_ctx = root_pos[b] + 1
        self._level_y = []
