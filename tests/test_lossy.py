"""Lossy routing (bmoe.streaming.lossy): off is today's output, a skipped or substituted expert is never read nor
computed from a stale slot, a request can ask for lossless output and gets it, and each lossy run
says so (summary line, CSV columns, BMOE_DONE, the API's stats, the server's `bmoe` field).

K by the hook against llama.cpp's own expert count is pinned per architecture in tests/test_seam.py.
"""

from __future__ import annotations

import pytest

from bmoe.api import Ask
from bmoe.base import telemetry
from bmoe.base.errors import ConfigError
from bmoe.base.model_files import read_model_files
from bmoe.base.units import MiB
from bmoe.edges.session_client import SessionClient
from tests import spec_lines
from tests.conftest import SlabCheck, complete, load, run_cli, wide
from tests.conftest import reference as plain

PROMPT = "In the valley below the mountains, a small village kept an old tradition: every spring the farmers sang"
N = 32
FLAGS = ("-c", 512, "-t", 2)


def third(path: object, share: float = 1 / 3) -> str:
    """A cache budget of a third of the experts: misses every token, and experts to keep."""
    return f"{read_model_files(str(path)).expert_bytes * share / MiB:.3f}"


def answer(path: object, *flags: object, lossless: bool = False):
    with load(path, *FLAGS, *flags) as m:
        return m.run(m.prepare(Ask(prompt=PROMPT, max_tokens=N, lossless=lossless)))


# ---- off is today ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", wide(["qwen3moe", "qwen2moe", "gpt-oss"], {"qwen3moe"}))
@pytest.mark.parametrize("mode", ["experts-per-token", "drop-cold", "cache-routing"])
def test_each_mode_at_its_off_setting_is_lossless(synth, arch: str, mode: str) -> None:
    """The lossy machinery on (spare slots, a stop at every routing, the rewrite) with the mode at the
    setting that changes nothing: K = the model's top-k; F and D so small that no expert qualifies.
    Byte-identical to plain llama.cpp, at a budget that forces misses."""
    path = synth(arch=arch, layers=4, experts=8, top_k=2)
    setting = {"experts-per-token": ["--experts-per-token", 2], "drop-cold": ["--drop-cold", 1e-9],
               "cache-routing": ["--cache-routing", 1e-9]}[mode]
    ref = plain(str(path), PROMPT, N, *FLAGS)
    with load(path, *FLAGS, "--cache-mb", third(path), *setting) as m:
        assert m.engine.lossy is not None
        check = SlabCheck(m.engine)
        try:
            got = complete(m, PROMPT, N)
        finally:
            check.close()
    assert got.ids == ref.ids and got.text == ref.text
    assert not check.bad and check.checked > 0
    assert got.stats.lossy and got.stats.weight_changed_pct == 0 and got.stats.dropped_per_token == 0 \
        and got.stats.substituted_per_token == 0
    assert sum(t.lookups - t.hits for t in got.tokens) > 0, "the budget must force misses, or the gate proves little"


# ---- what is skipped is never read -------------------------------------------------------------------


