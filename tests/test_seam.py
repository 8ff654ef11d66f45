"""Pins every assumption bmoe.seam makes about llama.cpp, on real models in real llama.cpp."""

from __future__ import annotations

import contextlib
import ctypes
import re
import time
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest

from bmoe.api import Model
from bmoe.coordinator import Engine
from bmoe.seam import capture, eval_hook, ggml_mirror, populate
from bmoe.seam.eval_hook import ABORTED
from bmoe.streaming.expert_cache import RESIDENT
from bmoe.tools.bench_sys import drop_file_cache
from bmoe.tools.synth_archs import ARCHES, PARTS_ARCHES
from tests.conftest import SlabCheck, complete, engine_for, generate, slice_bytes
from tests.conftest import load as load_model

PROMPT = "The old lighthouse keeper climbed the stairs every evening to light the lamp above the sea"


def engine(path, *flags: object) -> Engine:
    return engine_for(path, "-c", 256, "-t", 2, *flags)


def test_the_compiled_filter_is_built_here_and_mirrors_its_struct() -> None:
    """The README's install compiles the filter (a machine without a C compiler falls back to Python:
    BMOE_PY_HOOK=1 stands for it below); its ctypes mirror has every field of the C struct at C's own
    offset (offsetof, by the field's name) and the C struct's size, also checked at load."""
    from bmoe.seam import eval_filter

    lib = eval_filter.compiled()
    assert lib is not None, "bmoe/seam/_eval_filter.c was not built by pip install -e ."
    mirror = eval_filter.EvalFilter
    assert {name: lib.bmoe_filter_offset(name.encode()) for name, *_ in mirror._fields_} == \
        {name: getattr(mirror, name).offset for name, *_ in mirror._fields_}
    assert lib.bmoe_filter_size() == ctypes.sizeof(mirror)
    layer = eval_filter.FastLayer
    assert {name: lib.bmoe_fast_layer_offset(name.encode()) for name, *_ in layer._fields_} == \
        {name: getattr(layer, name).offset for name, *_ in layer._fields_}
    assert lib.bmoe_fast_layer_size() == ctypes.sizeof(layer)
    assert eval_filter.layout_problem(lib) is None
    assert eval_hook.EvalHook().user_data is not None


@pytest.mark.parametrize("arch,flags", [("qwen3moe", ("--overlap", "--spec-gate", "--spec-recall-min", 0)),
                                        ("gpt-oss", ("--no-overlap",))])
def test_the_filter_hands_python_every_node_it_stops_at(synth, monkeypatch, arch: str, flags: tuple) -> None:
    """With the compiled filter Python is asked about the nodes it stops at and no others, and answers
    them as it does when it is asked about every node (BMOE_PY_HOOK=1): the same stops, in the same
    order, the same text; the abort check reaches Python at most once per ABORT_CHECK_NS. (The routings the
    filter answers itself are off here: the next test has them.)"""
    from bmoe.seam import eval_filter
    from bmoe.streaming.graph_stops import StreamingStops

    monkeypatch.setattr(StreamingStops, "answers_in_c", lambda self: False)

    path = synth(arch=arch, layers=3, experts=8, top_k=2)
    seen: list[list[tuple[str, bool, bool]]] = []
    aborts: list[int] = []
    callback, abort = eval_hook.EvalHook._callback, eval_hook.EvalHook._abort

    def recorded(self, t, ask, user):
        answer = callback(self, t, ask, user)
        seen[-1].append((ggml_mirror.tensor_name(t), ask, answer))
        return answer

    def counted(self, user):
        aborts[-1] += 1
        return abort(self, user)

    monkeypatch.setattr(eval_hook.EvalHook, "_callback", recorded)
    monkeypatch.setattr(eval_hook.EvalHook, "_abort", counted)
    texts, walls = [], []
    for python_only in ("1", "0"):
        monkeypatch.setenv("BMOE_PY_HOOK", python_only)
        seen.append([])
        aborts.append(0)
        m = load_model(path, "-c", 256, "-t", 2, "--cache-mb", 1, "--force", "--io-threads", 2, *flags)
        try:
            assert (m.engine.hook.filter is None) == (python_only == "1")
            seen[-1].clear()  # (the warm-up capture: every node either way)
            aborts[-1] = 0
            t0 = time.perf_counter_ns()
            texts.append(complete(m, PROMPT, 12).ids)
            walls.append(time.perf_counter_ns() - t0)
        finally:
            m.close()
    python, filtered = seen
    assert texts[0] == texts[1]
    # the routing and router-input stops do not depend on timing (a 1 MiB cache never completes a layer);
    # whether a wait node (the gate matmul, the down input) stops depends on whether its reads are still in flight
    timed = ("ffn_moe_swiglu", "ffn_moe_gate-")
    assert [x for x in python if x[2] and not x[0].startswith(timed)] == \
        [x for x in filtered if x[2] and not x[0].startswith(timed)], "the same stops, in order"
    assert {n for n, _, answer in python if answer} <= {n for n, _, _ in filtered}, "every node it stops at"
    assert len(filtered) < len(python) / 4, "Python is not asked about the other nodes"
    assert {n.split("-")[0] for n, _, _ in filtered} <= {"ffn_moe_weights", "ffn_moe_logits", "ffn_moe_swiglu",
                                                          "ffn_moe_swiglu_oai", "ffn_moe_gate"}
    # Python's abort check: after every computed node without the filter, at most once per ABORT_CHECK_NS with it
    # (a bound on time, not on the other run's count, which a slow machine's long run could pass)
    assert aborts[0] > 0 and aborts[1] <= walls[1] // eval_filter.ABORT_CHECK_NS + 1


