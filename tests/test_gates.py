"""Byte-identity gates: streamed output equals plain llama.cpp (`--no-stream`) token for token."""

from __future__ import annotations

import pytest

from bmoe.api import Completion
from bmoe.base.model_files import read_model_files
from bmoe.base.units import MiB
from bmoe.streaming.speculation import SpecGate
from bmoe.tools.bench_sys import drop_file_cache
from bmoe.tools.synth_archs import ARCHES, FUSED_ARCHES, MTP_ARCHES, STREAMED_ARCHES
from tests import spec_lines
from tests.conftest import complete, load, run_cli, wide
from tests.conftest import reference as plain
from tests.plain_llama import plain_llama

PROMPT = ("In the valley below the mountains, a small village kept an old tradition: every spring the "
          "farmers walked to the river and sang")
N_PREDICT = 48
MIN_TOKENS = 32

CASES = [(arch, "q8_0") for arch in ARCHES] + [
    ("qwen3moe", "q4_0"), ("qwen3moe", "f16"), ("llama", "q4_0"), ("llama", "f16"), ("gpt-oss", "mxfp4"),
]


FLAGS = ("-c", 256, "-t", 2)


def generate(path: str, *flags: object) -> tuple[Completion, SpecGate | None]:
    """One greedy answer with these bmoe-cli flags through the one generation loop (bmoe.generation.driver);
    with it the run's spec-gate (closed), for its counters."""
    with load(path, *FLAGS, *flags) as m:
        gate = m.engine.streamer.ahead.gate if m.engine.streamer else None
        assert len(m.engine.tokenize(PROMPT)) >= 13
        return complete(m, PROMPT, N_PREDICT), gate


def reference(path: str) -> Completion:
    res = plain(path, PROMPT, N_PREDICT, *FLAGS)
    assert len(res.ids) >= MIN_TOKENS, "the reference must not stop early, or the gate proves little"
    return res


@pytest.mark.parametrize("arch", ARCHES)
def test_the_reference_is_what_llama_cpp_pythons_own_loop_generates(synth, arch: str) -> None:
    """Every gate compares with `reference`, which runs through bmoe's one generation loop
    (bmoe.generation.driver) like the streamed runs do; so that a bug in that loop cannot hide in both sides,
    the reference itself must equal llama-cpp-python's own generation loop (`Llama.generate`,
    greedy) on the same file with the same context: no repacked weights (as bmoe loads them),
    flash attention as llama.cpp's default chooses it on this CPU, one ubatch for the prompt."""
    import llama_cpp.llama_cpp as low

    path = str(synth(arch=arch, quant="q8_0", layers=4, experts=8, top_k=2))
    llm = plain_llama(path, n_ctx=256, n_batch=256, n_ubatch=256, n_threads=2, n_threads_batch=2, flash_attn=True)
    try:
        want = []
        for tok in llm.generate(llm.tokenize(PROMPT.encode(), add_bos=True, special=True), temp=0.0, reset=True):
            if low.llama_vocab_is_eog(llm._model.vocab, tok) or len(want) == N_PREDICT:
                break
            want.append(tok)
    finally:
        llm.close()
    assert list(reference(path).ids) == want


@pytest.mark.parametrize("lanes", [1, 4])
@pytest.mark.parametrize("budget", ["zero", "third", "all", "preload", "preload-cold"])
@pytest.mark.parametrize("arch,quant", CASES)
def test_streamed_equals_plain(synth, arch: str, quant: str, budget: str, lanes: int) -> None:
    """With the file warm a budget that holds every expert reads it through llama.cpp's mapping
    (bmoe.streaming.file_view); `preload-cold` drops it from the page cache first, so every layer
    runs through bound to the slab."""
    path = str(synth(arch=arch, quant=quant, layers=4, experts=8, top_k=2))
    ref = reference(path)
    if budget == "preload-cold":
        drop_file_cache([path])
    expert_bytes = read_model_files(path).expert_bytes
    cache_mb = {"zero": 0.0, "third": expert_bytes / 3 / MiB}.get(budget, expert_bytes * 2 / MiB)  # pages
    # force: a third is just under one token's page-rounded working set for mxfp4's small slices
    preload = ["--preload"] if budget.startswith("preload") else []
    res, _ = generate(path, "--cache-mb", cache_mb, "--io-threads", lanes, "--force", *preload)
    assert res.ids == ref.ids
    assert res.text == ref.text
    hits = sum(s.hits for s in res.tokens)
    misses = sum(s.lookups - s.hits for s in res.tokens)
    if budget == "zero":
        assert all(s.read_bytes > 0 for s in res.tokens), "with no cache every token reads its experts"
    if budget == "third":
        assert hits > 0 and misses > 0, "a third of the experts must force misses and still hit"
    if budget.startswith("preload"):  # every layer is complete: the hook lets the graph run through
        assert misses == 0 and hits > 0 and all(s.read_bytes == 0 for s in res.tokens)


