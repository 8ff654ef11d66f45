"""The slab and the LRU on their own: real POSIX shared memory, real lane processes, real O_DIRECT."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import posix_ipc
import pytest

from bmoe.lanes import LanePool, merge_reads
from bmoe.shm_cache import PAGE, RESIDENT, ExpertCache, Region, Slab, layout, sweep_stale_segments
from tests.conftest import bmoe_segments


def regions_for(expert_bytes: int, n_expert: int = 8, layers: int = 3, base: int = 1000) -> list[Region]:
    """Tensors placed in a fake file the way GGUF does: 32-byte aligned, back to back."""
    out, off = [], base
    for layer in range(layers):
        for kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            out.append(Region(f"blk.{layer}.{kind}.weight", layer, kind, 0, off, n_expert, expert_bytes))
            off += n_expert * expert_bytes + 96
            off += -off % 32
    return out


def test_layout_is_congruent_and_disjoint() -> None:
    regs = regions_for(5000)
    size = layout(regs)
    spans = []
    for r in regs:
        assert r.slab_offset % PAGE == r.file_offset % PAGE
        spans.append((r.slab_offset - r.slab_offset % PAGE, r.slab_offset + r.nbytes))
        for e in range(r.n_expert):
            fi, off, length, slab_off, needed = r.read_order(e)
            assert off % PAGE == 0 and length % PAGE == 0 and slab_off % PAGE == 0
            s, t = r.slice_bounds(e)
            assert slab_off <= s and t == slab_off + needed <= slab_off + length
            assert off - slab_off == r.file_offset - r.slab_offset
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "a superset read would spill into another tensor"
    assert spans[-1][1] <= size


@pytest.mark.parametrize("backend", ["posix", "memfd"])
def test_slab_is_sparse_and_eviction_frees_pages(backend: str) -> None:
    slab = Slab(1 << 30, backend)
    try:
        assert slab.resident_bytes() == 0, "creating the slab must not allocate its size"
        slab.mm[0:64 * PAGE] = b"\x01" * (64 * PAGE)
        assert slab.resident_bytes() >= 64 * PAGE
        slab.release(0, 32 * PAGE)
        assert slab.resident_bytes() == 32 * PAGE
        assert slab.mm[0] == 0 and slab.mm[32 * PAGE] == 1
    finally:
        slab.close()
    assert slab.name.lstrip("/") not in bmoe_segments()


def test_lru_evicts_oldest_keeps_pinned_and_shared_edge_pages() -> None:
    regs = regions_for(3 * PAGE // 2, n_expert=8, layers=4)
    slab = Slab(layout(regs))
    try:
        per_slice = max(r.page_span(e)[1] - r.page_span(e)[0] for r in regs for e in range(8))
        cache = ExpertCache(slab, regs, budget=3 * 2 * per_slice * 2, policy="lru")  # about two layers of top-2
        for layer in range(4):
            missing = cache.plan(layer, [0, 1])
            for _, ri, e in missing:
                s, t = regs[ri].slice_bounds(e)
                slab.mm[s:t] = bytes([1 + e]) * (t - s)
            cache.commit(missing)
            assert cache.used <= cache.budget
            assert all(cache.state[ri][e] == RESIDENT for _, ri, e in cache.layer_slices(layer, [0, 1]))
        assert cache.stats.misses == 4 * 3 * 2 and cache.stats.evictions > 0
        # layer 0 was least recently used, so it went first
        assert all(cache.state[ri][e] != RESIDENT for _, ri, e in cache.layer_slices(0, [0, 1]))
        assert slab.resident_bytes() <= cache.budget
        # experts 0 and 1 share a page; evicting 0 alone must leave 1's bytes intact
        ri = cache.by_layer[3][0]
        cache._evict((3, ri, 0))
        s, t = regs[ri].slice_bounds(1)
        assert bytes(slab.mm[s:t]) == b"\x02" * (t - s)
        # a layer larger than the budget still gets all of its slices (pinned)
        tiny = ExpertCache(slab, regs, budget=0, policy="lru")
        need = tiny.plan(2, list(range(8)))
        tiny.commit(need)
        assert len(need) == 24 and tiny.used > tiny.budget
        assert tiny.plan(3, [0]) and all(tiny.state[ri][e] != RESIDENT for _, ri, e in tiny.layer_slices(2, range(8)))
    finally:
        slab.close()


def test_stale_segment_of_dead_owner_is_swept_live_one_kept() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = posix_ipc.SharedMemory(f"/bmoe-{dead_pid}-deadbeef", posix_ipc.O_CREX, size=PAGE)
    stale.close_fd()
    live = Slab(PAGE)
    try:
        removed = sweep_stale_segments()
        assert f"bmoe-{dead_pid}-deadbeef" in removed
        assert live.name.lstrip("/") in bmoe_segments()
    finally:
        live.close()


@pytest.mark.parametrize("odirect,backend", [(True, "posix"), (False, "posix"), (True, "memfd")])
@pytest.mark.parametrize("lanes", [1, 3])
def test_lanes_land_superset_reads_in_place(tmp_path, odirect: bool, backend: str, lanes: int) -> None:
    data = np.random.default_rng(1).integers(0, 256, size=300_001, dtype=np.uint8).tobytes()
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    reg = Region("blk.0.ffn_up_exps.weight", 0, "ffn_up_exps", 0, 12_345, 20, 14_000)
    slab = Slab(layout([reg]), backend)
    pool = LanePool(lanes, slab.name, [str(path)], odirect=odirect)
    try:
        assert pool.odirect == odirect
        wanted = [0, 3, 4, 19]  # 19 is the tensor's (and the file's) tail: the read runs past EOF
        got = pool.wait(pool.submit([reg.read_order(e) for e in wanted]))
        assert got > sum(reg.expert_bytes for _ in wanted)
        for e in wanted:
            s, t = reg.slice_bounds(e)
            fo = reg.file_offset + e * reg.expert_bytes
            assert bytes(slab.mm[s:t]) == data[fo:fo + reg.expert_bytes]
        assert sum(lane.stats.bytes for lane in pool.lanes) == got
        assert sum(1 for lane in pool.lanes if lane.stats.orders) == min(lanes, len(wanted))
    finally:
        pool.close()
        slab.close()
    assert all(lane.proc.returncode is not None for lane in pool.lanes)


def test_lane_reports_read_error_naming_file_and_offset(tmp_path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 10_000)
    reg = Region("blk.0.ffn_up_exps.weight", 0, "ffn_up_exps", 0, 0, 8, 8192)  # claims 64 KiB
    slab = Slab(layout([reg]))
    pool = LanePool(1, slab.name, [str(path)])
    try:
        with pytest.raises(Exception, match=rf"short read of {path} at offset \d+"):
            pool.wait(pool.submit([reg.read_order(5)]))
    finally:
        pool.close()
        slab.close()


def test_resident_bytes_come_from_the_segment() -> None:
    slab = Slab(16 * PAGE)
    try:
        os.pwrite(slab.fd, b"z" * PAGE, 5 * PAGE)
        assert slab.resident_bytes() == PAGE
    finally:
        slab.close()


def test_merged_reads_cover_every_slice_at_its_place() -> None:
    """Merging must never drop or shift a slice, whatever order the slices come in."""
    rng = np.random.default_rng(3)
    regs = regions_for(5000, n_expert=8, layers=3) + [
        Region(f"blk.{9 + i}.ffn_up_exps.weight", 9 + i, "ffn_up_exps", 1, 4096 * 3 + 100 * i, 8, 7000)
        for i in range(2)]
    layout(regs)
    for _ in range(50):
        picks = [(ri, int(e)) for ri in range(len(regs)) for e in range(8) if rng.random() < 0.4]
        rng.shuffle(picks)
        merged = merge_reads([regs[ri].read_order(e) for ri, e in picks], max_len=64 * 1024)
        assert len(merged) <= len(picks)
        for ri, e in picks:
            r = regs[ri]
            s, t = r.slice_bounds(e)
            fo = r.file_offset + e * r.expert_bytes
            assert any(fi == r.file_index and slab <= s and t <= slab + need and fo - off == s - slab
                       for fi, off, length, slab, need in merged), (ri, e)
