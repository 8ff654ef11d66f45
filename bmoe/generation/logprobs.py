"""Each generated token's log-probability and its likeliest alternatives, when a request asks (`logprobs`).

What they are: the log-softmax of the model's raw logits at the decode step the token was sampled
from, the same row the sampler read (before a grammar, a logit bias, penalties or temperature
change anything): the model's own distribution, as OpenAI's logprobs are. With `Request.post_sampling`
(llama-server's post_sampling_probs) the row is instead the sampler chain's log p after its last sampler
(bmoe.seam.llama.sample_kept), -inf for the tokens it dropped. Under greedy sampling
with none of those, the chosen token is the likeliest. Computed only for a request that asks: the
logits row is copied and log-softmaxed per token (one pass over the vocab), and nothing otherwise.

How tokens map to text, exactly:
- A token's `text` is the characters of the answer it completes: a token that ends inside a
  multi-byte UTF-8 character has "" and the token that completes it carries the whole character;
  `bytes` is always the token's own bytes. So the tokens' texts joined are the answer's text, and
  their bytes joined are its UTF-8 (a stop string aside). An alternative's `text` is its bytes
  decoded on their own (U+FFFD for a partial character).
- A stop string cuts the answer: the token where it begins keeps only its text before the cut, and
  the tokens after are left out (their text is not the answer's).
- `TokenSpans.release` hands a token out with the first chunk whose text completes it; `ContentTokens`
  keeps, of a chat answer read into reasoning, content and tool calls, the tokens of the content.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from bmoe.chat.output import Delta, Reading

TOP_LOGPROBS_MAX = 20  # OpenAI's bound on top_logprobs (and on the legacy completions' logprobs)


@dataclass(frozen=True)
class Alternative:
    """One of the likeliest tokens at a step."""

    id: int
    text: str  # its bytes decoded on their own
    bytes: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token: its log-probability, the likeliest tokens at its step, its place in the answer."""

    id: int
    text: str  # the characters of the answer it completes (see the module notes)
    bytes: bytes  # the token's own bytes
    logprob: float
    top: tuple[Alternative, ...]  # the `n` likeliest at its step, likeliest first
    offset: int  # characters of the answer's text before `text`


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p of every token from a raw logits row, in float64 (stable: the max is subtracted first)."""
    x = logits.astype(np.float64)
    x -= x.max()
    return x - np.log(np.exp(x).sum())


def top_ids(lp: np.ndarray, n: int) -> np.ndarray:
    """The ids of the n likeliest tokens, likeliest first (ties: the lower id first, as a greedy argmax)."""
    if n <= 0:
        return np.empty(0, dtype=np.int64)
    part = np.argpartition(-lp, n - 1)[:n] if n < lp.size else np.arange(lp.size)
    return part[np.lexsort((part, -lp[part]))]


class TokenSpans:
    """One answer's tokens with their log-probabilities, in the order they come, handed out once
    their text is the answer's (`release`)."""

    def __init__(self, n_top: int, piece: Callable[[int], bytes]) -> None:
        self.n_top = n_top
        self.piece = piece  # token id -> its bytes
        self.pending: list[TokenLogprob] = []

    def add(self, tok: int, raw: bytes, text: str, offset: int, logits: np.ndarray) -> None:
        """Token `tok` (its bytes `raw`) completed `text` at character `offset` of the answer; `logits`
        is the row it was sampled from."""
        lp = log_softmax(logits)
        top = tuple(Alternative(int(i), (b := self.piece(int(i))).decode("utf-8", "replace"), b, float(lp[i]))
                    for i in top_ids(lp, self.n_top))
        self.pending.append(TokenLogprob(tok, text, raw, float(lp[tok]), top, offset))

    def finish_text(self, text: str) -> None:
        """The answer ended inside a UTF-8 character: its replacement `text` is the last token's."""
        if text and self.pending:
            last = self.pending[-1]
            self.pending[-1] = replace(last, text=last.text + text)

    def release(self, sent: int, cut: int | None, final: bool = False) -> tuple[TokenLogprob, ...]:
        """The tokens whose text is now handed out: wholly within the first `sent` characters (a
        token with no text of its own waits for the one that completes its character); with a stop
        string at `cut`, every token that begins before it, its text cut there, and none after;
        `final`: every token left."""
        if cut is not None:
            n = sum(1 for t in self.pending if t.offset < cut)  # offsets only grow
        elif final:
            n = len(self.pending)
        else:
            n = 0
            for i, t in enumerate(self.pending):
                if t.text and t.offset + len(t.text) > sent:
                    break
                if t.text:
                    n = i + 1
        out = tuple(replace(t, text=t.text[:cut - t.offset]) if cut is not None and t.offset + len(t.text) > cut
                    else t for t in self.pending[:n])
        self.pending = [] if cut is not None else self.pending[n:]
        return out


class ContentTokens:
    """Of a chat answer read into reasoning, content and tool calls (bmoe.chat.output's deltas), the
    tokens whose text is content: each delta's pieces are found in the answer's text in order
    (reasoning, then content, then calls' arguments, each verbatim after the last), and a token is
    content where its text overlaps a content piece, its text cut to the overlap. A token is handed
    out once the deltas have passed its end; one with no content is left out."""

    def __init__(self) -> None:
        self.raw = ""  # the answer's text so far
        self.pos = 0  # how far into `raw` the deltas have been placed
        self.spans: list[tuple[int, int]] = []  # content's places in `raw`
        self.pending: list[TokenLogprob] = []

    def push(self, text: str, tokens: Sequence[TokenLogprob], d: Delta, final: bool = False) -> list[TokenLogprob]:
        """The answer's next `text` and its `tokens`, and the delta the reader made of it; the content's tokens
        that are settled now (`final`: all of them)."""
        self.raw += text
        self.pending.extend(tokens)
        self._place(d.reasoning)
        if d.content:
            at = self._place(d.content)
            self.spans.append((at, at + len(d.content)))
        for c in d.calls:
            self._place(c.arguments)
        out, keep = [], []
        for t in self.pending:
            end = t.offset + len(t.text)
            if not final and (end > self.pos or (end == t.offset and t.offset >= self.pos)):
                keep.append(t)
                continue
            part = "".join(self.raw[max(a, t.offset):min(b, end)] for a, b in self.spans if a < end and b > t.offset)
            if part or (not t.text and any(a <= t.offset < b for a, b in self.spans)):
                out.append(replace(t, text=part))
        self.pending = keep
        return out

    def _place(self, piece: str) -> int:
        """Where `piece` is in the answer, at or after the last piece placed (found verbatim)."""
        if not piece:
            return self.pos
        at = self.raw.find(piece, self.pos)
        at = self.pos if at < 0 else at
        self.pos = at + len(piece)
        return at


def content_logprobs(reading: Reading, pieces: Sequence[tuple[str, Sequence[TokenLogprob]]]) -> list[TokenLogprob]:
    """The content's tokens of a whole chat answer given as its chunks' (text, tokens), read as a
    stream reads them (so a whole answer's logprobs are its stream's)."""
    parser, content, out = reading.parser(), ContentTokens(), []
    for text, tokens in pieces:
        out += content.push(text, tokens, parser.push(text))
    out += content.push("", (), parser.finish(), final=True)
    return out
