"""O_DIRECT read bandwidth of the model file for the requests bmoe issues.

bmoe reads one expert slice at a time: tensors `blk.N.ffn_*_exps.weight` have ggml shape
[.., .., n_expert] and one expert's slice is n_bytes / n_expert, read as its 4 KiB-aligned
superset (it fills one slot of the slab). This measures exactly those requests at random
experts, single-threaded and with several threads (Python threads release the GIL in preadv).
"""

from __future__ import annotations

import mmap
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import gguf

from bmoe.base import EXPERT_TENSOR, MiB
from bmoe.shm_cache import PAGE


@dataclass(frozen=True)
class ExpertSpan:
    file_index: int
    name: str
    offset: int
    nbytes: int
    n_expert: int

    @property
    def slice_bytes(self) -> int:
        return self.nbytes // self.n_expert

    def request(self, e: int) -> tuple[int, int]:
        """(aligned file offset, aligned length) of expert e's slice superset."""
        start = self.offset + e * self.slice_bytes
        end = start + self.slice_bytes
        a = start - start % PAGE
        b = -(-end // PAGE) * PAGE
        return a, b - a


def expert_tensors(paths: list[Path]) -> list[ExpertSpan]:
    out = []
    for i, p in enumerate(paths):
        r = gguf.GGUFReader(p)
        for t in r.tensors:
            if EXPERT_TENSOR.match(t.name) and len(t.shape) >= 3 and int(t.shape[-1]) > 0:
                out.append(ExpertSpan(i, t.name, int(t.data_offset), int(t.n_bytes), int(t.shape[-1])))
        del r
    return out


def tensor_bytes(paths: list[Path]) -> tuple[int, int]:
    """(expert tensor bytes, all tensor bytes) over the file set."""
    expert = total = 0
    for p in paths:
        r = gguf.GGUFReader(p)
        for t in r.tensors:
            total += int(t.n_bytes)
            if EXPERT_TENSOR.match(t.name):
                expert += int(t.n_bytes)
        del r
    return expert, total


@dataclass
class Bandwidth:
    threads: int
    mib_s: float
    bytes: int
    requests: int
    seconds: float
    mode: str  # "O_DIRECT" or "buffered+DONTNEED"


def _open(path: Path) -> tuple[int, bool]:
    if hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT), True
        except OSError:
            pass
    return os.open(path, os.O_RDONLY), False


def measure(paths: list[Path], tensors: list[ExpertSpan], total_mb: float, threads: int,
            seed: int = 0) -> Bandwidth:
    """Read about `total_mb` MiB of random expert-slice requests with `threads` threads."""
    if not tensors:
        raise ValueError("the model has no expert tensors (blk.N.ffn_*_exps.weight)")
    rng = random.Random(seed)
    target = int(total_mb * MiB)
    reqs: list[tuple[int, int, int]] = []
    got = 0
    while got < target:
        t = rng.choice(tensors)
        off, n = t.request(rng.randrange(t.n_expert))
        reqs.append((t.file_index, off, n))
        got += n
    fds = [_open(p) for p in paths]
    direct = all(d for _, d in fds)
    if not direct:  # mixed: read everything buffered so the mode is one thing
        for fd, _ in fds:
            os.close(fd)
        fds = [(os.open(p, os.O_RDONLY), False) for p in paths]
    bufsize = max(n for _, _, n in reqs)
    nxt = iter(range(len(reqs)))
    lock = threading.Lock()
    done = [0] * threads
    errors: list[BaseException] = []

    def work(k: int) -> None:
        buf = mmap.mmap(-1, bufsize)  # page-aligned, as O_DIRECT wants
        view = memoryview(buf)
        try:
            while True:
                with lock:
                    i = next(nxt, None)
                if i is None:
                    return
                fi, off, n = reqs[i]
                fd = fds[fi][0]
                r = os.preadv(fd, [view[:n]], off)
                if not direct:
                    os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
                done[k] += r
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            errors.append(e)
        finally:
            view.release()
            buf.close()

    ts = [threading.Thread(target=work, args=(k,), name=f"bmoe-bench-bw{k}") for k in range(threads)]
    t0 = time.perf_counter()
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    dt = time.perf_counter() - t0
    for fd, _ in fds:
        os.close(fd)
    if errors:
        raise errors[0]
    total = sum(done)
    return Bandwidth(threads, total / MiB / dt if dt > 0 else 0.0, total, len(reqs), dt,
                     "O_DIRECT" if direct else "buffered+DONTNEED")
