"""Stop strings found incrementally: a request's text grows at its end, step by step, so each step reads only the
characters it added (a Knuth-Morris-Pratt automaton per stop string), not the whole text once per stop.

The engine thread runs this for every request at every step, so its cost is what a client's stop strings impose
on everyone else's steps: the search costs O(new characters x stop strings) per step, whatever the strings' length
(which `SamplingParams` caps as well); checking that the text extends what was read is one comparison of the text
(C speed). The text itself is decoded a few tokens at a time (runtime/detok.py)."""

from __future__ import annotations

__all__ = ["StopMatcher"]


def _failure(s: str) -> list[int]:
    """fail[i]: the length of the longest proper prefix of s[: i + 1] that is also its suffix."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    """Where a request's stop strings occur in its text, and how much of the text's end may still become one.

    `feed(text)` takes the text so far (it must extend what was fed before; a text that does not is read again
    from its start) and returns the start of the earliest occurrence completed by the new characters (None: none).
    `hold` is the length of the longest end of the text that is a proper prefix of a stop string: what streaming
    withholds so that sent text is never taken back. After a hit the request ends: the matcher is not fed again
    (its state past the hit is not kept)."""

    def __init__(self, stops: list[str]) -> None:
        if not all(isinstance(s, str) and s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self.stops = list(stops)
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)  # per stop: characters of it matched at the text's end
        self._fed = ""

    def feed(self, text: str) -> int | None:
        if not text.startswith(self._fed):  # not an extension (a decoder that rewrote earlier text): start again
            self._state = [0] * len(self.stops)
            self._fed = ""
        begin, best = len(self._fed), None
        for j, (s, fail) in enumerate(zip(self.stops, self._fail)):
            k, n = self._state[j], len(s)
            for i in range(begin, len(text)):
                c = text[i]
                while k and s[k] != c:
                    k = fail[k - 1]
                if s[k] == c:
                    k += 1
                if k == n:  # this stop's first occurrence in the new part (an earlier one would have been found)
                    start = i + 1 - n
                    best = start if best is None else min(best, start)
                    k = fail[k - 1]
                    break
            self._state[j] = k
        self._fed = text
        return best

    @property
    def hold(self) -> int:
        return max(self._state, default=0)
