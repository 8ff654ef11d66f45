"""A warm start: the experts a usage profile (bmoe.streaming.usage_profile) says were most used, read into the
cache in the background before and while the first requests run (`WarmFill`), and the profile
written back at exit (`WarmStart`).

The fill rides on the read-ahead machinery (bmoe.streaming.readahead.ReadAhead calls `pump`, `busy`, `pause`
and `on_done` and sends nothing of its own for it): one order per expert, admitted like a read
ahead (the cache's cold end, kept until its layer routes), sent only after the reads ahead that
ReadAhead has queued, and served by the lanes after every demand read. Unlike a prediction it is
not cancelled when its layer routes other experts. It never evicts: it stops at the first expert
that does not fit the budget as it stands.

While a decode runs the fill has at most BUSY_DEPTH orders in flight in all: one lane reads for it
while the others serve demand alone, so the fill takes little of the CPU the tokens compute on (a
demand read on that lane waits for at most the one read under way); between requests (`idle`, from
the Engine's idle tick) each lane may hold IDLE_DEPTH, and the next decode cancels the ones not
started beyond BUSY_DEPTH, which go back to the front of the list. `stop` drops the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bmoe.base.model_files import ModelFiles
from bmoe.base.units import MiB
from bmoe.streaming import usage_profile
from bmoe.streaming.lanes import CANCELLED

if TYPE_CHECKING:
    from bmoe.streaming.orders import Order
    from bmoe.streaming.readahead import ReadAhead
    from bmoe.streaming.streamer import Streamer

# fill orders in flight while a decode runs (bench/reports/2026-12-03-resident: what filling costs a token)
BUSY_DEPTH = 1
# fill orders a lane may hold between requests: idle ticks come 0.5 s apart (Engine.follow_memory), and a
# tick's orders should keep a lane reading until the next one (bench/restart_with_usage_profile.py measures a fill)
IDLE_DEPTH = 32


class WarmFill:
    """The experts still to read, most used first, and the orders in flight for them."""

    def __init__(self, ahead: ReadAhead, experts: list[tuple[int, int]]) -> None:
        self.ra = ahead
        self.todo = list(experts)
        self.orders: set[int] = set()
        self.depth = 0  # orders it may have in flight now (0: paused)
        self.read = 0  # experts read so far
        self.stopped = False

    @property
    def done(self) -> bool:
        return not self.todo and not self.orders

    @property
    def filling(self) -> bool:
        """Reads still to send (a routing's stop is where they go out)."""
        return bool(self.todo) and not self.stopped

    def extend(self, experts: list[tuple[int, int]]) -> None:
        """More experts to read after the list's own (those already listed keep their place)."""
        listed = set(self.todo)
        self.todo += [k for k in experts if k not in listed]

    def owns(self, oid: int) -> bool:
        return oid in self.orders

    def idle(self) -> None:
        """Between requests: queue deeper, and send now."""
        if not self.stopped:
            self._depth(IDLE_DEPTH * self.ra.orders.lanes)
            self.ra.pump()

    def busy(self) -> None:
        """A decode starts: back to BUSY_DEPTH orders in flight."""
        if not self.stopped:
            self._depth(BUSY_DEPTH)

    def pause(self) -> None:
        """A generation settles: nothing new until `busy` or `idle`; what was queued comes back."""
        self._depth(0)

    def stop(self) -> None:
        """Cancel the fill: the list is dropped, orders not started are cancelled."""
        self.stopped = True
        self.todo.clear()
        self._depth(0)

    def pump(self) -> None:
        """Send the next experts while fewer than `depth` fill orders are in flight, each to the lane holding fewest."""
        ra, orders, cache = self.ra, self.ra.orders, self.ra.cache
        held = [0] * orders.lanes
        for oid in self.orders:
            held[orders.inflight[oid].lane] += 1
        while self.todo and len(self.orders) < self.depth:
            layer, e = self.todo[0]
            if not ra.absent(layer, e):
                self.todo.pop(0)
                continue
            if not cache.fits(layer, e):  # the budget is full: a fill never evicts
                self.todo.clear()
                break
            self.todo.pop(0)
            keys = cache.admit_speculative(layer, [e])
            if keys:
                lane = held.index(min(held))
                self.orders.add(orders.send(lane, orders.reads_for(keys), [(layer, e)]))
                held[lane] += 1

    def on_done(self, oid: int, order: Order, nbytes: int) -> None:
        if oid not in self.orders:
            return
        self.orders.discard(oid)
        if nbytes != CANCELLED:
            self.read += 1
        elif not self.stopped:  # paused or cut back: read it later
            self.todo[:0] = order.ahead

    def _depth(self, depth: int) -> None:
        """At most `depth` orders in flight from now on; queued ones are cancelled when it falls."""
        if depth < self.depth and self.orders:
            ra, orders = self.ra, self.ra.orders
            by_lane: dict[int, list[int]] = {}
            for oid in self.orders:
                if oid not in ra.cancelled:
                    by_lane.setdefault(orders.inflight[oid].lane, []).append(oid)
                    ra.cancelled.add(oid)
            orders.cancel(by_lane)
        self.depth = depth


def fill_rest(streamer: Streamer) -> None:
    """A budget that holds every expert: read those not resident in the background, layer by layer,
    behind demand (after a warm start's own list), so that each layer is soon complete at its
    experts' own indices and runs through without a stop."""
    c, ahead = streamer.cache, streamer.ahead
    rest = [(layer, e) for layer in streamer.layers for e in range(c.n_expert(layer)) if not c.resident[layer][e]]
    if ahead.warm is None:
        ahead.warm = WarmFill(ahead, rest)
    else:
        ahead.warm.extend(rest)


class WarmStart:
    """One run's usage profile (bmoe.streaming.usage_profile): read at start, where it seeds the cache policy
    and a WarmFill, and written back at exit with this run's counts.

    `idle` is the Engine's tick between requests: it collects the fill's reads and sends more. A
    profile that cannot be used is ignored with a notice (and replaced at exit); so is one when the
    run has no cache (budget 0), which still writes this run's counts.
    """

    def __init__(self, directory: Path, files: ModelFiles, streamer: Streamer, notice: Callable[[str], None]) -> None:
        self.st, self.notice = streamer, notice
        self.path = usage_profile.profile_path(directory, files)
        self.model = usage_profile.identity(files)
        cache = streamer.cache
        self.before, why = usage_profile.read_profile(self.path, self.model,
                                              {layer: cache.n_expert(layer) for layer in cache.by_layer})
        if why:
            notice(why)
        self.fill: WarmFill | None = None
        self.t0 = time.perf_counter()
        if self.before is None or self.before.empty or streamer.budget <= 0:
            return
        cache.policy.prior(self.before.frequencies(), max(self.before.routings.values()))
        order = self.before.fill_order()
        self.fill = streamer.ahead.warm = WarmFill(streamer.ahead, order)
        notice(f"warm start: filling the cache in the background from {self.path} "
               f"({len(order)} experts routed before, most used first)")
        self.fill.idle()

    def idle(self) -> None:
        """Between requests (after the Streamer's idle fill): say once when the fill is done."""
        f = self.fill
        if f is None:
            return
        if f.done:
            mib = self.st.cache.used / MiB
            self.notice(f"warm start: {f.read} experts read in {time.perf_counter() - self.t0:.1f} s "
                        f"(cache {mib:.0f} of {self.st.budget / MiB:.0f} MiB)")
            self.fill = None

    def save(self) -> None:
        """Write this run's counts, plus half the profile's, if the run routed anything; a failure
        to write is a notice (it never fails the run's exit)."""
        cache = self.st.cache
        now = usage_profile.Usage({layer: np.array(c, dtype=np.int64) for layer, c in cache.routed.items()},
                                  dict(cache.routings))
        if now.empty:
            return
        try:
            usage_profile.save(self.path, self.model, now.merged(self.before))
        except OSError as e:
            self.notice(f"could not save the usage profile {self.path}: {e.strerror or e}; "
                        "choose a writable --usage-dir or --no-warm-start")