@pytest.mark.parametrize("arch", wide(["qwen3moe", "olmoe", "gpt-oss"], {"qwen3moe"}))
def test_a_dropped_or_substituted_expert_is_never_read_nor_computed_stale(synth, arch: str) -> None:
    """Every routing the lossy modes changed: the experts it took out are not among the reads that
    routing sent to the lanes, the lanes read exactly what was sent (their byte count), and every
    matmul reads its expert's file bytes or, for a dropped position, the spare slot's zeros (SlabCheck)."""
    path = synth(arch=arch, layers=4, experts=8, top_k=4)
    with load(path, *FLAGS, "--cache-mb", third(path, 0.7), "--drop-cold", 0.3, "--cache-routing", 0.6,
              "--io-threads", 2) as m:
        e = m.engine
        st, stops = e.streamer, e.hook.stops
        check = SlabCheck(e)
        sent: list[tuple[int, int]] = []  # (layer, expert) of every slice sent to a lane
        sent_bytes = [0]
        taken: list[tuple[int, set[int], int]] = []  # per routing: layer, experts taken out, sends before
        reroute, send = stops.reroute, st.orders.send

        def on_reroute(layer, ids, node):
            before = ids.copy()
            reroute(layer, ids, node)
            # taken out of the routing: out of every row (a batch's other rows may still route it)
            out = {int(x) for x in before[before != ids]} - {int(x) for x in ids.ravel()}
            taken.append((layer, out, len(sent)))  # (also when empty: it ends the previous routing's window)

        def on_send(lane, share, ahead=None):
            for r, keys in share:
                sent.extend((k[0], k[2]) for k in keys)
                sent_bytes[0] += r[2]
            return send(lane, share, ahead)

        stops.reroute, st.orders.send = on_reroute, on_send
        try:
            got = complete(m, PROMPT, N)
            st.settle()
        finally:
            check.close()
        read = sum(t.read_bytes for t in got.tokens)
    assert got.stats.dropped_per_token > 0 and got.stats.substituted_per_token > 0, "both modes must act"
    assert any(out for _, out, _ in taken)
    for i, (layer, out, at) in enumerate(taken):
        end = taken[i + 1][2] if i + 1 < len(taken) else len(sent)
        now = {x for lay, x in sent[at:end] if lay == layer}
        assert not out & now, f"layer {layer}: experts {sorted(out & now)} were taken out of the routing and read"
    assert not check.bad and check.checked > 0, check.bad[:3]
    assert read <= sent_bytes[0], "the lanes read more than they were sent"


def test_drop_cold_never_drops_a_resident_expert_nor_the_best_one(synth) -> None:
    """With every expert resident (--preload) --drop-cold has nothing to save: the output is the lossless
    one; with no cache (nothing resident) it drops, never a token's best expert."""
    path = synth(arch="qwen3moe", layers=4, experts=8, top_k=4)
    ref = plain(str(path), PROMPT, N, *FLAGS)
    resident = answer(path, "--cache-mb", 1000, "--preload", "--drop-cold", 0.5)
    assert resident.ids == ref.ids and resident.stats.dropped_per_token == 0
    with load(path, *FLAGS, "--cache-mb", 0, "--drop-cold", 0.99) as m:
        stops, best = m.engine.hook.stops, []
        reroute = stops.reroute

        def on_reroute(layer, ids, node):
            top = ids[:, 0].copy()
            reroute(layer, ids, node)
            # a decode token keeps only its best expert; a prompt's rows also keep what another row reads
            best.append(bool((ids[:, 0] == top).all()) and (len(ids) > 1 or bool((ids[:, 1:] == -1).all())))

        stops.reroute = on_reroute
        cold = complete(m, PROMPT, N)
    assert all(best), "with F near 1 and nothing cached each decode token keeps exactly its best expert"
    assert cold.stats.dropped_per_token == 3 * 4  # three of four experts, in four layers
    assert all(t.read_bytes > 0 for t in cold.tokens)


# ---- lossless on request -------------------------------------------------------------------------------


def test_a_request_can_ask_for_lossless_and_gets_it(synth) -> None:
    """A model loaded with every lossy mode answers a lossless request with plain llama.cpp's output,
    and a lossy one with another; a lossless chat does not reuse KV a lossy answer computed."""
    path = synth(arch="qwen3moe", layers=4, experts=8, top_k=2)
    ref = plain(str(path), PROMPT, N, *FLAGS)
    lossy = ("--cache-mb", third(path), "--experts-per-token", 1, "--drop-cold", 0.2, "--cache-routing", 0.3)
    with load(path, *FLAGS, *lossy) as m:
        a = m.run(m.prepare(Ask(prompt=PROMPT, max_tokens=N)))
        b = m.run(m.prepare(Ask(prompt=PROMPT, max_tokens=N, lossless=True)))
        turn = [{"role": "user", "content": "Tell me about the river"}]
        first = m.chat(turn, max_tokens=8)
        convo = [*turn, {"role": "assistant", "content": first}, {"role": "user", "content": "And the mill?"}]
        again = m.run(m.prepare(Ask(messages=convo, max_tokens=12, lossless=True)))
    assert a.ids != ref.ids and a.stats.lossy and a.stats.weight_changed_pct > 0
    assert b.ids == ref.ids and not b.stats.lossy and b.stats.weight_changed_pct == 0
    assert again.stats.prefill_tokens == again.stats.prompt_tokens, "a lossless turn re-prefills a lossy KV"
    with load(path, *FLAGS, "--no-stream") as m:
        want = m.run(m.prepare(Ask(messages=convo, max_tokens=12)))
    assert again.ids == want.ids