# every architecture bmoe streams, at a K-quant (llama.cpp's Q4_K_M recipe: Q4_K and Q6_K experts, with
# the MTP layer where the loader has one) and a non-K type, in both expert layouts where the loader takes both
ARCH_CASES = [(arch, quant, fused) for arch in STREAMED_ARCHES for quant in ("q8_0", "q4_k_m")
              for fused in (False, True) if not fused or arch in FUSED_ARCHES]
ARCH_PREDICT = 24


@pytest.mark.parametrize(("arch", "quant", "fused"), ARCH_CASES)
def test_every_architecture_streams_what_plain_llama_cpp_computes(synth, arch: str, quant: str, fused: bool) -> None:
    """The lossless gate over every architecture: greedy, a cache of a quarter of the experts (which
    forces misses), two lanes; the answer equals `--no-stream`'s token for token, and every expert
    byte the matmuls read is the file's (SlabCheck). The experts of an MTP layer are not the model's:
    the capture finds exactly the others, and the quarter is of those."""
    from tests.conftest import SlabCheck

    mtp = quant == "q4_k_m" and arch in MTP_ARCHES
    path = str(synth(arch=arch, quant=quant, fused=fused, mtp=mtp, embd=256 if quant == "q4_k_m" else 128))
    for prompt in (PROMPT, PROMPT[:60], PROMPT[60:]):  # random weights: a prompt may end its answer early
        ref = plain(path, prompt, ARCH_PREDICT, *FLAGS)
        if len(ref.ids) == ARCH_PREDICT:
            break
    assert len(ref.ids) == ARCH_PREDICT, "the reference must not stop early, or the gate proves little"
    files = read_model_files(path)
    assert bool(files.mtp_layers) == mtp
    with load(path, *FLAGS, "--cache-mb", files.expert_bytes / 4 / MiB, "--io-threads", 2, "--force") as m:
        st = m.engine.streamer
        assert {r.name for r in st.cache.regions} == files.expert_names()
        check = SlabCheck(m.engine)
        try:
            res = complete(m, prompt, ARCH_PREDICT)
        finally:
            check.close()
    assert res.ids == ref.ids and res.text == ref.text
    assert check.checked > 0 and not check.bad, check.bad[:3]
    misses = sum(s.lookups - s.hits for s in res.tokens)
    assert misses > 0 and all(s.read_bytes > 0 for s in res.tokens[:4]), "a quarter of the experts must miss"


