"""The slab, its pools and the LRU on their own: real POSIX shared memory, real lane processes, real O_DIRECT."""

from __future__ import annotations

import itertools
import mmap
import os
import subprocess
import sys

import numpy as np
import posix_ipc
import pytest

from bmoe.shm_cache import PAGE, Slab, segment_name, sweep_stale_segments
from bmoe.streaming.expert_cache import RESIDENT, ExpertCache, Region, layout
from bmoe.streaming.lanes import LanePool, ReadOrder, merge_keyed, spread
from bmoe.streaming.orders import OrdersInFlight
from bmoe.tools.bench_sys import drop_file_cache
from bmoe.workers.io_lane import Reader
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


def apply(reads: list[ReadOrder], files: list[bytes], slab: bytearray) -> None:
    """What a lane does with reads, in memory: each aligned superset into the slab, then its move."""
    for fi, off, length, dest, needed, move_from, move_to, move_len in reads:
        got = files[fi][off:off + length]
        assert len(got) >= needed
        slab[dest:dest + len(got)] = got
        if move_len:
            slab[move_to:move_to + move_len] = bytes(slab[move_from:move_from + move_len])


@pytest.mark.parametrize("align", [512, PAGE])
def test_any_slot_takes_any_expert_and_no_two_slots_share_a_page(align: int) -> None:
    """Every kind has one pool shared by every layer, whatever its experts' sizes: any expert of any
    layer may take any index, its aligned superset read (file offset, length and slab address all
    aligned for direct I/O) plus at most one move land its bytes where ggml reads them (the tensor's
    data + index * stride), and no two slots share a page."""
    regs = regions_for(5000) + regions_for(3 * PAGE, n_expert=4, layers=1, base=10 ** 6) \
        + regions_for(2 * PAGE + 2048, n_expert=8, layers=2, base=3 * 10 ** 6)
    for r in regs[9:]:
        r.layer += 10 if r.expert_bytes == 3 * PAGE else 20  # layers of their own, experts of other sizes
    size = layout(regs, align=align)
    assert len({(r.pool_offset, r.stride) for r in regs}) == 3, "one pool per kind"
    assert {r.capacity for r in regs} == {3 * 8 + 4 + 2 * 8}, "an index for every (layer, expert)"
    file = np.random.default_rng(0).integers(0, 256, size=4 * 10 ** 6, dtype=np.uint8).tobytes()
    moved = 0
    for r in regs:
        for e in range(r.n_expert):
            for index in (0, 7, r.capacity - 1):
                read = r.read_order(e, index)
                _fi, off, length, dest, needed, move_from, move_to, move_len = read
                assert off % align == dest % align == length % align == 0 and needed <= length
                p0, p1 = r.slot_pages(index)
                assert p0 % PAGE == p1 % PAGE == 0 and p0 <= dest and dest + length <= p1 <= size
                assert not move_len or (p0 <= min(move_from, move_to) and max(move_from, move_to) + move_len <= p1)
                moved += bool(move_len)
                slab = bytearray(size)
                apply([read], [file], slab)
                at = r.data_offset + index * r.stride
                fo = r.file_offset + e * r.expert_bytes
                assert slab[at:at + r.expert_bytes] == file[fo:fo + r.expert_bytes], (r.name, e, index)
    assert moved, "experts whose offset in an aligned block differs from their tensor's are moved"
    for kind in {r.kind for r in regs}:
        r = next(x for x in regs if x.kind == kind)
        pages = [r.slot_pages(i) for i in range(r.capacity)]
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(pages)), "two slots would share a page"


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
    """What a lane does: write each slice's bytes (1 + expert) into its slot, where ggml reads them."""
    for key in keys:
        at = cache.slice_offset(key[1], key[2])
        slab.mm[at:at + cache.regions[key[1]].expert_bytes] = bytes([1 + key[2]]) * cache.regions[key[1]].expert_bytes


def _read(cache: ExpertCache, slab: Slab, ri: int, e: int) -> bytes:
    at = cache.slice_offset(ri, e)
    return bytes(slab.mm[at:at + cache.regions[ri].expert_bytes])


