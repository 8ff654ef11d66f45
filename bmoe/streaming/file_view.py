"""Under a budget that holds every expert, a layer may read its experts where plain llama.cpp reads
them: llama.cpp's own mapping of the model file, when the page cache holds all of the layer's expert
bytes (another program, an earlier run or a `cat` left the file in memory).

Such a layer runs through without a stop and without a read: the same bytes at the same speed as
plain llama.cpp (the kernel maps a file's large folios with 2 MiB pages, where the slab's shared
memory has 4 KiB ones), while the fill copies them into the slab in idle time
(bmoe.streaming.warm_fill); a layer the page cache does not hold whole reads the slab once it holds
the layer (bmoe.streaming.streamer.Streamer.run_through). The slab is what bmoe's budget owns and the
kernel cannot take back; the page cache is the kernel's and may be, so each layer's answer is looked
at again RECHECK_S later, and at once after a decode in which
the process took a major fault (`after_faults`). A page evicted in between is read back by a page
fault, the same bytes: while a layer reads the mapping its ranges get the kernel's default
read-around (`read_around`), so such a fault reads a run of pages at the device's speed, not the 4
KiB at a time of the MADV_RANDOM a streaming load leaves them (bmoe.seam.no_populate).
"""

from __future__ import annotations

import ctypes
import mmap
import resource
import time

from bmoe import seam
from bmoe.workers.io_lane import all_cached

# how long a layer's answer (in the page cache or not) stands: mincore over a layer's experts costs
# tens of microseconds, too much to ask at every layer of every token
RECHECK_S = 0.5
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


class FileView:
    """Which layers' experts the page cache holds whole, through llama.cpp's mapping of the file."""

    def __init__(self, tensors: dict[int, list[seam.ExpertTensor]]) -> None:
        self.extents = {layer: [(t.data, t.nbytes) for t in ts] for layer, ts in tensors.items()}
        self.seen: dict[int, tuple[float, bool]] = {}  # layer -> (answer good until, in the page cache)
        self.faults = 0  # the process's major faults when last looked

    def cached(self, layer: int) -> bool:
        """Whether the layer's expert bytes are all in the page cache (as of at most RECHECK_S ago)."""
        now = time.monotonic()
        seen = self.seen.get(layer)
        if seen is not None and seen[0] > now:
            return seen[1]
        held = all(all_cached(addr, n) for addr, n in self.extents[layer])
        self.seen[layer] = (now + RECHECK_S, held)
        return held

    def after_faults(self) -> None:
        """Forget every answer if the process took a major fault since the last call: a page of the
        file (an expert a layer reads through the mapping, or a dense weight) was read back from the
        device, so the page cache is being reclaimed and the layers are looked at again."""
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        if faults != self.faults:
            self.faults = faults
            self.seen.clear()

    def read_around(self, layer: int, on: bool) -> None:
        """Advise the layer's expert ranges of the mapping MADV_NORMAL while it reads them (`on`), else
        back to MADV_RANDOM, so nothing else faulting there reads ahead."""
        for addr, n in self.extents[layer]:
            start = addr - addr % mmap.PAGESIZE
            _libc.madvise(start, addr + n - start, mmap.MADV_NORMAL if on else mmap.MADV_RANDOM)
