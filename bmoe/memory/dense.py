"""The dense weights (attention, norms, routers, embeddings): where llama.cpp maps them, reading
them ahead, and pinning them.

A streaming load maps the model without reading it (bmoe.seam.no_populate), and llama.cpp then
advises the whole mapping MADV_RANDOM: a page touched for the first time is read alone. So the
dense ranges are read here, in large sequential requests, while the rest of the start-up runs
(`DenseReadAhead`), and advised back to normal read-around (`advise_normal`) so that a page the
kernel reclaimed later comes back with its neighbours, not 4 KiB at a time.

They stay in llama.cpp's own mapping of the file, as page cache. Under a tight memory limit the
kernel reclaims page cache before the cache's shared-memory slots (which it cannot drop without
swap), so every token faults the dense weights back in from flash (docs/memory.md has what that
cost, bench/memory_squeeze.py measures it). `--pin-dense` locks their
pages (mlock) so they stay, and their bytes join the charge the cache budget is measured against.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

from bmoe import seam
from bmoe.base.model_files import ModelFiles
from bmoe.shm_cache import PAGE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
READ_CHUNK = 8 << 20  # bytes per read request of the dense read-ahead


def file_spans(files: ModelFiles) -> list[tuple[int, int, int]]:
    """(file index, offset, length) of every dense tensor's bytes (`ModelFiles.dense_names`: no expert,
    no MTP layer, no table llama.cpp reads lazily), page-aligned, adjacent ones merged: what the first
    token reads through llama.cpp's mapping."""
    spans = sorted((e.file_index, e.offset - e.offset % PAGE, -(-(e.offset + e.nbytes) // PAGE) * PAGE)
                   for e in (files.extents[n] for n in files.dense_names()))
    merged: list[list[int]] = []
    for fi, start, end in spans:
        if merged and merged[-1][0] == fi and start <= merged[-1][2]:
            merged[-1][2] = max(merged[-1][2], end)
        else:
            merged.append([fi, start, end])
    return [(fi, start, end - start) for fi, start, end in merged]


class DenseReadAhead:
    """Reads the dense spans into the page cache on a thread: every span is handed to the kernel
    at once (POSIX_FADV_WILLNEED), then read through in READ_CHUNK requests, which returns when
    the bytes are there. `join` waits for it and gives the bytes read; an error is raised there."""

    def __init__(self, files: ModelFiles) -> None:
        self.paths = files.paths
        self.spans = file_spans(files)
        self.bytes = sum(n for _, _, n in self.spans)
        self.error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="bmoe-dense-read-ahead", daemon=True)

    def start(self) -> DenseReadAhead:
        self._thread.start()
        return self

    def _run(self) -> None:
        fds: dict[int, int] = {}
        try:
            for fi in sorted({fi for fi, _, _ in self.spans}):
                fds[fi] = os.open(self.paths[fi], os.O_RDONLY)
                os.posix_fadvise(fds[fi], 0, 0, os.POSIX_FADV_RANDOM)  # the spans exactly: no read-ahead past them
            for fi, offset, length in self.spans:
                os.posix_fadvise(fds[fi], offset, length, os.POSIX_FADV_WILLNEED)
            buf = mmap.mmap(-1, READ_CHUNK)
            try:
                view = memoryview(buf)
                for fi, offset, length in self.spans:
                    end = offset + length
                    while offset < end:
                        n = os.preadv(fds[fi], [view[:min(READ_CHUNK, end - offset)]], offset)
                        if n <= 0:
                            break
                        offset += n
                view.release()
            finally:
                buf.close()
        except OSError as e:
            self.error = e
        finally:
            for fd in fds.values():
                os.close(fd)

    def join(self) -> int:
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.bytes


def advise_normal(ranges: list[tuple[int, int]]) -> None:
    """Give the dense ranges of llama.cpp's mapping back the kernel's default read-around (a load
    that did not read the file leaves it MADV_RANDOM)."""
    for addr, length in ranges:
        _libc.madvise(addr, length, mmap.MADV_NORMAL)


def dense_ranges(files: ModelFiles, tensors: list[seam.ExpertTensor]) -> list[tuple[int, int]]:
    """Page-aligned (address, length) of every dense tensor (`ModelFiles.dense_names`) in llama.cpp's
    mapping, merged.

    llama.cpp maps each file whole and points a tensor at `mapping + file offset`; an expert
    tensor's data pointer, read before it is rebound into the slab's pools, gives each file's mapping.
    """
    base: dict[int, int] = {}
    for t in tensors:
        ext = files.extents[t.name]
        base.setdefault(ext.file_index, seam.tensor_at(t.addr).data - ext.offset)
    spans = sorted((base[e.file_index] + e.offset, base[e.file_index] + e.offset + e.nbytes)
                   for e in (files.extents[n] for n in files.dense_names()) if e.file_index in base)
    merged: list[list[int]] = []
    for start, end in spans:
        start, end = start - start % PAGE, -(-end // PAGE) * PAGE
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e - s) for s, e in merged]


def pin(ranges: list[tuple[int, int]]) -> int:
    """mlock every range (reading in what is not resident); returns the bytes locked. On failure
    nothing stays locked and OSError says why (RLIMIT_MEMLOCK for a non-root user, typically)."""
    done: list[tuple[int, int]] = []
    for addr, length in ranges:
        if _libc.mlock(addr, length) != 0:
            err = ctypes.get_errno()
            unpin(done)
            raise OSError(err, f"cannot lock {sum(n for _, n in ranges) >> 20} MiB of dense weights "
                               f"({os.strerror(err)}); raise the locked-memory limit (ulimit -l) or drop --pin-dense")
        done.append((addr, length))
    return sum(n for _, n in done)


def unpin(ranges: list[tuple[int, int]]) -> None:
    for addr, length in ranges:
        _libc.munlock(addr, length)
