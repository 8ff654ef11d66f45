"""Drafting's settings (bmoe.engine.drafts): guessing the next tokens and verifying them in one decode."""

from __future__ import annotations

from dataclasses import dataclass

from bmoe.base.argtypes import positive_int
from bmoe.base.option import setting

DRAFT_MODES = ("none", "ngram", "mtp")
DRAFT_MOST = 16  # llama.cpp's default --spec-draft-n-max: wider groups read more experts than they save


@dataclass(frozen=True)
class DraftSettings:
    """Drafting: which drafts, how many per step, and the gate that turns it off when it does not pay."""

    mode: str = setting(
        "none", "--draft", choices=DRAFT_MODES, metavar="none|ngram|mtp", ok=lambda v: v in DRAFT_MODES,
        rule=f"choose one of {', '.join(DRAFT_MODES)}",
        help="guess the next tokens and verify them in one decode, keeping only what the model itself samples (the "
             "text plain llama.cpp gives with the same drafts; docs/levers.md says where it equals decoding one token "
             "at a time): ngram drafts them from the prompt and the text so far (llama.cpp's prompt lookup), pays "
             "where the answer copies its input; mtp drafts them with the model's own multi-token-prediction layer "
             "(llama.cpp's draft-mtp; a model with one) (default {default})")
    most: int = setting(
        4, "--draft-max", parse=positive_int, metavar="N", ok=lambda v: 1 <= v <= DRAFT_MOST,
        rule=f"a number of tokens from 1 to {DRAFT_MOST}", help="tokens drafted per step at most (default {default})")
    gate: bool = setting(
        True, "--draft-gate", toggle=True,
        help="guess before drafting (one-token drafts checked against the tokens chosen, not verified) and turn "
             "drafting off for a while when half or fewer guesses are right or drafted tokens cost more time than "
             "without (default: on; --no-draft-gate drafts every step)")

