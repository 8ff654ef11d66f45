"""--overlap, --prefetch K and --spec-gate: every combination is lossless, and the levers do work.

The gates run each combination at a budget that forces misses and compare with plain llama.cpp
token for token; on top of that, SlabCheck verifies at every routing and down-input node that
the bytes the matmuls are about to read equal the file's.
"""

from __future__ import annotations

import itertools
import math
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from bmoe.api import Completion, Model
from bmoe.base import telemetry
from bmoe.base.model_files import read_model_files
from bmoe.base.units import MiB
from bmoe.streaming import gating, speculation
from bmoe.tools.synth_archs import STREAMED_ARCHES
from tests import spec_lines
from tests.conftest import SlabCheck, complete, load, per_token, run_cli, slice_bytes
from tests.conftest import reference as plain

PROMPT = ("In the valley below the mountains, a small village kept an old tradition: every spring the "
          "farmers walked to the river and sang")
N_PREDICT = 40
MODES = list(itertools.product([False, True], [0, 1, 2], [False, True]))  # overlap, prefetch, spec-gate
MODE_IDS = [f"{'overlap' if o else 'serial'}-p{p}-{'spec' if g else 'nospec'}" for o, p, g in MODES]


FLAGS = ("-c", 512, "-t", 1)


class Ran:
    """What a finished run leaves to look at (the Model itself is closed)."""

    def __init__(self, m: Model) -> None:
        e = m.engine
        self.streamer = e.streamer
        self.gate = e.streamer.ahead.gate if e.streamer else None
        self.router_stop = e.hook.stops.router_input


def _run(path: str, prompt_chat: bool = False, n: int = N_PREDICT, *flags: object,
         check: bool = True) -> tuple[Completion, Ran, SlabCheck | None]:
    m = load(path, *FLAGS, *flags)
    sc = SlabCheck(m.engine) if check and m.engine.streamer else None
    try:
        res = complete(m, PROMPT, n, prompt_chat)
        return res, Ran(m), sc
    finally:
        m.close()
        if sc:
            sc.close()


def reference(path: str, chat: bool = False, n: int = N_PREDICT) -> Completion:
    return plain(path, PROMPT, n, *FLAGS, chat=chat)


def _gate(path: str, cache_mb: float, overlap: bool, prefetch: int, spec_gate: bool,
          chat: bool = False, n: int = N_PREDICT) -> tuple[Completion, Ran, SlabCheck]:
    ref = reference(path, chat, n)
    levers = ["--overlap" if overlap else "--no-overlap", "--spec-gate" if spec_gate else "--no-spec-gate"]
    if prefetch:
        levers += ["--prefetch", prefetch]
    res, e, sc = _run(path, chat, n, "--cache-mb", cache_mb, "--io-threads", 2, *levers,
                      "--spec-recall-min", 0, "--spec-precision", 0)
    assert not sc.bad, sc.bad[:5]
    assert sc.checked > 0
    assert res.ids == ref.ids and res.text == ref.text
    assert sum(s.lookups - s.hits for s in res.tokens) > 0, "the budget must force misses"
    if prefetch or spec_gate:
        # (not speculative_mib > 0: that counts flash reads only, and SlabCheck's own reads of the file
        # leave it in the page cache, where the lanes copy from instead)
        assert res.stats.prefetched_experts > 0
    if spec_gate:
        assert e.gate is not None and e.gate.scored > 0
    if overlap:
        assert any(s.stall_ms > 0 for s in res.tokens)
    else:
        assert all(s.stall_ms == 0 for s in res.tokens)
    return res, e, sc