@pytest.mark.parametrize("arch,flags", [("qwen3moe", ("--no-overlap",)), ("gpt-oss", ("--overlap",))])
def test_the_filter_answers_all_resident_routings_and_python_keeps_their_books(synth, monkeypatch, arch: str,
                                                                             flags: tuple) -> None:
    """A decode routing whose experts are all resident is answered in C (ids to slots, the tensors narrowed)
    and replayed in Python afterwards: the same text as Python answering every routing (BMOE_PY_HOOK=1), the
    same lookups (each layer's routings and usage counts); each answered routing a hit of every expert in the
    replay, its slots the cache's (replay_hit checks) and its bytes the file's (SlabCheck)."""
    from bmoe.streaming.graph_stops import StreamingStops

    path = synth(arch=arch, layers=3, experts=8, top_k=2)
    answered: list[tuple[int, int]] = []  # (layer, hits the replay counted)
    replay = StreamingStops.replay_hit

    def counted(self, layer, ids, slots):
        hits = self.st.cache.stats.hits
        replay(self, layer, ids, slots)
        answered.append((layer, self.st.cache.stats.hits - hits))
        assert answered[-1][1] == len(set(ids.ravel().tolist()))

    monkeypatch.setattr(StreamingStops, "replay_hit", counted)
    runs = []
    for python_only in ("1", "0"):
        monkeypatch.setenv("BMOE_PY_HOOK", python_only)
        answered.clear()
        # a cache of 14 of the 24 experts: most routings find theirs, some evict
        m = load_model(path, "-c", 256, "-t", 2, "--cache-mb", 1.5, "--force", "--io-threads", 2,
                       "--no-warm-start", *flags)
        try:
            check = SlabCheck(m.engine)
            ids = complete(m, PROMPT, 24).ids
            c = m.engine.streamer.cache
            runs.append((ids, c.stats.hits + c.stats.misses, c.routed, c.routings, len(answered), check))
        finally:
            m.close()
    (ids0, looked0, routed0, routings0, n0, check0), (ids1, looked1, routed1, routings1, n1, check1) = runs
    assert n0 == 0 and n1 > 10, "only the compiled filter answers routings itself"
    assert (ids1, looked1, routed1, routings1) == (ids0, looked0, routed0, routings0)
    assert check0.bad == check1.bad == [] and check1.checked >= n1


def test_struct_layout_matches_ggml() -> None:
    ggml_object_size = 32  # offs, size, next, type + padding[4] (ggml.c)
    assert ctypes.sizeof(ggml_mirror.GgmlTensor) == ggml_mirror.libggml.ggml_tensor_overhead() - ggml_object_size
    assert ggml_mirror.GGML_OP_MUL_MAT_ID == 30  # enum ggml_op in the pinned vendor/llama.cpp ggml.h
    assert ggml_mirror.libggml.ggml_op_name(ggml_mirror.GGML_OP_MUL_MAT_ID) == b"MUL_MAT_ID"


@pytest.mark.parametrize("arch", [*ARCHES, "gemma4"])
def test_capture_finds_every_expert_tensor_with_file_shapes(synth, arch: str) -> None:
    path = synth(arch=arch, layers=3, experts=8, top_k=2)
    reader = gguf.GGUFReader(path)
    file_tensors = {t.name: t for t in reader.tensors if t.name.endswith("_exps.weight")}
    e = engine(path, "--cache-mb", 1000)
    try:
        regions = e.streamer.cache.regions
        assert {r.name for r in regions} == set(file_tensors), "capture must find exactly the file's expert tensors"
        assert len({r.layer for r in regions}) == 3
        for r in regions:
            ft = file_tensors[r.name]
            addr = e.streamer.tensors[r.name].addr
            t = ggml_mirror.tensor_at(addr)
            # name, data and ne read through the struct agree with ggml's accessors and the file
            name = ctypes.string_at(ggml_mirror.libggml.ggml_get_name(addr)).decode()
            assert name == ggml_mirror.tensor_name(addr) == r.name
            assert ggml_mirror.libggml.ggml_get_data(addr) == t.data
            assert [int(x) for x in t.ne[:2]] + [r.n_expert] == [int(x) for x in ft.shape[:3]]
            assert ft.n_bytes == r.nbytes
            # `data` is llama.cpp's own mapping of the tensor (what bind_file points back at): the file's bytes
            et = e.streamer.tensors[r.name]
            assert ctypes.string_at(et.data, et.nbytes) == bytes(ft.data.view(np.uint8).ravel())
            assert (et.n_expert, et.expert_bytes) == (r.n_expert, r.expert_bytes)
            # rebinding really pointed llama.cpp at the pool: `capacity` slots, one every `stride`
            assert t.data == e.streamer.slab.base + r.data_offset
            assert int(t.ne[2]) == r.capacity >= r.n_expert
            assert int(t.nb[2]) == r.stride and int(t.nb[3]) == r.stride * r.capacity
            assert ggml_mirror.libggml.ggml_nbytes(addr) == (r.capacity - 1) * r.stride + r.expert_bytes
        for r in regions:  # and back at the file as llama.cpp loaded it, then at the pool again
            et = e.streamer.tensors[r.name]
            et.bind_file()
            t = ggml_mirror.tensor_at(et.addr)
            assert (t.data, int(t.ne[2]), int(t.nb[2])) == (et.data, r.n_expert, r.expert_bytes)
            assert ggml_mirror.libggml.ggml_nbytes(et.addr) == file_tensors[r.name].n_bytes
        for layer in e.streamer.layer_tensors:
            e.streamer._bind(layer, None)
        biases = {b.name: b for bs in e.streamer.biases.values() for b, _, _ in bs}
        if arch == "gpt-oss":  # every expert tensor has its bias, added with the same ids (ggml_add_id)
            assert set(biases) == {r.name.replace(".weight", ".bias") for r in regions}
            for r in regions:
                b = biases[r.name.replace(".weight", ".bias")]
                bt = ggml_mirror.tensor_at(b.addr)
                assert b.n_expert == r.n_expert and int(bt.ne[1]) == r.capacity and int(bt.nb[1]) == b.row_bytes
        elif arch == "gemma4":  # the down experts' per-expert scale, bound to a pool of `capacity` elements
            down = [r for r in regions if r.kind == "ffn_down_exps"]
            assert set(biases) == {r.name.replace(".weight", ".scale") for r in down}
            for r in down:
                b = biases[r.name.replace(".weight", ".scale")]
                bt = ggml_mirror.tensor_at(b.addr)
                assert b.graph_fixed and b.n_expert == r.n_expert and int(bt.ne[0]) == r.capacity
            assert e.streamer.slot_bound == {r.layer for r in regions}, "a scaled layer is never bound direct"
        else:
            assert not biases
    finally:
        e.close()


