"""The shared-memory slab: where expert bytes live, and where llama.cpp reads them.

The slab is one shared segment (POSIX shm, or a memfd where /dev/shm is missing) that the I/O
lanes write expert slices into, a slot each. The coordinator maps it once; llama.cpp's expert
tensors point into that mapping (pools of slots, see bmoe.streaming.expert_cache), so filling or reusing a
slot changes no mapping. Which slot holds which expert, and what the budget allows, is the
cache's business; this module only makes the OS objects and gives pages back.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
from pathlib import Path

import posix_ipc

PAGE = 4096
SHM_PREFIX = "bmoe-"
SHM_DIR = Path("/dev/shm")

def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_segments() -> list[str]:
    """Remove segments whose owning process is dead (left by a SIGKILLed run)."""
    removed: list[str] = []
    if not SHM_DIR.is_dir():
        return removed
    for p in SHM_DIR.glob(f"{SHM_PREFIX}*"):
        parts = p.name.split("-")
        if len(parts) < 3 or not parts[1].isdigit() or _pid_alive(int(parts[1])):
            continue
        try:
            posix_ipc.unlink_shared_memory("/" + p.name)
            removed.append(p.name)
        except posix_ipc.ExistentialError:
            pass
    return removed


class Slab:
    """The shared segment: created by the coordinator, mapped by every lane.

    A POSIX shared-memory object when /dev/shm exists; otherwise (Android) an
    anonymous memfd that lanes open through /proc/<pid>/fd/<n>. `name` is what a
    lane passes to `open_segment`.
    """

    def __init__(self, size: int, backend: str = "auto") -> None:
        self.size = size
        if backend == "auto":
            backend = "posix" if SHM_DIR.is_dir() else "memfd"
        self.backend = backend
        self._shm: posix_ipc.SharedMemory | None = None
        if backend == "memfd":
            self.fd = os.memfd_create(f"{SHM_PREFIX}{os.getpid()}", 0)
            os.ftruncate(self.fd, size)
            self.name = f"/proc/{os.getpid()}/fd/{self.fd}"
        else:
            self.name = f"/{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
            try:
                self._shm = posix_ipc.SharedMemory(self.name, posix_ipc.O_CREX, size=size)
            except (posix_ipc.Error, OSError) as e:
                raise OSError(
                    f"cannot create shared memory {self.name} of {size} bytes ({e}); check that /dev/shm "
                    "is mounted and has room, or use --shm memfd"
                ) from e
            self.fd = self._shm.fd
        self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.base = _address_of(self.mm)
        self._open = True

    def resident_bytes(self) -> int:
        return os.fstat(self.fd).st_blocks * 512

    def release(self, start: int, end: int) -> None:
        if end > start:
            self.mm.madvise(mmap.MADV_REMOVE, start, end - start)

    def unlink(self) -> None:
        """Remove the segment's name (the memory goes once the last mapping does) but keep this
        process's mapping: for a close that cannot unmap under a decode still reading it."""
        if self._shm is not None:
            try:
                self._shm.unlink()
            except posix_ipc.ExistentialError:
                pass

    def close(self) -> None:
        """Unmap and unlink; safe to call twice and from a signal path."""
        if not self._open:
            return
        self._open = False
        try:
            self.mm.close()
        except BufferError:
            pass  # a ctypes view still exported; the mapping goes with the process
        if self._shm is None:
            os.close(self.fd)
            return
        try:
            self._shm.close_fd()
        except posix_ipc.Error:
            pass
        try:
            self._shm.unlink()
        except posix_ipc.ExistentialError:
            pass


def open_segment(name: str) -> mmap.mmap:
    """A lane's mapping of the slab, by the name the coordinator passed it."""
    if name.startswith("/proc/"):
        fd = os.open(name, os.O_RDWR)
    else:
        fd = posix_ipc.SharedMemory(name).fd
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _address_of(mm: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