@pytest.mark.parametrize("overlap,prefetch,spec_gate", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_synthetic_gate(synth, arch: str, overlap: bool, prefetch: int, spec_gate: bool) -> None:
    path = str(synth(arch=arch, layers=4, experts=8, top_k=2))
    _gate(path, read_model_files(path).expert_bytes / 3 / MiB, overlap, prefetch, spec_gate)


@pytest.fixture(scope="module")
def demo_model(demo8: Path) -> str:
    return str(demo8)


@pytest.mark.parametrize("overlap,prefetch,spec_gate", MODES, ids=MODE_IDS)
def test_demo_gate(demo_model: str, overlap: bool, prefetch: int, spec_gate: bool) -> None:
    # half the experts: still evicting and re-reading every token, at half the reads of a quarter
    _res, e, _ = _gate(demo_model, read_model_files(demo_model).expert_bytes / 2 / MiB, overlap, prefetch, spec_gate,
                      chat=True, n=16)
    if spec_gate:  # real routing: the predictor must do far better than chance (2 of 8 = 25 %)
        assert e.gate.recall_pct > 50


def test_precision_floor_reads_only_predictions_that_tend_to_come_true(demo_model: str) -> None:
    """--spec-precision: with a high floor fewer predicted experts are read, those read are not used
    less often than with no floor, and the output does not change.

    How many predictions arrive in time depends on the machine's load (a busy machine read 2 at the
    high floor), so "not used less often" is a binomial test: the high floor's hits must not be
    improbably few (below 1 %) for the no-floor run's share of useful reads."""
    runs = {}
    for floor in (0, 90):
        res, _, sc = _run(demo_model, True, 16, "--cache-mb", read_model_files(demo_model).expert_bytes / 2 / MiB,
                          "--io-threads", 2, "--overlap", "--spec-gate", "--spec-recall-min", 0,
                          "--spec-precision", floor)
        assert not sc.bad and res.ids == reference(demo_model, True, 16).ids
        runs[floor] = res.stats
    assert runs[90].prefetched_experts < runs[0].prefetched_experts
    n, k, p = runs[90].prefetched_experts, runs[90].useful_experts, runs[0].useful_experts / runs[0].prefetched_experts
    at_most_k = sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))
    assert at_most_k >= 0.01, (runs[0], runs[90])


def test_confidence_trusts_a_band_once_its_guesses_came_true_often_enough() -> None:
    c = speculation.Confidence(n_expert=64, min_precision_pct=75)
    low, high = c.band(1 / 64), c.band(4 / 64)
    assert c.band(1e-12) == 0 and c.band(1.0) == c.BANDS - 1 and low < high
    assert not c.worth(low) and not c.worth(high), "nothing is read before there is evidence"
    for _ in range(c.MIN_SAMPLES - 1):
        c.score(high, True)
    assert not c.worth(high), "too few outcomes yet"
    c.score(high, True)
    assert c.worth(high) and c.worth(c.BANDS - 1) and not c.worth(low), "bands above a trusted one are trusted"
    for i in range(c.MIN_SAMPLES):
        c.score(low, i % 2 == 0)  # 50 % < 75 %
    assert not c.worth(low) and c.worth(high)
    assert speculation.Confidence(64, 0).worth(0), "a floor of 0 reads every prediction"


def test_governor_switches_spec_gate_off_mid_run_losslessly(small_moe) -> None:
    path = str(small_moe)
    ref = reference(path)
    res, e, sc = _run(path, False, N_PREDICT, "--cache-mb", read_model_files(path).expert_bytes / 3 / MiB,
                      "--io-threads", 2, "--overlap", "--prefetch", 1, "--spec-gate", "--spec-warmup", 12,
                      "--spec-recall-min", 99.5, "--spec-precision", 0)
    assert not sc.bad and res.ids == ref.ids
    g = e.gate
    assert g.disabled_below == 99.5 and not g.active and g.proc is None
    assert 12 <= g.scored < 3 * len(res.ids), "it fired after the warm-up, mid-run"
    assert not e.router_stop, "the per-layer router stop goes with it"


