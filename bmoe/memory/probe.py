"""How much more memory this process may take, under every limit that applies to it.

A container's cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`, at this process's cgroup and
every ancestor), the machine's `MemAvailable`, and `RLIMIT_AS`/`RLIMIT_DATA`. A cgroup's room is
its limit minus its charge net of the page cache (`active_file` + `inactive_file`): the charge
already holds bmoe's own memory (coordinator and lanes, the KV, the cache's resident pages,
which are shared memory, not file pages), so that is counted, not assumed.

Page cache is counted as free in every room, and the page cache this process needs to keep (the
dense weights llama.cpp reads through its mapping, `MemoryProbe.kept`) as in use: the room is
then the same whether a start found the model cold (its pages charged here as it reads them,
inactive at first, active after use) or warm (charged to whoever read them first), and whether
the load read the whole file or not. Counting only `inactive_file` as reclaimable made a cold
`auto` budget depend on how much of a just-read file the kernel had called active: 1031-1143 MiB
cold against 1737 MiB warm on the 64-expert demo under 2500 MiB (issue 21).

Reading it is a few small files, cheap enough to do once per token; `MemoryProbe(proc, cgroup_root)`
reads a fabricated tree in tests.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

from bmoe.base.units import MiB

V1_UNLIMITED = 1 << 62  # v1 reports "no limit" as a page-rounded LONG_MAX


@dataclass(frozen=True)
class Room:
    """Bytes still to be had under one limit, and what that limit is, for the user."""

    bytes: int
    name: str  # e.g. "cgroup /docker/x (limit 2500 MiB, charge 900 MiB of which 200 MiB page cache)"
    cgroup_limit: int | None = None  # the limit itself, for a cgroup's room


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _keyed(text: str | None) -> dict[str, int]:
    out = {}
    for line in (text or "").splitlines():
        k, _, v = line.partition(" ")
        if v.strip().isdigit():
            out[k] = int(v)
    return out


def _kb(text: str | None) -> dict[str, int]:
    """`Key:   123 kB` lines (/proc/meminfo, /proc/self/status) as bytes by key."""
    out = {}
    for line in (text or "").splitlines():
        k, _, v = line.partition(":")
        f = v.split()
        if len(f) == 2 and f[1] == "kB" and f[0].isdigit():
            out[k] = int(f[0]) * 1024
    return out


def _int(text: str | None) -> int | None:
    try:
        return int(text.split()[0]) if text else None
    except ValueError:
        return None


class MemoryProbe:
    """The limits of this process; `proc` and `cgroup_root` default to the live system."""

    def __init__(self, proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> None:
        self.proc = proc
        self.kept = 0  # page cache this process keeps using (unpinned dense weights): in use in every room
        self.v2: list[Path] = []  # this process's cgroup v2 directories, innermost first
        self.v1: list[Path] = []  # the same for the v1 memory hierarchy
        v1_mount, v2_mount = self._mounts(proc, cgroup_root)
        for line in (_read(proc / "self" / "cgroup") or "").splitlines():
            hid, _, rest = line.partition(":")
            ctrls, _, rel = rest.partition(":")
            if hid == "0" and ctrls == "" and v2_mount is not None:
                self.v2 = self._ancestors(v2_mount, rel)
            elif "memory" in ctrls.split(",") and v1_mount is not None:
                self.v1 = self._ancestors(v1_mount, rel)

    @staticmethod
    def _mounts(proc: Path, cgroup_root: Path) -> tuple[Path | None, Path | None]:
        """Where the v1 memory controller and a v2 hierarchy that has it are mounted: from
        /proc/self/mounts (Android mounts v1 memory at /dev/memcg), else where systemd puts them."""
        v1 = v2 = None
        for line in (_read(proc / "self" / "mounts") or "").splitlines():
            f = line.split()
            if len(f) < 4:
                continue
            if f[2] == "cgroup" and "memory" in f[3].split(",") and v1 is None:
                v1 = Path(f[1])
            elif f[2] == "cgroup2" and "memory" in (_read(Path(f[1]) / "cgroup.controllers") or "").split():
                v2 = Path(f[1])
        if v1 is None and (cgroup_root / "memory" / "memory.limit_in_bytes").exists():
            v1 = cgroup_root / "memory"
        if v2 is None and "memory" in (_read(cgroup_root / "cgroup.controllers") or "").split():
            v2 = cgroup_root
        return v1, v2

    @staticmethod
    def _ancestors(root: Path, rel: str) -> list[Path]:
        """root/rel and each parent up to (not above) root, innermost first; missing ones left out
        (a container shows its own cgroup as the root)."""
        parts = [p for p in rel.strip("/").split("/") if p]
        dirs = [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
        return [d for d in dirs if d.is_dir()]

    def rooms(self) -> list[Room]:
        """Every limit that applies, as the room it leaves."""
        out = [r for r in (self._v2_room(d) for d in self.v2) if r is not None]
        out += [r for r in (self._v1_room(d) for d in self.v1) if r is not None]
        avail = _kb(_read(self.proc / "meminfo")).get("MemAvailable")
        if avail is not None:
            out.append(Room(max(0, avail - self.kept), f"available {avail / MiB:.0f} MiB{self._kept_text()}"))
        out += self._rlimit_rooms()
        return out

    def least(self) -> Room:
        """The tightest limit (the one that decides)."""
        return min(self.rooms(), key=lambda r: r.bytes)

    def _kept_text(self) -> str:
        return f" less the dense weights' {self.kept / MiB:.0f} MiB" if self.kept else ""

    def _cgroup_room(self, d: Path, limit: int, charge: int, page_cache: int) -> Room:
        net = max(0, charge - page_cache) + self.kept
        return Room(max(0, limit - net),
                    f"cgroup {self._label(d)} (limit {limit / MiB:.0f} MiB, charge {charge / MiB:.0f} MiB "
                    f"of which {page_cache / MiB:.0f} MiB page cache){self._kept_text()}", limit)

    def _label(self, d: Path) -> str:
        chain = self.v2 or self.v1
        return "/" + "/".join(d.relative_to(chain[-1]).parts) if chain else str(d)

    def _v2_room(self, d: Path) -> Room | None:
        raw = (_read(d / "memory.max") or "").strip()
        if not raw or raw == "max":
            return None
        charge = _int(_read(d / "memory.current"))
        if charge is None:
            return None
        stat = _keyed(_read(d / "memory.stat"))
        return self._cgroup_room(d, int(raw), charge, stat.get("inactive_file", 0) + stat.get("active_file", 0))

    def _v1_room(self, d: Path) -> Room | None:
        limit = _int(_read(d / "memory.limit_in_bytes"))
        charge = _int(_read(d / "memory.usage_in_bytes"))
        if limit is None or charge is None or limit >= V1_UNLIMITED:
            return None
        stat = _keyed(_read(d / "memory.stat"))
        return self._cgroup_room(d, limit, charge, sum(stat.get(f"total_{k}", stat.get(k, 0))
                                                       for k in ("inactive_file", "active_file")))

    def _rlimit_rooms(self) -> list[Room]:
        status = _kb(_read(self.proc / "self" / "status"))
        out = []
        for res, key, name in ((resource.RLIMIT_AS, "VmSize", "RLIMIT_AS"),
                               (resource.RLIMIT_DATA, "VmData", "RLIMIT_DATA")):
            soft, _ = resource.getrlimit(res)
            if soft != resource.RLIM_INFINITY and key in status:
                used = status[key]
                out.append(Room(max(0, soft - used), f"{name} {soft / MiB:.0f} MiB ({used / MiB:.0f} MiB in use)"))
        return out

    def pressure(self) -> float | None:
        """PSI `some avg10` (% of the last 10 s some task stalled on memory) for this cgroup (v2) or the
        machine; None where the kernel has no PSI."""
        for path in ([d / "memory.pressure" for d in self.v2[:1]] + [self.proc / "pressure" / "memory"]):
            text = _read(path)
            if text:
                for line in text.splitlines():
                    if line.startswith("some "):
                        fields = dict(kv.split("=", 1) for kv in line.split()[1:])
                        return float(fields["avg10"])
        return None
