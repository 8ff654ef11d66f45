"""The coordinator's side of the I/O lanes: start them, hand out reads, collect completions."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import time
from dataclasses import dataclass

import msgpack

ReadOrder = tuple[int, int, int, int, int]  # file index, file offset, length, slab offset, needed


def merge_reads(orders: list[ReadOrder], max_len: int) -> list[ReadOrder]:
    """Fewer, larger reads: in file order, reads that touch or overlap in one file at the same
    file-to-slab distance become one (never longer than max_len unless a single read is)."""
    out: list[ReadOrder] = []
    for fi, off, length, slab_off, needed in sorted(orders):
        if out:
            pfi, poff, plen, pslab, pneed = out[-1]
            if pfi == fi and off <= poff + plen and off - poff == slab_off - pslab \
                    and off + length - poff <= max_len:
                out[-1] = (pfi, poff, max(plen, off + length - poff), pslab, max(pneed, off + needed - poff))
                continue
        out.append((fi, off, length, slab_off, needed))
    return out


class LaneError(RuntimeError):
    pass


@dataclass
class LaneStats:
    orders: int = 0
    bytes: int = 0
    busy_ns: int = 0


class Lane:
    def __init__(self, index: int, shm_name: str, paths: list[str], odirect: bool) -> None:
        cmd = [sys.executable, "-m", "bmoe.workers.io_lane", str(index), "--shm", shm_name]
        if not odirect:
            cmd.append("--no-odirect")
        self.index = index
        self.proc = subprocess.Popen(cmd + list(paths), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.unpacker = msgpack.Unpacker()
        self.stats = LaneStats()
        self.pending: set[int] = set()
        self.odirect = False
        self.pid = self.proc.pid

    def send(self, order_id: int, reads: list[ReadOrder]) -> None:
        self.pending.add(order_id)
        self.proc.stdin.write(msgpack.packb([order_id, reads]))
        self.proc.stdin.flush()

    def stop(self, timeout: float = 2.0) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


class LanePool:
    """N lane processes. `read` splits a batch by bytes across lanes and waits for all of it."""

    def __init__(self, n: int, shm_name: str, paths: list[str], odirect: bool = True) -> None:
        self.lanes: list[Lane] = []
        self.sel = selectors.DefaultSelector()
        self._next_id = 0
        self.done: dict[int, tuple[int, int, str | None]] = {}
        try:
            for i in range(n):
                lane = Lane(i, shm_name, paths, odirect)
                self.lanes.append(lane)
                self.sel.register(lane.proc.stdout, selectors.EVENT_READ, lane)
            for lane in self.lanes:
                hello = self._next_message(lane, timeout=30.0)
                if not hello or hello[0] != "hello":
                    raise LaneError(f"I/O lane {lane.index} did not start")
                lane.odirect = bool(hello[3])
        except BaseException:
            self.close()
            raise

    @property
    def odirect(self) -> bool:
        return all(lane.odirect for lane in self.lanes)

    def _next_message(self, lane: Lane, timeout: float) -> list | None:
        deadline = time.monotonic() + timeout
        while True:
            for msg in lane.unpacker:
                return msg
            if time.monotonic() > deadline:
                return None
            chunk = os.read(lane.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                return None
            lane.unpacker.feed(chunk)

    def submit(self, reads: list[ReadOrder]) -> list[int]:
        """Spread reads over the lanes, largest first onto the least-loaded lane."""
        shares: list[list[ReadOrder]] = [[] for _ in self.lanes]
        load = [0] * len(self.lanes)
        for r in sorted(reads, key=lambda r: -r[2]):
            i = load.index(min(load))
            shares[i].append(r)
            load[i] += r[2]
        ids = []
        for lane, share in zip(self.lanes, shares):
            if share:
                self._next_id += 1
                lane.send(self._next_id, share)
                ids.append(self._next_id)
        return ids

    def wait(self, ids: list[int]) -> int:
        """Block until every order in ids completed; returns the bytes they read."""
        want = set(ids)
        while not want.issubset(self.done):
            for key, _ in self.sel.select(timeout=1.0):
                self._drain(key.data)
            for lane in self.lanes:
                if lane.proc.poll() is not None and lane.pending & want:
                    raise LaneError(f"I/O lane {lane.index} (pid {lane.pid}) exited with code {lane.proc.returncode}")
        total = 0
        for i in ids:
            nbytes, _busy, err = self.done.pop(i)
            if err:
                raise LaneError(err)
            total += nbytes
        return total

    def _drain(self, lane: Lane) -> None:
        chunk = os.read(lane.proc.stdout.fileno(), 1 << 16)
        if not chunk:
            return
        lane.unpacker.feed(chunk)
        for order_id, nbytes, busy_ns, err in lane.unpacker:
            lane.pending.discard(order_id)
            lane.stats.orders += 1
            lane.stats.bytes += nbytes
            lane.stats.busy_ns += busy_ns
            self.done[order_id] = (nbytes, busy_ns, err)

    def busy_ns(self) -> int:
        return sum(lane.stats.busy_ns for lane in self.lanes)

    def close(self) -> None:
        for lane in self.lanes:
            lane.stop()
        self.sel.close()
