"""`--draft mtp`: drafts from the model's own multi-token-prediction (NextN) layer, as llama.cpp's
draft-mtp makes them (common/speculative.cpp, `common_speculative_impl_draft_mtp` with one head).

The MTP layer runs in a context of its own on the same model (llama.cpp's MTP context type), which
follows the target's: every decode of the target (a prompt's calls, a step, a verify group) is decoded
there too, the same tokens at the same positions, each paired with the target's hidden state (h_nextn,
before the output norm) of the position before, the first with the one carried from the decode before
(`pending`; zeros for a new sequence). To draft, it decodes the token chosen last with the carried
state, takes its likeliest token (llama.cpp's top-k 10 draft chain, p_min 0) and decodes that with its
own hidden state, up to N times; then those positions leave its KV, and the verify group decodes on the
target and is followed as any decode is. Accepting k drafts carries the state of the group's k-th row,
and both contexts drop the positions after the kept tokens.

Following is deferred until the next draft (`behind`): the target's states are copied at once (the next
decode overwrites them), the MTP context decodes them when it is next asked to draft. While the draft
gate has drafting off, nothing of the MTP layer runs or is read; the steps it missed are decoded
together when drafting resumes (in calls of its ubatch, which also bounds what waits: a full ubatch
is decoded at once). Where drafts are made every step, what waits is the last decode alone and it is
decoded whole, rejected drafts included, then cut: llama-server's work exactly.

Every MTP decode goes through the engine's eval hook (`run`), so the MTP layer's experts are streamed
like the trunk's (bmoe.engine.load captures its graph with the target's). A decode that follows the
target has no outputs: all it leaves is the KV of its positions, and the K and V of a single MTP block
are projections of each token's own input, computed before the block's attention and experts, whose
results only an output row would carry on. So where the model has one MTP block its experts are not
read for those decodes (the engine's `blind` layers: they compute on the spare slot's zeros, and no
row reads what they make); llama.cpp computes them and drops them (qwen35moe's graph_mtp). Only a draft
reads them: a verify group's follow, and the catch-up after a pause, read nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import pairwise

import numpy as np

from bmoe.base.errors import ModelError
from bmoe.seam import llama

# runs one decode (returning its code and rows) on the MTP context under the engine's hook: the decode,
# its token count, whether it is a prompt's (several tokens of one sequence that are no verify group) and
# whether it has outputs (a draft's)
Run = Callable[[Callable[[], tuple[int, list[int]]], int, bool, bool], list[int]]


@dataclass
class Behind:
    """A target decode of one sequence the MTP context has not decoded yet: its tokens from position `pos`, the
    hidden state each is paired with, whether it was a prompt's, and how many of its tokens stay (the rest were
    rejected drafts, cut since)."""

    tokens: list[int]
    pos: int
    states: np.ndarray
    prompt: bool
    keep: int


class MtpDrafts:
    """The MTP context's state per sequence: the hidden state carried to its next decode's first token, the rows of
    the last target decode it followed (what accepting drafts picks from) and the decodes it has yet to make."""

    def __init__(self, ctx: llama.Context, model: llama.LlamaModel, vocab: llama.Vocab, run: Run) -> None:
        self.ctx, self.model, self.vocab, self.run = ctx, model, vocab, run
        self.width = llama.ubatch_size(ctx)  # the most tokens one MTP decode takes, and the most left waiting
        self.zero = np.zeros(llama.n_embd_out(model), dtype=np.float32)
        self.pending: dict[int, np.ndarray] = {}
        self.followed: dict[int, np.ndarray] = {}
        self.behind: dict[int, list[Behind]] = {}

    def follow(self, target: llama.Context, parts: Sequence[tuple[int, Sequence[int], int]], prompt: bool) -> None:
        """After the target decoded `parts` (sequence, tokens, first position): its hidden states are kept for the
        MTP context to decode the same tokens (llama.cpp's `process`), each with the state of the position before,
        when it next drafts (or now, once a full ubatch waits)."""
        n = sum(len(toks) for _, toks, _ in parts)
        h = llama.nextn_rows(target, self.model, range(n))
        at = 0
        for seq, toks, pos in parts:
            rows = h[at:at + len(toks)]
            at += len(toks)
            states = np.vstack([self.pending.get(seq, self.zero)[None], rows[:-1]])
            self.behind.setdefault(seq, []).append(Behind(list(toks), pos, states, prompt, len(toks)))
            self.followed[seq], self.pending[seq] = rows, rows[-1]
        if sum(b.keep for waits in self.behind.values() for b in waits) >= self.width:
            for seq in list(self.behind):
                self.catch_up(seq)

    def catch_up(self, seq: int) -> None:
        """Decode what the target decoded for `seq` since the MTP context last did, in calls of its ubatch: each
        waiting decode's kept tokens, the last one whole (its rejected drafts then cut, as llama-server does)."""
        waits = self.behind.pop(seq, [])
        if not waits:
            return
        last = waits[-1]
        assert all(a.pos + a.keep == b.pos for a, b in pairwise(waits)), "the target decodes positions in order"
        toks = [t for b in waits[:-1] for t in b.tokens[:b.keep]] + last.tokens
        states = np.vstack([b.states[:b.keep] for b in waits[:-1]] + [last.states])
        pos = waits[0].pos
        prompt = len(waits) > 1 or last.prompt
        for i in range(0, len(toks), self.width):
            fed = [(seq, toks[i:i + self.width], pos + i, states[i:i + self.width])]
            self.run(partial(llama.decode_mtp, self.ctx, fed, outputs=False), len(fed[0][1]), prompt, False)
        if last.keep < len(last.tokens):
            self._cut_kv(seq, last.pos + last.keep)

    def draft(self, seq: int, last: int, pos: int, most: int) -> list[int]:
        """`most` drafts after `last` (the token chosen, at `pos`, not decoded yet); the MTP context's KV is
        as before afterwards (the drafts' positions are dropped, as llama-server drops them)."""
        self.catch_up(seq)
        out: list[int] = []
        h, tok, ctx = self.pending.get(seq, self.zero), last, self.ctx
        for i in range(most):
            row = self.run(partial(llama.decode_mtp, ctx, [(seq, [tok], pos + i, h[None])], outputs=True), 1,
                           False, True)[0]
            tok = int(np.argmax(llama.logits(ctx, self.vocab, row)))
            h = llama.nextn_rows(ctx, self.model, [row])[0]
            out.append(tok)
        self._cut_kv(seq, pos)
        return out

    def accept(self, seq: int, kept: int, pos: int) -> None:
        """Of the verify group followed last (decoded from `pos`), the first `kept` tokens stay: the state of
        the last of them is carried, the positions after them leave the MTP context's KV."""
        self.pending[seq] = self.followed[seq][kept - 1]
        self.cut(seq, pos + kept)

    def cut(self, seq: int, n: int) -> None:
        """The MTP context's KV of `seq` from position `n` on leaves (as the target's does), decoded or waiting."""
        waits = [b for b in self.behind.get(seq, []) if b.pos < n]
        for b in waits:
            b.keep = min(b.keep, n - b.pos)
        if waits:
            self.behind[seq] = waits
        else:
            self.behind.pop(seq, None)
        self._cut_kv(seq, n)

    def _cut_kv(self, seq: int, n: int) -> None:
        if not llama.kv_cut(self.ctx, seq, n):
            raise ModelError("llama.cpp could not drop positions from its MTP context's KV")

    def clear(self, seq: int) -> None:
        """Sequence `seq` (-1: every one) starts afresh: an empty KV and no carried state."""
        llama.kv_clear(self.ctx, seq)
        for d in (self.pending, self.followed, self.behind):
            if seq < 0:
                d.clear()
            else:
                d.pop(seq, None)
