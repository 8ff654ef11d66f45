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

`DraftGate` times stretches of tokens with drafts against stretches without and turns drafting off for a
while when it does not pay (its notes say how); `DraftReads` measures the extra bytes a verify group
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
    extra_bytes: int = 0  # read for experts only the drafted rows routed, or to make MTP drafts (DraftReads)
    guesses: int = 0  # drafts made while the gate guesses: checked against the token chosen next, not verified
    right: int = 0  # of them, the token chosen

    def add(self, other: DraftTally) -> None:
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.extra_bytes += other.extra_bytes
        self.guesses += other.guesses
        self.right += other.right


class DraftGate:
    """Drafting on or off for one sequence, from the time it measures over stretches of tokens: seconds per
    generated token with drafting on against without, on this machine, model and cache, now.

    Before a drafted stretch, unless the one before it paid, the gate guesses: a draft of one token is made after
    each chosen token and checked against the token chosen next, without a verify decode (the n-gram lookup's cost
    nothing; the MTP layer's, one decode of its layer), until GUESS were made. Where half or fewer were right,
    drafting stays off for the pause without paying for a verify group (at one in two right, drafts of any width
    yield under 2 tokens a verify step, which pays only where a drafted row costs under half a token's time; on the
    64-expert demo a row costs 0.7 of one, bench/reports/2026-12-06-verify-width). On Qwen3.6-35B-A3B's shape under
    4000 MiB, one verify step of 2 rejected drafts read 1.1 GB, 3 % of a 64-token run at 700 MiB/s
    (bench/reports/2026-12-06-drafts-mtp-q36).

    A stretch, not a step, is what drafting costs: under a memory limit a verify group's drafted rows bring in
    experts that evict ones later tokens need, so the price of a verify step lands on the steps after it (the
    8-expert demo under 2500 MiB read 25 % more a token while drafting, and its verify steps looked cheaper per
    token than the run's average token; bench/reports/2026-12-06-drafts-gate). So the gate runs in cycles: drafting
    on for a stretch (`on_for` tokens, every step of it counted, with drafts or without), then off, its first SETTLE
    tokens charged to the drafted stretch (they pay for what it did to the cache) and the next MEASURE tokens the
    baseline; then it judges: drafting pays where a token cost at least MARGIN less over the drafted stretch and its
    settling than over the baseline (drafts that only break even lose to the noise; a stretch whose drafts were
    all rejected never pays, however fast it ran). Paying, the next drafted
    stretch is twice as long (up to LONGEST) and starts at once; not paying, drafting stays off for a pause
    that starts at PAUSE tokens and doubles each time it loses again (up to LONGEST), then the gate guesses and a
    drafted stretch of SHORTEST tries again. A stretch whose first SURE verify steps accepted nothing is judged at
    once (no draft paid for its row); the first such step is enough where its drafts made the cache read
    (`extra_bytes`: a rejected draft's experts are read for nothing and evict others; on Qwen3.6-35B-A3B's shape
    with a 2000 MiB cache one verify step of 2 drafts read about 1 GB for them). Each decision is a line in
    `decisions`: where drafts never pay, the stretches that find it out grow rare; where they do, the baselines
    that check it."""

    GUESS = 8
    SHORTEST = 16
    SETTLE = 8
    MEASURE = 16
    SURE = 3
    MARGIN = 0.05
    PAUSE = 64
    LONGEST = 512

    def __init__(self) -> None:
        self.stage = "guess"  # "guess", "on" (drafting), "settle", "measure" (the baseline), "pause" (off)
        self.left = self.GUESS  # tokens left in the stage (guesses, while it guesses)
        self.on_for, self.pause = self.SHORTEST, self.PAUSE  # the next drafted stretch's and the next pause's length
        self.drafts = DraftTally()  # the drafted stretch's
        self.drafted_tokens, self.drafted_s = 0, 0.0  # of the drafted stretch and its settling
        self.base_tokens, self.base_s = 0, 0.0  # of the baseline
        self.decisions: list[str] = []  # each "off for N tokens: why" or "on for N tokens: why", in order

    @property
    def on(self) -> bool:
        return self.stage == "on"

    @property
    def guessing(self) -> bool:
        return self.stage == "guess"

    def step(self, drafts: DraftTally, tokens: int, seconds: float) -> None:
        """A step's figures (`drafts.steps` 0 when it carried no drafts), the tokens it generated, its seconds."""
        self.left -= drafts.guesses if self.stage == "guess" else tokens
        if self.stage in ("on", "settle"):
            self.drafted_tokens += tokens
            self.drafted_s += seconds
        elif self.stage == "measure":
            self.base_tokens += tokens
            self.base_s += seconds
        elif self.stage == "guess":
            self.drafts.add(drafts)
        if self.stage == "on":
            d = self.drafts
            d.add(drafts)
            if d.accepted == 0 and d.steps and (d.steps >= self.SURE or d.extra_bytes):
                read = f", {d.extra_bytes / 2**20:.2f} MiB read for them" if d.extra_bytes else ""
                self._lost(f"{d.accepted} of {d.drafted} drafts accepted in {d.steps} verify steps{read}", self.SETTLE)
                return
        if self.left > 0:
            return
        if self.stage == "guess":
            self._guessed()
        elif self.stage == "on":
            self._next("settle", self.SETTLE)
        elif self.stage == "settle":
            self._next("measure", self.MEASURE)
        elif self.stage == "measure":
            self._judge()
        else:
            self._next("guess", self.GUESS)
            self.drafts = DraftTally()

    def _guessed(self) -> None:
        d = self.drafts
        why = f"{d.right} of {d.guesses} guesses right (checked against the token chosen next, not verified)"
        if d.guesses and 2 * d.right <= d.guesses:
            self._lost(why, 0)
            return
        self.decisions.append(f"on for {self.on_for} tokens: {why}")
        self._start()

    def _judge(self) -> None:
        d = self.drafts
        per, base = self.drafted_s / max(self.drafted_tokens, 1), self.base_s / max(self.base_tokens, 1)
        why = (f"{per * 1e3:.1f} ms a token over {self.drafted_tokens} tokens with drafts and after ({d.accepted} of "
               f"{d.drafted} accepted, {d.extra_bytes / max(d.accepted, 1) / 2**20:.2f} MiB extra per accepted token) "
               f"against {base * 1e3:.1f} over {self.base_tokens} without")
        if d.accepted == 0 or per > base * (1 - self.MARGIN):  # no draft paid for its row: noise if faster
            self._lost(why, 0)
            return
        self.on_for, self.pause = min(2 * self.on_for, self.LONGEST), self.PAUSE
        self.decisions.append(f"on for {self.on_for} tokens: {why}")
        self._start()

    def _lost(self, why: str, settle: int) -> None:
        """Drafting did not pay: off for `settle` tokens (their time not counted) and the pause."""
        self.decisions.append(f"off for {settle + self.pause} tokens: {why}")
        self._next("pause", settle + self.pause)
        self.on_for, self.pause = self.SHORTEST, min(2 * self.pause, self.LONGEST)

    def _start(self) -> None:
        """A drafted stretch."""
        self._next("on", self.on_for)
        self.drafts = DraftTally()
        self.drafted_tokens, self.drafted_s, self.base_tokens, self.base_s = 0, 0.0, 0, 0.0

    def _next(self, stage: str, tokens: int) -> None:
        self.stage, self.left = stage, tokens


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
        """How many tokens to draft now: 0 while the gate is off, one while it guesses, else `--draft-max` within
        `left` (the tokens the sequence may still generate, less one)."""
        if left <= 0 or (self.gate is not None and not self.gate.on):
            return 1 if left > 0 and self.guessing else 0
        return min(self.most, left)

    @property
    def guessing(self) -> bool:
        """The drafts made now are the gate's guesses: checked against the token chosen next, not verified."""
        return self.gate is not None and self.gate.guessing

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
        g.step(step, tokens, seconds)
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
