"""Warm start from the last run: the usage profile written at exit, read at the next start, the
background fill it drives, and every way a profile is refused (real Engine, real lanes, real files)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from bmoe.api import Model
from bmoe.coordinator import Engine
from bmoe.streaming import file_view, usage_profile
from bmoe.streaming.expert_cache import ABSENT, RESIDENT
from bmoe.streaming.streamer import ON_FILE
from bmoe.streaming.usage_profile import Usage
from bmoe.streaming.warm_fill import BUSY_DEPTH, IDLE_DEPTH, WarmFill
from bmoe.tools.bench_sys import drop_file_cache
from tests.conftest import complete, load, run_cli

# MiB: room for some experts only, so every layer stops and its routings are counted (under a budget that
# holds every expert, a layer the page cache holds reads llama.cpp's mapping without a stop, and a complete one
# the slab: neither is counted)
PART = 6
PROMPT = "The miller's daughter carried the flour down to the river before the sun came up"


@pytest.fixture(scope="module")
def model(synth) -> Path:
    return Path(synth(arch="qwen3moe", layers=4, experts=16, top_k=2))


def start(model: Path, usage: Path, *flags: object, notes: list[str] | None = None) -> Model:
    return load(model, "-c", 256, "-t", 2, "--usage-dir", usage, *flags,
                notice=(notes.append if notes is not None else lambda s: None))


def run(m: Model, n: int = 12) -> list[int]:
    """A completion through the one generation loop (the path users run): its token ids."""
    return list(complete(m, PROMPT, n).ids)


def fill_until_done(e: Engine, limit: int = 2000) -> None:
    """The Engine's idle tick, as a session or server calls it between requests, until the fill ends."""
    for _ in range(limit):
        if e.warm.fill is None:
            return
        e.follow_memory()
    raise AssertionError("the warm fill did not finish")


def test_a_profile_round_trips_and_stays_small_for_a_large_model(tmp_path) -> None:
    """48 layers x 128 experts (the 40 GB scale model's shape), counts as large as years of use."""
    rng = np.random.default_rng(0)
    counts = {layer: rng.integers(0, 10**9, 128) for layer in range(48)}
    usage = Usage(counts, {layer: 10**9 for layer in range(48)})
    ident = {"path": "/m.gguf", "sizes": [40 * 10**9], "mtimes": [1.5], "header_sha256": ["ab" * 32]}
    path = tmp_path / "p.json"
    usage_profile.save(path, ident, usage)
    assert path.stat().st_size <= 1 << 20
    back, why = usage_profile.read_profile(path, ident, {layer: 128 for layer in range(48)})
    assert why is None and back.routings == usage.routings
    assert all((back.counts[layer] == counts[layer]).all() for layer in counts)
    order = back.fill_order()
    shares = [back.counts[layer][e] / back.routings[layer] for layer, e in order]
    assert shares == sorted(shares, reverse=True), "most used first"


