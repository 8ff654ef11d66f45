"""The coordinator's side of the I/O lanes: start them, hand out reads, collect completions."""

from __future__ import annotations

import contextlib
import os
import select
import selectors
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import IO, TYPE_CHECKING, NamedTuple, TypeVar

import msgpack

from bmoe import workers
from bmoe.base.errors import LaneError
from bmoe.workers.io_lane import CANCELLED

if TYPE_CHECKING:
    from _typeshed import FileDescriptorLike

__all__ = ["CANCELLED", "Answer", "Lane", "LanePool", "ReadOrder", "merge_keyed", "spread"]

# file index, file offset, length, slab offset, bytes that must exist in the file; then a move within the
# slab once the read landed (from, to, length: 0 when the read lands in place)
ReadOrder = tuple[int, int, int, int, int, int, int, int]
_T = TypeVar("_T")


class Answer(NamedTuple):
    """A completed order as its lane answered it. `copied` of `nbytes` came from the page cache, not
    the device (bmoe.workers.io_lane.PageCache), in `copy_ns` of `busy_ns`: telemetry's flash numbers
    leave them out."""

    nbytes: int  # CANCELLED for a speculative order dropped unread
    busy_ns: int
    copied: int
    copy_ns: int

    @property
    def device_bytes(self) -> int:
        """What the device served (CANCELLED stays CANCELLED: nothing was copied)."""
        return self.nbytes - self.copied


def merge_keyed(items: list[tuple[ReadOrder, _T]], max_len: int) -> list[tuple[ReadOrder, list[_T]]]:
    """Fewer, larger reads: in file order, reads that touch or overlap in one file at the same
    file-to-slab distance become one (never longer than max_len unless a single read is), unless
    one of them has a move to make; each merged read comes with the items it covers."""
    out: list[tuple[ReadOrder, list[_T]]] = []
    for (fi, off, length, slab_off, needed, *move), key in sorted(items, key=lambda x: x[0]):
        if out and not move[2]:
            (pfi, poff, plen, pslab, pneed, *pmove), keys = out[-1]
            if pfi == fi and not pmove[2] and off <= poff + plen and off - poff == slab_off - pslab \
                    and off + length - poff <= max_len:
                out[-1] = ((pfi, poff, max(plen, off + length - poff), pslab, max(pneed, off + needed - poff),
                            0, 0, 0), [*keys, key])
                continue
        out.append(((fi, off, length, slab_off, needed, move[0], move[1], move[2]), [key]))
    return out


def spread(items: list[tuple[ReadOrder, _T]], load: list[int]) -> list[list[tuple[ReadOrder, _T]]]:
    """Reads shared out over lanes already holding `load` bytes: largest first onto the least loaded."""
    load = list(load)
    shares: list[list[tuple[ReadOrder, _T]]] = [[] for _ in load]
    for item in sorted(items, key=lambda x: -x[0][2]):
        i = load.index(min(load))
        shares[i].append(item)
        load[i] += item[0][2]
    return shares