@pytest.mark.parametrize("arch", ARCHES)
def test_a_dry_capture_visits_the_whole_graph_without_computing_it(synth, arch: str) -> None:
    """A CPU graph is one split: every ask=True visit comes before its compute, so the abort
    callback can stop llama_decode (code 2) before any node reads an expert from the file."""
    path = synth(arch=arch, layers=3, experts=8, top_k=2)
    e = engine(path, "--cache-mb", 1000)
    try:
        got = {}
        for dry in (True, False):
            cap = e.hook.capture = capture.Capture(dry=dry)
            tok = (llama_cpp.llama_token * 1)(e.vocab.warmup_token())
            try:
                with e.hook:
                    rc = llama_cpp.llama_decode(e.context, llama_cpp.llama_batch_get_one(tok, 1))
            finally:
                e.hook.capture = None
            # (the tensors are in the pools by now, so both captures list them in `bad` alike)
            got[dry] = (rc, e.kv_len(0), cap.seen, cap.bad, cap.down_inputs, cap.weights_at, cap.ids_nodes)
            e.clear_kv()
        assert got[True][:2] == (ABORTED, 0), "the dry decode was computed (or left a token in the KV)"
        assert got[False][:2] == (0, 1)
        assert got[True][2:] == got[False][2:], "the dry capture missed nodes the computed one visited"
        assert len(got[True][5]) == 3, "every layer's ffn_moe_weights-L was visited"
    finally:
        e.close()


@pytest.mark.parametrize("arch", [*ARCHES, "gemma4"])
def test_matmuls_read_slot_ids_and_the_router_weights_the_real_ids(synth, arch: str) -> None:
    """The remap's facts, node by node: `ffn_moe_weights-L` gathers the router's probabilities with
    the routed expert ids; every MUL_MAT_ID and ADD_ID of the layer, when it is about to run, reads
    the slot ids the remap wrote, each below its tensor's ne[2] (ADD_ID: ne[1]), where the slab holds
    the routed expert's file bytes, and an expert matmul's tensor shows ggml exactly the slots up to
    the highest it reads; a per-expert scale's GET_ROWS (gemma4) reads them from a REPEAT of
    its pool's `capacity` rows and gathers each routed expert's own scale from the file. Prompt (many
    rows) and decode (one row) alike."""
    path = synth(arch=arch, layers=3, experts=8, top_k=2)
    file_scales = {t.name: np.asarray(t.data, dtype=np.float32).copy() for t in gguf.GGUFReader(path).tensors
                   if t.name.endswith("_exps.scale")}
    e = engine(path, "--cache-mb", 0.5, "--force")
    check = SlabCheck(e)
    real: dict[int, np.ndarray] = {}
    slots: dict[int, np.ndarray] = {}
    probs: dict[int, np.ndarray] = {}
    seen = {"weights": 0, "mul_mat_id": 0, "add_id": 0, "scale": 0}
    bad: list[str] = []
    route, remap = e.hook.stops.on_route, e.hook.stops.slot_ids

    def on_route(layer, ids):
        real[layer] = ids.copy()
        route(layer, ids)

    def slot_ids(layer, ids):
        slots[layer] = remap(layer, ids)
        return slots[layer]

    e.hook.stops.on_route, e.hook.stops.slot_ids = on_route, slot_ids

    def f32(addr: int) -> np.ndarray:
        t = ggml_mirror.tensor_at(addr)
        rows = int(t.ne[1]) * int(t.ne[2])
        return np.ctypeslib.as_array((ctypes.c_float * (int(t.ne[0]) * rows)).from_address(t.data)).reshape(rows, -1)

    def cb(t: int, ask: bool, u: int) -> bool:
        name = ggml_mirror.tensor_name(t)
        m = re.fullmatch(r"ffn_moe_probs-(\d+)", name)
        if m:
            if not ask:
                probs[int(m.group(1))] = f32(t).copy()
            return True
        tt = ggml_mirror.tensor_at(t)
        if tt.op == ggml_mirror.GGML_OP_GET_ROWS and ggml_mirror.tensor_at(tt.src[0]).op == ggml_mirror.GGML_OP_REPEAT:
            rep = ggml_mirror.tensor_at(tt.src[0])
            scale = ggml_mirror.tensor_at(rep.src[0]).view_src  # REPEAT(RESHAPE(blk.L.ffn_down_exps.scale))
            layer = int(ggml_mirror.tensor_name(tt.src[1]).split("-")[1])
            if ask:
                if not (ggml_mirror.routing_ids(tt.src[1]) == slots[layer]).all() or int(rep.ne[1]) != int(
                        ggml_mirror.tensor_at(scale).ne[0]) or int(rep.ne[1]) <= slots[layer].max():
                    got = ggml_mirror.routing_ids(tt.src[1]).tolist()
                    bad.append(f"{name} gathers {got} from {int(rep.ne[1])} rows")
                e.hook._callback(t, ask, u)
                return True
            got = f32(t).reshape(len(real[layer]), -1)
            seen["scale"] += 1
            if not np.array_equal(got, file_scales[ggml_mirror.tensor_name(scale)][real[layer]]):
                bad.append(f"{name} gathered {got.tolist()}, not the scales of experts {real[layer].tolist()}")
            return True  # (False here would stop the graph)
        if ask and tt.op in (ggml_mirror.GGML_OP_MUL_MAT_ID, ggml_mirror.GGML_OP_ADD_ID):
            layer = int(ggml_mirror.tensor_name(tt.src[2]).split("-")[1])
            now = ggml_mirror.routing_ids(tt.src[2])
            n = int(ggml_mirror.tensor_at(tt.src[0 if tt.op == ggml_mirror.GGML_OP_MUL_MAT_ID else 1]).ne[
                2 if tt.op == ggml_mirror.GGML_OP_MUL_MAT_ID else 1])
            seen["mul_mat_id" if tt.op == ggml_mirror.GGML_OP_MUL_MAT_ID else "add_id"] += 1
            if not (now == slots[layer]).all() or now.max() >= n:
                bad.append(f"{name} reads {now.tolist()}, not the slots {slots[layer].tolist()} below {n}")
            elif tt.op == ggml_mirror.GGML_OP_MUL_MAT_ID and n != now.max() + 1:
                # ggml's mul_mat_id works through every one of its ne[2] experts on each call: a matmul
                # sees the pool only up to the highest slot it reads (Streamer.narrow)
                bad.append(f"{name} reads slots up to {now.max()} from a tensor of {n} experts")
        handled = e.hook._callback(t, ask, u)
        if not ask and re.fullmatch(r"ffn_moe_weights-\d+", name):
            layer = int(name.split("-")[1])
            w = f32(t).reshape(len(real[layer]), -1)
            seen["weights"] += 1
            if not np.array_equal(w, np.take_along_axis(probs[layer], real[layer].astype(np.int64), axis=1)):
                bad.append(f"{name} did not gather the router weights at the routed expert ids")
        return handled

    try:
        _swap_callback(e, llama_cpp.ggml_backend_sched_eval_callback(cb))
        complete(Model(e), PROMPT, 4)
    finally:
        check.close()
        e.close()
    assert not bad, bad[:3]
    assert not check.bad, check.bad[:3]
    assert seen["weights"] >= 3 * 4 and seen["mul_mat_id"] >= 3 * seen["weights"] - 3 and check.checked > 0
    assert (seen["add_id"] > 0) == (arch == "gpt-oss")
    assert (seen["scale"] >= seen["weights"] > 0) == (arch == "gemma4")


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_routing_ids_are_a_strided_view_and_match_the_router(synth, arch: str) -> None:
    """Recompute top-k from the router's own logits node and compare with the strided read. No cache:
    with one, a prompt's whole-layer reads ahead may complete a layer before it routes, and a complete
    layer is not stopped at (how soon depends on the machine's load)."""
    path = synth(arch=arch, layers=3, experts=8, top_k=2)
    e = engine(path, "--cache-mb", 0)
    seen: dict[int, np.ndarray] = {}
    logits: dict[int, np.ndarray] = {}
    strides: list[tuple[int, int]] = []
    inner = e.hook.stops.on_route

    def on_route(layer: int, ids: np.ndarray) -> None:
        seen[layer] = ids
        inner(layer, ids)

    def read_logits(t: int, ask: bool, _u: int) -> bool:
        name = ggml_mirror.tensor_name(t)
        if name.startswith("ffn_moe_topk-"):
            if not ask:
                tt = ggml_mirror.tensor_at(t)
                strides.append((int(tt.nb[1]), int(tt.ne[0]) * 4))
            return True
        m = re.fullmatch(r"ffn_moe_probs-(\d+)", name)
        if m:
            if ask:
                return True
            tt = ggml_mirror.tensor_at(t)
            n_exp, n_tok = int(tt.ne[0]), int(tt.ne[1])
            buf = (ctypes.c_float * (n_exp * n_tok)).from_address(tt.data)
            logits[int(m.group(1))] = np.frombuffer(buf, dtype=np.float32).reshape(n_tok, n_exp).copy()
            return True
        return e.hook._callback(t, ask, _u)

    e.hook.stops.on_route = on_route
    try:
        _swap_callback(e, llama_cpp.ggml_backend_sched_eval_callback(read_logits))
        toks = e.tokenize(PROMPT)
        e._decode([(0, toks, 0)])
    finally:
        e.close()
    assert set(seen) == {0, 1, 2}
    assert strides and all(row > used for row, used in strides), "ids rows are nb[1] apart, wider than top-k"
    for layer, ids in seen.items():
        # the last layer may compute only the row whose logits are requested (arch-dependent)
        assert ids.shape == (len(toks), 2) or (layer == 2 and ids.shape == (1, 2))
        probs = logits[layer]
        assert probs.shape[0] == ids.shape[0]
        for row, want in zip(ids, probs):
            top = set(np.argsort(-want, kind="stable")[:2].tolist())
            assert set(row.tolist()) == top


