"""The demo model (`bmoe-demo`): a real-routing MoE made from SmolLM2-135M.

It must answer like SmolLM2, stream to exactly the tokens plain llama.cpp gives, and make every
expert's bytes matter: a wrong or missing expert has to change the output, or the byte-identity
gates that use this model would pass on a broken cache.

The model (8 experts, top-2, about 0.7 GB) is built into the user cache on first use (about a
minute here, most of it the calibration run, which is cached too) and reused after that.
"""

from __future__ import annotations

import collections
import itertools
import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from bmoe.api import Model
from bmoe.base.model_files import read_model_files
from bmoe.base.units import MiB
from bmoe.base.user_cache import cache_dir
from bmoe.demo import build as demo
from bmoe.demo import router_fit as demo_routers
from bmoe.demo import write as demo_write
from bmoe.streaming.expert_cache import file_regions, working_sets
from tests.conftest import complete, load, slice_bytes
from tests.conftest import reference as plain

FACT = "What is the capital of France?"
STORY = "Write a short story about a dragon."
N_FACT, N_STORY = 32, 48
N_CTX = 512


EXPERTS, TOP_K = 8, 2  # the demo8 fixture's


@pytest.fixture(scope="module")
def model(demo8: Path) -> Path:
    return demo8


@pytest.fixture(scope="module")
def quarter_mb(model: Path) -> float:
    """A cache budget holding a quarter of the expert bytes: streaming has to evict and re-read.

    With top-2 of 8 a quarter is one token's routed set, which page rounding pushes just past a
    quarter: the budget is the larger, the least bmoe accepts without --force."""
    files = read_model_files(model)
    token = sum(working_sets(file_regions(files), files.n_expert_used).values())
    return max(files.expert_bytes / 4, token) / MiB


def _load(model: Path, *flags: object) -> Model:
    # One compute thread: the model is tiny, and llama.cpp's spinning thread pool slows down
    # many times over when another process (a parallel test, a build) competes for the cores.
    return load(model, "-c", N_CTX, "-t", 1, *flags)


def _run(m: Model, prompt: str, n: int) -> tuple[int, ...]:
    """A one-turn chat (it starts from an empty KV: it extends no earlier conversation)."""
    return complete(m, prompt, n, chat=True).ids