class Lane:
    """One lane process, restartable: its in-flight orders are kept so they can be re-issued."""

    def __init__(self, index: int, shm_name: str, paths: list[str], odirect: bool) -> None:
        self.cmd = workers.command("bmoe.workers.io_lane", str(index), "--shm", shm_name)
        if not odirect:
            self.cmd.append("--no-odirect")
        self.cmd += list(paths)
        self.index = index
        self.pending: dict[int, tuple[float, list[ReadOrder], bool]] = {}  # id -> (sent at, reads, speculative)
        self.odirect = False
        self._spawn()

    def _spawn(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pid = self.proc.pid
        self.unpacker = msgpack.Unpacker()
        self.eof = False
        self.unsent: list[bytes] = []
        self.hold = False  # LanePool.hold: messages wait for one write at flush

    def send(self, order_id: int, reads: list[ReadOrder], speculative: bool = False) -> None:
        self.pending[order_id] = (time.monotonic(), reads, speculative)
        self._write(["s", order_id, reads] if speculative else [order_id, reads])

    def cancel(self, order_ids: list[int]) -> None:
        """Drop these speculative orders if the lane has not started them (it answers CANCELLED)."""
        self._write(["c", order_ids])

    def _write(self, msg: list) -> None:
        self.unsent.append(msgpack.packb(msg))
        if not self.hold:
            self.flush()

    def flush(self) -> bool:
        if not self.unsent:
            return False
        data, self.unsent = b"".join(self.unsent), []
        assert self.proc.stdin is not None  # started with stdin=PIPE
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            self.eof = True  # found dead; the pool restarts it and re-sends what is pending
        return True

    def pending_bytes(self) -> int:
        return sum(r[2] for _, reads, _ in self.pending.values() for r in reads)

    @property
    def stdout(self) -> IO[bytes]:
        """The pipe the lane answers on (its process is started with stdout=PIPE)."""
        assert self.proc.stdout is not None
        return self.proc.stdout

    def respawn(self) -> None:
        """Replace a dead or hung process and re-issue everything it had not finished."""
        self.stop(timeout=0)
        self._spawn()
        orders = list(self.pending.items())
        self.pending.clear()
        for order_id, (_, reads, speculative) in orders:
            self.send(order_id, reads, speculative)

    def stop(self, timeout: float = 2.0) -> None:
        self.hang_up()
        self.reap(timeout)

    def hang_up(self) -> None:
        """Close the order pipe: the lane finishes its reads and exits."""
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
        except OSError:
            pass

    def reap(self, timeout: float = 2.0) -> None:
        """Wait for the exit `hang_up` asked for; kill a lane that does not go within `timeout`."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


class LanePool:
    """N lane processes. `send` gives one lane an order (the caller shares reads out with
    `spread`); `poll` collects completions into `done`, and `take` hands one over.

    A lane that exits, or leaves an order unanswered past `timeout` seconds, is
    replaced and its orders re-issued (a read rewrites its whole slab range, so
    a half-done read is harmless). More than `max_restarts` replacements in a
    run means something is wrong beyond one process: the run stops with an error.
    """

    def __init__(self, n: int, shm_name: str, paths: list[str], odirect: bool = True,
                 timeout: float = 30.0, max_restarts: int = 3) -> None:
        self.lanes: list[Lane] = []
        self.sel = selectors.DefaultSelector()
        self._next_id = 0
        self.done: dict[int, tuple[Answer, str | None]] = {}
        self.timeout = timeout
        self.max_restarts = max_restarts
        self.restarts = 0
        try:
            for i in range(n):
                self.lanes.append(Lane(i, shm_name, paths, odirect))
            for lane in self.lanes:
                self._hello(lane)
        except BaseException:
            self.close()
            raise

    def _hello(self, lane: Lane) -> None:
        hello = self._next_message(lane, timeout=30.0)
        if not hello or hello[0] != "hello":
            raise LaneError(f"I/O lane {lane.index} did not start (exit code {lane.proc.poll()})")
        lane.odirect = bool(hello[3])
        self.sel.register(lane.stdout, selectors.EVENT_READ, lane)
        # a replacement is sent its re-issued orders before its hello is read: a quick lane's
        # answers can arrive in the same read as the hello, and no select would report them again
        self._take_answers(lane)

    @property
    def odirect(self) -> bool:
        return all(lane.odirect for lane in self.lanes)

    def _next_message(self, lane: Lane, timeout: float) -> list | None:
        deadline = time.monotonic() + timeout
        while True:
            for msg in lane.unpacker:
                return msg
            left = deadline - time.monotonic()
            if left < 0 or not select.select([lane.stdout], [], [], left)[0]:
                return None
            chunk = os.read(lane.stdout.fileno(), 1 << 16)
            if not chunk:
                return None
            lane.unpacker.feed(chunk)

    def send(self, lane_index: int, reads: list[ReadOrder], speculative: bool = False) -> int:
        """One order to one lane, which reads demand orders in arrival order before any
        speculative one. Returns the order id."""
        self._next_id += 1
        self.lanes[lane_index].send(self._next_id, reads, speculative)
        return self._next_id

    def hold(self) -> None:
        """Orders and cancels wait until `flush`, which gives each lane one write: a write wakes
        the lane, which on a small machine takes the CPU from the sender at once."""
        for lane in self.lanes:
            lane.hold = True

    def flush(self) -> bool:
        """Write what `hold` kept; whether there was anything."""
        wrote = False
        for lane in self.lanes:
            lane.hold = False
            wrote |= lane.flush()
        return wrote

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """`hold` for the block, then `flush`."""
        self.hold()
        try:
            yield
        finally:
            self.flush()

    def poll(self, timeout: float, extra: dict[int, Callable[[], None]] | None = None) -> None:
        """Collect completions into `done` (waiting up to `timeout` s for one), replacing failed lanes.

        `extra` maps other readable file descriptors to the handler to call when they are
        ready, so one wait serves the lanes and, e.g., the spec-gate.
        """
        extra = extra or {}
        keys = [self.sel.register(fd, selectors.EVENT_READ, fn) for fd, fn in extra.items()]
        try:
            for key, _ in self.sel.select(timeout=timeout):
                if not isinstance(key.data, Lane):
                    key.data()
                elif key.fileobj is key.data.proc.stdout:
                    self._drain(key.data)
                else:
                    self._forget(key.fileobj)  # the pipe of a process already replaced
        finally:
            for key in keys:
                self.sel.unregister(key.fileobj)
        now = time.monotonic()
        for lane in self.lanes:
            if not lane.pending:
                continue
            oldest = min(t for t, _, _ in lane.pending.values())
            if lane.eof or lane.proc.poll() is not None:
                self._replace(lane, f"exited with code {lane.proc.poll()}")
            elif now - oldest > self.timeout:
                self._replace(lane, f"did not answer within {self.timeout:g} s")

    def take(self, order_id: int) -> Answer:
        """A completed order's answer; raises the lane's error if it failed."""
        answer, err = self.done.pop(order_id)
        if err:
            raise LaneError(err)
        return answer

    def _replace(self, lane: Lane, why: str) -> None:
        self.restarts += 1
        if self.restarts > self.max_restarts:
            raise LaneError(f"I/O lane {lane.index} (pid {lane.pid}) {why}, and lanes have failed "
                            f"{self.restarts} times in this run; check the model file and the device "
                            "(dmesg), or lower --io-threads")
        print(f"bmoe: I/O lane {lane.index} (pid {lane.pid}) {why}; restarting it", file=sys.stderr)
        self._forget(lane.stdout)
        lane.respawn()
        self._hello(lane)

    def _forget(self, fileobj: FileDescriptorLike) -> None:
        """Stop watching a lane's pipe (it may already be gone: EOF seen, or a send found it dead)."""
        try:
            self.sel.unregister(fileobj)
        except (KeyError, ValueError):
            pass

    def _drain(self, lane: Lane) -> None:
        chunk = os.read(lane.stdout.fileno(), 1 << 16)
        if not chunk:
            lane.eof = True
            self._forget(lane.stdout)
            return
        lane.unpacker.feed(chunk)
        self._take_answers(lane)

    def _take_answers(self, lane: Lane) -> None:
        """Every completion the lane's unpacker holds, into `done`."""
        for order_id, nbytes, busy_ns, err, copied, copy_ns in lane.unpacker:
            lane.pending.pop(order_id, None)
            self.done[order_id] = (Answer(nbytes, busy_ns, copied, copy_ns), err)

    def close(self) -> None:
        """Hang up on every lane first, then reap them: they exit together, not one after another."""
        for lane in self.lanes:
            lane.hang_up()
        for lane in self.lanes:
            lane.reap()
        self.sel.close()