def _swap_callback(e: Engine, cb) -> None:
    """Re-create the context with another eval callback (test-only instrumentation)."""
    import llama_cpp

    from bmoe.seam.llama import new_context

    llama_cpp.llama_free(e.context)
    e._test_cb = cb
    e._parts.ctx = new_context(e.model, 256, 2, cb)  # (the engine's own part, swapped by the test)


def test_llama_cpp_computes_from_the_slab(synth) -> None:
    """Corrupting a resident expert's slab bytes changes the output: nothing reads the mmap any more
    (the file cold: a layer the page cache held would read llama.cpp's mapping until the slab holds it)."""
    path = synth(arch="qwen3moe", layers=3, experts=8, top_k=2)
    drop_file_cache([path])
    e = engine(path, "--cache-mb", 1000)
    m = Model(e)
    try:
        good = complete(m, PROMPT, 16).ids
        cache = e.streamer.cache
        assert cache.stats.evictions == 0
        for ri, r in enumerate(cache.regions):  # everything the first run read stays resident: corrupt it
            for ex in range(r.n_expert):
                if cache.state[ri][ex] == RESIDENT:
                    slice_bytes(e.streamer, ri, ex)[:] = bytes(r.expert_bytes)
        bad = complete(m, PROMPT, 16).ids
    finally:
        m.close()
    assert good != bad


