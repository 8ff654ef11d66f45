"""The slab and the LRU on their own: real POSIX shared memory, real lane processes, real O_DIRECT."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import posix_ipc
import pytest

from bmoe.lanes import LanePool, ReadOrder, merge_keyed, spread
from bmoe.expert_cache import RESIDENT, ExpertCache, Region, layout, slab_size
from bmoe.shm_cache import PAGE, Slab, Window, sweep_stale_segments
from tests.conftest import bmoe_segments, window_bytes


def regions_for(expert_bytes: int, n_expert: int = 8, layers: int = 3, base: int = 1000) -> list[Region]:
    """Tensors placed in a fake file the way GGUF does: 32-byte aligned, back to back."""
    out, off = [], base
    for layer in range(layers):
        for kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            out.append(Region(f"blk.{layer}.{kind}.weight", layer, kind, 0, off, n_expert, expert_bytes))
            off += n_expert * expert_bytes + 96
            off += -off % 32
    return out


def test_window_layout_keeps_in_page_offsets_and_gives_each_expert_its_own_pages() -> None:
    regs = regions_for(5000) + regions_for(3 * PAGE, n_expert=4, layers=1, base=10 ** 6)
    size = layout(regs)
    spans = []
    for r in regs:
        assert r.stride % PAGE == r.expert_bytes % PAGE, "each expert keeps the file's in-page offset"
        for e in range(r.n_expert):
            s, t = r.slice_bounds(e)
            fo = r.file_offset + e * r.expert_bytes
            assert s % PAGE == fo % PAGE
            spans.append(r.page_span(e))
            fi, off, length, slot, needed = r.read_order(e, 7 * PAGE)
            p0 = r.page_span(e)[0]
            assert off % PAGE == 0 and length % PAGE == 0 and slot == 7 * PAGE
            assert length <= r.slot_bytes and off + (s - p0) == fo and needed == t - p0
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "two experts would share a page"
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


def read_all(pool: LanePool, reads: list[ReadOrder]) -> dict[int, int]:
    """Spread the reads over the lanes as the streamer does and wait for all; bytes read per lane."""
    shares = spread([(r, None) for r in reads], [0] * len(pool.lanes))
    sent = {pool.send(i, [r for r, _ in share]): i for i, share in enumerate(shares) if share}
    per_lane: dict[int, int] = {}
    while sent:
        pool.poll(0.5)
        for oid in [o for o in sent if o in pool.done]:
            per_lane[sent[oid]] = per_lane.get(sent[oid], 0) + pool.take(oid)[0]
            del sent[oid]
    return per_lane


def _fill(cache: ExpertCache, slab: Slab, keys: list) -> None:
    """What a lane does: write each slice's bytes (1 + expert) into its slot, at its in-page offset."""
    for key in keys:
        r = cache.regions[key[1]]
        s, t = r.slice_bounds(key[2])
        at = cache.slot_of[key] + s - r.page_span(key[2])[0]
        slab.mm[at:at + t - s] = bytes([1 + key[2]]) * (t - s)