def test_lossy_settings_bad_input_is_refused_in_the_users_words(synth) -> None:
    path = synth(arch="qwen3moe", layers=4, experts=8, top_k=2)
    with pytest.raises(ConfigError, match=r"--experts-per-token 3: .* routes each token to 2 experts; give at most 2"):
        load(path, *FLAGS, "--experts-per-token", 3)
    r = run_cli("-m", str(path), "--no-stream", "--drop-cold", "0.1")
    assert r.returncode == 2 and "--drop-cold change routing by what the expert cache holds, and --no-stream has none" \
        in r.stderr
    r = run_cli("-m", str(path), "--cache-mb", "0", "--cache-routing", "0.1")
    assert r.returncode == 2 and "--cache-routing takes a cached expert instead of a missing one" in r.stderr
    r = run_cli("-m", str(path), "--drop-cold", "1")
    assert r.returncode == 2 and "--drop-cold: must be a fraction from 0 (off) to below 1" in r.stderr
    with load(path, *FLAGS, "--no-stream", "--experts-per-token", 1) as m:
        with pytest.raises(ConfigError, match=r"loaded with --experts-per-token 1 and --no-stream: llama.cpp itself"):
            m.prepare(Ask(prompt=PROMPT, lossless=True))
    import bmoe

    with pytest.raises(ConfigError, match=r"^drop_cold=0.5: a fraction from 0 to below 1$|drop_cold"):
        bmoe.load(str(path), drop_cold=1.5)


# ---- each lossy run says so ------------------------------------------------------------------------


def test_a_lossy_run_says_so_in_its_summary_csv_and_session(synth, tmp_path) -> None:
    path = str(synth(arch="qwen3moe", layers=4, experts=8, top_k=2))
    csv_path = tmp_path / "run.csv"
    flags = ["--cache-mb", third(path), "--drop-cold", "0.45", "--experts-per-token", "2"]
    r = run_cli("-m", path, "-p", PROMPT, "-n", "16", "--progress", "--csv", str(csv_path), *flags)
    assert r.returncode == 0, r.stderr
    run = telemetry.parse_output(r.stdout)
    assert not run.stray and list(run.summary)[-1] == "moe-lossy"
    lossy = run.summary["moe-lossy"]
    assert (lossy["experts_per_token"], lossy["top_k"]) == (2, 2) and lossy["dropped_per_token"] > 0
    assert 0 < lossy["weight_changed_pct"] < 100
    for kind in ("generation", "moe-stream", "moe-cache"):  # the contract's lines as they were
        line = next(x for x in r.stdout.splitlines() if x.startswith(kind + ":"))
        assert spec_lines.summary_matches(kind, line, overlap=True), line
    header = csv_path.read_text().splitlines()[0]
    assert header == (spec_lines.CSV_HEADER + ",cache_budget_mib,dropped,substituted,weight_changed_pct"
                      ",page_cache_bytes,page_cache_ms")
    rows, _ = telemetry.read_csv(csv_path.read_text())
    assert sum(row["dropped"] for row in rows) / len(rows) == pytest.approx(lossy["dropped_per_token"], abs=0.01)
    plain_run = run_cli("-m", path, "-p", PROMPT, "-n", "4", "--progress", "--cache-mb", third(path))
    assert "moe-lossy" not in telemetry.parse_output(plain_run.stdout).summary

    with SessionClient(["-m", path, *flags, "-n", "8"]) as s:
        _, (tag, done) = s.ask(1, PROMPT)
        assert tag == "DONE" and tuple(done)[:len(spec_lines.DONE_KEYS)] == spec_lines.DONE_KEYS
        assert done["lossy"] is True and done["experts_per_token"] == 2 and done["dropped_tok"] > 0
        _, (tag, done) = s.ask(2, PROMPT, lossless=True)
        assert tag == "DONE" and done["lossy"] is False and done["dropped_tok"] == 0 and done["weight_changed_pct"] == 0