def _fake_graph(extra: str | None = None, late_weights: bool = False):
    """A ggml graph of one MoE layer built from struct ggml_tensor mirrors: argsort, the topk view,
    the router weights' GET_ROWS, an up matmul and a bias ADD_ID; `extra` adds a node of that name
    reading the ids, `late_weights` puts the GET_ROWS after the matmul. Returns the nodes in order
    and every struct (the leaves too: alive as long as the caller holds them)."""
    def node(name: str, op: int = 0, *srcs, ne=(4, 2, 1, 1), nb=(4, 16, 32, 32)) -> ggml_mirror.GgmlTensor:
        t = ggml_mirror.GgmlTensor()
        t.name, t.op, t.ne[:], t.nb[:] = name.encode(), op, ne, nb
        for i, s in enumerate(srcs):
            t.src[i] = ctypes.addressof(s) if s is not None else None
        return t

    probs = node("ffn_moe_probs-0")
    argsort = node("ffn_moe_argsort-0", 0, probs)
    topk = node("ffn_moe_topk-0", ggml_mirror.GGML_OP_VIEW, argsort)
    weights = node("ffn_moe_weights-0", ggml_mirror.GGML_OP_GET_ROWS, probs, topk)
    w = node("blk.0.ffn_up_exps.weight", ne=(4, 2, 8, 1), nb=(4, 16, 32, 256))
    bias = node("blk.0.ffn_up_exps.bias", ne=(4, 8, 1, 1), nb=(4, 16, 128, 128))
    w.data = bias.data = 4096  # any address: nothing is read
    up = node("ffn_moe_up-0", ggml_mirror.GGML_OP_MUL_MAT_ID, w, probs, topk)
    biased = node("ffn_moe_up_biased-0", ggml_mirror.GGML_OP_ADD_ID, up, bias, topk)
    nodes = [probs, argsort, topk, weights, up, biased]
    if late_weights:
        nodes = [probs, argsort, topk, up, weights, biased]
    leaves = [w, bias]
    if extra and extra.startswith("scale"):  # GET_ROWS(REPEAT(RESHAPE(scale)), ids), as build_lora_mm_id
        layer = 1 if extra == "scale_of_layer_1" else 0
        scale = node(f"blk.{layer}.ffn_up_exps.{'weight' if extra == 'scale_not_named_so' else 'scale'}",
                     ne=(8, 1, 1, 1), nb=(4, 32, 32, 32))
        scale.data = 4096
        shaped = node("scale (reshaped)", 0, scale, ne=(1, 8, 1, 1), nb=(4, 4, 32, 32))
        shaped.view_src = ctypes.addressof(scale)
        rep = node("", ggml_mirror.GGML_OP_REPEAT, shaped, ne=(1, 8, 2, 1), nb=(4, 4, 32, 64))
        nodes += [rep, node("node_9", ggml_mirror.GGML_OP_GET_ROWS, rep, topk)]
        leaves += [scale, shaped]
    elif extra:
        nodes.append(node(extra, 0, argsort if "argsort" in extra else topk))
    return nodes, [*nodes, *leaves]


@pytest.mark.parametrize("case", ["ok", "late_weights", "reads_ids", "reads_argsort", "scale",
                                  "scale_of_layer_1", "scale_not_named_so"])
def test_capture_refuses_a_graph_the_remap_would_change(case: str) -> None:
    """Load-time checks of the remap's facts: the router weights gathered before any matmul reads
    the ids, and nothing else reading them (or the argsort they view) but the GET_ROWS of a per-expert
    scale of the same layer (gemma4's `ffn_down_exps.scale`)."""
    extra = {"reads_ids": "ffn_moe_other-0", "reads_argsort": "ffn_moe_argsort_user-0"}.get(case, case)
    nodes, _alive = _fake_graph(extra=None if case in ("ok", "late_weights") else extra,
                                late_weights=case == "late_weights")
    cap = capture.Capture()
    for n in nodes:
        cap.visit(ctypes.addressof(n))
    assert len(cap.tensors) == 1 and len(cap.biases) == 1
    if case in ("ok", "scale"):
        assert not cap.bad and cap.weights_at == {0: 4}
        assert [(s.name, s.layer, s.kind, s.n_expert) for s in cap.scales.values()] == (
            [("blk.0.ffn_up_exps.scale", 0, "ffn_up_exps.scale", 8)] if case == "scale" else [])
    elif case == "late_weights":
        assert any("multiplied before ffn_moe_weights-0" in b for b in cap.bad), cap.bad
    else:
        assert any("reads layer 0's routed expert ids" in b for b in cap.bad), cap.bad


def test_a_node_tap_copies_every_layers_rows_as_llama_cpp_computes_them(synth) -> None:
    """`NodeTap` (what the demo's calibration reads the router input with) gets `ffn_inp-L` and
    `ffn_norm-L` of every layer once per decode as [n_tokens, n_embd] F32 rows, and the norm's rows
    are the RMS norm of the input's (the synthetic norm weights are ones): names, layout, values."""
    from bmoe.seam.llama import Vocab, init_backend, load_model, new_context

    path = synth(arch="llama", layers=4, experts=8, top_k=2)
    reader = gguf.GGUFReader(path)
    n_embd = int(reader.get_field("llama.embedding_length").parts[-1][0])
    eps = float(reader.get_field("llama.attention.layer_norm_rms_epsilon").parts[-1][0])
    got: dict[tuple[str, int], list[np.ndarray]] = {}
    tap = eval_hook.NodeTap(("ffn_inp", "ffn_norm"),
                       lambda name, layer, rows: got.setdefault((name, layer), []).append(rows))
    init_backend()
    model = load_model(path)
    ctx = new_context(model, 256, 2, tap.c_callback)
    try:
        toks = Vocab(model).tokenize(PROMPT)
        ids = (llama_cpp.llama_token * len(toks))(*toks)  # kept alive: the batch points into it
        rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(ids, len(toks)))
        assert rc == 0 and tap.error is None, (rc, tap.error)
    finally:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    assert sorted(got) == [(name, layer) for name in ("ffn_inp", "ffn_norm") for layer in range(4)]
    for layer in range(4):
        (x,), (y,) = got["ffn_inp", layer], got["ffn_norm", layer]
        n_rows = len(toks) if layer < 3 else 1  # the last layer computes only the output row
        assert x.shape == y.shape == (n_rows, n_embd) and x.dtype == y.dtype == np.float32
        want = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=1, keepdims=True) + eps)
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-6)


# ---- lossy routing's facts (bmoe.streaming.lossy): where the router weights may be changed --------------------

NORMS = {"qwen3moe": capture.NORM_SUM, "llama": capture.NORM_SUM, "qwen2moe": capture.NORM_NONE,
         "olmoe": capture.NORM_NONE, "gpt-oss": capture.NORM_SOFTMAX}