@pytest.mark.parametrize("backend", ["posix", "memfd"])
def test_lru_evicts_oldest_keeps_pinned_and_maps_slots_into_the_window(backend: str) -> None:
    regs = regions_for(3 * PAGE // 2, n_expert=8, layers=4)
    window_size = layout(regs)
    slab = Slab(slab_size(regs), backend)
    window = Window(window_size, slab)
    view = window_bytes(window)
    try:
        per_slice = max(r.slot_bytes for r in regs)
        cache = ExpertCache(window, regs, budget=3 * 2 * per_slice * 2, policy="lru")  # about two layers of top-2
        for layer in range(4):
            missing = cache.plan(layer, [0, 1])
            _fill(cache, slab, missing)
            cache.commit(missing)
            assert cache.used <= cache.budget
            for _, ri, e in cache.layer_slices(layer, [0, 1]):
                s, t = regs[ri].slice_bounds(e)
                assert cache.state[ri][e] == RESIDENT and bytes(view[s:t]) == bytes([1 + e]) * (t - s)
        assert cache.stats.misses == 4 * 3 * 2 and cache.stats.evictions > 0
        # layer 0 was least recently used, so it went first
        assert all(cache.state[ri][e] != RESIDENT for _, ri, e in cache.layer_slices(0, [0, 1]))
        assert slab.resident_bytes() <= cache.budget
        assert cache.top <= cache.budget, "evicted slots are reused: the slab does not grow past the budget"
        # experts 0 and 1 are neighbours in the file; evicting 0 leaves 1 whole
        ri = cache.by_layer[3][0]
        cache._evict((3, ri, 0))
        s, t = regs[ri].slice_bounds(1)
        assert bytes(view[s:t]) == b"\x02" * (t - s)
        # a layer larger than the budget still gets all of its slices (pinned)
        tiny = ExpertCache(None, regs, budget=0, policy="lru")
        need = tiny.plan(2, list(range(8)))
        tiny.commit(need)
        assert len(need) == 24 and tiny.used > tiny.budget
        assert tiny.plan(3, [0]) and all(tiny.state[ri][e] != RESIDENT for _, ri, e in tiny.layer_slices(2, range(8)))
    finally:
        window.close()
        slab.close()


def test_an_evicted_experts_window_range_faults_instead_of_showing_other_weights() -> None:
    code = """
import faulthandler, sys
from bmoe.expert_cache import ExpertCache, layout, slab_size
from bmoe.shm_cache import Slab, Window
from tests.conftest import window_bytes
from tests.test_shm_cache import regions_for
regs = regions_for(5000, n_expert=8, layers=2)
slab = Slab(slab_size(regs)); window = Window(layout(regs), slab)
cache = ExpertCache(window, regs, budget=3 * 2 * max(r.slot_bytes for r in regs), policy="lru")
for layer in (0, 1):
    cache.commit(cache.plan(layer, [0, 1]))
assert cache.state[cache.by_layer[0][0]][0] == 0, "layer 0 was evicted"
s, _ = regs[cache.by_layer[0][0]].slice_bounds(0)
print("read", flush=True)
slab.close()  # unlink now: the crash below must not leave the segment behind
print(window_bytes(window)[s])
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.stdout.strip() == "read" and r.returncode == -11, (r.returncode, r.stdout, r.stderr[-500:])


def test_slots_of_one_size_are_reused_and_other_sizes_give_pages_back() -> None:
    """Steady decode neither frees nor faults in pages; when the mix of slot sizes shifts, kept pages of
    the other size are given back so the slab stays within the budget."""
    small = regions_for(3 * PAGE // 2, n_expert=8, layers=3)
    big = [Region(f"blk.{3 + i}.ffn_up_exps.weight", 3 + i, "ffn_up_exps", 0, 10 ** 6 + i * 10 ** 5, 8, 5 * PAGE)
           for i in range(3)]
    regs = small + big
    slab = Slab(slab_size(regs))
    window = Window(layout(regs), slab)
    view = window_bytes(window)
    try:
        budget = 4 * max(r.slot_bytes for r in regs) * 3
        cache = ExpertCache(window, regs, budget=budget, policy="lru")
        for rounds in range(3):
            for layer in range(6):
                experts = [rounds % 8, (rounds + 3) % 8]
                missing = cache.plan(layer, experts)
                _fill(cache, slab, missing)
                cache.commit(missing)
                assert slab.resident_bytes() <= budget + sum(cache.charge(ri, e) for _, ri, e in cache.pinned)
                for _, ri, e in cache.layer_slices(layer, experts):
                    s, t = regs[ri].slice_bounds(e)
                    assert bytes(view[s:t]) == bytes([1 + e]) * (t - s)
        assert any(cache.cold.values()), "pages of the other size were given back"
    finally:
        window.close()
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
    layout([reg])
    slab = Slab(slab_size([reg]), backend)
    pool = LanePool(lanes, slab.name, [str(path)], odirect=odirect)
    try:
        assert pool.odirect == odirect
        wanted = [0, 3, 4, 19]  # 19 is the tensor's (and the file's) tail: the read runs past EOF
        slots = {e: i * reg.slot_bytes for i, e in enumerate(reversed(wanted))}
        per_lane = read_all(pool, [reg.read_order(e, slots[e]) for e in wanted])
        got = sum(per_lane.values())
        assert got > sum(reg.expert_bytes for _ in wanted)
        for e in wanted:
            s, t = reg.slice_bounds(e)
            at = slots[e] + s - reg.page_span(e)[0]
            fo = reg.file_offset + e * reg.expert_bytes
            assert bytes(slab.mm[at:at + reg.expert_bytes]) == data[fo:fo + reg.expert_bytes]
        assert len(per_lane) == min(lanes, len(wanted)), "every lane got a share"
    finally:
        pool.close()
        slab.close()
    assert all(lane.proc.returncode is not None for lane in pool.lanes)


def test_lane_reports_read_error_naming_file_and_offset(tmp_path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 10_000)
    reg = Region("blk.0.ffn_up_exps.weight", 0, "ffn_up_exps", 0, 0, 8, 8192)  # claims 64 KiB
    layout([reg])
    slab = Slab(slab_size([reg]))
    pool = LanePool(1, slab.name, [str(path)])
    try:
        with pytest.raises(Exception, match=rf"short read of {path} at offset \d+"):
            read_all(pool, [reg.read_order(5, 0)])
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
    """Merging must never drop or shift a slice, whatever order the slices come in and wherever their
    slots are."""
    rng = np.random.default_rng(3)
    regs = regions_for(5000, n_expert=8, layers=3) + [
        Region(f"blk.{9 + i}.ffn_up_exps.weight", 9 + i, "ffn_up_exps", 1, 4096 * 3 + 100 * i, 8, 7000)
        for i in range(2)]
    layout(regs)
    for _ in range(50):
        picks = [(ri, int(e)) for ri in range(len(regs)) for e in range(8) if rng.random() < 0.4]
        rng.shuffle(picks)
        slot, top = {}, 0
        for ri, e in (sorted(picks) if rng.random() < 0.5 else picks):
            slot[ri, e] = top
            top += regs[ri].slot_bytes
        merged = [r for r, _ in merge_keyed([(regs[ri].read_order(e, slot[ri, e]), None) for ri, e in picks],
                                            max_len=64 * 1024)]
        for ri, e in picks:
            r = regs[ri]
            s, t = r.slice_bounds(e)
            at = slot[ri, e] + s - r.page_span(e)[0]
            fo = r.file_offset + e * r.expert_bytes
            assert any(fi == r.file_index and dest <= at and at + r.expert_bytes <= dest + need
                       and fo - off == at - dest for fi, off, length, dest, need in merged), (ri, e)
