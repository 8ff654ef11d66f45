"""How big the expert cache may be: the `--cache-mb` rules and how an adaptive budget moves, pure
(the caller reads the machine: bmoe.memory.probe), and the adaptive budget's per-token step, which
reads it and moves the running cache's budget (`BudgetWatch`).

A budget below one layer's routed set cannot run at all; below one token's working set (every
MoE layer's top-k, page-rounded as the cache charges them) it only thrashes, so it is refused
unless forced, and `auto` falls back to no cache instead. A fixed budget above the room the
tightest limit leaves is refused too unless forced or `--adapt`: filling it would evict the dense
weights llama.cpp reads every token (a 2000 MiB cache beside an MTP context under 4000 MiB ran
at a quarter of the speed, bench/reports/2026-12-06-drafts-mtp-q36-cache2000). `auto` takes the least room any limit
leaves (a cgroup's, the machine's, an rlimit's) minus the floor; while running, `Adaptive` gives
memory back as soon as the room falls under the floor and takes it again, with hysteresis, once
it has stayed free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from bmoe.base.errors import ConfigError
from bmoe.base.settings import FLAGS, CacheSettings, Naming
from bmoe.base.units import MiB
from bmoe.memory.probe import MemoryProbe, Room


def mib_up(nbytes: int) -> str:
    """MiB rounded up to 0.1, so a number printed as "use --cache-mb N" is enough."""
    return f"{-(-nbytes * 10 // MiB) / 10:g}"


def floor(cache: CacheSettings, rooms: list[Room], w: Naming = FLAGS) -> tuple[int, str]:
    """Bytes the limits must keep free, and how to say so: --cache-floor-mb, or by default 1536 MiB
    but at most a quarter of the tightest cgroup limit. Inside a cgroup its charge already holds
    bmoe's own memory (dense weights, KV, lanes), so the floor only covers what may still grow;
    1536 MiB in a 2500 MiB container would leave a cache too small to hit."""
    if cache.floor_mb is not None:
        return int(cache.floor_mb * MiB), w.value("cache_floor_mb", cache.floor_mb)
    limits = [r.cgroup_limit for r in rooms if r.cgroup_limit]
    if limits and min(limits) // 4 < cache.FLOOR_MB * MiB:
        quarter = min(limits) // 4
        return quarter, f"the floor {quarter / MiB:.0f} MiB (a quarter of the cgroup limit)"
    return int(cache.FLOOR_MB * MiB), w.value("cache_floor_mb", cache.FLOOR_MB)


def auto_cache_bytes(expert_bytes: int, rooms: list[Room], floor_bytes: int, floor_text: str,
                     ceil_mb: float | None = None, w: Naming = FLAGS) -> tuple[int, str]:
    """The `--cache-mb auto` budget: the least of every limit's room minus the floor, the ceiling and
    every expert's bytes; with the terms it compared, for the notice that reports it."""
    terms = [(max(0, r.bytes - floor_bytes), f"{r.name} minus {floor_text}") for r in rooms]
    terms.append((expert_bytes, f"experts total {expert_bytes / MiB:.0f} MiB"))
    if ceil_mb is not None:
        terms.append((int(ceil_mb * MiB), w.value("cache_ceil_mb", ceil_mb)))
    budget = min(b for b, _ in terms)
    why = "; ".join(f"{'=> ' if b == budget else ''}{what}" for b, what in terms)
    return budget, why


@dataclass(frozen=True)
class Budget:
    bytes: int
    floor: int  # what an adaptive budget keeps free
    notice: str | None = None  # what `auto` chose and why, for the user


