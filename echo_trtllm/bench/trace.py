"""Per-step acceptance traces and the hindsight oracle.

At temperature 0 a lossless run's output *is* the target's greedy continuation, so after the run we know, for
every drafted candidate of every step, whether the target would have accepted it: a node is accepted in
hindsight iff its token equals the output token at its depth and its parent is accepted (the root always is).

Oracle bound. For the same number of verified tokens K of a step, an allocator that knew the flags would spend
the step's K - B non-root slots on accepted chains: request i has an accepted chain of L_i nodes (capped by its
per-request tree limit, the deepest level and what was left of its output), so the oracle emits
B + min(K - B, sum_i L_i) tokens; summed over the run's steps, the method's emitted tokens over the oracle's is
the ratio. Two candidate sets:

- own (`mat_vs_own_oracle`): the nodes this method drafted. A method that verifies all it drafts scores 1.0, so
  this only says what the allocation threw away of its own drafts.
- wider (`mat_vs_oracle`): every position where *any* method of the same bench cell drafted the target's token
  (the drafter's tree as far as all methods together revealed it). Requests are matched by their slot in the cell
  (same prompt, same output) and only where a method's output equals the reference's; for a separate draft
  model a position is keyed by the output index (its distribution depends on the tokens before it only), for an
  EAGLE-3 head by (step position, depth) (deeper levels read the head's own features). A method that stopped
  drafting early or drafted narrowly now scores below 1.0 where another method showed the tokens were there.

Traces (for `echo_trtllm.bench.simulate`): one record per request and step — the candidates' path probabilities
in priority order with their hindsight flags, depths and parents (indices into the same order, -1 for a child of
the root: the drafted tree itself, which the simulator replays through the real gate and budget), the tokens
verified and emitted, and the drafted levels.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepEntry", "TraceRecorder", "hindsight_flags", "oracle_emitted", "reveal_key"]


@dataclass
class StepEntry:
    """One request in one step (candidate arrays exclude the root)."""

    request: int  # request id
    position: int  # output tokens the request had before the step
    tokens: list[int]
    parents: list[int]  # parent index among these candidates, -1 for a child of the root
    path_probs: list[float]
    depths: list[int]
    verified: int  # nodes verified, root included
    emitted: int  # tokens kept this step (accepted + bonus, cut at the end of generation)


def hindsight_flags(entry: StepEntry, output: list[int]) -> list[bool]:
    """For each candidate: would the target have accepted it (its path matches the output)?"""
    flags = []
    for tok, parent, depth in zip(entry.tokens, entry.parents, entry.depths):
        pos = entry.position + depth - 1
        ok = (parent < 0 or flags[parent]) and pos < len(output) and output[pos] == tok
        flags.append(ok)
    return flags


def oracle_emitted(chain_lengths: list[int], verified_total: int) -> int:
    """Tokens the hindsight allocator emits in one step with the same verified total (module docstring)."""
    b = len(chain_lengths)
    return b + min(max(verified_total - b, 0), sum(chain_lengths))


def reveal_key(slot: int, entry_position: int, depth: int, depth_keyed: bool) -> tuple[int, int, int]:
    """Where a drafted token on the output path is recorded (module docstring, wider candidate set)."""
    return (slot, entry_position, depth) if depth_keyed else (slot, entry_position + depth - 1, 0)


class TraceRecorder:
    """Collects StepEntry records from step reports; evaluates them once the outputs are final."""

    def __init__(self, per_request_cap: int, max_depth: int | None = None) -> None:
        self.cap = per_request_cap  # most non-root nodes one request may verify in a step
        self.max_depth = max_depth if max_depth is not None else per_request_cap
        self.steps: list[list[StepEntry]] = []

    def record(self, report) -> None:
        if report.draft is None or not report.batch_size:
            return
        cand = report.draft.candidates
        cu = cand.cu_num_nodes.tolist()
        tokens, parents = cand.token_ids.tolist(), cand.parents.tolist()
        probs, depths = cand.path_probs.float().tolist(), cand.depths.tolist()
        verified = report.draft.selected.num_nodes.tolist()
        step = []
        for i in range(report.batch_size):
            lo, hi = cu[i] + 1, cu[i + 1]  # skip the root (node cu[i])
            step.append(StepEntry(report.request_ids[i], report.positions[i], tokens[lo:hi],
                                  [p - 1 for p in parents[lo:hi]], probs[lo:hi], depths[lo:hi], verified[i],
                                  report.emitted[i]))
        self.steps.append(step)

    def reveals(self, outputs: dict[int, list[int]], slot_of: dict[int, int], depth_keyed: bool = False,
                slots: set[int] | None = None) -> set[tuple[int, int, int]]:
        """Keys of every output-path token this run drafted (in `slots` only, when given)."""
        out = set()
        for step in self.steps:
            for e in step:
                slot = slot_of[e.request]
                if slots is not None and slot not in slots:
                    continue
                for flag, depth in zip(hindsight_flags(e, outputs[e.request]), e.depths):
                    if flag:
                        out.add(reveal_key(slot, e.position, depth, depth_keyed))
        return out

    def evaluate(self, outputs: dict[int, list[int]], revealed: set | None = None,
                 slot_of: dict[int, int] | None = None, depth_keyed: bool = False) -> dict:
        """Oracle comparisons and per-request-step trace records. outputs: request id -> final output token ids
        (call after every request finished). revealed / slot_of: the wider candidate set (keys from `reveals`
        of every method of the cell) and this run's request -> slot; without them the wider oracle is the own
        one."""
        actual = oracle = own_oracle = 0
        records = []
        for step in self.steps:
            chains, wide, verified_total = [], [], 0
            for e in step:
                out = outputs[e.request]
                flags = hindsight_flags(e, out)
                left = len(out) - e.position  # tokens this request still had to produce
                limit = min(self.cap, self.max_depth, max(left - 1, 0))
                own = min(sum(flags), limit)
                chains.append(own)
                if revealed is not None and slot_of is not None:
                    slot, n = slot_of[e.request], 0
                    while n < limit and reveal_key(slot, e.position, n + 1, depth_keyed) in revealed:
                        n += 1
                    wide.append(max(n, own))
                else:
                    wide.append(own)
                verified_total += e.verified
                actual += e.emitted
                order = sorted(range(len(e.tokens)), key=lambda j: (-e.path_probs[j], e.depths[j], j))
                where = {j: i for i, j in enumerate(order)}
                records.append({"probs": [round(e.path_probs[j], 6) for j in order],
                                "accepted": [int(flags[j]) for j in order], "verified": e.verified,
                                "emitted": e.emitted, "levels": max(e.depths, default=0),
                                "depths": [e.depths[j] for j in order],
                                "parents": [where[e.parents[j]] if e.parents[j] >= 0 else -1 for j in order]})
            own_oracle += oracle_emitted(chains, verified_total)
            oracle += oracle_emitted(wide, verified_total)
        return {"emitted": actual, "oracle_emitted": oracle, "own_oracle_emitted": own_oracle,
                "mat_vs_oracle": actual / oracle if oracle else float("nan"),
                "mat_vs_own_oracle": actual / own_oracle if own_oracle else float("nan"), "records": records}