def test_killed_spec_gate_turns_the_feature_off_and_output_is_unchanged(small_moe) -> None:
    path = str(small_moe)
    ref = reference(path)
    notices: list[str] = []
    with load(path, *FLAGS, "--cache-mb", read_model_files(path).expert_bytes / 3 / MiB, "--overlap", "--spec-gate",
              "--spec-recall-min", 0, notice=notices.append) as m:
        g = m.engine.streamer.ahead.gate
        pid = g.pid
        assert "bmoe.workers.spec_gate" in " ".join(open(f"/proc/{pid}/cmdline").read().split("\0"))

        def kill(i: int) -> None:
            if i == 5:
                os.kill(pid, signal.SIGKILL)

        res = complete(m, PROMPT, N_PREDICT, on_chunk=per_token(kill))
    assert res.ids == ref.ids
    assert not g.active and any("spec-gate" in n and "off" in n for n in notices), notices


def test_hung_spec_gate_turns_the_feature_off(small_moe, monkeypatch) -> None:
    monkeypatch.setattr(speculation, "HANG_S", 0.3)
    path = str(small_moe)
    ref = reference(path)
    notices: list[str] = []
    with load(path, *FLAGS, "--cache-mb", read_model_files(path).expert_bytes / 3 / MiB, "--no-overlap", "--spec-gate",
              "--spec-recall-min", 0, notice=notices.append) as m:
        g = m.engine.streamer.ahead.gate
        pid = g.pid

        def stop(i: int) -> None:
            if i == 3:
                os.kill(pid, signal.SIGSTOP)
            if i in (10, 20):
                time.sleep(0.4)

        res = complete(m, PROMPT, N_PREDICT, on_chunk=per_token(stop))
    assert res.ids == ref.ids
    assert not g.active and any("did not answer" in n for n in notices), notices
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_the_gate_answers_a_request_for_the_last_layer_too(small_moe) -> None:
    """After the last MoE layer there is nothing to predict; the gate still answers, or the request
    stays pending and the next generation after an idle while of HANG_S finds a 'hung' gate and
    turns it off (the soak saw that: bench/reports/2026-12-03-soak)."""
    import select

    import numpy as np

    path = str(small_moe)
    with load(path, *FLAGS, "--spec-gate", "--spec-recall-min", 0) as m:
        g = m.engine.streamer.ahead.gate  # loaded, nothing asked of it yet
        assert g.active and not select.select([g.fd], [], [], 0)[0]
        row = np.ones(g.n_embd, dtype=np.float32)
        g.send(m.engine.streamer.layers[-1], row.ctypes.data, 0)
        assert select.select([g.fd], [], [], 120)[0], "the gate never answered the last layer's request"
        assert g.receive() == [] and g.active


def test_stall_is_zero_when_every_expert_is_resident_and_positive_on_every_miss(small_moe) -> None:
    """Stall is the time compute waited for reads: none at all when every expert is resident
    (--preload) and something on every token when no expert is (--cache-mb 0). SlabCheck turns the
    hook's all-resident skip off, so the resident run still stops at every routing node."""
    path = str(small_moe)
    ref = reference(path, n=16)
    every = read_model_files(path).expert_bytes * 2 / MiB  # page rounding: twice the expert bytes hold them all
    res, _, sc = _run(path, False, 16, "--cache-mb", every, "--preload", "--overlap", "--io-threads", 2)
    assert not sc.bad and sc.checked > 0 and res.ids == ref.ids
    assert all(s.read_bytes == 0 and 0 < s.hits == s.lookups for s in res.tokens), "every expert resident"
    assert [s.stall_ms for s in res.tokens] == [0] * len(res.tokens)
    res, _, sc = _run(path, False, 16, "--cache-mb", 0, "--overlap", "--io-threads", 2)
    assert not sc.bad and sc.checked > 0 and res.ids == ref.ids
    assert all(s.read_bytes > 0 and s.stall_ms > 0 for s in res.tokens), [s.stall_ms for s in res.tokens]