def test_the_server_loads_lossy_and_a_request_asks_for_lossless(synth) -> None:
    """bmoe-server with lossy settings, the official openai client: `extra_body={"bmoe": {"lossless":
    true}}` gets plain llama.cpp's answer and says so in `bmoe`; without it the answer is lossy and
    `bmoe` has the price; a misspelt option is a 400 naming it."""
    import httpx

    from tests.test_server import Server

    path = str(synth(arch="qwen3moe", layers=4, experts=8, top_k=2))
    want = plain(path, PROMPT, 16, "-c", 4096, "-t", 1).text
    s = Server("-m", path, "-t", "1", "--cache-mb", third(path), "--experts-per-token", "1", "--drop-cold", "0.2")
    try:
        c = s.client()
        r = c.completions.create(model="x", prompt=PROMPT, max_tokens=16, extra_body={"bmoe": {"lossless": True}})
        b = r.model_extra["bmoe"]
        assert r.choices[0].text == want and b["lossy"] is False and b["experts_per_token"] == 2
        r = c.completions.create(model="x", prompt=PROMPT, max_tokens=16)
        b = r.model_extra["bmoe"]
        assert r.choices[0].text != want and b["lossy"] is True and b["experts_per_token"] == 1
        assert b["weight_changed_pct"] > 0 and "dropped_per_token" in b and "substituted_per_token" in b
        chunks = list(c.chat.completions.create(model="x", messages=[{"role": "user", "content": PROMPT}],
                                                max_tokens=8, stream=True, extra_body={"bmoe": {"lossless": True}}))
        assert chunks[-1].model_extra["bmoe"]["lossy"] is False
        bad = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPT, "bmoe": {"losless": True}})
        assert bad.status_code == 400 and "bmoe.losless" in bad.json()["error"]["message"]
    finally:
        s.stop()


@pytest.mark.parametrize(("arch", "flags", "why"), [
    ("llama4", ["--experts-per-token", 1], "multiplies each expert's routing weight (an unnormalised sigmoid) into"),
    ("llama4", ["--drop-cold", 0.1, "--cache-routing", 0.2], "into the expert's input"),
    ("deepseek4", ["--experts-per-token", 1], "hash layers [0] take their experts from a token table"),
    ("deepseek2", ["--cache-routing", 0.2], "limits each token's experts to 2 of 4 groups"),
])
def test_a_lossy_mode_the_models_gating_would_change_the_meaning_of_is_refused(synth, arch: str, flags: list,
                                                                                 why: str) -> None:
    """Decided from the graph at load (bmoe.streaming.gating), before the slab and the workers: one line
    naming the settings and the reason, exit 1; what the same model's gating does follow is accepted."""
    path = synth(arch=arch, layers=4, experts=8, top_k=2)
    r = run_cli("-m", str(path), "-p", PROMPT, "-n", "4", "-t", "2", *map(str, flags))
    err = [line for line in r.stderr.splitlines() if line.startswith("bmoe-cli: error:")]
    assert r.returncode == 1 and len(err) == 1, (r.returncode, r.stderr)
    assert err[0].startswith(f"bmoe-cli: error: {flags[0]}") and why in err[0] and arch in err[0], err[0]
    if arch == "deepseek2":  # its group limit holds --drop-cold and --experts-per-token as llama.cpp's own
        with load(path, *FLAGS, "--cache-mb", third(path), "--force", "--drop-cold", 0.2) as m:
            assert complete(m, PROMPT, 4).ids