def decide(cache: CacheSettings, reads_ahead: bool, expert_bytes: int, layer_need: int, token_need: int,
           rooms: list[Room], w: Naming = FLAGS) -> Budget:
    """The cache budget in bytes for this model, or a ConfigError that names the fix in the
    caller's words (`w`: flags or bmoe.load keywords).

    `layer_need` / `token_need`: one layer's / one token's working set (bmoe.streaming.expert_cache.working_sets).
    """
    notice = None
    floor_bytes, floor_text = floor(cache, rooms, w)
    force, no_cache = w.value("force", True), w.value("cache_mb", 0.0)
    if cache.mb is not None:
        budget = int(cache.mb * MiB)
    else:
        budget, why = auto_cache_bytes(expert_bytes, rooms, floor_bytes, floor_text, cache.ceil_mb, w)
        notice = f"cache budget {budget / MiB:.1f} MiB (auto, the least of: {why})"
        if 0 < budget < token_need and not cache.force:
            notice += (f"; that is below one token's working set ({token_need / MiB:.1f} MiB), where a "
                       f"cache thrashes, so this run has none (as {no_cache}); {force} keeps it")
            budget = 0
        if reads_ahead and budget <= 0:
            raise ConfigError(f"{w.name('prefetch')} and {w.name('spec_gate')} read experts ahead into the cache, "
                              f"and {w.value('cache_mb', None)} found no room for one; free memory, lower "
                              f"{w.name('cache_floor_mb')}, or drop them")
    what = (w.value("cache_mb", cache.mb) if cache.mb is not None
            else f"{w.value('cache_mb', None)} ({budget / MiB:.1f})")
    enough = w.value("cache_mb", float(mib_up(token_need)))
    if 0 < budget < layer_need:
        raise ConfigError(f"{what} is below one layer's working set ({layer_need / MiB:.1f} MiB), which even "
                          f"{force} cannot run; use {enough} (one token's working set) or more, or 0 for no cache")
    least = min(rooms, key=lambda r: r.bytes, default=None)
    if cache.mb is not None and not (cache.adapt or cache.force) and least is not None \
            and min(budget, expert_bytes) > least.bytes:  # (a cache never holds more than every expert)
        roomy = auto_cache_bytes(expert_bytes, rooms, floor_bytes, floor_text, cache.ceil_mb, w)[0]
        fits = (f"{w.value('cache_mb', float(int(roomy / MiB)))} or less (what {w.value('cache_mb', None)} takes "
                f"now, {floor_text} left free)" if roomy >= token_need else w.value("cache_mb", None))
        raise ConfigError(f"{what} is more than the {least.bytes / MiB:.0f} MiB the tightest memory limit leaves now "
                          f"({least.name}): the cache would push out the pages llama.cpp reads every token (the dense "
                          f"weights, read again each token) or be killed for it; use {fits}, {w.name('adapt')} to "
                          f"let it shrink when memory runs short, or {force} to run with it anyway")
    if 0 < budget < token_need and not cache.force:
        raise ConfigError(f"{what} is below one token's working set ({token_need / MiB:.1f} MiB): the cache "
                          f"would thrash, each token evicting experts the next one needs again; use {enough} "
                          f"or more, 0 for no cache, or {force} to run with it anyway")
    return Budget(budget, floor_bytes, notice)


@dataclass
class Adaptive:
    """Moves a running cache's budget with the room the limits leave (bmoe.memory.probe), once per token.

    `room` is measured with the cache's resident pages already charged; the pages it may still
    take (`budget - resident`) are subtracted first, so a cache that is still filling is not
    mistaken for free memory. Under the floor the budget shrinks at once by the shortfall and a
    margin; it grows only after `grow_after` tokens in a row with more than two margins to spare,
    and never under memory pressure (PSI). A budget that would fall below one token's working set
    becomes 0 (no cache: every token reads its experts) instead of thrashing.
    """

    floor: int  # bytes the limits must keep free
    token_need: int  # one token's working set
    ceiling: int  # the most the budget may be (every expert's slots, --cache-ceil-mb, a fixed --cache-mb)
    margin: int = 128 * MiB  # hysteresis: shrink this much below the shortfall, grow only with twice it spare
    grow_after: int = 4
    pressure_pct: float = 10.0  # PSI some avg10 above which the budget does not grow
    calm: int = 0

    def step(self, budget: int, resident: int, room: Room, pressure: float | None = None) -> tuple[int, str] | None:
        """The new budget and why, or None to keep it."""
        usable = min(budget, self.ceiling)  # a budget past every expert's slots is never filled
        to_fill = max(0, usable - resident)
        spare = room.bytes - to_fill - self.floor
        if spare < 0:
            self.calm = 0
            want = max(0, usable + spare - self.margin)
            left = f"{room.name} leaves {room.bytes / MiB:.0f} MiB" + (
                f", {to_fill / MiB:.0f} MiB of it still to be filled by the cache" if to_fill else "")
            if want < self.token_need:
                if budget == 0:
                    return None
                return 0, (f"{left}: under the floor of {self.floor / MiB:.0f} MiB even at one token's working "
                           f"set ({self.token_need / MiB:.0f} MiB), so no cache until memory frees")
            return want, f"{left}: under the floor of {self.floor / MiB:.0f} MiB"
        if usable < self.ceiling and spare > 2 * self.margin and not (pressure or 0) > self.pressure_pct:
            self.calm += 1
            if self.calm >= self.grow_after:
                self.calm = 0
                want = min(self.ceiling, usable + spare - self.margin)
                if want >= max(self.token_need, usable + self.margin):
                    return want, f"{room.name} leaves {room.bytes / MiB:.0f} MiB free again"
            return None
        self.calm = 0
        return None


class Budgeted(Protocol):
    """A cache whose budget an adaptive budget moves (bmoe.streaming.streamer.Streamer)."""

    @property
    def budget(self) -> int: ...

    def set_budget(self, budget: int) -> None: ...

    def resident_bytes(self) -> int: ...


@dataclass
class BudgetWatch:
    """The adaptive budget's step, which the cache runs as its `watch` once per token and whenever it
    took another WATCH_STEP (bmoe.streaming.streamer): the budget follows the room the memory limits
    leave (`Adaptive`), and `notice` hears each change and why."""

    adaptive: Adaptive
    cache: Budgeted
    memory: MemoryProbe  # the limits it reads (the load's probe)
    notice: Callable[[str], None]

    def __call__(self) -> None:
        cache = self.cache
        change = self.adaptive.step(cache.budget, cache.resident_bytes(), self.memory.least(), self.memory.pressure())
        if change is not None:
            old = cache.budget
            cache.set_budget(change[0])
            self.notice(f"cache budget {old / MiB:.0f} -> {change[0] / MiB:.0f} MiB: {change[1]}")