def test_quantized_router_turns_spec_gate_off_with_a_notice(synth) -> None:
    path = str(synth(arch="qwen3moe", layers=4, experts=8, top_k=2, router="q8_0"))
    r = run_cli("-m", path, "-p", PROMPT, "-n", "8", "-t", "1", "--cache-mb", "1", "--spec-gate")
    assert r.returncode == 0, r.stderr
    notes = [x for x in r.stderr.splitlines() if "spec-gate" in x]
    assert len(notes) == 1 and "Q8_0" in notes[0] and "F32/F16" in notes[0], r.stderr
    assert "moe-spec-gate:" not in r.stdout


def test_telemetry_lines_under_every_lever(small_moe, tmp_path: Path) -> None:
    path = str(small_moe)
    csv = tmp_path / "run.csv"
    r = run_cli("-m", path, "-p", PROMPT, "-n", "24", "-t", "1", "--cache-mb", "1", "--overlap",
                "--prefetch", "2", "--spec-gate", "--spec-recall-min", "0", "--progress", "--csv", str(csv))
    assert r.returncode == 0, r.stderr
    run = telemetry.parse_output(r.stdout)
    assert not run.stray, run.stray[:3]
    s = run.summary
    assert s["moe-stream"]["stall_s_per_token"] is not None
    assert 0 <= s["moe-prefetch"]["useful"] <= s["moe-prefetch"]["prefetched"] > 0
    assert s["moe-prefetch"]["speculative_mib"] > 0
    assert 0 <= s["moe-spec-gate"]["recall_pct"] <= 100 and s["moe-spec-gate"]["disabled_below_pct"] is None
    progress = [ev for tag, ev in run.events if tag == "PROGRESS"]
    assert any(p["stall_ms"] > 0 for p in progress)
    for p in progress:  # compute is a residual: check that the measured terms fit in the wall time
        assert 0 < p["compute_ms"] <= p["wall_ms"], p
        assert p["stall_ms"] >= 0 and p["mgmt_ms"] >= 0 and p["stall_ms"] + p["mgmt_ms"] <= p["wall_ms"] + 0.001, p
        # overlap io is the lanes' busy time (it may exceed the wall): some whenever bytes landed
        assert p["io_ms"] >= 0 and (p["read_mb"] == 0 or p["io_ms"] > 0), p
    assert "stall_s/tok=" in csv.read_text().splitlines()[-1]

    r = run_cli("-m", path, "-p", PROMPT, "-n", "24", "-t", "1", "--cache-mb", "1", "--spec-gate",
                "--spec-warmup", "6", "--spec-recall-min", "100")
    disabled = spec_lines.line_regex(spec_lines.SUMMARY["moe-spec-gate"][1])
    assert disabled.fullmatch(r.stdout.splitlines()[-1]) and "auto-disabled below 100%" in r.stdout, r.stdout
    assert "moe-prefetch:" not in r.stdout, "the prefetch line belongs to --prefetch"


