"""Guessing ahead losslessly: n-gram drafts (`--draft ngram`; `--draft mtp`'s come from the model's MTP layer,
bmoe.engine.mtp), verified in one llama_decode, and the gate that turns drafting off when it does not pay.

After each step the engine drafts up to `--draft-max` tokens from the prompt and the text so far
(`NgramLookup`: llama.cpp's prompt lookup, examples/lookup with common/ngram-cache's context cache),
decodes the token it chose plus the drafts in one llama_decode (through the streaming engine, so a
layer reads the union of the group's experts once), samples each row in order with the sequence's own
sampler chain and keeps the longest prefix of drafts that agrees (`accepted`); the positions after it
leave the KV (llama_memory_seq_rm). Every token kept is one the chain sampled, in the order it would
have sampled them without drafts, so greedy and seeded sampling alike (penalties and grammars too)
give the text llama.cpp gives doing the same speculative work: the same drafts, the same verify
batches (tests/test_drafts.py runs this module's loop on llama-cpp-python's own context to show it).
Whether that also equals decoding one token at a time depends on ggml's CPU kernels giving a row of a
batch the logits they give the row alone (docs/levers.md says where it holds).

`DraftGate` times the verify steps against the steps without drafts and turns drafting off for a while
when it does not pay (its notes say how); `DraftReads` measures the extra bytes a verify group
made the expert cache read, through StreamingStops' `on_plan` hook.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

NGRAM_MIN, NGRAM_MAX = 1, 4  # llama.cpp's LLAMA_NGRAM_MIN and LLAMA_NGRAM_MAX (common/ngram-cache.h)
# llama.cpp's lax thresholds for its context cache, by n-gram size: the n-gram must have been seen followed by
# something at least this many times, the likeliest follower at least this share of them (draft_min_*_lax)
MIN_SEEN = (2, 2, 1, 1)
MIN_PERCENT = (66, 50, 50, 50)


class NgramLookup:
    """The n-grams (1 to 4 tokens) of one sequence's prompt and generated tokens, each with the tokens that
    followed it and how often: llama.cpp's context n-gram cache, bounded by the context (4 entries a token)."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        self.seen: dict[tuple[int, ...], dict[int, int]] = {}
        self.add(tokens)

    def add(self, tokens: Sequence[int]) -> None:
        """Tokens appended to the sequence (only ever appended, as llama.cpp's cache asks)."""
        for tok in tokens:
            i = len(self.tokens)
            self.tokens.append(tok)
            for n in range(NGRAM_MIN, min(NGRAM_MAX, i) + 1):
                after = self.seen.setdefault(tuple(self.tokens[i - n:i]), {})
                after[tok] = after.get(tok, 0) + 1

    def draft(self, n_max: int) -> list[int]:
        """Up to `n_max` tokens that likely come next (common_ngram_cache_draft with the context cache alone):
        token by token, the follower of the longest latest n-gram that passes its size's thresholds."""
        out: list[int] = []
        if len(self.tokens) < 2:  # LLAMA_NGRAM_STATIC: too little to go on
            return out
        while len(out) < n_max:
            recent = self.tokens[-NGRAM_MAX:] + out
            for n in range(min(NGRAM_MAX, len(recent)), NGRAM_MIN - 1, -1):
                after = self.seen.get(tuple(recent[-n:]))
                if not after:
                    continue
                best = max(after, key=after.__getitem__)  # ties: the follower seen first
                total = sum(after.values())
                if total >= MIN_SEEN[n - 1] and 100 * after[best] >= MIN_PERCENT[n - 1] * total:
                    out.append(best)
                    break
            else:
                break
        return out


def verify(group: Sequence[int], choose: Callable[[int], int], is_eog: Callable[[int], bool]) -> list[int]:
    """After one llama_decode of `group` (the token chosen last, then the drafts) with logits at every row:
    `choose(i)` samples row i (and accepts it in the chain); rows are sampled in order while each sampled
    token is the draft the next row was decoded with. Returns the tokens sampled: all but the last are the
    drafts accepted, the last is the token chosen next (not decoded yet), as one-token steps would have
    chosen them."""
    out: list[int] = []
    for i in range(len(group)):
        tok = choose(i)
        out.append(tok)
        if i + 1 == len(group) or tok != group[i + 1] or is_eog(tok):
            break
    return out


