"""Pins every assumption bmoe.seam makes about llama.cpp, on real models in real llama.cpp."""

from __future__ import annotations

import ctypes
import re

import gguf
import numpy as np
import pytest

from bmoe import seam
from bmoe.coordinator import Engine
from bmoe.expert_cache import RESIDENT
from bmoe.tools.synth import ARCHES
from tests.conftest import settings_for, window_bytes

PROMPT = "The old lighthouse keeper climbed the stairs every evening to light the lamp above the sea"


def engine(path, *flags: object) -> Engine:
    return Engine(settings_for(path, "-c", 256, "-t", 2, *flags))


def test_struct_layout_matches_ggml() -> None:
    ggml_object_size = 32  # offs, size, next, type + padding[4] (ggml.c)
    assert ctypes.sizeof(seam.GgmlTensor) == seam.libggml.ggml_tensor_overhead() - ggml_object_size
    assert seam.GGML_OP_MUL_MAT_ID == 30  # enum ggml_op in the pinned vendor/llama.cpp ggml.h
    assert seam.libggml.ggml_op_name(seam.GGML_OP_MUL_MAT_ID) == b"MUL_MAT_ID"


@pytest.mark.parametrize("arch", ARCHES)
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
            t = seam.tensor_at(addr)
            # name, data and ne read through the struct agree with ggml's accessors and the file
            assert ctypes.string_at(seam.libggml.ggml_get_name(addr)).decode() == seam.tensor_name(addr) == r.name
            assert seam.libggml.ggml_get_data(addr) == t.data
            assert [int(x) for x in t.ne[:3]] == [int(x) for x in ft.shape[:3]]
            assert ft.n_bytes == r.nbytes
            # rebinding really pointed llama.cpp at the window, an expert every `stride` bytes
            assert t.data == e.streamer.window.base + r.window_offset
            assert int(t.nb[2]) == r.stride and int(t.nb[3]) == r.stride * r.n_expert
            assert seam.libggml.ggml_nbytes(addr) == (r.n_expert - 1) * r.stride + r.expert_bytes
    finally:
        e.close()


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_routing_ids_are_a_strided_view_and_match_the_router(synth, arch: str) -> None:
    """Recompute top-k from the router's own logits node and compare with the strided read."""
    path = synth(arch=arch, layers=3, experts=8, top_k=2)
    e = engine(path, "--cache-mb", 1000)
    seen: dict[int, np.ndarray] = {}
    logits: dict[int, np.ndarray] = {}
    strides: list[tuple[int, int]] = []
    inner = e.streamer.on_route

    def on_route(layer: int, ids: np.ndarray) -> None:
        seen[layer] = ids
        inner(layer, ids)

    def read_logits(t: int, ask: bool, _u: int) -> bool:
        name = seam.tensor_name(t)
        if name.startswith("ffn_moe_topk-") and not ask:
            tt = seam.tensor_at(t)
            strides.append((int(tt.nb[1]), int(tt.ne[0]) * 4))
        m = re.fullmatch(r"ffn_moe_probs-(\d+)", name)
        if m:
            if ask:
                return True
            tt = seam.tensor_at(t)
            n_exp, n_tok = int(tt.ne[0]), int(tt.ne[1])
            buf = (ctypes.c_float * (n_exp * n_tok)).from_address(tt.data)
            logits[int(m.group(1))] = np.frombuffer(buf, dtype=np.float32).reshape(n_tok, n_exp).copy()
            return True
        return e.hook._callback(t, ask, _u)

    e.hook.on_route = on_route
    try:
        _swap_callback(e, seam.llama_cpp.ggml_backend_sched_eval_callback(read_logits))
        toks = e.prompt_tokens(PROMPT, chat=False)
        e._decode(toks)
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

    from bmoe.llama import new_context

    llama_cpp.llama_free(e.ctx)
    e._test_cb = cb
    e.ctx = new_context(e.model, 256, 2, cb)


def test_llama_cpp_computes_from_the_slab(synth) -> None:
    """Corrupting a resident expert's slab bytes changes the output: nothing reads the mmap any more."""
    path = synth(arch="qwen3moe", layers=3, experts=8, top_k=2)
    e = engine(path, "--cache-mb", 1000)
    try:
        toks = e.prompt_tokens(PROMPT, chat=False)
        good = e.generate(toks, 16).ids
        e.clear_kv()
        cache = e.streamer.cache
        assert cache.stats.evictions == 0
        for ri, r in enumerate(cache.regions):  # everything the first run read stays resident: corrupt it
            for ex in range(r.n_expert):
                if cache.state[ri][ex] == RESIDENT:
                    s, t = r.slice_bounds(ex)
                    window_bytes(e.streamer.window)[s:t] = bytes(t - s)
        bad = e.generate(toks, 16).ids
    finally:
        e.close()
    assert good != bad