@pytest.mark.parametrize("flags,msg", [
    (["--prefetch", "1", "--cache-mb", "0"], "--prefetch"),
    (["--spec-gate", "--cache-mb", "0"], "--spec-gate"),
    (["--overlap", "--no-stream"], "--no-stream"),
    (["--prefetch", "0"], "--prefetch"),
    (["--spec-recall-min", "120"], "percentage"),
    (["--spec-precision", "-1"], "percentage"),
])
def test_bad_lever_flags_exit_2(small_moe, flags: list[str], msg: str) -> None:
    path = str(small_moe)
    r = run_cli("-m", path, "-n", "4", *flags)
    assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_session_done_reports_recall_and_stall(small_moe) -> None:
    from bmoe.edges.session_client import SessionClient

    path = str(small_moe)
    flags = ["-m", path, "-t", "1", "--cache-mb", "1", "--overlap", "--prefetch", "1"]
    with SessionClient([*flags, "--spec-gate", "--spec-recall-min", "0"]) as s:
        done = list(s.generate(1, PROMPT, n_predict=16))[-1]
        again = list(s.generate(2, PROMPT, n_predict=16, clear_kv=True))[-1]
        assert s.close() == 0
    assert done[0] == "DONE" and 0 < done[1]["spec_recall_pct"] <= 100 and done[1]["stall_s_tok"] > 0
    assert again[0] == "DONE" and again[1]["text"] == done[1]["text"], "the warm cache changes no byte"
    with SessionClient([*flags, "--no-spec-gate"]) as s:
        plain = list(s.generate(1, PROMPT, n_predict=16))[-1]
        assert s.close() == 0
    assert plain[1]["spec_recall_pct"] == -1 and plain[1]["text"] == done[1]["text"]


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
@pytest.mark.parametrize("stop,zeroed,changes", [
    ("down", "ffn_down_exps", True), ("down", "ffn_gate_exps", False), ("down", "ffn_up_exps", False),
    ("up", "ffn_up_exps", True), ("up", "ffn_down_exps", True), ("up", "ffn_gate_exps", False)])
