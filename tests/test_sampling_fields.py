"""The sampling fields besides temperature, top_p, top_k and seed: min_p, repeat_penalty, frequency_penalty,
presence_penalty and logit_bias, each honoured through llama.cpp's own sampler chain. bmoe's answer,
through bmoe.load and through a real bmoe-server driven by the openai client, equals llama-cpp-python's
own high-level `Llama` at the same settings on the same file (greedy is deterministic, and seeded
sampling is too). A field bmoe does not implement is a 400 naming it."""

from __future__ import annotations

import httpx
import llama_cpp
import pytest

import bmoe
from bmoe.base.settings import SamplerSettings
from bmoe.seam.llama import Vocab, free_sampler, init_backend, load_model, make_sampler
from tests.plain_llama import plain_llama
from tests.test_server import KEY, Server, auth, error_of

PROMPT = "The list of colors: red, blue, red, blue,"
N = 16
# each case changes the greedy answer on the 16-expert demo model (asserted below), frequency and presence
# each their own way
CASES = {
    "greedy": {},
    "frequency": {"frequency_penalty": 1.0},
    "presence": {"presence_penalty": 2.0},
    "repeat": {"repeat_penalty": 1.3},
    "mixed": {"frequency_penalty": 0.4, "presence_penalty": 0.3, "repeat_penalty": 1.1},
    "min_p": {"temperature": 1.0, "min_p": 0.2, "seed": 7},
    "sampled": {"temperature": 1.0, "seed": 7},
}


@pytest.fixture(scope="module")
def demo(demo_default) -> str:
    return str(demo_default[0])


def _cases(first: int) -> dict[str, dict]:
    """CASES and two that ban `first`, the greedy answer's first token (so it becomes the second best)."""
    return {**CASES, "ban": {"logit_bias": {first: -100}},
            "ban+penalty": {"logit_bias": {first: -100}, "frequency_penalty": 1.0}}


@pytest.fixture(scope="module")
def plain(demo: str) -> tuple[int, dict[str, str]]:
    """llama-cpp-python's own Llama.create_completion at each case's settings (no repacked weights, as bmoe
    loads them; flash attention as llama.cpp's default chooses it; its KV reset per case), and the greedy
    answer's first token."""
    llm = plain_llama(demo, n_ctx=512, n_batch=512, n_ubatch=512, n_threads=2, n_threads_batch=2, flash_attn=True)
    out = {}
    try:
        first = next(iter(llm.generate(llm.tokenize(PROMPT.encode()), temp=0.0)))
        for name, kw in _cases(first).items():
            llm.reset()
            out[name] = llm.create_completion(PROMPT, max_tokens=N, **{"temperature": 0.0, "min_p": 0.0, **kw}
                                              )["choices"][0]["text"]
    finally:
        llm.close()
    return first, out


def test_the_default_chain_is_todays_and_each_field_adds_llama_cpps_sampler_in_its_order(demo: str) -> None:
    init_backend()
    model = load_model(demo)
    vocab = Vocab(model)

    def names(**kw: object) -> list[str]:
        chain = make_sampler(SamplerSettings(**kw), vocab)
        try:
            return [llama_cpp.llama_sampler_name(llama_cpp.llama_sampler_chain_get(chain, i)).decode()
                    for i in range(llama_cpp.llama_sampler_chain_n(chain))]
        finally:
            free_sampler(chain)

    try:
        assert names() == ["greedy"]
        assert names(temp=0.7) == ["top-k", "top-p", "temp", "dist"]
        assert names(frequency_penalty=0.0, presence_penalty=0.0, repeat_penalty=1.0, min_p=0.0) == ["greedy"]
        assert names(repeat_penalty=1.1, repeat_last_n=0) == ["greedy"]  # nothing to count: no penalties
        assert names(logit_bias=((5, -100.0),), presence_penalty=0.5) == ["logit-bias", "penalties", "greedy"]
        assert names(temp=0.7, min_p=0.1, repeat_penalty=1.1) == ["penalties", "top-k", "top-p", "min-p", "temp",
                                                                 "dist"]
    finally:
        llama_cpp.llama_model_free(model)


def test_each_field_samples_as_llama_cpp_pythons_own_llama(demo: str, plain: tuple[int, dict[str, str]]) -> None:
    first_token, plain_text = plain
    cases = _cases(first_token)
    assert len(set(plain_text.values())) == len(plain_text), f"every case must change the answer: {plain_text}"
    with bmoe.load(demo, io_threads=2, n_ctx=512, notice=lambda _: None) as m:
        greedy = m.run(m.prepare(bmoe.Ask(prompt=PROMPT, max_tokens=N)))
        assert greedy.ids[0] == first_token
        for name, kw in cases.items():
            got = m.generate(PROMPT, max_tokens=N, **kw)
            assert got == plain_text[name], name