def test_split_model_streams_from_every_shard(tmp_path) -> None:
    from bmoe.tools.synth import write_model

    first = write_model(tmp_path / "split.gguf", layers=6, experts=8, top_k=2, splits=3)
    files = read_model_files(first)
    assert [p.name for p in files.paths] == [f"split-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert {e.file_index for n, e in files.extents.items() if "_exps" in n} == {0, 1, 2}
    ref = reference(str(first))
    res, _ = generate(str(first), "--cache-mb", files.expert_bytes / 3 / MiB, "--io-threads", 2)
    assert res.ids == ref.ids and res.text == ref.text


def test_split_model_with_a_missing_shard_is_refused(tmp_path) -> None:
    from bmoe.base.errors import ModelError
    from bmoe.tools.synth import write_model

    first = write_model(tmp_path / "gap.gguf", layers=2, splits=2)
    (tmp_path / "gap-00002-of-00002.gguf").unlink()
    with pytest.raises(ModelError, match=r"missing shard.*gap-00002-of-00002.gguf"):
        read_model_files(first)


def test_memfd_segment_streams_identically(small_moe) -> None:
    """Where /dev/shm is missing (Android) the slab is a memfd the lanes open through /proc."""
    from tests.conftest import bmoe_segments

    path = str(small_moe)
    before = bmoe_segments()
    third = read_model_files(path).expert_bytes / 3 / MiB
    res, _ = generate(path, "--cache-mb", third, "--io-threads", 2, "--shm", "memfd")
    assert res.ids == reference(path).ids
    assert bmoe_segments() == before


def test_a_cache_that_holds_every_expert_runs_full_layers_without_a_stop(small_moe) -> None:
    """A budget that holds every expert, preloaded: each layer's experts land at indices in expert
    order, so its tensors read them by their own ids and the graph no longer stops there (every
    layer bound direct), with plain llama.cpp's text."""
    path = str(small_moe)
    with load(path, *FLAGS, "--cache-mb", 2 * read_model_files(path).expert_bytes / MiB, "--preload") as m:
        st = m.engine.streamer
        res = complete(m, PROMPT, N_PREDICT)
        assert st.holds_everything and set(st.direct) == set(st.layers), sorted(st.direct)
    assert res.ids == reference(path).ids


@pytest.mark.parametrize("lanes", [1, 2])
@pytest.mark.parametrize("arch", wide(["qwen3moe", "gpt-oss"], {"qwen3moe"}))
def test_every_cache_policy_streams_identically(synth, arch: str, lanes: int) -> None:
    """A policy changes which bytes stay resident, never which bytes are computed."""
    from bmoe.streaming.cache_policy import POLICIES

    path = str(synth(arch=arch, layers=4, experts=8, top_k=2))
    ref = reference(path)
    cache_mb = read_model_files(path).expert_bytes / 3 / MiB
    hit_pcts = {}
    for policy in POLICIES:
        res, _ = generate(path, "--cache-mb", cache_mb, "--io-threads", lanes, "--cache-policy", policy)
        assert res.ids == ref.ids and res.text == ref.text, policy
        misses = sum(s.lookups - s.hits for s in res.tokens)
        assert misses > 0, f"{policy}: a third of the experts must force misses"
        hit_pcts[policy] = sum(s.hits for s in res.tokens) / sum(s.lookups for s in res.tokens)
    assert len(set(hit_pcts.values())) > 1, f"the policies should not all keep the same experts: {hit_pcts}"


@pytest.mark.parametrize("arch", wide(["qwen3moe", "gpt-oss"], {"qwen3moe"}))
def test_every_cache_policy_with_speculative_reads_streams_identically(synth, arch: str) -> None:
    """Prefetch and spec-gate reads enter each policy at its cold end and leave through forget: output stays exact.

    The spec-gate trusts every prediction from the start (--spec-precision 0, --spec-recall-min 0),
    and one run per policy has no --prefetch: what it reads ahead came from the gate's predictions."""
    from bmoe.streaming.cache_policy import POLICIES

    path = str(synth(arch=arch, layers=4, experts=8, top_k=2))
    ref = reference(path)
    cache_mb = read_model_files(path).expert_bytes / 2 / MiB
    gate = ["--spec-gate", "--spec-warmup", 1, "--spec-recall-min", 0, "--spec-precision", 0]
    for policy in POLICIES:
        for prefetch in ([], ["--prefetch", 2]):
            res, g = generate(path, "--cache-mb", cache_mb, "--io-threads", 2, "--cache-policy", policy, "--overlap",
                              *prefetch, *gate)
            what = f"{policy} {' '.join(map(str, prefetch)) or 'spec-gate only'}"
            assert res.ids == ref.ids and res.text == ref.text, what
            assert g.active and g.disabled_below is None and g.scored > 0 and g.predicted > 0, what
            assert res.stats.prefetched_experts > 0 and res.stats.speculative_mib > 0, \
                f"{what}: the run must read ahead, or the gate proves little"


# ---- bmoe-cli options against plain llama.cpp (`--no-stream` with the same options) ----------------

SAMPLING = ["--temp", "0.9", "--top-k", "40", "--top-p", "0.95"]


def cli_run(path: str, *flags: object) -> tuple[str, dict, str]:
    """(answer, summary lines by kind, stderr) of a `bmoe-cli --progress` run of PROMPT."""
    r = run_cli("-m", path, "-p", PROMPT, "-n", str(MIN_TOKENS), "-t", "1", "--progress", *map(str, flags))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    a, p = lines.index(spec_lines.ANSWER_BANNER), lines.index(spec_lines.PERF_BANNER)
    return "\n".join(lines[a + 1:p]), {x.split(":")[0]: x for x in lines[p + 1:]}, r.stderr


@pytest.mark.parametrize("case", ["sampled", "no-odirect", "cache-auto", "chat"])
def test_cli_options_stream_what_plain_llama_cpp_computes(small_moe, case: str) -> None:
    """Sampling, buffered reads, an auto-sized cache and the chat template: each streamed answer is
    plain llama.cpp's with the same options, at a budget that forces misses; and each option did
    change something (a sampled answer is not the greedy one, the chat answer not the raw one)."""
    path = str(small_moe)
    third = f"{read_model_files(path).expert_bytes / 3 / MiB:.2f}"
    same = {"sampled": [*SAMPLING, "--seed", 1234], "chat": ["--chat"]}.get(case, [])
    cache = {"cache-auto": ["--cache-mb", "auto", "--cache-floor-mb", 0, "--cache-ceil-mb", third],
             "no-odirect": ["--cache-mb", third, "--no-odirect"]}.get(case, ["--cache-mb", third])
    plain, _, _ = cli_run(path, "--no-stream", *same)
    streamed, summary, err = cli_run(path, *same, *cache)
    assert streamed == plain and plain.strip()
    hit = float(summary["moe-cache"].split("%")[0].split()[-1])
    assert 0 < hit < 100, summary["moe-cache"]  # a real cache that misses
    greedy, _, _ = cli_run(path, "--no-stream")
    if case == "sampled":
        other, _, _ = cli_run(path, "--no-stream", *SAMPLING, "--seed", 99)
        assert plain != greedy and plain != other, "the sampling options and the seed must matter"
    elif case == "chat":
        assert plain != greedy, "--chat must wrap the prompt in the model's template"
    elif case == "cache-auto":
        assert f"bmoe: cache budget {float(third):.1f} MiB (auto, " in err and f"=> --cache-ceil-mb {third}" in err, err
    else:
        assert plain == greedy
        with load(path, "-c", 256, "-t", 1, "--cache-mb", third, "--no-odirect") as m:
            pool = m.engine.streamer.pool
            assert pool.odirect is False and all("--no-odirect" in lane.cmd for lane in pool.lanes)


@pytest.mark.parametrize("overlap", ["--overlap", "--no-overlap"])
def test_a_prefill_that_routes_every_expert_of_a_layer_streams_exactly(small_moe, overlap: str) -> None:
    """The prompt's batch routes every expert of a layer at once, more than a budget of a third
    holds: the layer's whole set is pinned and read in one go, and the output is still plain's."""
    path = str(small_moe)
    ref = reference(path)
    with load(path, *FLAGS, "--cache-mb", read_model_files(path).expert_bytes / 3 / MiB, "--force", "--io-threads", 2,
              overlap) as m:
        e = m.engine
        prefill: dict[int, set[int]] = {}
        inner = e.hook.stops.on_route

        def on_route(layer, ids) -> None:
            if len(ids) > 1:
                prefill[layer] = {int(x) for x in ids.reshape(-1)}
            inner(layer, ids)

        e.hook.stops.on_route, e.hook.stops.skip_route = on_route, lambda layer: False
        res = complete(m, PROMPT, N_PREDICT)
    assert any(len(experts) == 8 for experts in prefill.values()), prefill
    assert res.ids == ref.ids and res.text == ref.text


@pytest.mark.parametrize("arch", wide(ARCHES, {"qwen3moe"}))
def test_a_prompt_of_two_calls_reads_each_layer_ahead_and_streams_exactly(synth, arch: str) -> None:
    """A prefill of two llama_decode calls (the first as wide as the context's ubatch, 2048 tokens:
    bmoe.engine.prompt_calls) that routes nearly every expert reads each next layer whole while
    this one computes (the first layer of each call too), under a budget of 2.5 of its 4 layers.
    Only the last layer may wait on demand reads: where llama.cpp computes just the logits' row
    there, in every call; where it computes every row (gpt-oss), in the first call only. Prompt and
    answer equal plain llama.cpp's with its default ubatch of 512."""
    path = str(synth(arch=arch, layers=4, experts=8, top_k=2))
    flags = ("-c", 2560, "-t", 2)
    words = (PROMPT + " ") * 38
    ref = plain(path, words, N_PREDICT, *flags)
    m = load(path, *flags, "--cache-mb", read_model_files(path).expert_bytes * 2.5 / 4 / MiB, "--io-threads", 2)
    e = m.engine
    toks = e.tokenize(words)
    assert 2048 + 64 <= len(toks) <= 2560 - N_PREDICT, len(toks)  # two calls, the second past the tail's own
    st = e.streamer
    demand: set[tuple[int, int]] = set()  # (call, layer routing) of the prefill's demand orders
    ahead: set[int] = set()  # layers the prefill read ahead
    ahead_at: list[int] = []  # routings done when each was sent
    routes: list[tuple[int, int]] = []  # (layer, tokens) of every routing
    send, inner = st.orders.send, e.hook.stops.on_route

    def on_send(lane, share, ahead_of=None) -> int:
        if (0, 1) not in routes:  # the decode has not started
            if ahead_of:
                ahead.update(layer for layer, _ in ahead_of)
                ahead_at.append(len(routes))
            else:
                demand.add((sum(1 for layer, _ in routes if layer == 0), routes[-1][0]))
        return send(lane, share, ahead_of)

    def on_route(layer, ids) -> None:
        routes.append((layer, len(ids)))
        inner(layer, ids)

    st.orders.send, e.hook.stops.on_route = on_send, on_route
    try:
        res = complete(m, words, N_PREDICT)
    finally:
        m.close()
    assert routes[:8:4] == [(0, 2048), (0, len(toks) - 2048)]
    last = [n for layer, n in routes[:8] if layer == 3]
    if arch == "gpt-oss":
        assert last == [2048, len(toks) - 2048]
        assert demand == {(1, 3)}, demand  # learnt in the first call
    else:
        assert last == [0, 1]
        assert demand == {(2, 3)}, demand  # the logits' row (the first call wants none)
    assert set(ahead) == {0, 1, 2, 3} if arch == "gpt-oss" else {0, 1, 2}
    assert max(ahead_at) < 8, "the prompt's last call was through: nothing is to be read whole"
    assert res.ids == ref.ids and res.text == ref.text


def test_the_slab_check_finds_one_wrong_byte_in_a_resident_expert(small_moe) -> None:
    """SlabCheck (tests/conftest.py) backs the gates that use it: one flipped byte in an expert the
    cache holds must be reported when that expert is next routed (the budget holds every expert, so
    nothing re-reads and repairs it)."""
    from tests.conftest import SlabCheck, slice_bytes

    path = str(small_moe)
    with load(path, *FLAGS, "--cache-mb", read_model_files(path).expert_bytes / MiB + 8, "--io-threads", 2) as m:
        check = SlabCheck(m.engine)
        try:
            complete(m, PROMPT, 4)
            assert check.checked > 0 and not check.bad, check.bad[:3]
            st = m.engine.streamer
            ri = next(i for i in st.cache.by_layer[0] if st.cache.regions[i].kind == "ffn_up_exps")
            expert = min(check._slots[0])
            slice_bytes(st, ri, expert)[100] ^= 0x5A
            complete(m, PROMPT, 1)
        finally:
            check.close()
    assert any(b.startswith(f"{st.cache.regions[ri].name} expert {expert} ") for b in check.bad), check.bad[:3]
