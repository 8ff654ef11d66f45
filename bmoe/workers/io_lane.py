"""I/O lane: reads expert slices from the model file(s) straight into the slab.

Run as `python -m bmoe.workers.io_lane INDEX --shm NAME FILE...` so `ps` shows
its role. Orders arrive on stdin and completions leave on stdout, both as
msgpack: demand order `[id, [[file, offset, length, slab_offset, needed, move_from, move_to, move_len], ...]]`
(a read whose expert belongs elsewhere in its slot than the direct-I/O alignment let it land is then moved
there: bmoe.streaming.expert_cache),
speculative order `["s", id, [...]]`, cancel `["c", [id, ...]]` (speculative orders not
started yet are dropped and answered with bytes = -1), completion
`[id, bytes, busy_ns, error_or_None, copied, copy_ns]`: `copied` of the bytes came from the page cache
(`PageCache`), not the device, in `copy_ns` of the busy time, so the coordinator counts the device's
reads apart from memory's copies. The lane owns no cache state; it only moves bytes. It exits on EOF,
so it never outlives its coordinator.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import mmap
import os
import select
import signal
import sys
import time

import msgpack

from bmoe.shm_cache import open_segment

CANCELLED = -1  # the byte count of a completion whose speculative order was cancelled unread
# Reads shorter than this always go to the device: a few pages are as quick to read as to look up, and
# they are the ones that share pages with the dense tensors llama.cpp keeps mapped (cached for its sake)
MIN_COPY = 256 << 10
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_LOW_BIT = bytes(b & 1 for b in range(256))  # mincore's answer: bit 0 of each byte, the others reserved


def all_cached(addr: int, length: int) -> bool:
    """Whether every page of [addr, addr + length) of a file mapping is in the page cache now. mincore
    answers for the file's pages, touched by this process or not, when the caller owns the file or may
    write it; otherwise only for pages this process mapped, so the answer errs towards False."""
    start = addr - addr % mmap.PAGESIZE
    n = (addr + length - start + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = ctypes.create_string_buffer(n)
    if _libc.mincore(start, n * mmap.PAGESIZE, vec) != 0:
        return False
    return vec.raw.translate(_LOW_BIT).find(0) < 0


class PageCache:
    """Which ranges of a file are in the page cache now, and a buffered way to copy them from there.

    O_DIRECT reads the device even when another program (plain llama.cpp, an earlier `cat`) left the
    file in memory; a range whose every page is cached is copied from there instead, through a
    descriptor advised POSIX_FADV_RANDOM (no read-ahead), so this reads nothing from the device that
    O_DIRECT would not. The file is mapped only to ask mincore; nothing is read through the mapping."""

    def __init__(self, path: str, size: int) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.size = size
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, self.fd, 0) if size else None
        self.addr = None if addr in (None, ctypes.c_void_p(-1).value) else addr
        self.copied = 0  # bytes served from the page cache, and the time they took: not the device's
        self.copy_ns = 0

    def holds(self, offset: int, length: int) -> bool:
        """Every page of [offset, offset + length) is in the page cache (as of this call)."""
        if self.addr is None or length < MIN_COPY or offset + length > self.size:
            return False
        return all_cached(self.addr + offset, length)

    def copy(self, view: memoryview, offset: int) -> int:
        """Copy into `view` from the page cache; counted only when whole (a short copy is read again
        from the device, and its bytes are the device's)."""
        t0 = time.perf_counter_ns()
        n = os.preadv(self.fd, [view], offset)
        if n == len(view):
            self.copied += n
            self.copy_ns += time.perf_counter_ns() - t0
        return n


class Reader:
    """One open model file: O_DIRECT when the file system allows, else buffered + DONTNEED; with
    O_DIRECT, a range the page cache holds whole is copied from there (`PageCache`)."""

    def __init__(self, path: str, odirect: bool) -> None:
        self.path = path
        self.odirect = False
        self.fd = -1
        if odirect and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                self.odirect = True
            except OSError:
                self.fd = -1
        if self.fd < 0:
            self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        self.cache = PageCache(path, self.size) if self.odirect else None

    def read_into(self, view: memoryview, offset: int, needed: int) -> int:
        """Fill `view` from `offset`; past end of file it may stop short, but never before `needed`."""
        want = max(0, min(len(view), self.size - offset))
        if want >= needed and self.cache is not None and self.cache.holds(offset, want) \
                and self.cache.copy(view[:want], offset) == want:
            return want  # (short only if pages were evicted since the look: then it is read again below)
        got = 0
        while got < want:
            try:
                n = os.preadv(self.fd, [view[got:]], offset + got)
            except OSError as e:
                if not self.odirect:
                    raise
                self._fall_back(e)
                continue
            if n <= 0:
                break
            got += n
        if not self.odirect:
            os.posix_fadvise(self.fd, offset, got, os.POSIX_FADV_DONTNEED)
        if got < needed:
            raise OSError(f"short read of {self.path} at offset {offset}: {got} of {needed} bytes")
        return got

    def _fall_back(self, err: OSError) -> None:
        """O_DIRECT refused a request (alignment, file system): continue buffered."""
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_RDONLY)
        self.odirect = False
        print(f"io_lane: O_DIRECT read failed ({err.strerror}); using buffered reads", file=sys.stderr)


