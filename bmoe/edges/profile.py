"""Process-level profile of a run: one row per process (coordinator, each lane, spec-gate).

Taken with psutil while the workers are still alive, so their counters are final
for the run. Peak RSS comes from the kernel's high-water mark (VmHWM).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, fields

import psutil

from bmoe.base import MiB


@dataclass
class ProcRow:
    role: str
    pid: int
    cpu_user_s: float
    cpu_sys_s: float
    peak_rss_mib: float
    shared_mib: float
    read_bytes: int
    ctx_switches: int
    minor_faults: int  # page faults served from memory: a slab page or mapped file page touched first here
    major_faults: int  # page faults that read the device


def _peak_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _faults(pid: int) -> tuple[int, int]:
    """(minor, major) page faults of the process so far (/proc/PID/stat's minflt and majflt)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields_ = f.read().rsplit(")", 1)[1].split()
        return int(fields_[7]), int(fields_[9])
    except (OSError, IndexError, ValueError):
        return 0, 0


def proc_row(role: str, pid: int) -> ProcRow:
    p = psutil.Process(pid)
    with p.oneshot():
        cpu = p.cpu_times()
        mem = p.memory_info()
        try:
            read = p.io_counters().read_bytes
        except (psutil.AccessDenied, AttributeError):
            read = 0
        ctx = p.num_ctx_switches()
    return ProcRow(role, pid, cpu.user, cpu.system, _peak_rss(pid) / MiB, getattr(mem, "shared", 0) / MiB,
                   read, ctx.voluntary + ctx.involuntary, *_faults(pid))


def collect(workers: list[tuple[str, int]]) -> list[ProcRow]:
    rows = [proc_row("coordinator", os.getpid())]
    for role, pid in workers:
        try:
            rows.append(proc_row(role, pid))
        except psutil.NoSuchProcess:
            pass
    return rows


COLUMNS = [f.name for f in fields(ProcRow)]


def process_table(rows: list[ProcRow], slab_resident: int, lanes: Sequence[str] = ()) -> str:
    """The rows, the slab's resident bytes, then `lanes` (Engine.lane_lines: busy time, queue depth)."""
    head = f"{'role':<12} {'pid':>7} {'user_s':>8} {'sys_s':>8} {'peak_rss_MiB':>13} {'shared_MiB':>11} " \
           f"{'read_MiB':>9} {'ctx_sw':>8} {'minflt':>9} {'majflt':>7}"
    out = [head]
    for r in rows:
        out.append(f"{r.role:<12} {r.pid:>7} {r.cpu_user_s:>8.2f} {r.cpu_sys_s:>8.2f} {r.peak_rss_mib:>13.1f} "
                   f"{r.shared_mib:>11.1f} {r.read_bytes / MiB:>9.2f} {r.ctx_switches:>8} {r.minor_faults:>9} "
                   f"{r.major_faults:>7}")
    out.append(f"slab resident: {slab_resident / MiB:.1f} MiB")
    out.extend(lanes)
    return "\n".join(out)


def csv_text(rows: list[ProcRow], slab_resident: int) -> str:
    lines = [",".join(COLUMNS)]
    for r in rows:
        lines.append(",".join(str(round(getattr(r, c), 4)) if isinstance(getattr(r, c), float)
                              else str(getattr(r, c)) for c in COLUMNS))
    lines.append(f"# slab_resident_bytes={slab_resident}")
    return "\n".join(lines) + "\n"