@pytest.mark.parametrize("arch", ARCHES)
def test_router_weights_come_ranked_and_the_layers_normalisation_reads_them(synth, arch: str) -> None:
    """What bmoe.streaming.lossy relies on, node by node: `ffn_moe_weights-L` is a contiguous F32 [1, top_k, n]
    tensor of the router's scores at the routed ids, best first (llama.cpp's top-k is a descending
    argsort); its src[0] holds every expert's score (`router_scores`); and the layer's normalisation,
    as the capture names it per architecture (a sum, a softmax, or none), computes from that node
    (through reshapes), later in graph order, so a weight rewritten at its ask=False call is what
    gets normalised."""
    path = synth(arch=arch, layers=3, experts=8, top_k=2)
    e = engine(path, "--cache-mb", 1000)
    order: list[str] = []
    addr: dict[str, int] = {}
    got: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    topk = re.compile(r"ffn_moe_topk-(\d+)")

    def reads(node: int, target: int, hops: int = 4) -> bool:
        """`node` computes from `target` within a few nodes (reshapes, the softmax's own node)."""
        srcs = ggml_mirror.tensor_at(node).src
        return node == target or (hops > 0 and any(reads(x, target, hops - 1) for x in srcs if x))

    def cb(t: int, ask: bool, u: int) -> bool:
        name = ggml_mirror.tensor_name(t)
        tt = ggml_mirror.tensor_at(t)
        if ask and name.startswith("ffn_moe_weights"):
            order.append(name)
            addr[name] = t
        if not ask and re.fullmatch(r"ffn_moe_weights-\d+", name):
            layer = int(name.split("-")[1])
            ids = ggml_mirror.routing_ids(tt.src[1])
            assert topk.fullmatch(ggml_mirror.tensor_name(tt.src[1])), "the weights gather by the routed ids"
            got[layer] = (ids, ggml_mirror.moe_weights(t).copy(), ggml_mirror.router_scores(t).copy())
        return e.hook._callback(t, ask, u) or name.startswith("ffn_moe_weights")

    try:
        _swap_callback(e, llama_cpp.ggml_backend_sched_eval_callback(cb))
        e._decode([(0, e.tokenize(PROMPT), 0)])
    finally:
        e.close()
    cap_norms = {layer: NORMS[arch] for layer in range(3)} if NORMS[arch] != capture.NORM_NONE else {}
    assert e.hook.capture is None
    for layer in range(3):
        ids, w, scores = got[layer]
        assert scores.shape == (len(ids), 8) and w.shape == ids.shape == (len(ids), 2)
        assert np.array_equal(w, np.take_along_axis(scores, ids.astype(np.int64), axis=1)), "the scores at the ids"
        assert (np.diff(w, axis=1) <= 0).all(), "the routed ids come best first"
        weights = f"ffn_moe_weights-{layer}"
        norm = {capture.NORM_SUM: f"ffn_moe_weights_norm-{layer}",
                capture.NORM_SOFTMAX: f"ffn_moe_weights_softmax-{layer}"}
        names = [n for n in order if n.endswith(f"-{layer}")]
        if NORMS[arch] == capture.NORM_NONE:
            assert names == [weights] * names.count(weights), f"{arch} weighs the experts as gathered: {names}"
        else:
            first = norm[NORMS[arch]] if NORMS[arch] == capture.NORM_SOFTMAX else f"ffn_moe_weights_sum-{layer}"
            assert first in names and names.index(first) > names.index(weights), names
            assert norm[NORMS[arch]] in names
            assert reads(addr[first], addr[weights]) and reads(addr[norm[NORMS[arch]]], addr[weights]), \
                f"the normalisation of layer {layer} does not compute from {weights}"
    # the capture names the same normalisation (what bmoe.streaming.lossy is told at load)
    e2 = engine(path, "--cache-mb", 1000, "--drop-cold", 0.1)
    try:
        assert e2.lossy is not None and e2.lossy.norms == cap_norms
    finally:
        e2.close()


@pytest.mark.parametrize("arch", [*ARCHES, *(a for a in PARTS_ARCHES if a not in ("llama4", "deepseek4"))])
def test_fewer_experts_by_the_hook_is_llama_cpps_own_expert_count(synth, arch: str) -> None:
    """The pin of where bmoe.streaming.lossy changes the weights: routing a token to its K best experts by
    rewriting the weights node (and the dropped positions to the spare zero slot) before the layer's
    own normalisation computes, token for token, what llama.cpp computes with the model's
    expert_used_count set to K at load (`--no-stream --experts-per-token K`), while streaming with
    a cache that forces misses; and it is not the model's full top-k output. On every architecture whose
    gating the lossy modes follow (a selection bias, a group limit, a scale after the normalisation,
    gemma4's per-expert scale: bmoe.streaming.gating refuses llama4's and deepseek4's)."""
    path = synth(arch=arch, layers=4, experts=8, top_k=2)
    flags = ("-c", 256, "-t", 2)
    with load_model(path, *flags, "--no-stream") as m:
        full = complete(m, PROMPT, 24).ids
    with load_model(path, *flags, "--no-stream", "--experts-per-token", 1) as m:
        assert m.engine.fixed_k == 1 and m.engine.lossy is None
        want = complete(m, PROMPT, 24).ids
    with load_model(path, *flags, "--cache-mb", 0.5, "--force", "--experts-per-token", 1) as m:
        check = SlabCheck(m.engine)
        try:
            got = complete(m, PROMPT, 24)
        finally:
            check.close()
    assert got.ids == want and want != full
    assert not check.bad and check.checked > 0, check.bad[:3]
    assert got.stats.lossy and got.stats.experts_per_token == 1 and got.stats.weight_changed_pct > 0


# ---- the load that maps the file without reading it (populate.no_populate) ----------------------------


def _gpa(reg: int, name: bytes) -> int | None:
    return ggml_mirror.libggml.ggml_backend_reg_get_proc_address(reg, name)


def _read_bytes() -> int:
    """Bytes this process has had read from storage (/proc/self/io)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def _ggml_is_numa() -> int:
    """Address of ggml-cpu's own `ggml_is_numa`, looked up by symbol in the library the registry lives in."""
    lib = populate.library_of(populate.BackendReg.from_address(populate.cpu_registry()).iface.get_proc_address)
    cpu = ctypes.CDLL(str(next(Path(llama_cpp.__file__).parent.glob(f"lib/{lib}"))))
    return ctypes.cast(cpu.ggml_is_numa, ctypes.c_void_p).value


