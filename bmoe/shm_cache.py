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
import stat
from pathlib import Path

import posix_ipc

PAGE = 4096
SHM_PREFIX = "bmoe-"
SHM_DIR = Path("/dev/shm")
NAME_TRIES = 8  # fresh names tried when one is taken (by a segment of another user, or planted)


def segment_name(pid: int | None = None) -> str:
    """A new segment's name, `bmoe-<uid>-<pid>-<hex>`: the uid keeps users' segments apart in the
    shared /dev/shm, the pid tells a later start whether the owner still runs."""
    return f"{SHM_PREFIX}{os.geteuid()}-{os.getpid() if pid is None else pid}-{secrets.token_hex(4)}"


def segment_owner(name: str) -> tuple[int | None, int] | None:
    """(uid, pid) of a segment named by `segment_name`; (None, pid) for `bmoe-<pid>-<hex>`, the name
    before the uid was in it (a run of an older bmoe); None for any other name."""
    parts = name.split("-")
    ids = parts[1:-1]
    if f"{parts[0]}-" != SHM_PREFIX or len(ids) not in (1, 2) or not all(i.isdigit() for i in ids):
        return None
    return (int(ids[0]), int(ids[1])) if len(ids) == 2 else (None, int(ids[0]))


def segments_of(pid: int) -> list[Path]:
    """The segments process `pid` made (for measuring a run's slab from outside)."""
    if not SHM_DIR.is_dir():
        return []
    out = []
    for p in SHM_DIR.glob(f"{SHM_PREFIX}*"):
        owner = segment_owner(p.name)
        if owner is not None and owner[1] == pid:
            out.append(p)
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_segments() -> list[str]:
    """Remove this user's segments whose owning process is dead (left by a SIGKILLed run).

    /dev/shm is shared by every user: a segment another user owns, or one planted under our name,
    is left alone and never fails the start, whatever it is called or whoever can unlink it."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return removed
    uid = os.geteuid()
    for e in entries:
        owner = segment_owner(e.name)
        if owner is None or owner[0] not in (uid, None) or _pid_alive(owner[1]):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid != uid or not stat.S_ISREG(st.st_mode):
            continue
        try:
            posix_ipc.unlink_shared_memory("/" + e.name)
        except (posix_ipc.Error, OSError):
            continue
        removed.append(e.name)
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
            self._shm = self._create(size)
            self.name = self._shm.name
            self.fd = self._shm.fd
        self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.base = _address_of(self.mm)
        self._open = True

    @staticmethod
    def _create(size: int) -> posix_ipc.SharedMemory:
        """A segment under a fresh name: a name that is taken (another user's segment, or one planted
        to block us) is passed over, never opened, so no start fails or shares memory on it."""
        for _ in range(NAME_TRIES):
            name = "/" + segment_name()
            try:
                return posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=size)
            except posix_ipc.ExistentialError:
                continue
            except (posix_ipc.Error, OSError) as e:
                raise OSError(
                    f"cannot create shared memory {name} of {size} bytes ({e}); check that /dev/shm "
                    "is mounted and has room, or use --shm memfd"
                ) from e
        raise OSError(f"cannot create shared memory: {NAME_TRIES} fresh names under /dev/shm/{SHM_PREFIX}* "
                      "were all taken; remove what is there or use --shm memfd")

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


