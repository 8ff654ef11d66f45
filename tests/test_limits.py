"""Memory limits: the cgroup v1/v2 readers on fabricated trees, the adaptive budget's rules, a cache
that shrinks and grows under a moving limit (real Engine, real slab), pinned dense weights, and
one live run in a real cgroup where the machine allows it."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bmoe.base.errors import ConfigError
from bmoe.base.model_files import read_model_files
from bmoe.base.settings import CacheSettings
from bmoe.base.units import MiB
from bmoe.engine import load as engine_load
from bmoe.memory.budget import Adaptive, decide
from bmoe.memory.probe import V1_UNLIMITED, MemoryProbe, Room
from bmoe.tools import bench_sys
from tests.conftest import REPO, complete, engine_for, load, per_token, reference, run_cli

PROMPT = "The harbour master counted the boats that came in before the storm reached the coast"


def tree(tmp: Path, files: dict[str, str]) -> tuple[Path, Path]:
    """A fake /proc and /sys/fs/cgroup: `files` maps paths under them (proc/..., cg/...) to contents."""
    for rel, text in files.items():
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    (tmp / "cg").mkdir(exist_ok=True)
    return tmp / "proc", tmp / "cg"


MEMINFO = "MemTotal:       24000000 kB\nMemAvailable:   20480000 kB\n"


def test_cgroup_v2_the_tightest_ancestor_decides_net_of_page_cache(tmp_path) -> None:
    proc, cg = tree(tmp_path, {
        "proc/self/cgroup": "0::/outer/inner\n", "proc/meminfo": MEMINFO, "cg/cgroup.controllers": "cpu memory\n",
        "cg/outer/memory.max": f"{3000 * MiB}\n", "cg/outer/memory.current": f"{1000 * MiB}\n",
        "cg/outer/memory.stat": f"anon {500 * MiB}\ninactive_file {400 * MiB}\nactive_file {100 * MiB}\n",
        "cg/outer/inner/memory.max": "max\n", "cg/outer/inner/memory.current": f"{900 * MiB}\n",
        "cg/outer/inner/memory.stat": f"inactive_file {400 * MiB}\n",
    })
    p = MemoryProbe(proc, cg)
    assert p.v2 and not p.v1
    least = p.least()
    assert least.bytes == (3000 - (1000 - 400 - 100)) * MiB  # the limit minus the charge net of file pages
    assert least.name.startswith("cgroup /outer ") and "limit 3000 MiB" in least.name
    assert least.cgroup_limit == 3000 * MiB
    assert [r.bytes for r in p.rooms() if r.name.startswith("available")] == [20480000 * 1024]


def test_the_room_is_the_same_whether_the_dense_weights_were_read_here_or_elsewhere(tmp_path) -> None:
    """A cold start reads the dense weights into this cgroup's page cache (inactive, then active once
    used); a warm one finds them charged elsewhere. With their bytes kept as in use, every case
    leaves the same room, in the cgroup and in MemAvailable (which counts page cache as free)."""
    rooms = []
    for name, current, stat in (("warm", 600, ""), ("cold", 900, f"inactive_file {300 * MiB}\n"),
                                ("used", 900, f"active_file {300 * MiB}\n")):
        proc, cg = tree(tmp_path / name, {
            "proc/self/cgroup": "0::/\n", "proc/meminfo": MEMINFO, "cg/cgroup.controllers": "memory\n",
            "cg/memory.max": f"{2500 * MiB}\n", "cg/memory.current": f"{current * MiB}\n", "cg/memory.stat": stat,
        })
        p = MemoryProbe(proc, cg)
        p.kept = 300 * MiB
        rooms.append({r.name.split()[0]: r.bytes for r in p.rooms()})
        assert p.least().name.endswith(" less the dense weights' 300 MiB")
    assert rooms[0] == rooms[1] == rooms[2] == {"cgroup": (2500 - 600 - 300) * MiB,
                                                "available": 20480000 * 1024 - 300 * MiB}


def test_cgroup_v1_walks_up_and_ignores_unlimited_levels(tmp_path) -> None:
    proc, cg = tree(tmp_path, {
        "proc/self/cgroup": "9:cpu,cpuacct:/x\n4:memory:/docker/abc\n0::/\n", "proc/meminfo": MEMINFO,
        "cg/memory/memory.limit_in_bytes": f"{V1_UNLIMITED + 4096}\n", "cg/memory/memory.usage_in_bytes": "1\n",
        "cg/memory/docker/memory.limit_in_bytes": f"{V1_UNLIMITED}\n",
        "cg/memory/docker/memory.usage_in_bytes": f"{10 * MiB}\n",
        "cg/memory/docker/abc/memory.limit_in_bytes": f"{2500 * MiB}\n",
        "cg/memory/docker/abc/memory.usage_in_bytes": f"{2000 * MiB}\n",
        "cg/memory/docker/abc/memory.stat": f"cache {1200 * MiB}\ninactive_file 1\ntotal_inactive_file {700 * MiB}\n",
    })
    p = MemoryProbe(proc, cg)
    assert p.v1 and not p.v2 and p.v1[0] == cg / "memory" / "docker" / "abc"
    cgroup_rooms = [r for r in p.rooms() if r.cgroup_limit]
    assert len(cgroup_rooms) == 1, "unlimited levels leave no room of their own"
    assert cgroup_rooms[0].bytes == (2500 - (2000 - 700)) * MiB
    assert p.least() == cgroup_rooms[0]


def test_the_v1_memory_controller_is_found_where_proc_mounts_says(tmp_path) -> None:
    """Android mounts the v1 memory controller at /dev/memcg, not under /sys/fs/cgroup."""
    memcg = tmp_path / "dev" / "memcg"
    proc, cg = tree(tmp_path, {
        "proc/self/cgroup": "3:memory:/apps/uid_10123\n", "proc/meminfo": MEMINFO,
        "proc/self/mounts": f"none {memcg} cgroup rw,nosuid,memory 0 0\nnone /x cgroup2 rw 0 0\n",
        "dev/memcg/memory.limit_in_bytes": f"{V1_UNLIMITED}\n",
        "dev/memcg/apps/uid_10123/memory.limit_in_bytes": f"{800 * MiB}\n",
        "dev/memcg/apps/uid_10123/memory.usage_in_bytes": f"{300 * MiB}\n",
        "dev/memcg/apps/uid_10123/memory.stat": "total_inactive_file 0\n",
    })
    p = MemoryProbe(proc, cg)
    assert p.v1 and p.v1[0] == memcg / "apps" / "uid_10123"
    assert p.least().bytes == 500 * MiB and p.least().name.startswith("cgroup /apps/uid_10123 ")


def test_a_container_sees_its_cgroup_as_the_root_and_no_cgroup_means_the_machine(tmp_path) -> None:
    proc, cg = tree(tmp_path / "a", {
        "proc/self/cgroup": "0::/\n", "proc/meminfo": MEMINFO, "cg/cgroup.controllers": "memory\n",
        "cg/memory.max": f"{1500 * MiB}\n", "cg/memory.current": f"{100 * MiB}\n", "cg/memory.stat": "",
    })
    assert MemoryProbe(proc, cg).least().bytes == 1400 * MiB
    proc, cg = tree(tmp_path / "b", {"proc/self/cgroup": "0::/\n", "proc/meminfo": MEMINFO})
    p = MemoryProbe(proc, cg)
    assert not (p.v1 or p.v2) and p.least().name == "available 20000 MiB"


def test_pressure_reads_psi_and_is_none_without_it(tmp_path) -> None:
    proc, cg = tree(tmp_path, {"proc/self/cgroup": "0::/\n", "proc/meminfo": MEMINFO,
                               "proc/pressure/memory": "some avg10=12.50 avg60=3.00 avg300=1.00 total=5\n"
                                                       "full avg10=1.00 avg60=0.00 avg300=0.00 total=1\n"})
    assert MemoryProbe(proc, cg).pressure() == 12.5
    (proc / "pressure" / "memory").unlink()
    assert MemoryProbe(proc, cg).pressure() is None


def test_rlimit_as_is_a_limit_too() -> None:
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (8 << 30, resource.RLIM_INFINITY)); "
            "from bmoe.memory.probe import MemoryProbe; "
            "print([r.name.split()[0] for r in MemoryProbe().rooms()])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "RLIMIT_AS" in r.stdout


# ---- the adaptive budget's rules (pure) ---------------------------------------------------------


def room(mib: float) -> Room:
    return Room(int(mib * MiB), "cgroup /t (limit 3000 MiB)")


def test_a_fixed_budget_is_held_to_the_room_at_the_size_the_cache_can_reach() -> None:
    """Refused where the cache could fill past the room; a budget above every expert counts as the experts; --adapt
    (it shrinks when memory runs short) and --force take it."""
    def decided(mb: float, experts_mib: float, **kw: bool) -> int:
        cache = CacheSettings(mb=mb, **kw)
        limit = Room(1000 * MiB, "cgroup /t (limit 3000 MiB)", 3000 * MiB)  # its floor a quarter: 750 MiB
        return decide(cache, False, int(experts_mib * MiB), MiB, 2 * MiB, [limit]).bytes

    assert decided(5000, 800) == 5000 * MiB  # holds every expert in 800 MiB of the 1000 left
    assert decided(1000, 5000) == 1000 * MiB
    with pytest.raises(ConfigError, match=r"--cache-mb 1001 is more than the 1000 MiB the tightest memory limit "
                                          r"leaves now \(cgroup /t \(limit 3000 MiB\)\).* use --cache-mb 250 or less"):
        decided(1001, 5000)
    assert decided(1001, 5000, adapt=True) == decided(1001, 5000, force=True) == 1001 * MiB


def test_adaptive_shrinks_at_once_and_grows_only_after_a_calm_spell() -> None:
    a = Adaptive(floor=500 * MiB, token_need=300 * MiB, ceiling=2000 * MiB, margin=100 * MiB, grow_after=3)
    assert a.step(1500 * MiB, 1500 * MiB, room(600)) is None, "above the floor: nothing to do"
    new, why = a.step(1500 * MiB, 1500 * MiB, room(300))  # 200 MiB short
    assert new == (1500 - 200 - 100) * MiB and "under the floor of 500 MiB" in why
    assert [a.step(1200 * MiB, 1200 * MiB, room(1000)) for _ in range(2)] == [None, None], "hysteresis"
    new, why = a.step(1200 * MiB, 1200 * MiB, room(1000))
    assert new == (1200 + 500 - 100) * MiB and "free again" in why
    a.calm = 0
    assert all(a.step(1200 * MiB, 1200 * MiB, room(1000), pressure=40.0) is None for _ in range(5)), \
        "no growth under memory pressure"


def test_adaptive_counts_what_a_filling_cache_will_still_take() -> None:
    a = Adaptive(floor=500 * MiB, token_need=300 * MiB, ceiling=2000 * MiB, margin=100 * MiB, grow_after=1)
    # 1000 MiB budget of which only 200 resident: the 800 still to come are not free memory
    new, _ = a.step(1000 * MiB, 200 * MiB, room(1100))
    assert new == (1000 + (1100 - 800 - 500) - 100) * MiB


def test_adaptive_falls_back_to_no_cache_rather_than_thrash_and_says_so() -> None:
    a = Adaptive(floor=500 * MiB, token_need=300 * MiB, ceiling=2000 * MiB, margin=100 * MiB, grow_after=1)
    assert a.step(600 * MiB, 600 * MiB, room(400))[0] == 400 * MiB, "still above one token's working set"
    new, why = a.step(600 * MiB, 600 * MiB, room(200))
    assert new == 0 and "one token's working set" in why and "no cache" in why
    assert a.step(0, 0, room(200)) is None, "already no cache: no repeated notice"
    assert a.step(0, 0, room(850)) is None, "250 MiB spare is not enough for a useful cache"
    assert a.step(0, 0, room(1000))[0] == 400 * MiB


# ---- a moving limit on a real engine ------------------------------------------------------------


@pytest.fixture(scope="module")
def model(small_moe) -> str:
    return str(small_moe)


def test_an_auto_budget_with_room_to_spare_holds_every_expert_and_preloads(model: str) -> None:
    notes: list[str] = []
    with engine_for(model, "--preload", "-t", 1, "--io-threads", 2, notice=notes.append) as e:
        assert e.streamer.holds_everything, notes  # capped at the experts' slots, not their raw bytes
        assert e.stats().budget_bytes == e.streamer.full_bytes and e.stats().resident_bytes > 0
    assert not any("--preload ignored" in n for n in notes) and any(n.startswith("preloaded ") for n in notes)


def test_the_cache_shrinks_and_grows_back_with_the_limit_and_the_output_stays_exact(model: str, tmp_path) -> None:
    """A fabricated v1 cgroup whose charge the test moves between tokens: the budget falls under
    pressure (pages given back to the system) and comes back once the memory is free again."""
    limit = 4096 * MiB
    proc, cg = tree(tmp_path, {"proc/self/cgroup": "4:memory:/t\n", "proc/meminfo": MEMINFO,
                               "cg/memory/memory.limit_in_bytes": f"{V1_UNLIMITED}\n",
                               "cg/memory/t/memory.limit_in_bytes": f"{limit}\n",
                               "cg/memory/t/memory.usage_in_bytes": f"{100 * MiB}\n",
                               "cg/memory/t/memory.stat": "total_inactive_file 0\n"})
    usage = cg / "memory" / "t" / "memory.usage_in_bytes"
    ref = reference(model, PROMPT, 40, "-c", 256, "-t", 2).ids
    # out of the page cache: a warm file's layers would read llama.cpp's mapping and the slab stay empty
    bench_sys.drop_file_cache([model])
    notices: list[str] = []
    m = load(model, "-c", 256, "-t", 2, "--cache-mb", 1000, "--adapt", "--cache-floor-mb", 100, notice=notices.append)
    e = m.engine
    try:
        e.streamer.watch.memory = MemoryProbe(proc, cg)  # the probe the adaptive budget reads (BudgetWatch)
        assert e.adaptive is not None
        full = e.adaptive.ceiling  # every expert's slots: the most a budget can use
        resident: list[int] = []

        other = 100 * MiB  # what the rest of the cgroup holds; the charge is that plus the slab

        def squeeze(i: int) -> None:
            nonlocal other
            resident.append(e.stats().resident_bytes)
            if i == 8:  # another process takes all but 99 MiB of the limit: 1 MiB under the floor
                other = limit - 99 * MiB - e.stats().resident_bytes
            if i == 20:
                other = 100 * MiB
            usage.write_text(f"{other + e.stats().resident_bytes}\n")

        res = complete(m, PROMPT, 40, on_chunk=per_token(squeeze))
        # idle between requests, the budget still follows the limit
        usage.write_text(f"{limit - 50 * MiB}\n")
        e.follow_memory()
        idle_budget = e.stats().budget_bytes
    finally:
        m.close()
    assert res.ids == ref
    budgets = [min(s.budget_bytes, full) for s in res.tokens]
    low = min(budgets)
    assert budgets[0] == full and 0 < low < full and budgets[-1] == full, [b / MiB for b in budgets]
    assert budgets.index(low) == 9, "the shrink is at the first token after the squeeze"
    assert resident[9] < resident[8], "the shrink gave pages back at once"
    assert idle_budget < full
    shrink = [n for n in notices if "->" in n][:2]
    assert len(shrink) == 2 and "under the floor of 100 MiB" in shrink[0] and "free again" in shrink[1], notices


def test_pinned_dense_weights_are_the_files_bytes_and_the_output_is_exact(model: str, monkeypatch) -> None:
    seen: list[list[tuple[int, int]]] = []
    real_pin = engine_load.pin

    def pin_and_keep(ranges: list[tuple[int, int]]) -> int:
        seen.append(ranges)
        return real_pin(ranges)

    monkeypatch.setattr(engine_load, "pin", pin_and_keep)
    notices: list[str] = []
    m = load(model, "-c", 256, "-t", 2, "--cache-mb", 1, "--pin-dense", notice=notices.append)
    e = m.engine
    try:
        (ranges,) = seen
        locked = int(Path("/proc/self/status").read_text().split("VmLck:")[1].split()[0]) * 1024
        assert locked >= sum(n for _, n in ranges) > 0
        # llama.cpp maps the file page-aligned: the first locked range starts at the page of the first
        # dense tensor, which gives the mapping's base; every dense tensor there is the file's bytes,
        # and lies inside a locked range
        dense = sorted((ext.offset, ext.nbytes) for name, ext in e.files.extents.items()
                       if "_exps." not in name and ext.nbytes)
        base = ranges[0][0] - dense[0][0] // 4096 * 4096
        data = e.files.paths[0].read_bytes()
        for offset, nbytes in dense:
            assert ctypes.string_at(base + offset, nbytes) == data[offset:offset + nbytes]
            assert any(a <= base + offset and base + offset + nbytes <= a + n for a, n in ranges)
        out = complete(m, PROMPT, 16).ids
    finally:
        m.close()
    assert any("pinned" in n and "dense weights" in n for n in notices), notices
    assert out == reference(model, PROMPT, 16, "-c", 256, "-t", 2).ids


# ---- live runs in a real cgroup --------------------------------------------------------------


@pytest.fixture
def cgroups() -> bench_sys.CgroupHierarchy:
    """The memory cgroup hierarchy this process may make child groups in (the test skips, saying why, where none)."""
    h = bench_sys.find_cgroup()
    try:
        if h is None:
            raise bench_sys.LimitError("no memory cgroup hierarchy")
        bench_sys.probe_cgroup(h)
    except bench_sys.LimitError as e:
        pytest.skip(f"no writable memory cgroup here: {e}")
    return h


def test_auto_budget_in_a_real_cgroup_names_the_cgroup_and_streams_exactly(model: str, cgroups) -> None:
    plain = run_cli("-m", model, "-p", PROMPT, "-n", "24", "--no-stream")
    with bench_sys.Cgroup(cgroups, f"bmoe-test-{os.getpid()}", 1024 * MiB) as cgroup:
        r = subprocess.run(cgroup.wrap([sys.executable, "-m", "bmoe.cli", "-m", model, "-p", PROMPT, "-n", "24"]),
                           capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    (note,) = [x for x in r.stderr.splitlines() if "cache budget" in x and "auto" in x]
    assert "cgroup /" in note and "limit 1024 MiB" in note and "(a quarter of the cgroup limit)" in note, note
    assert r.stdout.split("\ngeneration:")[0] == plain.stdout.split("\ngeneration:")[0]


def test_a_fixed_budget_above_the_room_a_real_cgroup_leaves_is_refused_and_the_fix_runs(demo8: Path,
                                                                                      cgroups) -> None:
    """--cache-mb larger than what the cgroup leaves would push the dense weights out of memory (read again every
    token): refused with the room and the fixes named, the exit code non-zero; the budget it names runs. (A budget
    above the model's experts counts at their size: the cache never holds more.)"""
    limit = 256 * MiB + read_model_files(demo8).expert_bytes // 2  # it leaves less room than every expert takes
    argv = [sys.executable, "-m", "bmoe.cli", "-m", str(demo8), "-p", PROMPT, "-n", "4"]
    with bench_sys.Cgroup(cgroups, f"bmoe-test-{os.getpid()}", limit) as cgroup:
        refused = subprocess.run(cgroup.wrap([*argv, "--cache-mb", "100000"]), capture_output=True, text=True,
                                 cwd=REPO)
    assert refused.returncode != 0
    told = re.search(r"--cache-mb 100000 is more than the \d+ MiB the tightest memory limit leaves now \(cgroup /.*"
                     r"\): the cache would push out the pages llama.cpp reads every token \(the dense weights, read "
                     r"again each token\) or be killed for it; use --cache-mb (\d+) or less \(what --cache-mb auto "
                     r"takes now, the floor \d+ MiB \(a quarter of the cgroup limit\) left free\), --adapt to let it "
                     r"shrink when memory runs short, or --force to run with it anyway", refused.stderr)
    assert told, refused.stderr
    with bench_sys.Cgroup(cgroups, f"bmoe-test-{os.getpid()}", limit) as cgroup:
        fits = subprocess.run(cgroup.wrap([*argv, "--cache-mb", told[1]]), capture_output=True, text=True, cwd=REPO)
    assert fits.returncode == 0, fits.stderr