def test_the_cpu_backend_registry_is_the_layout_bmoe_knows() -> None:
    """`struct ggml_backend_reg` of the pinned ggml: int api_version (2), then the four function
    pointers of ggml_backend_reg_i, then the context; its get_proc_address gives ggml_is_numa."""
    reg = populate.cpu_registry()
    assert populate.registry_problem(reg) is None
    assert ctypes.sizeof(populate.BackendReg) == 48 and populate.BackendReg.iface.offset == 8
    r = populate.BackendReg.from_address(reg)
    assert r.api_version == populate.REGISTRY_API_VERSION == 2
    assert populate.library_of(r.iface.get_proc_address).startswith("libggml-cpu")
    assert _gpa(reg, populate.IS_NUMA) == _ggml_is_numa()
    assert populate._IsNuma(_ggml_is_numa())() is False, "one NUMA node here: llama.cpp's load reads every byte"


def test_no_populate_answers_true_inside_only_and_puts_the_registry_back() -> None:
    reg = populate.cpu_registry()
    iface = populate.BackendReg.from_address(reg).iface
    before, real = iface.get_proc_address, _gpa(reg, populate.IS_NUMA)
    other = _gpa(reg, b"ggml_backend_set_n_threads")
    with pytest.raises(KeyboardInterrupt):
        with populate.no_populate() as why:
            assert why is None
            inside = _gpa(reg, populate.IS_NUMA)
            assert inside != real and populate._IsNuma(inside)() is True
            assert _gpa(reg, b"ggml_backend_set_n_threads") == other, "every other name is forwarded"
            assert _gpa(reg, b"no_such_function") is None
            raise KeyboardInterrupt  # however the block ends, the registry is put back
    assert iface.get_proc_address == before and _gpa(reg, populate.IS_NUMA) == real


def test_no_populate_leaves_an_unknown_registry_alone(monkeypatch) -> None:
    reg = populate.cpu_registry()
    before = populate.BackendReg.from_address(reg).iface.get_proc_address
    monkeypatch.setattr(populate, "REGISTRY_API_VERSION", 3)
    with populate.no_populate() as why:
        assert why == "the CPU backend registry has api_version 2, not 3"
        assert populate.BackendReg.from_address(reg).iface.get_proc_address == before
    assert populate.registry_problem(0) == "llama.cpp has no CPU backend registry"


@pytest.fixture(scope="module")
def big_experts(synth) -> Path:
    """A model whose file is nearly all experts (about 200 MB, 4 MiB of dense weights)."""
    return Path(synth(arch="qwen3moe", layers=4, experts=16, top_k=4, embd=256, size_gb=0.2))


def test_a_load_under_no_populate_reads_the_header_only(big_experts: Path) -> None:
    from bmoe.seam.llama import init_backend, load_model

    init_backend()
    size = big_experts.stat().st_size
    read = {}
    for mode in ("no_populate", "plain"):
        drop_file_cache([big_experts])
        r0 = _read_bytes()
        with populate.no_populate() if mode == "no_populate" else contextlib.nullcontext():
            model = load_model(big_experts)
        read[mode] = _read_bytes() - r0
        llama_cpp.llama_model_free(model)
    assert read["no_populate"] <= 0.02 * size, read
    assert read["plain"] >= 0.9 * size, read


def _start(path: Path, *flags: object) -> tuple[Engine, int, list[str]]:
    """An Engine started on a cold page cache: (engine, bytes this process read to start it, notices)."""
    notes: list[str] = []
    drop_file_cache([path])
    r0 = _read_bytes()
    e = engine_for(path, "-c", 256, "-t", 2, *flags, notice=notes.append)
    return e, _read_bytes() - r0, notes


def _dense_bytes(path: Path) -> int:
    from bmoe.base.model_files import read_model_files
    from bmoe.memory.dense import file_spans

    return sum(n for _, _, n in file_spans(read_model_files(path)))


def test_a_streaming_start_reads_the_dense_weights_and_no_expert(big_experts: Path) -> None:
    """The whole start (table, llama.cpp's load, the dense read-ahead, capture, lanes) reads the
    dense bytes plus at most 2 % of the file; afterwards the dense weights are in the page cache
    (reading them again reads nothing from storage), and the registry is llama.cpp's again."""
    from bmoe.base.model_files import read_model_files
    from bmoe.memory.dense import file_spans

    reg = populate.cpu_registry()
    before = populate.BackendReg.from_address(reg).iface.get_proc_address
    size, dense = big_experts.stat().st_size, _dense_bytes(big_experts)
    e, read, notes = _start(big_experts, "--cache-mb", 100)
    try:
        assert not any("whole model file" in n for n in notes), notes
        assert read <= dense + 0.02 * size, (read, dense, size)
        assert populate.BackendReg.from_address(reg).iface.get_proc_address == before
        assert _gpa(reg, populate.IS_NUMA) == _ggml_is_numa()
        r0 = _read_bytes()
        with open(big_experts, "rb") as f:
            for _, offset, length in file_spans(read_model_files(big_experts)):
                f.seek(offset)
                f.read(length)
        assert _read_bytes() - r0 < 64 * 1024, "the dense weights were read ahead into the page cache"
    finally:
        e.close()


def test_an_unknown_registry_falls_back_to_reading_the_whole_file_with_one_notice(big_experts: Path,
                                                                                  monkeypatch) -> None:
    """Output is the same either way, streaming through a small cache or with every expert resident,
    and the same as plain llama.cpp's."""
    want = generate(big_experts, PROMPT, 12, "-c", 256, "-t", 2, "--no-stream").ids
    got, reads = {}, {}
    for mode in ("no_populate", "fallback"):
        if mode == "fallback":
            monkeypatch.setattr(populate, "REGISTRY_API_VERSION", 7)
        e, reads[mode], notes = _start(big_experts, "--cache-mb", 100)
        try:
            got[mode] = complete(Model(e), PROMPT, 12).ids
        finally:
            e.close()
        e, _, _ = _start(big_experts, "--cache-mb", 400, "--preload")
        try:
            assert e.streamer.holds_everything
            got[mode + " resident"] = complete(Model(e), PROMPT, 12).ids
        finally:
            e.close()
        whole = [n for n in notes if "whole model file" in n]
        if mode == "fallback":
            assert whole == ["loading the whole model file, as llama.cpp does (the CPU backend registry has "
                             "api_version 2, not 7): a slower start, the same output"]
        else:
            assert not whole
    size = big_experts.stat().st_size
    assert reads["fallback"] >= 0.9 * size and reads["no_populate"] <= _dense_bytes(big_experts) + 0.02 * size, reads
    assert got == dict.fromkeys(("no_populate", "no_populate resident", "fallback", "fallback resident"), want)