@pytest.mark.parametrize("backend", ["posix", "memfd"])
def test_lru_evicts_oldest_keeps_pinned_and_reuses_slots_across_layers(backend: str) -> None:
    regs = regions_for(3 * PAGE // 2, n_expert=8, layers=4)
    slab = Slab(layout(regs), backend)
    try:
        cache = ExpertCache(slab, regs, budget=0, policy="lru")
        cache.set_budget(2 * 2 * cache.charge[0])  # two layers of top-2
        for layer in range(4):
            missing = cache.plan(layer, [0, 1])
            _fill(cache, slab, missing)
            cache.commit(missing)
            assert cache.used <= cache.budget
            for _, ri, e in cache.layer_slices(layer, [0, 1]):
                assert cache.state[ri][e] == RESIDENT
                assert _read(cache, slab, ri, e) == bytes([1 + e]) * regs[ri].expert_bytes
            want = [[cache.index_of[(layer, 1)], cache.index_of[(layer, 0)]]]
            assert (cache.slot_ids(layer, np.array([[1, 0]])) == want).all()
        assert cache.stats.misses == 4 * 2 and cache.stats.evictions > 0  # (counted per routed expert)
        # layer 0 was least recently used, so it went first; layers 2 and 3 took its slot indices
        assert all(cache.state[ri][e] != RESIDENT for _, ri, e in cache.layer_slices(0, [0, 1]))
        assert sorted(cache.index_of.values()) == [0, 1, 2, 3], "freed indices are reused by other layers"
        assert slab.resident_bytes() <= cache.budget
        assert cache.fresh * cache.charge[0] <= cache.budget, "freed slots are reused: the slab stays in budget"
        # an expert is evicted whole: every slice of it, and its index
        ri = cache.by_layer[3][0]
        cache.pinned.clear()  # as once the next layer routed
        cache._evict((3, 0))
        assert all(cache.state[r][0] != RESIDENT for r in cache.by_layer[3]) and (3, 0) not in cache.index_of
        assert _read(cache, slab, ri, 1) == b"\x02" * regs[ri].expert_bytes, "its neighbour stays whole"
        # a layer larger than the budget still gets all of its slices (pinned)
        tiny = ExpertCache(None, regs, budget=0, policy="lru")
        need = tiny.plan(2, list(range(8)))
        tiny.commit(need)
        assert len(need) == 24 and tiny.used > tiny.budget
        assert tiny.plan(3, [0]) and all(tiny.state[ri][e] != RESIDENT for _, ri, e in tiny.layer_slices(2, range(8)))
    finally:
        slab.close()


def test_an_evicted_expert_is_never_read_from_the_slot_it_left() -> None:
    """Once an expert is evicted its slot may hold another layer's expert: the remap refuses the
    evicted id rather than point ggml at the slot, and the slot now named is the new owner's."""
    regs = regions_for(5000, n_expert=8, layers=2)
    layout(regs)
    cache = ExpertCache(None, regs, budget=0, policy="lru")
    cache.set_budget(2 * cache.charge[0])
    cache.commit(cache.plan(0, [0, 1]))
    old = cache.slot_ids(0, np.array([[0, 1]]))
    cache.commit(cache.plan(1, [0, 1]))
    assert cache.state[cache.by_layer[0][0]][0] == 0, "layer 0 was evicted"
    assert sorted(cache.slot_ids(1, np.array([[0, 1]]))[0]) == sorted(old[0]), "layer 1 took the slots layer 0 left"
    with pytest.raises(RuntimeError, match=r"layer 0 routed to experts \[0, 1\] that hold no slot"):
        cache.slot_ids(0, np.array([[1, 0]]))
    assert (cache.table[0] == -1).all()


def test_experts_of_every_size_share_the_slots_within_the_budget() -> None:
    """Small and big experts take the same indices (the pool is sized for the biggest), in the policy's
    order alone; each is charged the pages it touches, the slab's pages stay within what is charged
    and the budget, and a budget cut gives kept pages back."""
    small = regions_for(3 * PAGE // 2, n_expert=8, layers=3)
    big = [Region(f"blk.{3 + i}.ffn_up_exps.weight", 3 + i, "ffn_up_exps", 0, 10 ** 6 + i * 10 ** 5, 8, 5 * PAGE)
           for i in range(3)]
    regs = small + big
    slab = Slab(layout(regs))
    try:
        cache = ExpertCache(slab, regs, budget=0, policy="lru")
        budget = 4 * cache.charge[0]
        cache.set_budget(budget)
        seen: dict[int, set[int]] = {}  # index -> layers whose experts took it
        for rounds in range(6):
            for layer in range(6):
                experts = [rounds % 8, (rounds + 3) % 8]
                missing = cache.plan(layer, experts)
                _fill(cache, slab, missing)
                cache.commit(missing)
                assert slab.resident_bytes() <= budget + len(cache.pinned) * cache.charge[0]
                # each expert charged its own layer's pages: an index a smaller one took gave the rest back
                assert slab.resident_bytes() <= cache.used + cache.warm_bytes
                for _, ri, e in cache.layer_slices(layer, experts):
                    assert _read(cache, slab, ri, e) == bytes([1 + e]) * regs[ri].expert_bytes
                for e in experts:
                    seen.setdefault(cache.index_of[(layer, e)], set()).add(layer)
        assert any(ls & {0, 1, 2} and ls & {3, 4, 5} for ls in seen.values()), "small and big take the same index"
        cache.pinned.clear()
        cache.set_budget(cache.charge[0])
        assert cache.cold and slab.resident_bytes() <= cache.charge[0], "a cut gives pages back at once"
    finally:
        slab.close()


def test_stale_segment_of_dead_owner_is_swept_live_one_kept() -> None:
    """Under today's name (`bmoe-<uid>-<pid>-<hex>`) and an older bmoe's (`bmoe-<pid>-<hex>`)."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    names = [segment_name(dead_pid), f"bmoe-{dead_pid}-deadbeef"]
    for name in names:
        posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, size=PAGE).close_fd()
    live = Slab(PAGE)
    try:
        removed = sweep_stale_segments()
        assert set(names) <= set(removed), removed
        assert live.name.lstrip("/") in bmoe_segments()
    finally:
        live.close()


@pytest.mark.parametrize("odirect,backend", [(True, "posix"), (False, "posix"), (True, "memfd")])
@pytest.mark.parametrize("lanes", [1, 3])
def test_lanes_land_superset_reads_in_place(tmp_path, odirect: bool, backend: str, lanes: int) -> None:
    data = np.random.default_rng(1).integers(0, 256, size=300_001, dtype=np.uint8).tobytes()
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    drop_file_cache([path])  # O_DIRECT reads the device (a file the page cache holds is copied from there)
    reg = Region("blk.0.ffn_up_exps.weight", 0, "ffn_up_exps", 0, 12_345, 20, 14_000)
    slab = Slab(layout([reg]), backend)
    pool = LanePool(lanes, slab.name, [str(path)], odirect=odirect)
    try:
        assert pool.odirect == odirect
        wanted = [0, 3, 4, 19]  # 19 is the tensor's (and the file's) tail: the read runs past EOF
        slots = {0: 5, 3: 0, 4: 19, 19: 2}  # any index takes any expert (some land in place, some are moved)
        reads = [reg.read_order(e, slots[e]) for e in wanted]
        assert any(r[7] for r in reads) and not all(r[7] for r in reads)
        per_lane = read_all(pool, reads)
        got = sum(per_lane.values())
        assert got > sum(reg.expert_bytes for _ in wanted)
        for e in wanted:
            at = reg.data_offset + slots[e] * reg.stride
            fo = reg.file_offset + e * reg.expert_bytes
            assert bytes(slab.mm[at:at + reg.expert_bytes]) == data[fo:fo + reg.expert_bytes]
        assert len(per_lane) == min(lanes, len(wanted)), "every lane got a share"
    finally:
        pool.close()
        slab.close()
    assert all(lane.proc.returncode is not None for lane in pool.lanes)


def test_a_layers_later_slices_queue_behind_their_experts_gate_slice_on_one_lane(tmp_path) -> None:
    """Demand reads go out in the order the matmuls read them: the gate slices of a layer's misses over
    the least loaded lanes, and each expert's up and down slices behind its gate slice on the same
    lane (read in sending order), not on idle lanes where they would share the device with the gate
    slices awaited first. Every slice still lands where ggml reads it."""
    regs = regions_for(3 * PAGE + 100, n_expert=8, layers=1)
    data = np.random.default_rng(2).integers(0, 256, size=regs[-1].file_offset + 8 * regs[-1].expert_bytes + PAGE,
                                             dtype=np.uint8).tobytes()
    path = tmp_path / "model.bin"
    path.write_bytes(data)
    slab = Slab(layout(regs), "posix")
    cache = ExpertCache(slab, regs, budget=1 << 30)
    pool = LanePool(4, slab.name, [str(path)])
    try:
        orders = OrdersInFlight(pool, cache)
        missing = cache.plan(0, [1, 5])  # not neighbours: no read spans both
        stages = [[k for k in missing if regs[k[1]].kind == kind]
                  for kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")]
        sent = orders.staged(stages)
        lane_of = {(stage, k[2]): orders.inflight[oid].lane
                   for stage, oids in enumerate(sent) for oid in oids for k in orders.inflight[oid].keys}
        assert lane_of[(0, 1)] != lane_of[(0, 5)], "the gate slices are spread"
        for e in (1, 5):
            assert lane_of[(1, e)] == lane_of[(2, e)] == lane_of[(0, e)], f"expert {e}'s slices on one lane"
        for lane in {lane_of[(0, 1)], lane_of[(0, 5)]}:
            kinds = [regs[orders.inflight[oid].keys[0][1]].kind for oid in pool.lanes[lane].pending]
            assert kinds == ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"], "read in the matmuls' order"
        left = {oid for oids in sent for oid in oids}
        while left:
            pool.poll(0.5)
            for oid in orders.done():
                pool.take(oid)
                cache.commit(orders.pop(oid).keys)
                left.discard(oid)
        for _, ri, e in missing:
            at, fo = cache.slice_offset(ri, e), regs[ri].file_offset + e * regs[ri].expert_bytes
            assert bytes(slab.mm[at:at + regs[ri].expert_bytes]) == data[fo:fo + regs[ri].expert_bytes]
    finally:
        pool.close()
        slab.close()


def test_a_range_the_page_cache_holds_is_copied_from_there(tmp_path) -> None:
    """An O_DIRECT reader copies a range whose every page is in the page cache from there (another
    program left the file in memory) and reads any other range from the device; the same bytes either
    way, and the copy reads nothing ahead into the page cache."""
    data = np.random.default_rng(2).integers(0, 256, size=4 << 20, dtype=np.uint8).tobytes()
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    drop_file_cache([path])
    r = Reader(str(path), odirect=True)
    assert r.odirect and r.cache is not None
    buf = mmap.mmap(-1, 1 << 20)  # (page-aligned, as the slab is)
    assert not r.cache.holds(4096, len(buf))
    assert r.read_into(memoryview(buf), 4096, len(buf)) == len(buf) and buf[:] == data[4096:4096 + len(buf)]
    assert r.cache.copied == 0, "not cached: read with O_DIRECT"
    with open(path, "rb", buffering=0) as f:  # another program reads the first half (and no further)
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        f.read(2 << 20)
    assert r.cache.holds(8192, len(buf)) and not r.cache.holds(3 << 20, len(buf))
    assert r.read_into(memoryview(buf), 8192, len(buf)) == len(buf) and buf[:] == data[8192:8192 + len(buf)]
    assert r.cache.copied == len(buf), "cached: copied from the page cache"
    assert r.read_into(memoryview(buf), 3 << 20, len(buf)) == len(buf) and buf[:] == data[3 << 20:(3 << 20) + len(buf)]
    assert r.cache.copied == len(buf) and not r.cache.holds(3 << 20, len(buf)), \
        "the device range stays out of the cache"


def test_a_lane_answers_how_many_bytes_it_copied_from_the_page_cache(tmp_path) -> None:
    """A real lane's answer says which of an order's bytes came from the page cache, not the device,
    and how long copying them took: all of them with the file warm, none with it dropped."""
    data = np.random.default_rng(3).integers(0, 256, size=4 << 20, dtype=np.uint8).tobytes()
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    reg = Region("blk.0.ffn_up_exps.weight", 0, "ffn_up_exps", 0, 8192, 6, 512 << 10)  # reads >= MIN_COPY
    slab = Slab(layout([reg]))
    pool = LanePool(1, slab.name, [str(path)])
    try:
        if not pool.odirect:
            pytest.skip("the file system refuses O_DIRECT: every read goes through the page cache")
        answers = {}
        for state in ("dropped", "warm"):
            if state == "dropped":
                drop_file_cache([path])
            else:
                path.read_bytes()  # another program reads the whole file
            oid = pool.send(0, [reg.read_order(e, e) for e in (1, 4)])
            while oid not in pool.done:
                pool.poll(0.5)
            answers[state] = pool.take(oid)
    finally:
        pool.close()
        slab.close()
    dropped, warm = answers["dropped"], answers["warm"]
    assert dropped.nbytes == warm.nbytes >= 2 * reg.expert_bytes
    assert dropped.copied == dropped.copy_ns == 0 and dropped.device_bytes == dropped.nbytes, dropped
    assert warm.copied == warm.nbytes and warm.device_bytes == 0 and 0 < warm.copy_ns <= warm.busy_ns, warm


def test_lane_reports_read_error_naming_file_and_offset(tmp_path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 10_000)
    reg = Region("blk.0.ffn_up_exps.weight", 0, "ffn_up_exps", 0, 0, 8, 8192)  # claims 64 KiB
    slab = Slab(layout([reg]))
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
    slots are: the merged reads (and their moves) land every slice where ggml reads it."""
    rng = np.random.default_rng(3)
    regs = regions_for(5000, n_expert=8, layers=3) + [
        Region(f"blk.{9 + i}.ffn_up_exps.weight", 9 + i, "ffn_up_exps", 1, 4096 * 3 + 100 * i, 8, 7000)
        for i in range(2)]
    size = layout(regs, align=512)
    files = [rng.integers(0, 256, size=5 * 10 ** 5, dtype=np.uint8).tobytes() for _ in range(2)]
    for _ in range(50):
        picks = [(ri, int(e)) for ri in range(len(regs)) for e in range(8) if rng.random() < 0.4]
        rng.shuffle(picks)
        free = list(range(regs[0].capacity))
        slot = {}
        for ri, e in picks:  # one index per (layer, expert), taken in a random order
            key = (regs[ri].layer, e)
            if key not in slot:
                slot[key] = free.pop(int(rng.integers(len(free))))
        order = sorted(picks) if rng.random() < 0.5 else picks
        merged = [r for r, _ in merge_keyed([(regs[ri].read_order(e, slot[regs[ri].layer, e]), None)
                                             for ri, e in order], max_len=64 * 1024)]
        slab = bytearray(size)
        apply(merged, files, slab)
        for ri, e in picks:
            r = regs[ri]
            at = r.data_offset + slot[r.layer, e] * r.stride
            fo = r.file_offset + e * r.expert_bytes
            assert slab[at:at + r.expert_bytes] == files[r.file_index][fo:fo + r.expert_bytes], (ri, e)


def test_steady_decode_neither_gives_back_nor_takes_new_pages() -> None:
    """Past the first fill an eviction's freed index (its pages kept) is the next miss's, whatever the two
    experts' sizes or offsets: decode neither gives pages back nor faults new ones in."""
    regs = regions_for(2 * PAGE + 2048, n_expert=8, layers=4)
    layout(regs, align=512)
    cache = ExpertCache(None, regs, budget=0, policy="lru")
    cache.set_budget(5 * cache.charge[0])
    rng = np.random.default_rng(5)
    for token in range(60):
        for layer in range(4):
            cache.commit(cache.plan(layer, sorted(rng.choice(8, size=2, replace=False).tolist())))
            assert cache.used + cache.warm_bytes <= cache.budget + 2 * cache.charge[0]
        if token == 5:
            fresh = cache.fresh
    assert cache.stats.evictions > 100 and not cache.cold and not cache.giving_back
    assert cache.fresh == fresh, "no new pages after the first tokens"


@pytest.mark.parametrize("policy", ["lru", "next-use"])
def test_a_prompts_experts_its_last_tokens_did_not_route_go_first(policy: str) -> None:
    """A prompt batch plans the union of its tokens' experts; those its last tokens did not route
    (`cold`) enter the policy's order at the cold end, so decode evicts them before the ones it is
    about to reuse, although they were read last."""
    regs = regions_for(5000, n_expert=8, layers=2)
    layout(regs)
    cache = ExpertCache(None, regs, budget=0, policy=policy)
    cache.set_budget(4 * cache.charge[0])
    cache.commit(cache.plan(0, [0, 1, 2, 3], cold={2, 3}))
    cache.commit(cache.plan(1, [0, 1]))
    held = {e for (layer, e) in cache.index_of if layer == 0}
    assert held == {0, 1}, f"the prompt's cold experts were evicted first, not {sorted({0, 1, 2, 3} - held)}"
    assert not cache.prompt_only


def test_a_budget_that_holds_every_expert_gives_each_its_own_index() -> None:
    """While the budget holds every expert, each takes its own index (`home[layer] + e`) in whatever
    order they are routed, so a complete layer is read by its experts' own ids from the pool shifted
    by `home[layer]` slots (`direct_base`); under a smaller budget indices go out in turn."""
    regs = regions_for(5000)
    layout(regs)
    big = ExpertCache(None, regs, 10 ** 9)
    assert big.holds_everything and big.home == {0: 0, 1: 8, 2: 16}
    for layer, experts in [(2, [5, 1]), (0, [7, 0, 3]), (1, [4]), (2, [0, 2, 3, 4, 6, 7]),
                           (0, [1, 2, 4, 5, 6]), (1, [0, 1, 2, 3, 5, 6, 7])]:
        big.commit(big.plan(layer, experts))
        assert all(big.index_of[(layer, e)] == big.home[layer] + e for e in experts)
    assert [big.direct_base(layer) for layer in range(3)] == [0, 8, 16]
    small = ExpertCache(None, regs, 4 * big.charge[0])
    assert not small.holds_everything
    small.commit(small.plan(2, [5, 1]))
    small.commit(small.plan(0, [7]))
    assert [small.index_of[k] for k in [(2, 5), (2, 1), (0, 7)]] == [0, 1, 2], "in turn, not at home"
