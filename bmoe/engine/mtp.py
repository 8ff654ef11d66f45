"""`--draft mtp`: drafts from the model's own multi-token-prediction (NextN) layer, as llama.cpp's
draft-mtp makes them (common/speculative.cpp, `common_speculative_impl_draft_mtp` with one head).

The MTP layer runs in a context of its own on the same model (llama.cpp's MTP context type), which
follows the target's: after every decode of the target (a prompt's calls, a step, a verify group) it
decodes the same tokens at the same positions, each paired with the target's hidden state (h_nextn,
before the output norm) of the position before, the first with the one carried from the decode
before (`pending`; zeros for a new sequence). To draft, it decodes the token chosen last with the
carried state, takes its likeliest token (llama.cpp's top-k 10 draft chain, p_min 0) and decodes that
with its own hidden state, up to N times; then those positions leave its KV, and the verify group
decodes on the target and is followed as any decode is. Accepting k drafts carries the state of the
group's k-th row, and both contexts drop the positions after the kept tokens.

Every MTP decode goes through the engine's eval hook (`run`), so the MTP layer's experts are streamed
like the trunk's (bmoe.engine.load captures its graph with the target's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from bmoe.base.errors import ModelError
from bmoe.seam import llama

# runs one decode (returning its code and rows) on the MTP context under the engine's hook: the decode,
# its token count, and whether it is a prompt's (several tokens of one sequence that are no verify group)
Run = Callable[[Callable[[], tuple[int, list[int]]], int, bool], list[int]]


class MtpDrafts:
    """The MTP context's state per sequence: the hidden state carried to its next decode's first token and the
    rows of the last target decode it followed (what accepting drafts picks from)."""

    def __init__(self, ctx: llama.Context, model: llama.LlamaModel, vocab: llama.Vocab, run: Run) -> None:
        self.ctx, self.model, self.vocab, self.run = ctx, model, vocab, run
        self.zero = np.zeros(llama.n_embd_out(model), dtype=np.float32)
        self.pending: dict[int, np.ndarray] = {}
        self.followed: dict[int, np.ndarray] = {}

    def follow(self, target: llama.Context, parts: Sequence[tuple[int, Sequence[int], int]], prompt: bool) -> None:
        """After the target decoded `parts` (sequence, tokens, first position): the MTP context decodes them
        too (llama.cpp's `process`), each token with the target's hidden state of the position before."""
        n = sum(len(toks) for _, toks, _ in parts)
        h = llama.nextn_rows(target, self.model, range(n))
        at, fed = 0, []
        for seq, toks, pos in parts:
            rows = h[at:at + len(toks)]
            at += len(toks)
            fed.append((seq, toks, pos, np.vstack([self.pending.get(seq, self.zero)[None], rows[:-1]])))
            self.followed[seq], self.pending[seq] = rows, rows[-1]
        ctx = self.ctx
        self.run(lambda: llama.decode_mtp(ctx, fed, outputs=False), n, prompt)

    def draft(self, seq: int, last: int, pos: int, most: int) -> list[int]:
        """`most` drafts after `last` (the token chosen, at `pos`, not decoded yet); the MTP context's KV is
        as before afterwards (the drafts' positions are dropped, as llama-server drops them)."""
        out: list[int] = []
        h, tok, ctx = self.pending.get(seq, self.zero), last, self.ctx
        for i in range(most):
            row = self.run(partial(llama.decode_mtp, ctx, [(seq, [tok], pos + i, h[None])], outputs=True), 1,
                           False)[0]
            tok = int(np.argmax(llama.logits(ctx, self.vocab, row)))
            h = llama.nextn_rows(ctx, self.model, [row])[0]
            out.append(tok)
        self.cut(seq, pos)
        return out

    def accept(self, seq: int, kept: int, pos: int) -> None:
        """Of the verify group followed last (decoded from `pos`), the first `kept` tokens stay: the state of
        the last of them is carried, the positions after them leave the MTP context's KV."""
        self.pending[seq] = self.followed[seq][kept - 1]
        self.cut(seq, pos + kept)

    def cut(self, seq: int, n: int) -> None:
        """The MTP context's KV of `seq` from position `n` on leaves (as the target's does)."""
        if not llama.kv_cut(self.ctx, seq, n):
            raise ModelError("llama.cpp could not drop positions from its MTP context's KV")

    def clear(self, seq: int) -> None:
        """Sequence `seq` (-1: every one) starts afresh: an empty KV and no carried state."""
        llama.kv_clear(self.ctx, seq)
        for d in (self.pending, self.followed):
            if seq < 0:
                d.clear()
            else:
                d.pop(seq, None)
