"""The shared-memory slab and the window: where expert bytes live and where llama.cpp sees them.

The slab is one shared segment (POSIX shm, or a memfd where /dev/shm is missing) that the I/O
lanes write expert slices into, a slot each. The window is a reserved address range that
llama.cpp's expert tensors point into; a slot is mapped into it (mmap MAP_FIXED) under the
expert whose bytes it holds, and an absent expert's range is inaccessible, so a stray read
faults instead of computing with someone else's weights. Which slot holds which expert, and
what the budget allows, is the cache's business (bmoe.expert_cache); this module only makes
the OS objects and maps them.
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
    removed = []
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


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_PROT_NONE, _MAP_FIXED, _MAP_NORESERVE, _MAP_POPULATE = 0, 0x10, 0x4000, 0x8000


class Window:
    """The address range llama.cpp's expert tensors point into; slots of the slab are mapped into it.

    Reserved inaccessible; `map` makes a range show a slot, `unmap` makes it inaccessible again.
    """

    def __init__(self, size: int, slab: Slab) -> None:
        self.size = size
        self.slab = slab
        addr = _libc.mmap(None, size, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if addr == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), f"cannot reserve {size} bytes of address space for the experts")
        self.base: int = addr

    def _mmap(self, offset: int, length: int, prot: int, flags: int, fd: int, slab_offset: int) -> None:
        if _libc.mmap(self.base + offset, length, prot, flags | _MAP_FIXED, fd, slab_offset) == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot map {length} bytes of the expert window ({os.strerror(err)}); "
                               "if this is ENOMEM, raise vm.max_map_count or lower --cache-mb")

    def map(self, offset: int, length: int, slab_offset: int) -> None:
        self._mmap(offset, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_POPULATE,
                   self.slab.fd, slab_offset)

    def unmap(self, offset: int, length: int) -> None:
        self._mmap(offset, length, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)

    def close(self) -> None:
        if self.base:
            _libc.munmap(self.base, self.size)
            self.base = 0


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


