"""What a generation takes and gives back: the Request it runs (Model.prepare makes it), the Chunks it
streams, the Completion and GenerationStats it ends with, and a conversation's Turn. Plain records:
every edge reads them, the generation loop (bmoe.generation.request_life) fills them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from bmoe.base import telemetry
from bmoe.base.settings import SamplerSettings
from bmoe.generation.logprobs import TokenLogprob

if TYPE_CHECKING:
    from bmoe.chat.grammar import Grammar
    from bmoe.chat.output import Reading

Turn = dict[str, str]  # one message of a conversation as the engine keeps it (role, content)


@dataclass(frozen=True)
class GenerationStats:
    """One generation in numbers; per-token figures are over its decode tokens (the contract's)."""

    finish_reason: str  # "stop" (end of generation or a stop string), "length" (max_tokens) or "cancelled"
    prompt_tokens: int  # the prompt as rendered (for a chat, all of the conversation)
    prefill_tokens: int  # those decoded: the prompt less the KV prefix reused from the previous call
    completion_tokens: int
    kv_tokens: int  # in the KV afterwards (the session's n_past)
    prefill_s: float
    tok_s: float
    read_mib: float
    mib_per_token: float
    cache_hit_pct: float  # cumulative over the decode tokens; -1 without a cache
    stall_s_per_token: float
    mgmt_s_per_token: float
    io_s_per_token: float
    speculative_mib: float = 0.0  # read ahead of demand (--prefetch, --spec-gate)
    prefetched_experts: int = 0
    useful_experts: int = 0  # of those, the ones their layer then routed
    lossy: bool = False  # lossy routing changed this generation (the load's settings; it did not ask lossless)
    experts_per_token: int = 0  # experts per layer its tokens used (the model's top-k when not lossy)
    dropped_per_token: float = 0.0  # lossy routing: experts dropped (--drop-cold), over every layer
    substituted_per_token: float = 0.0  # experts taken from the cache instead (--cache-routing)
    weight_changed_pct: float = 0.0  # mean share of a layer's routing weight not computed as routed
    page_cache_mib: float = 0.0  # copied from the page cache by the lanes instead of read from flash (not in read_mib)
    drafted: int = 0  # --draft (bmoe.engine.drafts): tokens drafted, those accepted, and the MiB read for experts only
    accepted: int = 0  # the drafted rows of verify steps routed
    draft_extra_mib: float = 0.0
    verify_steps: int = 0  # --draft: the steps that verified drafts (llama-server's n_draft_verif_steps)
    accepted_per_pos: tuple[int, ...] = ()  # per draft position, the verify steps that accepted a draft there


@dataclass(frozen=True)
class PrefillProgress:
    """How far a prompt's prefill is (llama-server's `prompt_progress`): the prompt's tokens, those the KV held
    before it (a reused prefix, a prompt cache's), those in the KV now, and the seconds its prefill has taken."""

    total: int
    cache: int
    processed: int
    seconds: float


@dataclass(frozen=True)
class Chunk:
    """A piece of the answer: one per generated token, then a last one with the outcome.

    `text` may be empty while a UTF-8 sequence or a possible stop string is held back.
    `token` is that token's telemetry in the contract's units (telemetry.TokenLine: wall_ms,
    io_ms, compute_ms, mgmt_ms, stall_ms, read_mb, cache_hit_pct); the last chunk has none
    and carries `finish_reason` and `stats` instead.
    """

    text: str
    token: telemetry.TokenLine | None = None
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    logits: np.ndarray | None = None  # with Request.logits: the distribution this token was chosen from
    stop: str | None = None  # the last chunk's: the stop string that ended the answer, if one did
    logprobs: tuple[TokenLogprob, ...] = ()  # with Request.logprobs: the tokens whose text this chunk completes
    token_id: int | None = None  # the generated token's id (None on the held-back text and the last chunk)
    # the first token's: the prompt's tokens decoded (the reused KV prefix left out) and the prefill's seconds, so a
    # stream can tell its speed as it goes (llama-server's timings_per_token)
    prefill: tuple[int, float] | None = None
    # with Request.progress: a report on the prefill, before the first token (no text, no token): one when it
    # starts, one after each llama_decode call it is cut into (bmoe.engine.prompt_calls)
    progress: PrefillProgress | None = None


@dataclass(frozen=True)
class Completion:
    """A finished generation: its text, stats, and the tokens it generated with each one's telemetry."""

    text: str
    stats: GenerationStats
    ids: tuple[int, ...] = ()  # the generated tokens (an end-of-generation token is not one)
    tokens: tuple[telemetry.TokenLine, ...] = ()  # each generated token's telemetry, in order
    logprobs: tuple[TokenLogprob, ...] = ()  # with Request.logprobs: the text's tokens (bmoe.generation.logprobs)

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason


@dataclass(frozen=True)
class Request:
    """A generation ready to run: the prompt as tokens, checked against the context (Model.prepare)."""

    tokens: tuple[int, ...]
    max_tokens: int
    sampler: SamplerSettings
    stop: tuple[str, ...] = ()
    messages: tuple[Turn, ...] | None = None  # a chat's conversation; None: a plain prompt
    grammar: Grammar | None = None  # holds sampling to a JSON schema or a tool call (bmoe.chat.grammar)
    specials: frozenset[int] = frozenset()  # tokens written as their special text (a chat syntax's markers)
    reading: Reading | None = None  # how a chat's answer splits into reasoning, content, tool calls
    cache_prefix: int = 0  # the prompt's first tokens worth keeping in a prompt cache (bmoe.generation.prompt_cache)
    lossless: bool = False  # no lossy routing, whatever the load's settings (bmoe.streaming.lossy)
    forced: tuple[int, ...] = ()  # teacher forcing: the tokens generated, in order, instead of sampled ones
    logits: bool = False  # each Chunk carries the distribution its token was chosen from
    logprobs: int | None = None  # each Chunk carries its tokens' log-probabilities and this many alternatives
    progress: bool = False  # the prefill is reported as it goes (Chunk.progress)
    post_sampling: bool = False  # logprobs are of the sampler chain's probabilities after its last sampler
    slot: int | None = None  # the KV sequence it runs on, waiting for it (llama-server's id_slot); None: any free one