def test_the_wait_stops_sit_between_the_expert_matmuls(synth, arch: str, stop: str, zeroed: str,
                                                      changes: bool) -> None:
    """Zero one tensor's routed slices at a wait stop found from the graph: after the gate matmul
    (where the up slices are awaited) or at the down input (the down slices).

    A matmul after the stop must still read them (output changes); one before it must already have
    run (output unchanged). With no cache every token reads its experts again, so the damage lasts
    one layer of one token."""
    path = str(synth(arch=arch, layers=4, experts=8, top_k=2))
    ref = reference(path, n=16)
    m = load(path, *FLAGS, "--cache-mb", 0, "--io-threads", 1, "--overlap")
    try:
        e = m.engine
        st = e.streamer
        nodes = e.hook.stops.wait_nodes
        assert {k // 2 for k in nodes.values() if k % 2} == set(st.layers)
        assert {k // 2 for k in nodes.values() if not k % 2} == set(st.layers), "gate before up in every layer"
        assert all(n.decode().startswith("ffn_moe_swiglu" if k % 2 else "ffn_moe_gate-") for n, k in nodes.items())
        routed: dict[int, list[int]] = {}
        route, wait = e.hook.stops.on_route, e.hook.stops.on_wait
        stops = []

        def on_route(layer, ids):
            routed[layer] = sorted({int(x) for x in ids[-1]})
            route(layer, ids)

        def on_wait(key):
            wait(key)
            layer = key // 2
            if (key % 2 == 0) != (stop == "up"):
                return
            stops.append(layer)
            for ri in st.cache.by_layer[layer]:
                r = st.cache.regions[ri]
                if r.kind == zeroed and layer == st.layers[-1]:
                    for x in routed[layer]:
                        slice_bytes(st, ri, x)[:] = bytes(r.expert_bytes)

        e.hook.stops.on_route, e.hook.stops.on_wait = on_route, on_wait
        e.hook.stops.wait_pending = lambda key: True  # stop at every wait node, reads done or not
        res = complete(m, PROMPT, 16)
    finally:
        m.close()
    assert len(stops) >= 16 * len(st.layers)
    assert (res.ids != ref.ids) == changes


# ---- the predictor follows each architecture's gating; where it cannot, --spec-gate is refused -------

FOLLOWED = [a for a in STREAMED_ARCHES if a not in gating.HYPER_CONNECTIONS]


@pytest.mark.parametrize("arch", FOLLOWED)
def test_the_predictor_routes_as_the_model_does_from_the_layers_own_input(synth, arch: str) -> None:
    """The spec-gate's recipe, given layer L's own router input (no norm swap), must choose what llama.cpp
    chose: the model's gating op, its selection bias and its group limit (bmoe.streaming.gating reads them
    from the graph). Every row of a prompt and a few decoded tokens, every MoE layer but the first;
    a near-tie may rank differently in numpy's float32, so 97 % of the rows must match exactly."""
    import llama_cpp

    from bmoe.seam import ggml_mirror
    from bmoe.workers import routers
    from tests.test_seam import _swap_callback

    path = synth(arch=arch, layers=6 if arch == "llama4" else 4, experts=16, top_k=4)  # llama4: MoE every 2nd
    with load(path, *FLAGS, "--cache-mb", 1000) as m:
        e = m.engine
        g = e.gating
        inputs: dict[int, list[np.ndarray]] = {}
        routed: dict[int, list[np.ndarray]] = {}

        def cb(t: int, ask: bool, u: int) -> bool:
            name = ggml_mirror.tensor_name(t)
            if name.startswith("ffn_moe_logits-") or name.startswith("ffn_moe_topk-"):
                if not ask:
                    layer = int(name.split("-")[1])
                    if name.startswith("ffn_moe_logits-"):
                        inputs.setdefault(layer, []).append(ggml_mirror.router_input(t))
                    else:
                        routed.setdefault(layer, []).append(ggml_mirror.routing_ids(t))
                e.hook._callback(t, ask, u)
                return True
            return e.hook._callback(t, ask, u)

        _swap_callback(e, llama_cpp.ggml_backend_sched_eval_callback(cb))
        complete(m, PROMPT, 6)
        layers = sorted(routed)
        pred = routers.Predictor(routers.load_routers([path], arch, layers), 4, rescale=False, gating=g.func,
                                 groups=g.groups)
    same = total = 0
    for prev, layer in itertools.pairwise(layers):
        xs = np.concatenate(inputs[layer])[-len(np.concatenate(routed[layer])):]  # last layer: logits' rows only
        for x, ids in zip(xs, np.concatenate(routed[layer])):
            p = pred.predict(prev, x)
            same += p.layer == layer and list(p.ids) == list(ids)
            total += 1
    assert total >= 30 and same >= 0.97 * total, f"{same}/{total} rows chosen as llama.cpp chose ({g})"


@pytest.mark.parametrize("arch", sorted(gating.HYPER_CONNECTIONS))
def test_spec_gate_is_refused_where_the_router_input_mixes_several_streams(synth, arch: str) -> None:
    path = synth(arch=arch, layers=4, experts=8, top_k=2)
    r = run_cli("-m", str(path), "-p", PROMPT, "-n", "4", "-t", "2", "--spec-gate")
    assert r.returncode == 1, r.stderr
    err = [line for line in r.stderr.splitlines() if line.startswith("bmoe-cli: error:")]
    assert len(err) == 1 and f"--spec-gate cannot predict {arch}'s routing: " in err[0] \
        and "hyper-connection" in err[0] and err[0].endswith("run without --spec-gate"), r.stderr
    assert run_cli("-m", str(path), "-p", PROMPT, "-n", "4", "-t", "2").returncode == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_guesses_are_lossless_and_read_the_next_layers_experts_ahead(small_moe, overlap: bool) -> None:
    """--guess: the experts the routing seen so far says follow each layer's are read into idle lanes
    ahead of the next layer's routing; the answer is plain llama.cpp's and every matmul reads the
    file's bytes (SlabCheck), and guesses were read and some used."""
    path = str(small_moe)
    third = read_model_files(path).expert_bytes / 3 / MiB
    ref = reference(path)
    res, _, sc = _run(path, False, N_PREDICT, "--cache-mb", f"{third:.2f}", "--io-threads", 2, "--guess", 0.2,
                      "--overlap" if overlap else "--no-overlap")
    assert not sc.bad, sc.bad[:5]
    assert sc.checked > 0
    assert res.ids == ref.ids and res.text == ref.text
    assert res.stats.prefetched_experts > 0 and res.stats.useful_experts > 0, res.stats
