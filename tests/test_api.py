"""The Python API (bmoe.load → Model) in-process, on a real synthetic model and real llama.cpp."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import psutil
import pytest

import bmoe
from bmoe.api import Ask, Chunk, Model
from bmoe.base.errors import ConfigError, FieldError, ModelError
from bmoe.generation.answer_text import StopStrings
from tests.conftest import bmoe_segments, run_cli

PROMPT = "Once upon a time there was a king"
FAST = {"threads": 1, "io_threads": 2}
CHAT = [{"role": "user", "content": "hello there how are you"}]


@pytest.fixture(scope="module")
def path(small_moe) -> str:
    return str(small_moe)


@pytest.fixture(scope="module")
def model(path: str) -> Model:
    with bmoe.load(path, cache_mb=1, **FAST) as m:
        yield m


@pytest.fixture(scope="module")
def plain(path: str) -> Model:
    """Plain llama.cpp (no streaming): the reference every streamed answer equals."""
    with bmoe.load(path, stream=False, threads=1) as m:
        yield m


def cli_answer(path: str, prompt: str, n: int, *args: str) -> str:
    r = run_cli("-m", path, "-p", prompt, "-n", str(n), "-t", "1", "--progress", *args)
    assert r.returncode == 0, r.stderr
    from bmoe.base import telemetry

    return telemetry.parse_output(r.stdout).answer


def test_generate_equals_bmoe_cli_and_plain_llama_cpp(path: str, model: Model, plain: Model) -> None:
    text = model.generate(PROMPT, max_tokens=16)
    assert text.strip() and model.stats.last.finish_reason == "length"
    assert text == cli_answer(path, PROMPT, 16, "--cache-mb", "1") == plain.generate(PROMPT, max_tokens=16)
    assert model.generate(PROMPT, max_tokens=16) == text  # a plain prompt starts from an empty KV


def test_stream_gives_each_token_with_its_telemetry(model: Model) -> None:
    want = model.generate(PROMPT, max_tokens=10)
    chunks = list(model.stream(PROMPT, max_tokens=10))
    *tokens, last = chunks
    assert "".join(c.text for c in chunks) == want
    assert [c.token.step for c in tokens] == list(range(1, 11)) and all(c.token.steps == 10 for c in tokens)
    assert all(c.token.wall_ms > 0 and c.token.read_mb >= 0 and 0 <= c.token.cache_hit_pct <= 100 for c in tokens)
    assert last.token is None and last.finish_reason == "length" and last.stats is model.stats.last
    s = last.stats
    assert s.completion_tokens == 10 and s.prompt_tokens == s.prefill_tokens > 0 and s.tok_s > 0
    assert s.read_mib == pytest.approx(sum(c.token.read_mb for c in tokens))
    assert s.cache_hit_pct == tokens[-1].token.cache_hit_pct


def test_chat_reuses_the_kv_of_the_conversation_it_extends(model: Model, plain: Model) -> None:
    def turns(m: Model) -> list[tuple[str, int, int]]:
        out, msgs = [], list(CHAT)
        for follow in ("and then what happened", "tell me more about the king"):
            answer = m.chat(msgs, max_tokens=8)
            s = m.stats.last
            out.append((answer, s.prompt_tokens, s.prefill_tokens))
            msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": follow}]
        return out

    got = turns(model)
    assert got[0][1] == got[0][2], "a new conversation prefills all of its prompt"
    assert got[1][1] - got[1][2] >= got[0][1], "the next turn reuses at least the first turn's prompt"
    assert model.stats.kv_tokens == got[1][1] + 8
    assert got == turns(plain)
    # the same first message again is a new conversation: no reuse, the same answer
    assert model.chat(CHAT, max_tokens=8) == got[0][0] and model.stats.last.prefill_tokens == got[0][1]


def test_stop_strings_cut_the_answer(model: Model) -> None:
    full = model.generate(PROMPT, max_tokens=12)
    word = full.split()[3]
    want = full[:full.index(word)]
    assert model.generate(PROMPT, max_tokens=12, stop=["zzz-never", word]) == want
    assert model.stats.last.finish_reason == "stop" and model.stats.last.completion_tokens < 12
    chunks = list(model.stream(PROMPT, max_tokens=12, stop=word))
    assert "".join(c.text for c in chunks) == want and chunks[-1].finish_reason == "stop"
    assert model.generate(PROMPT, max_tokens=12) == full


@pytest.mark.parametrize("pieces,stops,out,flushed,text", [
    (["ab", "c<", "/s", ">tail"], ["</s>"], ["ab", "c", "", ""], "", "abc"),  # held back, then cut
    (["ab", "c<", "x"], ["</s>"], ["ab", "c", "<x"], "", "abc<x"),  # held back, then released
    (["ab", "c</"], ["</s>"], ["ab", "c"], "</", "abc</"),  # held back to the end: released by flush
    (["hello", " wor", "ld"], ["o w", "ld"], ["hell", "", ""], "", "hell"),  # the first stop to begin wins
    (["abc"], [], ["abc"], "", "abc"),
])
def test_stop_text(pieces: list[str], stops: list[str], out: list[str], flushed: str, text: str) -> None:
    st = StopStrings(stops)
    assert [st.push(p) for p in pieces] == out
    assert st.flush() == flushed and st.text == text == "".join(out) + flushed


def _stop_oracle(stops: list[str], pieces: list[str]) -> tuple[list[str], str]:
    """StopStrings' answer by brute force: after each piece, the earliest place any stop string
    begins in all the text so far, else everything but the longest end that starts a stop string."""
    raw, sent, out = "", 0, []
    stops = [s for s in stops if s]
    for p in pieces:
        raw += p
        hits = [i for s in stops if (i := raw.find(s)) >= 0]
        if hits:
            out.append(raw[sent:min(hits)])
            return out + [""] * (len(pieces) - len(out)), raw[:min(hits)]
        hold = max((k for s in stops for k in range(1, len(s)) if raw.endswith(s[:k])), default=0)
        end = max(sent, len(raw) - hold)
        out.append(raw[sent:end])
        sent = end
    return out, raw


def test_stop_text_agrees_with_brute_force() -> None:
    rng = random.Random(5)
    for _ in range(20_000):
        letters = rng.choice(["ab", "abc"])
        stops = ["".join(rng.choices(letters, k=rng.randint(0, 6))) for _ in range(rng.randint(0, 4))]
        pieces = ["".join(rng.choices(letters, k=rng.randint(0, 4))) for _ in range(rng.randint(0, 10))]
        st = StopStrings(stops)
        got = [st.push(p) for p in pieces]
        st.flush()
        assert (got, st.text) == _stop_oracle(stops, pieces), (stops, pieces)


def test_cancel_from_another_thread_rolls_the_kv_back(model: Model) -> None:
    want = model.generate(PROMPT, max_tokens=8)
    answer = model.chat(CHAT, max_tokens=8)
    kv = model.stats.kv_tokens
    more = [*CHAT, {"role": "assistant", "content": answer}, {"role": "user", "content": "go on forever"}]
    req = model.prepare(Ask(messages=more, max_tokens=500))
    seen: list[Chunk] = []

    def on_chunk(c: Chunk) -> None:
        seen.append(c)
        if len(seen) == 3:
            threading.Thread(target=model.cancel, args=(req,)).start()

    done = model.run(req, on_chunk)
    assert done.finish_reason == "cancelled" and 3 <= done.stats.completion_tokens < 500
    # rolled back to the prefix it reused: the first turn and its answer
    assert model.stats.kv_tokens == model.engine.kv_len() == kv and model.messages[-1]["content"] == answer
    model.cancel(req)  # too late: nothing runs, and the next generation is not hit by it
    assert model.generate(PROMPT, max_tokens=8) == want


def test_leaving_a_stream_early_cancels_it(model: Model) -> None:
    want = model.generate(PROMPT, max_tokens=8)
    for i, _ in enumerate(model.stream(PROMPT, max_tokens=2000)):
        if i == 2:
            break
    assert model.stats.last.finish_reason == "cancelled" and model.stats.last.completion_tokens < 2000
    assert model.generate(PROMPT, max_tokens=8) == want


def test_bad_input_is_a_config_error_and_the_model_keeps_serving(model: Model) -> None:
    want = model.generate(PROMPT, max_tokens=4)
    cases = [dict(prompt="word " * 3000), dict(prompt=PROMPT, max_tokens=0), dict(prompt=PROMPT, temperature=-1),
             dict(prompt=PROMPT, top_p=0), dict(prompt=PROMPT, top_k=-2), dict(prompt=PROMPT, stop=[3]),
             dict(messages=[]), dict(messages=[{"role": "user"}]), dict(prompt=5)]
    for kw in cases:
        with pytest.raises(ConfigError):
            model.generate(**kw) if "prompt" in kw else model.chat(**kw)
    with pytest.raises(ConfigError, match="exceeds the context of 2048 tokens"):
        model.generate("word " * 3000)
    assert model.generate(PROMPT, max_tokens=4) == want


def test_hostile_schemas_grammars_and_stops_are_refused_and_the_model_keeps_serving(path: str) -> None:
    """What crashed or stalled the server (issue 32) reaches bmoe.load's Model the same way: each is a
    FieldError naming the field and the bound; the grammar checker process goes with the Model."""
    strings = {"type": "array", "items": {"type": "string"}}
    with bmoe.load(path, cache_mb=1, **FAST) as m:
        want = m.generate(PROMPT, max_tokens=4)
        cases = [
            (dict(messages=CHAT, response_format={"type": "json_schema", "json_schema": {
                "name": "n", "schema": {**strings, "maxItems": 100000}}}),
             "response_format.json_schema.schema.maxItems", "100000 is more than the 1000"),
            (dict(prompt=PROMPT, response_format={"type": "json_object", "schema": {"type": "string",
                                                                                   "minLength": 10**7}}),
             "response_format.schema.minLength", "10000000 is more than the 1000"),
            (dict(prompt=PROMPT, grammar="root ::= " + "(" * 50_000 + '"a"' + ")" * 50_000), "grammar",
             "nests 50000 groups deep"),
            (dict(messages=CHAT, tools=[{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"s": {"type": "string", "pattern": "^a{0,99999}$"}}}}}]),
             "tools[0].function.parameters.properties.s.pattern", "99999 is more than the 1000"),
            (dict(prompt=PROMPT, stop=["x" * 1_000_000]), "stop[0]", "1000000 characters, more than the 1024"),
            (dict(prompt=PROMPT, stop=["a", "b", "c", "d", "e"]), "stop", "5 stop strings, more than the 4"),
        ]
        for kw, param, words in cases:
            with pytest.raises(FieldError) as e:
                m.generate(**kw) if "prompt" in kw else m.chat(**kw)
            assert e.value.param == param and words in str(e.value), (param, str(e.value))
        assert m.generate(PROMPT, max_tokens=4, response_format={"type": "json_object"}).startswith("{")
        checker = m.grammars.checkers[0].proc
        assert checker is not None and checker.poll() is None
        assert m.generate(PROMPT, max_tokens=4) == want
    assert checker.poll() is not None, "closing the Model ends the grammar checker"


def test_sampling_options_per_call(model: Model) -> None:
    a = model.generate(PROMPT, max_tokens=12, temperature=1.5, top_k=0, top_p=1.0, seed=7)
    assert a == model.generate(PROMPT, max_tokens=12, temperature=1.5, top_k=0, top_p=1.0, seed=7)
    others = {model.generate(PROMPT, max_tokens=12, temperature=1.5, top_k=0, top_p=1.0, seed=s) for s in range(4)}
    assert len(others) > 1, "the seed reaches llama.cpp's sampler"
    assert model.generate(PROMPT, max_tokens=12) != a  # the load's sampler (greedy) again


def test_load_refuses_contradictory_settings_and_leaves_nothing(path: str) -> None:
    before = bmoe_segments()
    with pytest.raises(ConfigError, match=r"^cache_mb=-1: "):
        bmoe.load(path, cache_mb=-1)
    with pytest.raises(ModelError, match="does not exist"):
        bmoe.load(path + ".missing")
    assert bmoe_segments() == before


def test_close_stops_the_workers_and_frees_shared_memory(path: str) -> None:
    before = bmoe_segments()
    with bmoe.load(path, cache_mb=1, **FAST) as m:
        workers = [psutil.Process(pid) for _, pid in m.stats.engine.workers]
        assert len(workers) == 2 and bmoe_segments() - before
        m.chat(CHAT, max_tokens=4)
    assert bmoe_segments() == before
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive
    m.close()  # idempotent


def test_no_path_loads_the_demo_model(demo_default: tuple[Path, float]) -> None:
    path, budget_mib = demo_default
    with bmoe.load(threads=2) as m:  # as bmoe-cli with no -m: the demo model and its cache budget
        assert m.stats.model == path.stem and m.stats.cache_budget_mib == pytest.approx(budget_mib, abs=0.1)
        assert m.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=4).strip()