def test_the_server_takes_them_with_the_openai_client(demo: str, plain: tuple[int, dict[str, str]]) -> None:
    """Also as bmoe-server's flags: a server started with --frequency-penalty answers as a request asking for it."""
    first_token, plain_text = plain
    s = Server("-m", demo, "-c", "512", "--io-threads", "2", env={"BMOE_API_KEY": KEY})
    try:
        c = s.client()
        for name, kw in _cases(first_token).items():
            extra = {k: kw[k] for k in ("min_p", "repeat_penalty") if k in kw}
            std = {k: v for k, v in kw.items() if k not in extra}
            r = c.completions.create(model="x", prompt=PROMPT, max_tokens=N, extra_body=extra or None, **std)
            assert r.choices[0].text == plain_text[name], name
        with httpx.Client(headers=auth(), timeout=60) as h:
            url = s.url + "/v1/completions"
            for body, param in [({"best_of": 2}, "best_of"), ({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"),
                                ({"mirostat": 2}, "mirostat"), ({"typical_p": 0.5}, "typical_p"),
                                ({"frequency_penalty": 2.5}, "frequency_penalty"),
                                ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
                                ({"logit_bias": {"99999999": -100}}, "logit_bias"),
                                ({"repeat_penalty": 0}, "repeat_penalty"), ({"min_p": 1.5}, "min_p")]:
                err = error_of(h.post(url, json={"prompt": PROMPT, "max_tokens": 2, **body}), 400)
                assert param in err["message"], (body, err)
                if param in ("best_of", "echo", "suffix", "mirostat", "typical_p", "logit_bias"):
                    assert err["param"] == param, (body, err)
            # what asks for nothing passes, and so does another server's extension
            ok = h.post(url, json={"prompt": PROMPT, "max_tokens": N, "best_of": 1, "echo": False, "mirostat": 0,
                                   "typical_p": 1.0, "n": 1, "some_vendor_field": {"x": 1}})
            assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == plain_text["greedy"]
    finally:
        s.stop()
    s = Server("-m", demo, "-c", "512", "--io-threads", "2", "--frequency-penalty", "1", "--logit-bias",
               f"{first_token}-100", env={"BMOE_API_KEY": KEY})
    try:
        r = s.client().completions.create(model="x", prompt=PROMPT, max_tokens=N)
        assert r.choices[0].text == plain_text["ban+penalty"]
    finally:
        s.stop()


def test_a_bias_on_a_token_the_vocab_lacks_is_refused_by_name(demo: str) -> None:
    with bmoe.load(demo, io_threads=2, n_ctx=512, notice=lambda _: None) as m:
        with pytest.raises(bmoe.ConfigError, match=r"logit_bias: token 99999999 is not in the model's vocabulary"):
            m.generate(PROMPT, max_tokens=2, logit_bias={99999999: -100})
        with pytest.raises(bmoe.ConfigError, match=r"presence_penalty 3: it is from -2 to 2"):
            m.generate(PROMPT, max_tokens=2, presence_penalty=3)



def test_the_sampling_names_are_the_settings_one_list_everywhere() -> None:
    """bmoe.base.settings.SAMPLING_FIELDS names every sampler setting once; `Ask`, the OpenAI bodies and the
    other wires take exactly those names (the server reads them through the list), so a setting added to the
    sampler without its request name, or a body field spelled its own way, fails here."""
    from dataclasses import fields

    from bmoe.api import Ask
    from bmoe.base.settings import SAMPLING_FIELDS
    from bmoe.server.anthropic_wire import MessagesBody, chat_body_of_messages
    from bmoe.server.openai_wire import ChatBody
    from bmoe.server.request_base import SamplingFields, sampling_of

    assert sorted(SAMPLING_FIELDS.values()) == sorted(f.name for f in fields(SamplerSettings))
    assert set(SAMPLING_FIELDS) <= {f.name for f in fields(Ask)}
    assert set(SamplingFields.model_fields) == set(SAMPLING_FIELDS)
    assert issubclass(ChatBody, SamplingFields)
    # Anthropic's body takes its own few, by the same names, and hands each to the chat request
    sent = {"temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 3}
    body = MessagesBody.model_validate({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **sent})
    assert sampling_of(body) == sent
    assert {k: v for k, v in sampling_of(chat_body_of_messages(body)).items() if v is not None} == sent
