"""llama-server's `timings` object, from bmoe's own measurements: llama-server's clients and web UI read a
generation's speed from it (on its native answers and on its OpenAI ones), at the end or, with
`timings_per_token`, on every streamed piece. `prompt_n` is the prompt's tokens decoded, `cache_n` those the KV
held already; `predicted_ms` is the decode's wall time, the same time `bmoe.tok_s` divides by. A generation that
verified drafts (`--draft`) adds `draft_n` and `draft_n_accepted`, the tokens it drafted and those accepted, as
llama-server adds them (server-common.cpp's server_slot_stats: only when it drafted any).
"""

from __future__ import annotations

from typing import Any

from bmoe.api import Chunk, GenerationStats


def timings(prompt_n: int, cache_n: int, prompt_s: float, predicted_n: int, predicted_ms: float,
            drafts: tuple[int, int] = (0, 0)) -> dict[str, Any]:
    """llama-server's timings for these counts and times (`drafts`: the tokens drafted and those accepted)."""
    prompt_ms = prompt_s * 1000
    out = {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
           "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
           "prompt_per_second": prompt_n / prompt_s if prompt_s > 0 else 0.0,
           "predicted_n": predicted_n, "predicted_ms": predicted_ms,
           "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
           "predicted_per_second": predicted_n * 1000 / predicted_ms if predicted_ms > 0 else 0.0}
    if drafts[0] > 0:
        out["draft_n"], out["draft_n_accepted"] = drafts
    return out


def final_timings(s: GenerationStats) -> dict[str, Any]:
    """A whole generation's timings."""
    predicted_ms = s.completion_tokens / s.tok_s * 1000 if s.tok_s > 0 else 0.0
    return timings(s.prefill_tokens, s.prompt_tokens - s.prefill_tokens, s.prefill_s, s.completion_tokens,
                   predicted_ms, (s.drafted, s.accepted))


class TimingsSoFar:
    """A stream's timings as its tokens come (`prompt_tokens`: the prompt as rendered): the prefill from its progress
    reports, then from the first token's chunk, each token's wall time added."""

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.prefill: tuple[int, float] = (0, 0.0)
        self.predicted_n, self.predicted_ms = 0, 0.0
        self.drafted, self.accepted = 0, 0

    def add(self, c: Chunk) -> None:
        if c.progress is not None:  # a report on the prefill under way (llama-server's return_progress)
            self.prefill = (c.progress.processed - c.progress.cache, c.progress.seconds)
        if c.prefill is not None:
            self.prefill = c.prefill
        if c.token is not None:
            self.predicted_n += 1
            self.predicted_ms += c.token.wall_ms
            self.drafted += c.token.drafted
            self.accepted += c.token.accepted

    def now(self) -> dict[str, Any]:
        decoded, seconds = self.prefill
        return timings(decoded, self.prompt_tokens - decoded, seconds, self.predicted_n, self.predicted_ms,
                       (self.drafted, self.accepted))
