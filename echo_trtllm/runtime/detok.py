"""A request's output text kept up to date as its tokens grow, decoding only a short window of tokens per step.

Decoding the whole output at every step costs O(output length) per request and step (O(n^2) over a request), which
the engine thread pays for every request in the batch; serving engines detokenize incrementally instead. This is
the same window technique: the text of tokens[:read] is kept (`stable`); each call decodes tokens[prefix:] and
tokens[prefix:read] (`prefix` a few tokens before `read`, so that a decoder that treats a text's first token
specially, e.g. SentencePiece's leading space, treats both alike), and the first's surplus over the second is the
text the new tokens add. The window moves on only when its text does not end in U+FFFD (half of a multi-byte
character: the next token may complete it); until then the half character is shown as the whole decode shows it.

`text(ids)` equals `decode(ids)` (the oracle, tests/runtime/test_detok.py, on the project's tokenizers); where
the window's text does not extend its head's (a decoder that rewrites earlier text), it decodes the whole output
once and starts its window again from there.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["IncrementalText"]

# tokens a half character may span at the end of a restart (a UTF-8 character is at most 4 bytes)
MAX_HALF = 4


class IncrementalText:
    """The text of a growing token list: `text(ids)` with ids extending those of the previous call (a list shorter
    than the tokens already read starts again; a list that replaces them is not detected: the executor only appends)."""

    __slots__ = ("_decode", "_prefix", "_read", "_stable", "_head", "full_decodes")

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._prefix = 0  # the window's start
        self._read = 0  # tokens whose text is in _stable
        self._stable = ""  # decode(ids[:_read])
        self._head = ""  # decode(ids[_prefix:_read])
        self.full_decodes = 0  # whole-output decodes (the fallback), for tests and profiles

    def text(self, ids: list[int]) -> str:
        n = len(ids)
        if n < self._read:  # not an extension of what was read: start again
            return self._restart(ids)
        window = self._decode(ids[self._prefix:])
        if not window.startswith(self._head):  # the decoder rewrote the window's start: decode it all once
            return self._restart(ids)
        text = self._stable + window[len(self._head):]
        if n > self._read:
            self._move(ids, window)
        return text

    def _move(self, ids: list[int], window: str) -> None:
        """The window moves on to the last token boundary with a whole character before it, up to MAX_HALF tokens
        before the end (a half character is at most that many tokens); a longer run of U+FFFD (stray bytes) is cut
        MAX_HALF tokens before the end where the text before and after decode apart. Its start moves to the old `read`
        unless the tokens between decode to nothing: a decoder's first-token rule (SentencePiece's leading space)
        must meet a token that shows."""
        end, text = len(ids), window
        while text.endswith("\ufffd"):
            end -= 1
            if end <= self._read:
                return
            text = self._decode(ids[self._prefix:end])
            if not text.startswith(self._head):
                return
            if end == len(ids) - MAX_HALF:  # a run of U+FFFD (stray bytes): cut where the two sides decode apart
                if text + self._decode(ids[end:]) != window:
                    return
                break
        self._stable += text[len(self._head):]
        head = self._decode(ids[self._read:end])
        if head:
            self._prefix, self._head = self._read, head
        else:  # tokens that show nothing (skipped special tokens) cannot start a window: its first word would lose
            self._head = self._decode(ids[self._prefix:end])  # its leading space under SentencePiece's rule
        self._read = end

    def _restart(self, ids: list[int]) -> str:
        """The whole decode; the window starts again from the first token and moves on from there."""
        self.full_decodes += 1
        text = self._decode(ids)
        self._prefix = self._read = 0
        self._stable = self._head = ""
        if ids:
            self._move(ids, text)
        return text
