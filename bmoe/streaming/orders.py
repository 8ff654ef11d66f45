"""The reads sent to the I/O lanes and not answered yet: which slices each order fills, on which
lane, and which experts it reads ahead of demand.

Demand reads (bmoe.streaming.streamer) and reads ahead (bmoe.streaming.readahead) both send, cancel and look up
orders here, the one owner of that state; neither reaches into the other.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from bmoe.base.units import MiB
from bmoe.streaming.cache_policy import ExpertKey, Key
from bmoe.streaming.expert_cache import ExpertCache
from bmoe.streaming.lanes import LanePool, ReadOrder, merge_keyed, spread

MAX_MERGED_READ = 4 * MiB


@dataclass
class Order:
    """Reads sent to one lane: the slices they fill and, if speculative, the experts read ahead."""

    keys: list[Key]
    lane: int
    ahead: list[tuple[int, int]] = field(default_factory=list)


class OrdersInFlight:
    """Every order in flight, by id and by the slice it fills."""

    def __init__(self, pool: LanePool, cache: ExpertCache) -> None:
        self.pool = pool
        self.cache = cache
        self.inflight: dict[int, Order] = {}
        self.order_of: dict[Key, int] = {}
        # the speculative ones, in sending order (each layer's stop looks at these alone)
        self.ahead_ids: dict[int, None] = {}

    @property
    def lanes(self) -> int:
        return len(self.pool.lanes)

    def pending_bytes(self) -> list[int]:
        """Bytes each lane has been asked to read and has not answered yet."""
        return [lane.pending_bytes() for lane in self.pool.lanes]

    def ahead(self) -> Iterator[tuple[int, Order]]:
        """(id, order) of every speculative order in flight."""
        return ((oid, self.inflight[oid]) for oid in list(self.ahead_ids))

    def reads_for(self, keys: list[Key]) -> list[tuple[ReadOrder, list[Key]]]:
        """The slices' reads, adjacent ones merged, each with the slices it fills."""
        return merge_keyed([(self.cache.read_order(k), k) for k in keys], MAX_MERGED_READ)

    def send(self, lane: int, share: list[tuple[ReadOrder, list[Key]]],
             ahead: list[tuple[int, int]] | None = None) -> int:
        """One order to one lane; `ahead` names the experts it reads ahead of demand (speculative)."""
        oid = self.pool.send(lane, [r for r, _ in share], speculative=bool(ahead))
        keys = [k for _, ks in share for k in ks]
        self.inflight[oid] = Order(keys, lane, ahead or [])
        if ahead:
            self.ahead_ids[oid] = None
        for k in keys:
            self.order_of[k] = oid
        return oid

    def spread(self, keys: list[Key]) -> list[int]:
        """Demand reads over all lanes, largest first onto the least loaded; returns order ids."""
        return self.staged([keys])[0]

    def staged(self, stages: list[list[Key]]) -> list[list[int]]:
        """Demand reads in the order the matmuls read them (a layer's gate slices, then up, then down),
        each stage's order ids. The first stage is spread over the least loaded lanes; a later slice
        queues behind its expert's earlier ones on the same lane (a read spanning experts on several
        lanes is spread). A lane reads its orders one after another, and one stream takes nearly all
        of the device's rate, so the slices awaited first arrive first instead of sharing the device
        with the ones needed later, and an expert's slices cost the lane one wake."""
        lane_of: dict[ExpertKey, int] = {}  # (layer, expert) -> the lane its earliest slice went to
        out: list[list[int]] = []
        for keys in stages:
            shares: list[list[tuple[ReadOrder, list[Key]]]] = [[] for _ in self.pool.lanes]
            rest = []
            for item in self.reads_for(keys):
                lanes = {lane_of.get((k[0], k[2])) for k in item[1]}
                if len(lanes) == 1 and None not in lanes:
                    shares[lanes.pop()].append(item)  # type: ignore[index]  # (None excluded above)
                else:
                    rest.append(item)
            load = [b + sum(r[2] for r, _ in share) for b, share in zip(self.pending_bytes(), shares)]
            for i, share in enumerate(spread(rest, load)):
                shares[i] += share
            out.append([self.send(i, share) for i, share in enumerate(shares) if share])
            for i, share in enumerate(shares):
                for _, ks in share:
                    for k in ks:
                        lane_of.setdefault((k[0], k[2]), i)
        return out

    def cancel(self, by_lane: dict[int, list[int]]) -> None:
        """Ask lanes to drop these speculative orders if not started (they answer CANCELLED)."""
        for lane, oids in by_lane.items():
            self.pool.lanes[lane].cancel(oids)

    def done(self) -> list[int]:
        """Orders the lanes have answered and that are still ours to collect."""
        return [o for o in self.pool.done if o in self.inflight]

    def pop(self, oid: int) -> Order:
        """An answered order leaves flight; its slices are no longer being read."""
        order = self.inflight.pop(oid)
        self.ahead_ids.pop(oid, None)
        for k in order.keys:
            del self.order_of[k]
        return order