@pytest.fixture(scope="module")
def reference(model: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Plain llama.cpp (no streaming): the token ids and text every other run is compared with."""
    out = {}
    for prompt, n in ((FACT, N_FACT), (STORY, N_STORY)):
        res = plain(str(model), prompt, n, "-c", N_CTX, "-t", 1, chat=True)
        out[prompt] = (res.ids, res.text)
    return out


# --- the file --------------------------------------------------------------------------------


def test_file_is_a_llama_moe_with_copied_experts(model: Path) -> None:
    r = gguf.GGUFReader(model)
    src = gguf.GGUFReader(demo.source_model())
    assert r.get_field("general.architecture").contents() == "llama"
    assert r.get_field("llama.expert_count").contents() == EXPERTS
    assert r.get_field("llama.expert_used_count").contents() == TOP_K
    assert r.get_field("tokenizer.chat_template").contents() == src.get_field("tokenizer.chat_template").contents()
    t = {x.name: x for x in r.tensors}
    s = {x.name: x for x in src.tensors}
    assert not [n for n in t if n.split(".")[-2] in ("ffn_gate", "ffn_up", "ffn_down")]
    # everything but the FFN is the source's, byte for byte
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_norm.weight", "output_norm.weight"):
        assert np.array_equal(t[name].data, s[name].data), name
    n_embd, n_ff = 576, 1536
    for layer in (0, 29):
        p = f"blk.{layer}."
        router = t[p + "ffn_gate_inp.weight"]
        assert router.tensor_type == gguf.GGMLQuantizationType.F32
        assert list(router.shape) == [n_embd, EXPERTS]
        assert np.isfinite(router.data).all()
        for kind, shape in (("gate", [n_embd, n_ff, EXPERTS]), ("up", [n_embd, n_ff, EXPERTS]),
                            ("down", [n_ff, n_embd, EXPERTS])):
            x = t[p + f"ffn_{kind}_exps.weight"]
            assert x.tensor_type == gguf.GGMLQuantizationType.Q8_0
            assert list(x.shape) == shape
        gate = t[p + "ffn_gate_exps.weight"].data
        assert all(np.array_equal(gate[0], gate[e]) for e in range(1, EXPERTS))
        # down projections differ only in their block scales, by the documented signature
        down = t[p + "ffn_down_exps.weight"].data.reshape(EXPERTS, -1, 34)
        scale = down[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float64)
        for e in range(1, EXPERTS):
            assert np.array_equal(down[0, :, 2:], down[e, :, 2:])
            nz = scale[0] != 0
            ratio = np.median(scale[e][nz] / scale[0][nz])
            want = demo_routers.signature_gain(layer, e, TOP_K) / demo_routers.signature_gain(layer, 0, TOP_K)
            assert abs(ratio - want) < 2e-3, (layer, e, ratio, want)


def test_neighbouring_experts_differ_by_at_least_the_gain() -> None:
    for layer, top_k in ((0, 2), (7, 8)):
        s = demo_routers.signature_scale(top_k)
        g = [demo_routers.signature_gain(layer, e, top_k) for e in range(64)]
        assert all(abs(a - b) >= s - 1e-12 for a, b in itertools.pairwise(g))
        assert all(s / 2 <= abs(x - 1) <= s for x in g)
    assert demo_routers.signature_scale(2) < demo_routers.signature_scale(8) <= 0.3


def test_routers_are_deterministic_and_use_every_expert() -> None:
    rng = np.random.default_rng(0)
    states = rng.standard_normal((600, 64)).astype(np.float32) + 3 * rng.standard_normal(64).astype(np.float32)
    w1, s1 = demo_routers.make_router(states, 16, 4, seed=5)
    w2, s2 = demo_routers.make_router(states, 16, 4, seed=5)
    assert np.array_equal(w1, w2) and s1 == s2
    ids = np.argsort(-(states @ w1.T), axis=1)[:, :4]
    assert len(np.unique(ids[:, 0])) == 16
    p = demo_routers._softmax(states @ w1.T)
    mass = np.sort(p, axis=1)[:, -4:].sum(axis=1).mean()
    assert abs(mass - demo_routers.TOPK_MASS) < 0.01


def test_size_and_names() -> None:
    src = demo.source_model()
    assert demo_write.experts_for_size(5.5, src) == 64
    assert demo_write.experts_for_size(1.4, src) == 16
    with pytest.raises(ValueError):
        demo_write.experts_for_size(0.05, src)
    p = demo.default_path(16, 4)
    assert p.parent == cache_dir() and "e16" in p.name and "k4" in p.name


def test_cli(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        demo.main(["--help"])
    assert e.value.code == 0
    assert "examples:" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        demo.main(["--experts", "4", "--top-k", "5"])
    assert e.value.code == 2
    capsys.readouterr()
    assert demo.main(["--experts", str(EXPERTS), "--top-k", str(TOP_K), "-q"]) == 0  # cached: no rebuild
    assert capsys.readouterr().out.strip() == str(model)


def test_stats_come_from_a_cli_route_trace(model: Path) -> None:
    r = demo.routing_report(model, n_predict=24)
    assert 2 <= r["tokens"] <= 24
    assert r["uniform_reuse"] == 100 * TOP_K / EXPERTS
    assert all(0 <= r[k] <= 100 for k in r if k != "tokens")
    assert r["reuse"] > r["uniform_reuse"]  # routing follows the text, not chance
    assert r["next_layer_recall"] > 0 and r["busiest_quarter"] >= 25
    assert r["lru_hit_50"] >= r["lru_hit_25"] and r["lru_hit_50"] > 0


def test_default_model_budget_is_a_quarter(model: Path, quarter_mb: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quarter of the experts, or one token's working set where page rounding puts that higher."""
    monkeypatch.setattr(demo, "build_demo", lambda *a, **k: model)
    path, mb = demo.default_model()
    assert path == model
    assert quarter_mb >= read_model_files(model).expert_bytes / 4 / MiB
    assert mb == pytest.approx(quarter_mb, abs=0.1)


# --- running it ------------------------------------------------------------------------------


def test_answers_like_smollm2(reference: dict[str, tuple[tuple[int, ...], str]]) -> None:
    _ids, text = reference[FACT]
    assert "Paris" in text, text
    story = reference[STORY][1]
    assert len(reference[STORY][0]) == N_STORY and "dragon" in story.lower(), story


def test_streaming_gives_the_same_tokens(model: Path, quarter_mb: float,
                                         reference: dict[str, tuple[tuple[int, ...], str]]) -> None:
    with _load(model, "--cache-mb", quarter_mb) as m:
        for prompt, n in ((FACT, N_FACT), (STORY, N_STORY)):
            assert _run(m, prompt, n) == reference[prompt][0], prompt
        assert m.engine.streamer.cache.stats.evictions > 0  # the quarter budget really made it re-read


def test_wrong_or_missing_expert_changes_the_output(model: Path, quarter_mb: float,
                                                     reference: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """Overwrite one routed expert's slab bytes right after the cache has them, every time it is
    routed: with another expert's bytes (wrong) or zeros (missing). Either must change the text.

    The budget holds every expert, so after the first run nothing is re-read and the runs are
    quick; the slab is the same one a smaller budget would use."""
    m = _load(model, "--cache-mb", 4 * quarter_mb + 64)
    eng = m.engine
    try:
        st = eng.streamer
        inner = eng.hook.stops.on_route
        eng.hook.stops.skip_route = lambda layer: False  # every routing decision goes through the wrapper below
        uses: collections.Counter[tuple[int, int]] = collections.Counter()
        target: dict[str, object] = {}
        hits = 0

        def on_route(layer: int, ids: np.ndarray) -> None:
            nonlocal hits
            inner(layer, ids)  # now the routed experts are resident in the slab
            for e in np.unique(ids).tolist():
                uses[(layer, e)] += 1
            if target and layer == target["layer"] and target["expert"] in ids:
                for r, data in target["bytes"]:
                    slice_bytes(st, st.cache.regions.index(r), target["expert"])[:] = data
                hits += 1

        eng.hook.stops.on_route = on_route
        ref = reference[STORY][0]
        assert _run(m, STORY, N_STORY) == ref
        (layer, victim), _ = max(uses.items(), key=lambda kv: (kv[1], -kv[0][0], -kv[0][1]))
        donor = (victim + 1) % EXPERTS
        regions = [r for r in st.cache.regions if r.layer == layer]
        assert len(regions) == 3
        fds = {i: os.open(p, os.O_RDONLY) for i, p in enumerate(eng.files.paths)}
        try:
            def expert_bytes(r: object, e: int) -> bytes:
                return os.pread(fds[r.file_index], r.expert_bytes, r.file_offset + e * r.expert_bytes)

            originals = [(r, expert_bytes(r, victim)) for r in regions]
            for name, payload in (("wrong", [(r, expert_bytes(r, donor)) for r in regions]),
                                  ("missing", [(r, bytes(r.expert_bytes)) for r in regions])):
                hits = 0
                target.update(layer=layer, expert=victim, bytes=payload)
                got = _run(m, STORY, N_STORY)
                target.clear()
                for r, data in originals:  # put the right bytes back for the next case
                    slice_bytes(st, st.cache.regions.index(r), victim)[:] = data
                assert hits > 0, f"expert {victim} of layer {layer} was never routed"
                assert got != ref, f"a {name} expert {victim} in layer {layer} left the output unchanged"
        finally:
            for fd in fds.values():
                os.close(fd)
        assert _run(m, STORY, N_STORY) == ref  # and with the right bytes back, the same text again
    finally:
        m.close()