def page_cache_use(readers: list[Reader]) -> tuple[int, int]:
    """Bytes the readers have copied from the page cache so far, and the ns it took."""
    caches = [r.cache for r in readers if r.cache is not None]
    return sum(c.copied for c in caches), sum(c.copy_ns for c in caches)


def read_with_retry(reader: Reader, view: memoryview, offset: int, needed: int) -> int:
    """A failed read is tried once more before it is reported; never computed on missing bytes."""
    try:
        return reader.read_into(view, offset, needed)
    except OSError as first:
        try:
            return reader.read_into(view, offset, needed)
        except OSError as e:
            raise OSError(f"reading {reader.path} at offset {offset} failed twice: {e.strerror or e} "
                          f"(first: {first.strerror or first}); check the file and the device") from e


def serve_lane(index: int, shm_name: str, paths: list[str], odirect: bool) -> None:
    """Read orders as they come, demand before speculative; queued speculative orders can be cancelled.

    Between two reads the lane takes in whatever arrived, so a demand order waits
    for at most the one read under way, however many speculative orders are queued.
    """
    seg = open_segment(shm_name)
    view = memoryview(seg)
    base = ctypes.addressof(ctypes.c_char.from_buffer(seg))
    readers = [Reader(p, odirect) for p in paths]
    out = sys.stdout.buffer
    out.write(msgpack.packb(["hello", index, os.getpid(), all(r.odirect for r in readers)]))
    out.flush()
    unpacker = msgpack.Unpacker()
    fd = sys.stdin.buffer.raw.fileno()  # type: ignore[union-attr]  # typeshed: BinaryIO; it is a BufferedReader
    demand: collections.deque = collections.deque()
    spec: collections.OrderedDict = collections.OrderedDict()
    while True:
        idle = not demand and not spec
        while idle or select.select([fd], [], [], 0)[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return
            unpacker.feed(chunk)
            idle = False
        for msg in unpacker:
            if msg[0] == "s":
                spec[msg[1]] = msg[2]
            elif msg[0] == "c":
                for order_id in msg[1]:
                    if spec.pop(order_id, None) is not None:
                        out.write(msgpack.packb([order_id, CANCELLED, 0, None, 0, 0]))
                out.flush()
            else:
                demand.append(msg)
        if demand:
            order_id, reads = demand.popleft()
        elif spec:
            order_id, reads = spec.popitem(last=False)
        else:
            continue
        t0 = time.perf_counter_ns()
        copied0, copy_ns0 = page_cache_use(readers)
        total, err = 0, None
        try:
            for fi, off, length, slab_off, needed, move_from, move_to, move_len in reads:
                total += read_with_retry(readers[fi], view[slab_off:slab_off + length], off, needed)
                if move_len:
                    ctypes.memmove(base + move_to, base + move_from, move_len)
        except OSError as e:
            err = str(e)
        busy = time.perf_counter_ns() - t0
        copied, copy_ns = page_cache_use(readers)
        out.write(msgpack.packb([order_id, total, busy, err, copied - copied0, copy_ns - copy_ns0]))
        out.flush()


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ap = argparse.ArgumentParser(prog="bmoe.workers.io_lane")
    ap.add_argument("index", type=int)
    ap.add_argument("--shm", required=True)
    ap.add_argument("--no-odirect", action="store_true")
    ap.add_argument("files", nargs="+")
    a = ap.parse_args(argv)
    serve_lane(a.index, a.shm, a.files, not a.no_odirect)
    return 0


if __name__ == "__main__":
    sys.exit(main())
