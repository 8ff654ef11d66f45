"""System plumbing for `bmoe-bench`: memory limits, cold page cache, process-tree sampling.

A memory limit is applied per benchmark run, to the `bmoe-cli` process and everything it
spawns (the I/O lanes), in the first way that works here:

1. a cgroup v1 memory cgroup (`memory.limit_in_bytes`), created fresh for each run so its
   `memory.max_usage_in_bytes` is that run's peak;
2. a cgroup v2 child cgroup (`memory.max`, peak from `memory.peak`);
3. a *balloon*: a helper process that holds enough touched (and, when allowed, mlocked)
   anonymous memory that only about the limit is left on the machine.

The child joins its cgroup *before it allocates anything*: it is started as
`sh -c 'echo $$ > .../cgroup.procs && shift && exec "$@"' ...`. Cgroups are removed after
each run, on errors, on Ctrl-C / SIGTERM and at interpreter exit.
"""

from __future__ import annotations

import atexit
import mmap
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bmoe import workers
from bmoe.base import MiB
from bmoe.shm_cache import SHM_DIR, segment_owner

CGROUP_PREFIX = "bmoe-bench-"
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
_JOIN = 'echo $$ > "$1" && shift && exec "$@"'


class LimitError(Exception):
    """The requested memory-limit method cannot be used here."""


# ---- cold page cache ---------------------------------------------------------------------------

def drop_file_cache(paths: Sequence[str | os.PathLike[str]]) -> None:
    """Evict the model file(s) from the page cache (pages still mapped by a live process stay; a file just
    written is written back first, since dirty pages are not dropped)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_into_page_cache(path: str | os.PathLike[str], advice: int = os.POSIX_FADV_SEQUENTIAL) -> None:
    """Read the file whole through the page cache: read ahead (`advice` SEQUENTIAL, where ext4 keeps large folios
    that a mapping then maps with 2 MiB entries) or in 4 KiB pages (POSIX_FADV_RANDOM)."""
    fd = os.open(path, os.O_RDONLY)
    buf = bytearray(8 << 20)
    try:
        os.posix_fadvise(fd, 0, 0, advice)
        offset = 0
        while (n := os.preadv(fd, [buf], offset)) > 0:
            offset += n
    finally:
        os.close(fd)


def drop_all_caches() -> bool:
    """`echo 1 > /proc/sys/vm/drop_caches`; False when not writable (not root, read-only /proc)."""
    try:
        os.sync()
        DROP_CACHES.write_text("1\n")
        return True
    except OSError:
        return False


# ---- cgroups -----------------------------------------------------------------------------------

def _mounts() -> list[tuple[str, str, set[str]]]:
    out = []
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 4:
                out.append((parts[1], parts[2], set(parts[3].split(","))))
    except OSError:
        pass
    return out


def _own_cgroup(v2: bool) -> str:
    """This process's cgroup path (relative to the hierarchy root) for the memory controller."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return "/"
    for line in lines:
        hid, ctrls, path = line.split(":", 2)
        if v2 and hid == "0" and ctrls == "":
            return path or "/"
        if not v2 and "memory" in ctrls.split(","):
            return path or "/"
    return "/"


@dataclass
class CgroupHierarchy:
    version: int  # 1 or 2
    root: Path  # the mount point of the hierarchy holding the memory controller
    parent: Path  # where per-run cgroups are created


def find_cgroup(parent: str | None = None) -> CgroupHierarchy | None:
    """The memory-controller hierarchy, v1 preferred; None when there is none."""
    mounts = _mounts()
    for mnt, fstype, opts in mounts:
        if fstype == "cgroup" and "memory" in opts:
            rel = parent if parent is not None else _own_cgroup(v2=False)
            return CgroupHierarchy(1, Path(mnt), Path(mnt) / rel.lstrip("/"))
    for mnt, fstype, _opts in mounts:
        if fstype != "cgroup2":
            continue
        try:
            ctrls = (Path(mnt) / "cgroup.controllers").read_text().split()
        except OSError:
            continue
        if "memory" in ctrls:
            rel = parent if parent is not None else _own_cgroup(v2=True)
            return CgroupHierarchy(2, Path(mnt), Path(mnt) / rel.lstrip("/"))
    return None