def keep_two_profiles(folder: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Four profiles saved one after another into `folder`, which keeps two (MAX_PROFILES, lowered):
    the four paths, oldest first."""
    monkeypatch.setattr(usage_profile, "MAX_PROFILES", 2)
    ident = {"path": "/m.gguf", "sizes": [1], "mtimes": [1.0], "header_sha256": ["ab" * 32]}
    paths = [folder / f"model{i}-{i:012x}.json" for i in range(4)]
    for i, p in enumerate(paths):
        usage_profile.save(p, ident, Usage({0: np.array([1, 0])}, {0: 1}))
        os.utime(p, (1000 + i, 1000 + i))
    return paths


def test_a_folder_keeps_its_newest_profiles_and_never_removes_a_users_files(tmp_path, monkeypatch) -> None:
    """Past MAX_PROFILES the oldest of bmoe's profiles go; a user's `my.json` and a file of theirs named like
    a profile, older than all of them, stay (bmoe's are told by name and by how they begin)."""
    mine = tmp_path / "my.json"
    look_alike = tmp_path / "notes-0123456789ab.json"
    for p in (mine, look_alike):
        p.write_text('{"format": "mine"}')
        os.utime(p, (0, 0))
    paths = keep_two_profiles(tmp_path, monkeypatch)
    assert sorted(tmp_path.iterdir()) == sorted([mine, look_alike, *paths[2:]])


def test_another_users_profile_is_never_removed(tmp_path, monkeypatch) -> None:
    """A profile bmoe wrote as another user, in a folder both use: theirs to keep, however old."""
    if os.geteuid() != 0:
        pytest.skip("giving a file to another uid needs root")
    theirs = tmp_path / "theirs-0123456789ab.json"
    usage_profile.save(theirs, {"path": "/t.gguf"}, Usage({0: np.array([1])}, {0: 1}))
    os.chown(theirs, 12345, 12345)
    os.utime(theirs, (0, 0))
    paths = keep_two_profiles(tmp_path, monkeypatch)
    assert sorted(tmp_path.iterdir()) == sorted([theirs, *paths[2:]])


def test_merging_keeps_half_the_old_counts() -> None:
    old = Usage({0: np.array([8, 0, 4])}, {0: 10})
    new = Usage({0: np.array([1, 3, 0])}, {0: 4})
    m = new.merged(old)
    assert m.counts[0].tolist() == [5, 3, 2] and m.routings == {0: 9}


def test_a_run_writes_its_profile_and_the_next_start_fills_the_cache_from_it(model: Path, tmp_path) -> None:
    usage = tmp_path / "usage"
    plain = load(model, "-c", 256, "-t", 2, "--no-stream")
    try:
        want = run(plain)
    finally:
        plain.close()
    m = start(model, usage, "--cache-mb", PART)
    e = m.engine
    try:
        assert e.warm.fill is None, "no profile yet"
        assert run(m) == want
        routed = {layer: c.copy() for layer, c in e.streamer.cache.routed.items()}
    finally:
        m.close()
    (path,) = usage.glob("*.json")
    saved = json.loads(path.read_text())
    assert {int(k): v["counts"] for k, v in saved["layers"].items()} == routed
    assert saved["model"]["sizes"] == [model.stat().st_size]

    notes: list[str] = []
    budget_mb = 6  # room for a few of the most used experts only: the fill must pick
    m = start(model, usage, "--cache-mb", budget_mb, "--force", notes=notes)
    e = m.engine
    try:
        assert any(n.startswith("warm start: filling the cache") for n in notes), notes
        fill_until_done(e)
        c = e.streamer.cache
        resident = {(layer, x) for layer in c.by_layer for x in range(c.n_expert(layer))
                    if all(c.state[ri][x] == RESIDENT for ri in c.by_layer[layer])}
        assert resident and c.used <= c.budget, "it fills, and never past the budget"
        order = usage_profile.read_profile(path, usage_profile.identity(e.files),
                                   {layer: c.n_expert(layer) for layer in c.by_layer})[0].fill_order()
        assert resident == set(order[:len(resident)]), "the most used experts, in order"
        assert any(n.startswith("warm start:") and "experts read in" in n for n in notes), notes
        assert run(m) == want, "a warm start computes the same bytes"
    finally:
        m.close()


def _until(cond, e: Engine, seconds: float = 30.0) -> None:
    """Collect the lanes' answers (non-blocking ticks) until `cond()` holds."""
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        e.streamer.tick()


def test_the_fill_waits_behind_demand_and_can_be_stopped(model: Path, tmp_path) -> None:
    usage = tmp_path / "usage"
    m = start(model, usage, "--cache-mb", PART)
    e = m.engine
    try:
        run(m)
    finally:
        m.close()
    m = start(model, usage, "--cache-mb", 1000, "--io-threads", 2)
    e = m.engine
    try:
        fill, ra = e.warm.fill, e.streamer.ahead
        assert isinstance(fill, WarmFill) and len(fill.orders) > 2, "sent at start, before any request"
        assert len(fill.orders) <= IDLE_DEPTH * 2
        ra.begin_batch(1)  # a decode starts: queued fill orders beyond BUSY_DEPTH are cancelled
        _until(lambda: not (fill.orders & ra.cancelled), e)
        ra.pump()
        assert 0 < len(fill.orders) <= BUSY_DEPTH, "at most BUSY_DEPTH fill orders while a decode runs"
        assert fill.todo, "the cancelled ones came back to the list"
        e.streamer.settle()  # the end of a generation: the fill pauses, nothing left in flight
        assert not fill.orders and fill.todo
        fill.stop()
        assert not fill.todo and not fill.orders
        e.follow_memory()
        assert not fill.orders, "stopped: an idle tick sends nothing"
    finally:
        m.close()


def test_the_fill_never_evicts(model: Path, tmp_path) -> None:
    """A cache already full of what demand read: a fill sends nothing and evicts nothing."""
    m = start(model, tmp_path / "usage", "--cache-mb", 6, "--force")
    e = m.engine
    try:
        run(m)
        c = e.streamer.cache
        e.streamer.set_budget(c.used)  # full: what demand read fills the budget exactly
        absent = [(layer, x) for layer in c.by_layer for x in range(c.n_expert(layer))
                  if c.state[c.by_layer[layer][0]][x] == ABSENT]
        evictions, resident = c.stats.evictions, c.used
        assert absent and not c.fits(*absent[0])
        fill = e.streamer.ahead.warm = WarmFill(e.streamer.ahead, absent)
        fill.idle()
        assert not fill.orders and not fill.todo and c.stats.evictions == evictions and c.used == resident
    finally:
        m.close()


@pytest.mark.parametrize("case", ["mtime", "header", "damaged", "garbage", "nested", "checksum", "layers"])
def test_a_foreign_or_damaged_profile_is_ignored_with_a_notice_and_replaced(model: Path, tmp_path, case: str) -> None:
    usage = tmp_path / "usage"
    copy = tmp_path / "model.gguf"
    copy.write_bytes(model.read_bytes())
    m = start(copy, usage, "--cache-mb", PART)
    e = m.engine
    try:
        run(m, 4)
    finally:
        m.close()
    (path,) = usage.glob("*.json")
    st = copy.stat()
    if case == "mtime":
        os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    elif case == "header":  # same size and mtime, another first MiB (a byte of the first tensor's data)
        at = min(e.files.extents.values(), key=lambda x: x.offset).offset + 8
        with open(copy, "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 1]))
        os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif case == "damaged":
        path.write_bytes(path.read_bytes()[:-40])
    elif case == "garbage":
        path.write_bytes(os.urandom(300))
    elif case == "nested":  # within the size bound, past the JSON parser's recursion limit: not a crash at start
        path.write_bytes(b"[" * 200_000)
    elif case == "checksum":
        doc = json.loads(path.read_text())
        doc["layers"]["0"]["counts"][0] += 1
        path.write_text(json.dumps(doc))
    elif case == "layers":
        doc = json.loads(path.read_text())
        del doc["layers"]["1"]["counts"][0]
        doc["checksum"] = usage_profile._checksum({k: v for k, v in doc.items() if k != "checksum"})
        path.write_text(json.dumps(doc))
    want = {"mtime": "it was written for another version of the model file (its mtime differs)",
            "header": "it was written for another version of the model file (its header hash differs)",
            "damaged": "it is damaged (JSONDecodeError", "garbage": "it is damaged (",
            "nested": "it is damaged (RecursionError",
            "checksum": "it is damaged (checksum mismatch)", "layers": "its layers do not match the model's"}[case]
    notes: list[str] = []
    m = start(copy, usage, "--cache-mb", PART, notes=notes)
    e = m.engine
    try:
        refused = [n for n in notes if n.startswith(f"ignoring the usage profile {path}: ")]
        assert len(refused) == 1 and want in refused[0], notes
        assert e.warm.fill is None and not any(n.startswith("warm start:") for n in notes)
        run(m, 4)
    finally:
        m.close()
    c = e.files
    assert usage_profile.read_profile(path, usage_profile.identity(c), {0: 16, 1: 16, 2: 16, 3: 16}) [1] is None, \
        "rewritten at exit for the file as it is now"


def test_no_warm_start_neither_reads_nor_writes_a_profile(model: Path, tmp_path) -> None:
    usage = tmp_path / "usage"
    m = load(model, "-c", 256, "-t", 2, "--no-warm-start", "--cache-mb", 1000)
    e = m.engine
    try:
        assert e.warm is None
        run(m, 4)
    finally:
        m.close()
    assert not usage.exists()
    r = run_cli("-m", str(model), "-p", "hi", "-n", "2", "--usage-dir", str(usage), "--no-warm-start")
    assert r.returncode == 2 and "--usage-dir names where usage profiles are kept, and --no-warm-start" in r.stderr


def test_the_server_writes_the_profile_at_shutdown_and_fills_from_it_at_start(model: Path, tmp_path) -> None:
    from tests.test_server import Server

    flags = ["-m", str(model), "-t", "1", "--io-threads", "2", "--cache-mb", str(PART), "--usage-dir", str(tmp_path)]
    s = Server(*flags)
    try:
        s.client().completions.create(model="m", prompt=PROMPT, max_tokens=4)
    finally:
        assert s.stop() == 143
    assert len(list(tmp_path.glob("*.json"))) == 1
    s = Server(*flags)
    try:
        assert "warm start: filling the cache in the background" in s.stderr
    finally:
        s.stop()


def test_the_session_and_the_api_write_the_profile_at_exit(model: Path, tmp_path) -> None:
    import bmoe
    from bmoe.edges.session_client import SessionClient

    with SessionClient(["-m", str(model), "-c", "256", "-t", "2", "--cache-mb", str(PART),
                        "--usage-dir", str(tmp_path / "s")]) as s:
        s.ask(1, PROMPT, n_predict=4)
    assert len(list((tmp_path / "s").glob("*.json"))) == 1
    with bmoe.load(str(model), n_ctx=256, threads=2, cache_mb=PART, usage_dir=str(tmp_path / "a"),
                   notice=lambda s: None) as m:
        m.generate(PROMPT, max_tokens=4)
    assert len(list((tmp_path / "a").glob("*.json"))) == 1


@pytest.mark.parametrize("warm_start", ["off", "on, no profile yet"])
def test_a_cache_that_holds_every_expert_fills_and_then_stops_nowhere(model: Path, tmp_path, warm_start: str) -> None:
    """A budget above every expert: the experts no request routed are read in the background (while
    the session waits, and one order at a time while a decode runs), each at its own index, whether
    or not a warm start runs beside it; then every layer runs through without a stop, bound to read
    its experts by their own ids, and the text is plain llama.cpp's throughout."""
    plain = load(model, "-c", 256, "-t", 2, "--no-stream")
    try:
        want = run(plain)
    finally:
        plain.close()
    flags = ("--no-warm-start",) if warm_start == "off" else ("--usage-dir", tmp_path / "usage")
    m = load(model, "-c", 256, "-t", 2, "--cache-mb", 1000, *flags)
    e = m.engine
    try:
        fill, c = e.streamer.ahead.warm, e.streamer.cache
        assert isinstance(fill, WarmFill), "a background fill from the start"
        e.follow_memory()
        assert fill.orders, "the idle tick before any request sends the fill's reads"
        assert run(m) == want
        while not fill.done:  # the idle tick sends, the wait collects what landed
            e.follow_memory()
            e.streamer.wait(list(fill.orders))
        assert fill.read > 0, "experts the answer did not route were read by the fill"
        assert all(c.layer_complete(layer) and c.direct_base(layer) == c.home[layer] for layer in c.by_layer)
        stops: list[int] = []
        route = e.hook.stops.on_route
        e.hook.stops.on_route = lambda layer, ids: (stops.append(layer), route(layer, ids))
        assert run(m) == want
        assert stops == [] and set(e.streamer.direct) == set(c.by_layer), "every layer ran through"
    finally:
        m.close()


def test_a_filling_cache_reads_what_the_page_cache_holds_through_llama_cpps_mapping(synth) -> None:
    """A budget above every expert and the file in the page cache: a layer the page cache holds reads its
    experts where plain llama.cpp does (llama.cpp's own mapping of the file), with no stop and no read,
    and the fill waits for the idle tick; a layer whose pages were evicted stops and reads as before,
    and once the idle ticks filled the slab it reads the slab without a stop. The text is plain
    llama.cpp's throughout. (64 experts: a prompt routes too few of a layer's to read it whole.)"""
    model = Path(synth(arch="qwen3moe", layers=4, experts=64, top_k=2))
    plain = load(model, "-c", 256, "-t", 2, "--no-stream")
    try:
        want = run(plain)
    finally:
        plain.close()
    m = load(model, "-c", 256, "-t", 2, "--cache-mb", 1000, "--no-warm-start")
    e, st = m.engine, m.engine.streamer
    try:
        fill = st.ahead.warm
        assert isinstance(fill, WarmFill)
        model.read_bytes()  # every page of the file in the page cache ...
        cold = st.layers[1]  # ... but this layer's experts
        fd = os.open(model, os.O_RDONLY)
        try:
            os.fsync(fd)
            for _, r in st.layer_tensors[cold]:
                os.posix_fadvise(fd, r.file_offset, r.nbytes, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        stops: list[int] = []
        route = e.hook.stops.on_route
        e.hook.stops.on_route = lambda layer, ids: (stops.append(layer), route(layer, ids))
        assert run(m) == want
        assert set(stops) == {cold}, "only the evicted layer stops"
        assert {layer for layer, b in st.direct.items() if b == ON_FILE} == set(st.layers) - {cold}
        read = fill.read
        assert run(m) == want
        assert fill.read == read and not fill.orders, "the fill sends nothing while layers read the file"
        while not fill.done:
            e.follow_memory()
            st.wait(list(fill.orders))
        stops.clear()
        assert run(m) == want
        assert stops == [] and set(st.direct) == set(st.layers), "filled: no layer stops"
        assert st.direct[cold] == (st.cache.home[cold], st.cache.moved[cold]), "the evicted layer reads the slab"
        assert all(st.direct[layer] == ON_FILE for layer in st.layers if layer != cold), \
            "the others still read the page cache's pages"
    finally:
        m.close()


def test_layers_read_through_the_mapping_are_looked_at_again_after_a_major_fault(synth, monkeypatch) -> None:
    """The page cache may be reclaimed while layers read the file's mapping: after a decode in which the
    process took a major fault (a page read back from the device) the layers' answers are taken again
    at once, not RECHECK_S later (here an hour); a decode without one leaves them. The text stays
    plain llama.cpp's."""
    monkeypatch.setattr(file_view, "RECHECK_S", 3600.0)
    # 128 experts of 136 KiB slices: a prompt touches (maps) a fraction of each 17 MiB tensor's pages
    model = Path(synth(arch="qwen3moe", layers=2, experts=128, top_k=2, embd=256, ff=512))
    other = "Seven swans flew over the frozen lake while the old ferryman counted his coins"
    plain = load(model, "-c", 256, "-t", 2, "--no-stream")
    try:
        want = run(plain), list(complete(plain, other, 12).ids)
    finally:
        plain.close()
    model.read_bytes()  # the file in the page cache
    m = load(model, "-c", 256, "-t", 2, "--cache-mb", 1000, "--no-warm-start")
    st = m.engine.streamer
    try:
        assert run(m) == want[0]
        assert set(st.direct) == set(st.layers) and set(st.direct.values()) == {ON_FILE}
        assert st.view is not None
        assert run(m) == want[0]  # the same experts again: nothing faults
        seen = dict(st.view.seen)
        assert run(m) == want[0]
        assert st.view.seen == seen, "no fault: the answers stand"
        drop_file_cache([model])  # what no layer touched yet leaves the page cache (mapped pages stay)
        faults = st.view.faults
        assert list(complete(m, other, 12).ids) == want[1]  # another prompt routes experts never touched
        assert st.view.faults > faults, "the experts evicted were read back by major faults"
        assert all(st.view.seen[layer][0] > seen[layer][0] for layer in st.layers), "and looked at again"
    finally:
        m.close()
