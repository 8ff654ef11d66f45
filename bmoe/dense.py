"""The dense weights (attention, norms, routers, embeddings): where llama.cpp maps them, and pinning them.

They stay in llama.cpp's own mapping of the file, as page cache. Under a tight memory limit the
kernel reclaims page cache before the cache's shared-memory slots (which it cannot drop without
swap), so every token faults the dense weights back in from flash: measured on the 64-expert
demo model under a 1500 MiB cgroup with a cold page cache and `--cache-mb 1300`, 594 major faults
per token and 0.33-0.56 tok/s (bench/reports/2026-11-30-issue14/). `--pin-dense` locks their
pages (mlock) so they stay, and their bytes join the charge the cache budget is measured against.
"""

from __future__ import annotations

import ctypes
import os

from bmoe import seam
from bmoe.model_files import EXPERT_TENSOR, ModelFiles
from bmoe.shm_cache import PAGE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def dense_ranges(files: ModelFiles, tensors: list[seam.ExpertTensor]) -> list[tuple[int, int]]:
    """Page-aligned (address, length) of every non-expert tensor in llama.cpp's mapping, merged.

    llama.cpp maps each file whole and points a tensor at `mapping + file offset`; an expert
    tensor's data pointer, read before it is rebound into the slab's pools, gives each file's mapping.
    """
    base: dict[int, int] = {}
    for t in tensors:
        ext = files.extents[t.name]
        base.setdefault(ext.file_index, seam.tensor_at(t.addr).data - ext.offset)
    spans = sorted((base[e.file_index] + e.offset, base[e.file_index] + e.offset + e.nbytes)
                   for name, e in files.extents.items()
                   if not EXPERT_TENSOR.match(name) and e.file_index in base and e.nbytes)
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