_LIVE: set[Path] = set()  # cgroups created by this process and not yet removed


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _keyed(path: Path) -> dict[str, int]:
    out = {}
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if v.strip().lstrip("-").isdigit():
                out[k] = int(v)
    except OSError:
        pass
    return out


class Cgroup:
    """One per-run memory cgroup. Use as a context manager; removal also runs at exit."""

    def __init__(self, h: CgroupHierarchy, name: str, limit_bytes: int) -> None:
        self.h = h
        self.path = h.parent / name
        self.limit_bytes = limit_bytes
        if h.version == 2:
            self._enable_v2_controller()
        try:
            self.path.mkdir()
        except OSError as e:
            raise LimitError(f"cannot create {self.path}: {e.strerror}") from e
        _LIVE.add(self.path)
        try:
            if h.version == 1:
                _write(self.path / "memory.limit_in_bytes", str(limit_bytes))
                try:  # no swap escape where swap accounting exists (memsw must be >= limit)
                    _write(self.path / "memory.memsw.limit_in_bytes", str(limit_bytes))
                except OSError:
                    pass
            else:
                _write(self.path / "memory.max", str(limit_bytes))
                try:
                    _write(self.path / "memory.swap.max", "0")
                except OSError:
                    pass
        except OSError as e:
            self.remove()
            raise LimitError(f"cannot set the memory limit in {self.path}: {e.strerror}") from e

    def _enable_v2_controller(self) -> None:
        sub = self.h.parent / "cgroup.subtree_control"
        try:
            if "memory" not in sub.read_text().split():
                _write(sub, "+memory")
        except OSError as e:
            raise LimitError(f"cannot enable the memory controller in {sub}: {e.strerror} "
                             "(cgroup v2 forbids it while that cgroup holds processes; "
                             "pass --cgroup-parent to an empty, delegated cgroup)") from e

    def set_limit(self, limit_bytes: int) -> None:
        """Move the limit while the run goes on (a squeeze, then the way back)."""
        name = "memory.limit_in_bytes" if self.h.version == 1 else "memory.max"
        if self.h.version == 1 and limit_bytes > self.limit_bytes:  # v1: memsw must stay >= the limit
            self._try_write("memory.memsw.limit_in_bytes", limit_bytes)
            _write(self.path / name, str(limit_bytes))
        else:
            _write(self.path / name, str(limit_bytes))
            if self.h.version == 1:
                self._try_write("memory.memsw.limit_in_bytes", limit_bytes)
        self.limit_bytes = limit_bytes

    def usage_bytes(self) -> int | None:
        """What the cgroup is charged now (its page cache included)."""
        return _read_int(self.path / ("memory.usage_in_bytes" if self.h.version == 1 else "memory.current"))

    def _try_write(self, name: str, value: int) -> None:
        try:
            _write(self.path / name, str(value))
        except OSError:  # no swap accounting here
            pass

    @property
    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    def wrap(self, cmd: list[str]) -> list[str]:
        """`cmd`, started so that it joins this cgroup before it runs anything else."""
        return ["/bin/sh", "-c", _JOIN, "bmoe-bench-join", str(self.procs_file), *cmd]

    def python(self, directory: Path) -> str:
        """An executable in `directory` that joins this cgroup and then runs this Python: for drivers
        that take an interpreter rather than a command line (bmoe.edges.session_client.SessionClient)."""
        path = directory / f"python-in-{self.path.name}"
        path.write_text(f'#!/bin/sh\necho $$ > "{self.procs_file}" && exec "{sys.executable}" "$@"\n')
        path.chmod(0o755)
        return str(path)

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in self.procs_file.read_text().split()]
        except (OSError, ValueError):
            return []

    def peak_bytes(self) -> int | None:
        name = "memory.max_usage_in_bytes" if self.h.version == 1 else "memory.peak"
        return _read_int(self.path / name)

    def oom_kills(self) -> int | None:
        if self.h.version == 1:
            return _keyed(self.path / "memory.oom_control").get("oom_kill")
        return _keyed(self.path / "memory.events").get("oom_kill")

    def remove(self, grace: float = 5.0) -> None:
        """Wait for (then kill) what is left inside, and rmdir. Safe to call twice."""
        if self.path not in _LIVE:
            return
        _remove_cgroup(self.path, grace)

    def __enter__(self) -> Cgroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _remove_cgroup(path: Path, grace: float) -> None:
    deadline = time.monotonic() + grace
    killed = False
    while True:
        try:
            pids = [int(x) for x in (path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            pids = []
        if not pids:
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                if time.monotonic() < deadline + 5:
                    time.sleep(0.05)
                    continue
                print(f"bmoe-bench: warning: could not remove {path}; remove it with rmdir", file=sys.stderr)
            _LIVE.discard(path)
            return
        if time.monotonic() > deadline and not killed:
            for pid in pids:  # only our own benchmark's processes can be in this cgroup
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            killed = True
            deadline = time.monotonic() + grace
        elif time.monotonic() > deadline:
            print(f"bmoe-bench: warning: processes {pids} stay in {path}", file=sys.stderr)
            _LIVE.discard(path)
            return
        time.sleep(0.05)


@atexit.register
def remove_all_cgroups() -> None:
    for p in list(_LIVE):
        _remove_cgroup(p, grace=2.0)


def probe_cgroup(h: CgroupHierarchy) -> None:
    """Create a cgroup, start a trivial process inside it the way real runs are started, remove it.

    Raises LimitError with the reason when any step is refused.
    """
    cg = Cgroup(h, f"{CGROUP_PREFIX}{os.getpid()}-probe", 64 * MiB)
    try:
        r = subprocess.run(cg.wrap(["/bin/sh", "-c", 'cat /proc/self/cgroup']), capture_output=True,
                           text=True, timeout=10)
        if r.returncode != 0 or cg.path.name not in r.stdout:
            raise LimitError(f"cannot move a process into {cg.path}: {r.stderr.strip() or r.stdout.strip()}")
    finally:
        cg.remove()


# ---- balloon -----------------------------------------------------------------------------------

def available_bytes() -> int:
    return psutil.virtual_memory().available


class Balloon:
    """A helper process holding `nbytes` of touched anonymous memory (mlocked when allowed); `cgroup`
    puts it in that cgroup, beside the run it competes with."""

    def __init__(self, nbytes: int, timeout: float = 300.0, cgroup: Cgroup | None = None) -> None:
        self.nbytes = nbytes
        self.locked = False
        cmd = workers.command("bmoe.tools.bench_sys", "balloon", str(nbytes))
        self.proc = subprocess.Popen(cgroup.wrap(cmd) if cgroup else cmd,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        t = threading.Timer(timeout, self.proc.kill)
        t.start()
        assert self.proc.stdout is not None  # stdout=PIPE
        try:
            line = self.proc.stdout.readline().strip()
        finally:
            t.cancel()
        if not line.startswith("ready"):
            self.close()
            raise LimitError(f"balloon of {nbytes / MiB:.0f} MiB did not start (got {line!r})")
        self.locked = line == "ready locked"

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None  # stdin=PIPE
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Balloon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _balloon_main(nbytes: int) -> int:
    mm = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE), mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    step = mmap.PAGESIZE
    for off in range(0, len(mm), step):
        mm[off] = 1
    locked = False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        locked = libc.mlockall(1) == 0  # MCL_CURRENT
    except (OSError, AttributeError):
        pass
    sys.stdout.write("ready locked\n" if locked else "ready\n")
    sys.stdout.flush()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the bench closes stdin to end us
    sys.stdin.read()
    return 0


# ---- process-tree sampling ---------------------------------------------------------------------

def status_kb(pid: int) -> dict[str, int]:
    """A process's resident memory by kind (RssAnon, RssFile, RssShmem), in KiB; empty once it is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                    k, v = line.split(":", 1)
                    out[k] = int(v.split()[0])
    except (OSError, ValueError):
        pass
    return out


def _read_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def shm_bytes(pids: set[int]) -> int:
    """The blocks of the bmoe shared-memory segments these processes own (each counted once)."""
    total = 0
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return 0
    for e in entries:
        owner = segment_owner(e.name)
        if owner is not None and owner[1] in pids:
            try:
                total += e.stat().st_blocks * 512
            except OSError:
                pass
    return total


@dataclass
class TreeSampler:
    """Samples a process tree's memory: anonymous RSS + file-backed RSS + bmoe shared memory.

    Anonymous RSS is summed over the processes. File-backed RSS (the interpreter, libraries, the
    model mapping) is mostly the same pages in every process of the tree, so the largest one
    stands for all. Shared memory is counted once, from the bmoe segments' allocated blocks,
    not from every process's RssShmem (each I/O lane maps the same slab).
    """

    pid: int
    interval: float = 0.1
    peak_total: int = 0
    peak_rss: int = 0
    peak_shm: int = 0
    samples: int = 0
    _io: dict[int, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> TreeSampler:
        self._thread = threading.Thread(target=self._loop, name="bmoe-bench-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()

    @property
    def read_bytes(self) -> int:
        """Storage bytes read by the tree (last sample of each process's /proc/PID/io)."""
        return sum(self._io.values())

    def sample(self) -> None:
        try:
            root = psutil.Process(self.pid)
            pids = {self.pid} | {c.pid for c in root.children(recursive=True)}
        except psutil.Error:
            return
        anon = file = 0
        for pid in pids:
            st = status_kb(pid)
            anon += st.get("RssAnon", 0) * 1024
            file = max(file, st.get("RssFile", 0) * 1024)
            rb = _read_bytes(pid)
            if rb is not None:
                self._io[pid] = rb
        shm = shm_bytes(pids)
        rss = anon + file
        self.samples += 1
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_shm = max(self.peak_shm, shm)
        self.peak_total = max(self.peak_total, rss + shm)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)


class ServerProcess:
    """`bmoe-server` started by a benchmark: every stderr line kept (read on a thread, so the server
    never blocks on a full pipe) and its URL once it says where it serves."""

    def __init__(self, cmd: list[str], cwd: Path | None = None, new_session: bool = False,
                 wait_s: float | None = None) -> None:
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, cwd=cwd,
                                     start_new_session=new_session)
        self.lines: list[str] = []
        self.url = ""
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stderr is not None  # stderr=PIPE
            for raw in self.proc.stderr:
                line = raw.decode(errors="replace")
                self.lines.append(line)
                m = re.match(r"bmoe: serving \S+ at (http://\S+)/v1 ", line)
                if m:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(wait_s)
        if not self.url:
            raise SystemExit(f"bmoe-server did not start (exit {self.proc.poll()}):\n" + "".join(self.lines[-20:]))


def kill_group(proc: subprocess.Popen, grace: float = 3.0) -> None:
    """End a child started with start_new_session=True, and the process group it leads."""
    if proc.poll() is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers (lanes) of an already-dead leader
        except (ProcessLookupError, PermissionError):
            pass
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "balloon":
        sys.exit(_balloon_main(int(sys.argv[2])))
    print("usage: python -m bmoe.tools.bench_sys balloon NBYTES", file=sys.stderr)
    sys.exit(2)