@dataclass
class DraftTally:
    """What drafting did over some verify steps."""

    steps: int = 0  # verify steps that carried drafts
    drafted: int = 0
    accepted: int = 0
    extra_bytes: int = 0  # read for experts only the drafted rows routed (DraftReads)

    def add(self, other: DraftTally) -> None:
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.extra_bytes += other.extra_bytes


class DraftGate:
    """Drafting on or off for one sequence, from the time it measures: seconds per generated token of its
    verify steps against those of its steps without drafts, on this machine, model and cache, now.

    Steps without drafts (nothing to draft, or the gate off) keep the baseline: the median seconds per token
    of those of the last FRESH tokens (at most KEEP), the first after a verify step left out (it pays for the
    reads the drafts' rows left undone or did for it); older ones are dropped, since a cache that fills or a
    text that changes moves what a token costs. Drafting is judged over a window of WINDOW verify steps: it
    stays on only where a token cost at least MARGIN less with drafts than without (drafts that only break
    even lose to the noise and to the windows that judge them). With fewer than PROBE fresh steps to compare
    with, the window's end turns drafting off for as long as measuring them takes. A window whose first SURE
    steps accepted nothing is judged at once (no draft paid for its row). Off, it stays off for a pause that
    starts at PAUSE tokens and doubles each time drafting loses again (up to PAUSE_MAX), then tries again
    with a fresh window: where drafts never pay, the windows that find it out grow rare; a window that pays
    resets the pause."""

    WINDOW = 6
    SURE = 3
    KEEP = 16
    FRESH = 96
    PROBE = 4
    MARGIN = 0.05
    PAUSE = 16
    PAUSE_MAX = 512

    def __init__(self) -> None:
        self.window = DraftTally()
        self.window_s = 0.0  # the window's verify steps' seconds and the tokens they generated
        self.window_tokens = 0
        self.tokens = 0  # generated so far
        self.plain: list[tuple[int, float]] = []  # (token count then, seconds per token) of steps without drafts
        self.after_verify = False  # the last step was a verify step
        self.pause = self.PAUSE  # the next off's length
        self.paused = 0  # tokens left before drafting tries again
        self.decisions: list[str] = []  # each "off for N tokens: why", in order (the run's notices)

    @property
    def on(self) -> bool:
        return self.paused == 0

    def plain_step(self, tokens: int, seconds: float) -> None:
        """A step without drafts generated `tokens` in `seconds`."""
        self.tokens += tokens
        if tokens and not self.after_verify:
            self.plain = [*self.plain[-(self.KEEP - 1):], (self.tokens, seconds / tokens)]
        self.after_verify = False
        self.paused = max(0, self.paused - tokens)

    def baseline(self) -> list[float]:
        """Seconds per token of the steps without drafts that are fresh enough to compare with."""
        return [per for at, per in self.plain if at > self.tokens - self.FRESH]

    def verify_step(self, step: DraftTally, tokens: int, seconds: float) -> None:
        """A verify step's figures, the tokens it generated and its seconds; at the end of a window, decide."""
        self.tokens += tokens
        self.after_verify = True
        w = self.window
        w.add(step)
        self.window_s += seconds
        self.window_tokens += tokens
        if w.accepted == 0 and w.steps >= self.SURE:
            self._off(f"{w.accepted} of {w.drafted} drafts accepted in {w.steps} verify steps", self.pause)
        elif w.steps >= self.WINDOW:
            per, fresh = self.window_s / self.window_tokens, sorted(self.baseline())
            base = fresh[len(fresh) // 2] if len(fresh) >= self.PROBE else None
            if base is None:
                self._off(f"measuring steps without drafts ({per * 1e3:.1f} ms a token with them)",
                          self.PROBE - len(fresh) + 1, grow=False)  # the first after a verify step is not counted
            elif per > base * (1 - self.MARGIN):
                self._off(f"{per * 1e3:.1f} ms a token with drafts ({w.accepted} of {w.drafted} accepted, "
                          f"{w.extra_bytes / max(w.accepted, 1) / 2**20:.2f} MiB extra per accepted token) "
                          f"against {base * 1e3:.1f} without", self.pause)
            else:
                self.pause = self.PAUSE
                self._fresh()

    def _off(self, why: str, tokens: int, grow: bool = True) -> None:
        self.paused = tokens
        self.decisions.append(f"off for {tokens} tokens: {why}")
        if grow:
            self.pause = min(2 * self.pause, self.PAUSE_MAX)
        self._fresh()

    def _fresh(self) -> None:
        self.window, self.window_s, self.window_tokens = DraftTally(), 0.0, 0


class Drafter:
    """One sequence's drafting: its n-gram lookup (None: the drafts are the MTP layer's, bmoe.engine.mtp) and its
    gate (None: `--no-draft-gate`); `notice` hears the gate's decisions."""

    def __init__(self, prompt: Sequence[int] | None, most: int, gated: bool,
                 notice: Callable[[str], None] = lambda s: None) -> None:
        self.lookup = None if prompt is None else NgramLookup(prompt)
        self.most = most
        self.gate = DraftGate() if gated else None
        self.notice = notice

    def room(self, left: int) -> int:
        """How many tokens to draft now: 0 while the gate is off, else `--draft-max` within `left` (the tokens
        the sequence may still generate, less one)."""
        if left <= 0 or (self.gate is not None and not self.gate.on):
            return 0
        return min(self.most, left)

    def propose(self, most: int) -> list[int]:
        """The n-gram lookup's drafts after the sequence's last token, `most` at most (none without a lookup: an MTP
        drafter's are the MTP context's, bmoe.engine.mtp)."""
        return self.lookup.draft(most) if self.lookup is not None and most else []

    def settle(self, step: DraftTally, tokens: int, seconds: float) -> None:
        """A step's figures (`step.steps` 0 when it carried no drafts), the tokens it generated, its seconds."""
        g = self.gate
        if g is None:
            return
        told = len(g.decisions)
        if step.steps:
            g.verify_step(step, tokens, seconds)
        else:
            g.plain_step(tokens, seconds)
        if len(g.decisions) > told:
            self.notice(f"draft gate: {g.decisions[-1]}")


class DraftReads:
    """StreamingStops' `on_plan` observer: of the reads a verify step's layers send, the bytes of experts
    that only the drafted rows routed (row 0 is the token chosen already: its experts are read anyway); of the
    decodes that make MTP drafts (bmoe.engine.mtp), every byte (no token would read them without drafts)."""

    def __init__(self, expert_bytes: Callable[[int], int]) -> None:
        self.expert_bytes = expert_bytes  # a region's bytes per expert
        self.verifying = False
        self.drafting = False
        self.extra = 0

    def begin(self, verifying: bool, drafting: bool = False) -> None:
        """Decodes start: a verify group's (its reads are sorted), the MTP layer's drafting (`drafting`: every
        read is extra) or another's (they are not counted)."""
        self.verifying, self.drafting = verifying or drafting, drafting
        self.extra = 0

    def take(self) -> int:
        """The extra bytes the decodes since `begin` read; counting stops."""
        self.verifying = False
        return self.extra

    def on_plan(self, layer: int, ids: np.ndarray, missing: Sequence[tuple[int, int, int]]) -> None:
        """The layer's routed ids (a row per token) and the slices (layer, region, expert) it reads now."""
        if not self.verifying or not missing:
            return
        chosen = set() if self.drafting else set(np.asarray(ids[:1]).ravel().tolist())
        self.extra += sum(self.expert_bytes(ri) for _, ri, e in missing if e not in chosen)
