"""How busy the I/O lanes are: each lane's reading time, the orders in flight when a layer's reads
have gone out, and per decode token the lanes' busy share (the flash's idle time made visible,
for `--profile` and overlap's `io_ms`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class LaneLoad:
    """How busy the lanes were since the streamer started."""

    busy_s: list[float]  # per lane, reading
    since_s: float  # wall time since the lanes started
    mean_depth: float  # orders in flight (demand and read-ahead) when a layer's reads had gone out
    per_token: list[tuple[float, float]] = field(default_factory=list)  # (lanes busy %, mean depth) per decode token

    def lines(self) -> list[str]:
        out = [f"io_lane {i}: busy {b:.2f} s of {self.since_s:.2f} s ({100 * b / self.since_s:.0f}%)"
               for i, b in enumerate(self.busy_s)] if self.since_s > 0 else []
        out.append(f"orders in flight when a layer's reads had gone out: {self.mean_depth:.2f} on average")
        if self.per_token:
            busy = sorted(b for b, _ in self.per_token)
            depth = sorted(d for _, d in self.per_token)
            out.append(f"per decode token ({len(busy)}): lanes busy p10 {_pct(busy, .1):.0f}% median "
                       f"{_pct(busy, .5):.0f}% p90 {_pct(busy, .9):.0f}%; orders in flight median "
                       f"{_pct(depth, .5):.2f} p90 {_pct(depth, .9):.2f}")
        return out


def _pct(values: list[float], q: float) -> float:
    """The q-quantile of sorted `values` (nearest rank)."""
    return values[min(len(values) - 1, int(q * len(values)))]


class LaneStats:
    """The lanes' busy time and queue depth, as the streamer collects answered orders."""

    def __init__(self, lanes: int) -> None:
        self.lane_busy_ns = [0] * lanes
        self.busy_ns = 0  # since the last `take`: overlap's io
        self.started = time.perf_counter()
        self.depth_sum = self.depth_samples = 0
        self.depth_taken = (0, 0)  # (depth_sum, depth_samples) at the last take
        self.taken_at = time.perf_counter_ns()
        self.per_token: list[tuple[float, float]] = []

    def answered(self, lane: int, busy_ns: int) -> None:
        """A lane answered an order after reading for `busy_ns`."""
        self.busy_ns += busy_ns
        self.lane_busy_ns[lane] += busy_ns

    def sample_depth(self, in_flight: int) -> None:
        """A layer's reads have gone out with `in_flight` orders outstanding."""
        self.depth_sum += in_flight
        self.depth_samples += 1

    def take(self, step: bool) -> int:
        """The lanes' busy ns since the last take; a decode `step` also records its busy share
        (busy time of the reads answered ÷ lanes × its wall time) and mean depth."""
        now = time.perf_counter_ns()
        if step and now > self.taken_at:
            total, samples = self.depth_sum - self.depth_taken[0], self.depth_samples - self.depth_taken[1]
            depth = total / samples if samples else 0.0
            self.per_token.append((100 * self.busy_ns / (len(self.lane_busy_ns) * (now - self.taken_at)), depth))
        self.taken_at, self.depth_taken = now, (self.depth_sum, self.depth_samples)
        busy, self.busy_ns = self.busy_ns, 0
        return busy

    def load(self) -> LaneLoad:
        return LaneLoad([b / 1e9 for b in self.lane_busy_ns], time.perf_counter() - self.started,
                        self.depth_sum / self.depth_samples if self.depth_samples else 0.0, list(self.per_token))
