"""What an edge prints about a load and the cache now: `EngineStats` (Engine.stats), a plain record, so
that the API can name it without loading llama.cpp."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bmoe.base.telemetry import TokenStat
from bmoe.memory.probe import Room

if TYPE_CHECKING:
    from bmoe.streaming.streamer import Counters


@dataclass(frozen=True)
class EngineStats:
    """The load and the cache now (Engine.stats): every figure an edge prints about them."""

    arch: str
    n_ctx: int
    load_s: float
    llama_load_s: float  # of load_s, llama.cpp's own load (model, then context)
    streaming: bool
    lossy: bool  # generations change routing unless they ask for lossless (bmoe.streaming.lossy)
    top_k: int  # experts the model's router picks per token and layer
    experts_per_token: int  # experts a lossy generation's tokens use per layer
    budget_bytes: int  # the expert cache's budget now (0 without streaming or without a cache)
    resident_bytes: int  # expert bytes in memory now
    holds_every_expert: bool  # plain llama.cpp's mapping, or a cache budget that holds them all
    spec_gate: tuple[float, float | None] | None  # (recall %, the floor that switched it off) of the spec-gate
    lanes: tuple[str, ...]  # the lanes' busy time and queue depth so far (--profile)
    workers: tuple[tuple[str, int], ...]  # (role, pid) of every worker process
    full_bytes: int  # a budget that holds every expert's slot (0 without streaming)
    memory: Room  # the tightest memory limit now and the room it leaves (bmoe.memory.probe)
    # per MoE layer (layer, one character per expert: '1' resident, '0' not); empty without streaming
    residency: tuple[tuple[int, str], ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class EmbeddingFacts:
    """How a load computes embeddings (--embedding): each input is one decode of at most `width` tokens,
    pooled by `pooling` (none, mean, cls, last) into vectors of `size` floats."""

    pooling: str
    size: int
    width: int


def token_shares(walls: list[int], c: Counters | None, budget: int) -> list[TokenStat]:
    """A step's TokenStats, one per token it made (`walls`: each one's wall time): token i gets an even share of
    each of the step's counts `c` (None without streaming), the shares adding up to the count."""
    if c is None:
        return [TokenStat(w, 0, 0, 0, 0, 0) for w in walls]
    k = len(walls)
    counts = (c.io_ns, c.mgmt_ns, c.read_bytes, c.hits, c.lookups, c.stall_ns, c.page_cache_bytes, c.page_cache_ns)
    shares = []
    for i in range(k):
        io, mgmt, read, hits, lookups, stall, copied, copy_ns = (x * (i + 1) // k - x * i // k for x in counts)
        shares.append(TokenStat(walls[i], io, mgmt, read, hits, lookups, stall, budget, page_cache_bytes=copied,
                                page_cache_ns=copy_ns))
    return shares
