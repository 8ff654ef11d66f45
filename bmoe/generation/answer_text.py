"""An answer's text as its tokens come: a partial UTF-8 sequence held back until it completes
(`TextStream`), and the stop strings matched a character at a time, the text that could begin one
held back until the next piece decides (`StopStrings`).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class _StopStringMatcher:
    """One stop string, matched a character at a time (Knuth-Morris-Pratt): `state` is the length
    of the longest start of the string the text so far ends with. Each character costs amortised
    O(1), so a long stop string cannot make a token's text expensive to check."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.back = [0] * len(stop)  # back[i]: the longest proper start of stop[:i+1] that also ends it
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.back[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.back[i] = k
        self.state = 0

    def feed(self, ch: str) -> bool:
        """Take the next character; True when the stop string ends with it."""
        k, stop = self.state, self.stop
        while k and ch != stop[k]:
            k = self.back[k - 1]
        if ch == stop[k]:
            k += 1
        if k == len(stop):
            self.state = self.back[k - 1]
            return True
        self.state = k
        return False


class StopStrings:
    """The answer's text with the first of its stop strings and what follows cut off.

    Text that could be the start of a stop string is held back until the next piece decides.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.matchers = [_StopStringMatcher(s) for s in stop if s]
        self.raw = ""  # every piece so far
        self.sent = 0  # characters of `raw` handed out
        self.cut: int | None = None  # where the first stop string begins, once one appeared
        self.matched: str | None = None  # that stop string

    @property
    def text(self) -> str:
        return self.raw if self.cut is None else self.raw[:self.cut]

    def push(self, piece: str) -> str:
        """Add a piece; returns the text that can be handed out now."""
        if self.cut is not None:
            return ""
        start = len(self.raw)
        self.raw += piece
        # a stop string cannot begin in text handed out: its start would have been held back; of the
        # stop strings that appear in this piece, the one that begins first cuts
        for m in self.matchers:
            for i, ch in enumerate(piece):
                if m.feed(ch):
                    begins = start + i + 1 - len(m.stop)
                    if self.cut is None or begins < self.cut:
                        self.cut, self.matched = begins, m.stop
                    break
        if self.cut is not None:
            end = self.cut
        else:
            hold = max((m.state for m in self.matchers), default=0)
            end = max(self.sent, len(self.raw) - hold)
        out, self.sent = self.raw[self.sent:end], end
        return out

    def flush(self) -> str:
        """The generation ended: what was held back is the answer's after all."""
        if self.cut is not None:
            return ""
        out, self.sent = self.raw[self.sent:], len(self.raw)
        return out


class TextStream:
    """Token pieces → text, holding back a partial UTF-8 sequence until it completes."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, piece: bytes) -> str:
        return self._dec.decode(piece)

    def finish(self) -> str:
        return self._dec.decode(b"", final=True)