@pytest.mark.parametrize("arch,quant", [("qwen3moe", "q4_k_m"), ("deepseek2", "q8_0"), ("gpt-oss", "q8_0")])
def test_every_weight_a_decode_reads_is_the_files_bytes_as_bmoe_loads_it(synth, arch: str, quant: str) -> None:
    """bmoe loads models without llama.cpp's extra buffer types (`seam.llama.model_params`), so every weight
    a decode reads is llama.cpp's mapping of the file, byte for byte: what expert streaming rebinds and
    `bind_file` points back at. With them llama.cpp copies some weights into buffers of its own (on this
    kind of CPU CPU_REPACK takes Q4_K as q4_K_8x8; on an AMX CPU the AMX buffer takes Q4_K and Q8_0 too),
    which streaming cannot serve and which crash llama.cpp on some CPUs and shapes (docs/architecture.md).
    Dense (MLA's attn_k_b / attn_v_b in deepseek2) and expert weights, K-quant and q8_0 alike."""
    from bmoe.seam.llama import Vocab, init_backend, load_model, new_context

    path = synth(arch=arch, quant=quant, layers=3, experts=8, top_k=2)
    file = {t.name: bytes(t.data.view(np.uint8).ravel()) for t in gguf.GGUFReader(path).tensors}
    read: dict[str, bytes] = {}

    def on_node(addr: int, ask: bool, _user: int) -> bool:
        for src in ggml_mirror.tensor_at(addr).src:
            name = ggml_mirror.tensor_name(src) if src else ""
            if name in file and name not in read:
                read[name] = ctypes.string_at(ggml_mirror.tensor_at(src).data, len(file[name]))
        return False

    cb = llama_cpp.ggml_backend_sched_eval_callback(on_node)
    init_backend()
    model = load_model(path)
    assert model
    ctx = new_context(model, 64, threads=2, eval_cb=cb)
    try:
        toks = Vocab(model).tokenize(PROMPT)
        arr = (llama_cpp.llama_token * len(toks))(*toks)
        assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(toks))) == 0
    finally:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    experts = {n for n in file if n.endswith("_exps.weight")}
    assert experts < set(read), "the decode read every expert tensor and dense weights besides"
    if arch == "deepseek2":
        assert {"blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight"} <= set(read)
    changed = [n for n in read if read[n] != file[n]]
    assert not changed, f"llama.cpp reads these weights from a copy of its own, not the file: {changed}"


# ---- MTP drafting's staging API (bmoe.seam.llama, bmoe.engine.mtp) --------------------------------------------

# src/llama-ext.h's declarations, as c++filt spells the C++ names libllama exports them under
NEXTN_DECLARED = {"llama_set_embeddings_nextn": "llama_set_embeddings_nextn(llama_context*, bool, bool)",
                  "llama_get_embeddings_nextn_ith": "llama_get_embeddings_nextn_ith(llama_context*, int)"}


def test_the_nextn_staging_api_is_exported_under_the_names_its_header_declares() -> None:
    import shutil
    import subprocess

    from bmoe.seam import llama

    assert set(llama.NEXTN_SYMBOLS) == set(NEXTN_DECLARED)
    for name, mangled in llama.NEXTN_SYMBOLS.items():
        assert getattr(llama.LIBLLAMA, mangled), name  # the symbol is there (AttributeError otherwise)
        if shutil.which("c++filt"):
            spelled = subprocess.run(["c++filt", mangled], capture_output=True, text=True, check=True).stdout.strip()
            assert spelled == NEXTN_DECLARED[name]
    # the C API that drives it: the MTP context type, load_mtp, n_rs_seq, ctx_other and the extended batch
    assert llama_cpp.LLAMA_CONTEXT_TYPE_MTP == 1 and llama_cpp.LLAMA_PROCESS_TYPE_DECODE == 1
    assert {"load_mtp"} <= {f for f, _ in llama_cpp.llama_model_params._fields_}
    assert {"ctx_type", "n_rs_seq", "ctx_other"} <= {f for f, _ in llama_cpp.llama_context_params._fields_}
    for fn in ("llama_model_n_layer_nextn", "llama_n_rs_seq", "llama_batch_ext_init", "llama_batch_ext_add_token",
               "llama_batch_ext_set_pos", "llama_batch_ext_set_embd_token", "llama_batch_ext_set_output_logits",
               "llama_batch_ext_free", "llama_process"):
        assert callable(getattr(llama_cpp, fn)), fn


def test_an_mtp_context_keeps_the_hidden_states_it_is_asked_for(synth) -> None:
    """The target context keeps every row's hidden state (unmasked), the MTP context only its output rows'; a state
    fed with a token changes what the MTP layer predicts (it is read, not ignored)."""
    from bmoe.seam import llama

    path = str(synth(arch="glm4moe", mtp=True))
    llama.init_backend()
    mdl = llama.load_model(path, mtp=True)
    assert mdl and llama.n_layer_nextn(mdl) == 1
    tgt = llama.new_context(mdl, 64, 2)
    dft = llama.new_context(mdl, 64, 2, mtp_of=tgt)
    try:
        llama.set_embeddings_nextn(tgt, masked=False)
        llama.set_embeddings_nextn(dft, masked=True)
        vocab = llama.Vocab(mdl)
        toks = vocab.tokenize("one two three")
        assert llama.decode(tgt, [(0, toks, 0)])[0] == 0
        h = llama.nextn_rows(tgt, mdl, range(len(toks)))
        assert h.shape == (len(toks), llama.n_embd_out(mdl)) and np.isfinite(h).all() and len({*map(bytes, h)}) > 1
        logits = []
        for state in (h[:1], np.zeros_like(h[:1])):
            assert llama.decode_mtp(dft, [(0, toks[1:2], 1, state)], outputs=True) == (0, [0])
            logits.append(llama.logits(dft, vocab, 0))
            assert llama.nextn_rows(dft, mdl, [0]).shape == (1, llama.n_embd_out(mdl))
            llama.kv_clear(dft)
        assert not np.array_equal(*logits)
    finally:
        llama.free_context(dft)
        llama.free_context(tgt)
        llama.free_model(mdl)
