"""llama-server's own API and paths on a real bmoe-server, as its clients meet them: the native
`/completion` (raw HTTP, its response and stream shapes), `/tokenize`, `/detokenize`,
`/apply-template`, `/props`; the OpenAI routes without `/v1` (the official `openai` client with
llama-server's base URL); and CORS for the pages `--allowed-origin` lists, on a keyed server (a
browser's preflight and request, raw HTTP with `Origin`). The keyless side of CORS is in
tests/test_server_hosts.py."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.test_server import FLAGS, KEY, PROMPT, Server, auth, error_of, metric

APP = "http://app.example:3000"  # the web page --allowed-origin lets use the server
N = 8


@pytest.fixture(scope="module")
def server(small_moe) -> Iterator[Server]:
    s = Server("-m", str(small_moe), *FLAGS, "--allowed-origin", APP, env={"BMOE_API_KEY": KEY})
    yield s
    s.stop()


def post(server: Server, path: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={**auth(), **headers}, timeout=120)


def events(server: Server, path: str, body: dict) -> list[dict]:
    """A streamed answer's `data:` objects, in order (an OpenAI stream's `[DONE]` left out)."""
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, headers=auth(), timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


# ---- /completion ---------------------------------------------------------------------------------


def test_completion_is_the_v1_completions_answer_in_llama_servers_shapes(server: Server) -> None:
    want = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": N}).json()["choices"][0]["text"]
    assert want
    r = post(server, "/completion", {"prompt": PROMPT, "n_predict": N, "cache_prompt": True, "seed": -1})
    got = r.json()
    assert r.status_code == 200 and got["content"] == want, got
    assert got["stop"] is True and got["stop_type"] == "limit" and got["tokens_predicted"] == N
    assert got["tokens_evaluated"] == got["bmoe"]["prompt_tokens"] > 0 and got["truncated"] is False
    assert got["prompt"] == PROMPT and got["generation_settings"]["n_predict"] == N
    t = got["timings"]
    assert t["predicted_n"] == N and t["prompt_n"] + t["cache_n"] == got["tokens_evaluated"]
    assert t["predicted_per_second"] > 0 and t["prompt_ms"] >= 0
    # streamed: one object per piece, `stop: false`, then the last with the rest; no [DONE]
    *pieces, last = events(server, "/completions", {"prompt": PROMPT, "n_predict": N})
    assert "".join(p["content"] for p in pieces) == want and not any(p["stop"] for p in pieces)
    assert last["stop"] is True and last["content"] == "" and last["stop_type"] == "limit"
    assert last["tokens_predicted"] == N and "timings" in last
    # the token ids: each piece's, and with return_tokens the whole answer's, which detokenize to its text
    ids = [t for p in [*pieces, last] for t in p["tokens"]]
    assert len(ids) == N and all(p["tokens"] for p in pieces) and got["tokens"] == []
    whole = post(server, "/completion", {"prompt": PROMPT, "n_predict": N, "return_tokens": True}).json()
    assert whole["tokens"] == ids
    assert post(server, "/detokenize", {"tokens": ids}).json()["content"] == want
    # n_probs: each token's log-probability and its likeliest, joining into the text, streamed or not
    probs = post(server, "/completion", {"prompt": PROMPT, "n_predict": N, "n_probs": 3}).json()
    probs = probs["completion_probabilities"]
    assert len(probs) == N and "".join(p["token"] for p in probs) == want and [p["id"] for p in probs] == ids
    assert all(len(p["top_logprobs"]) == 3 and p["top_logprobs"][0]["id"] == p["id"] for p in probs)  # greedy
    assert all(p["logprob"] == p["top_logprobs"][0]["logprob"] <= 0 for p in probs)
    streamed = events(server, "/completion", {"prompt": PROMPT, "n_predict": N, "n_probs": 3})
    assert [p for e in streamed for p in e["completion_probabilities"]] == probs
    # the prompt as token ids (/tokenize's, BOS added as bmoe's own tokenizing adds it) is the same prompt
    ids = post(server, "/tokenize", {"content": PROMPT, "add_special": True}).json()["tokens"]
    by_ids = post(server, "/completion", {"prompt": ids, "n_predict": N}).json()
    assert by_ids["content"] == want and by_ids["tokens_evaluated"] == len(ids)
    # llama-server's prompt object, without media
    by_object = post(server, "/completion", {"prompt": {"prompt_string": PROMPT}, "n_predict": N}).json()
    assert by_object["content"] == want and by_object["prompt"] == PROMPT


def test_post_sampling_probs_are_the_sampler_chains_and_sample_the_same(server: Server) -> None:
    sampled = {"prompt": PROMPT, "n_predict": N, "temperature": 1.0, "top_k": 5, "top_p": 1.0, "seed": 7, "n_probs": 10}
    plain = post(server, "/completion", sampled).json()
    got = post(server, "/completion", {**sampled, "post_sampling_probs": True}).json()
    assert got["content"] == plain["content"], "the same draws"  # lossless: the chain samples as it did
    probs = got["completion_probabilities"]
    assert [p["id"] for p in probs] == [p["id"] for p in plain["completion_probabilities"]]
    for p in probs:  # top_k 5 keeps five: their probabilities after the chain, which add up to 1
        assert 0 < p["prob"] <= 1 and "logprob" not in p and len(p["top_probs"]) == 5, p
        assert sum(a["prob"] for a in p["top_probs"]) == pytest.approx(1, abs=1e-5)
        assert p["prob"] == next(a["prob"] for a in p["top_probs"] if a["id"] == p["id"])
        assert [a["prob"] for a in p["top_probs"]] == sorted((a["prob"] for a in p["top_probs"]), reverse=True)
    streamed = events(server, "/completion", {**sampled, "post_sampling_probs": True})
    assert [p for e in streamed for p in e.get("completion_probabilities", [])] == probs
    # greedy: the likeliest alone, with probability 1 (llama-server's chain at temperature 0 keeps only it)
    greedy = post(server, "/completion", {"prompt": PROMPT, "n_predict": N, "n_probs": 3,
                                          "post_sampling_probs": True}).json()
    assert all(p["prob"] == 1 and [a["id"] for a in p["top_probs"]] == [p["id"]]
               for p in greedy["completion_probabilities"])
    assert error_of(post(server, "/v1/completions", {"prompt": PROMPT, "post_sampling_probs": True}),
                    400)["param"] == "post_sampling_probs"  # OpenAI's logprobs have no place for them


def test_completion_holds_to_stop_schema_and_grammar(server: Server) -> None:
    text = post(server, "/completion", {"prompt": PROMPT, "n_predict": N}).json()["content"]
    word = text.split()[1]
    r = post(server, "/completion", {"prompt": PROMPT, "n_predict": N, "stop": [word]}).json()
    assert r["stop_type"] == "word" and r["stopping_word"] == word and word not in r["content"], r
    r = post(server, "/completion", {"prompt": PROMPT, "n_predict": N, "json_schema": {"const": "42"}}).json()
    assert json.loads(r["content"]) == "42" and r["stop_type"] == "eos", r
    r = post(server, "/completion", {"prompt": PROMPT, "n_predict": N, "grammar": 'root ::= "yes" | "no"'}).json()
    assert r["content"] in ("yes", "no"), r
    r = post(server, "/completion", {"prompt": PROMPT, "n_predict": 2, "logit_bias": [[7, -100]], "temperature": 0.5,
                                     "top_k": 5, "min_p": 0.1, "repeat_penalty": 1.1, "n_keep": -1})
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 2, r.text


def test_logit_bias_of_a_text_biases_each_of_its_tokens(server: Server) -> None:
    plain = post(server, "/completion", {"prompt": PROMPT, "n_predict": N}).json()["content"]
    word = plain.split()[0]
    ids = post(server, "/tokenize", {"content": " " + word}).json()["tokens"]
    by_ids = post(server, "/completion", {"prompt": PROMPT, "n_predict": N, "logit_bias": [[t, -100] for t in ids]})
    assert by_ids.json()["content"] != plain and word not in by_ids.json()["content"].split()
    for bias in ([[" " + word, -100]], {" " + word: -100}):  # llama-server's pairs and OpenAI's map, keyed by text
        got = post(server, "/completion", {"prompt": PROMPT, "n_predict": N, "logit_bias": bias}).json()
        assert got["content"] == by_ids.json()["content"], (bias, got)
        assert sorted(b["token"] for b in got["generation_settings"]["logit_bias"]) == sorted(ids)


def test_ignore_eos_runs_past_the_end_of_generation(server: Server) -> None:
    eos = httpx.get(server.url + "/props", headers=auth()).json()["eos_token"]
    (end,) = post(server, "/tokenize", {"content": eos}).json()["tokens"]
    ask = {"prompt": PROMPT, "n_predict": N, "logit_bias": [[end, 50]]}  # the end of generation made likeliest
    ended = post(server, "/completion", ask).json()
    assert ended["stop_type"] == "eos" and ended["tokens_predicted"] < N, ended
    assert ended["generation_settings"]["logit_bias"] == [{"bias": 50, "token": end}]
    plain = post(server, "/completion", {"prompt": PROMPT, "n_predict": N}).json()
    on = post(server, "/completion", {**ask, "ignore_eos": True}).json()
    # every end-of-generation token banned (-inf: null, as llama-server writes it); the rest of the distribution
    # as it was, so greedy gives the answer without the bias
    assert on["stop_type"] == "limit" and on["content"] == plain["content"] and on["tokens_predicted"] == N
    banned = [b["token"] for b in on["generation_settings"]["logit_bias"] if b["bias"] is None]
    assert end in banned, on["generation_settings"]
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}],
                                                 "max_tokens": N, "logit_bias": {str(end): 50}, "ignore_eos": True})
    assert chat.json()["choices"][0]["finish_reason"] == "length" and chat.json()["usage"]["completion_tokens"] == N


@pytest.mark.parametrize("body, param", [
    ({"n_predict": 0}, "n_predict"), ({"mirostat": 2}, "mirostat"), ({"n_probs": 21}, "n_probs"),
    ({"samplers": ["top_k"]}, "samplers"), ({"n_cmpl": 17}, "n_cmpl"), ({"n_cmpl": 2, "n": 3}, "n_cmpl"),
    ({"lora": [{"id": 0, "scale": 1}]}, "lora"), ({"id_slot": 1}, "id_slot"),
    ({"prompt": ["one", 2.5]}, "prompt[1]"), ({"prompt": [0, 10 ** 9]}, "prompt"), ({"prompt": []}, "prompt"),
    ({"prompt": {"prompt_string": "<__media__>", "multimodal_data": ["AAAA"]}}, "prompt.multimodal_data"),
    ({"json_schema": {"type": "nonsense"}}, "json_schema"), ({"logit_bias": [["Hello", False]]}, "logit_bias"),
    ({"logit_bias": {" king": 101}}, "logit_bias"),
])
def test_what_completion_does_not_take_is_a_400_naming_it(server: Server, body: dict, param: str) -> None:
    err = error_of(post(server, "/completion", {"prompt": PROMPT, **body}), 400)
    assert err["param"] == param and param.split(".")[0] in err["message"], err


# ---- llama-server's timings, first chunk and context error on the OpenAI routes too ----------------


def agree(t: dict, bmoe: dict) -> None:
    """llama-server's `timings` are bmoe's own figures: the prompt decoded and reused, the tokens and their speed."""
    assert t["prompt_n"] == bmoe["prefill_tokens"] and t["prompt_n"] + t["cache_n"] == bmoe["prompt_tokens"], t
    assert t["predicted_n"] == bmoe["completion_tokens"] and t["prompt_ms"] == bmoe["prefill_s"] * 1000
    assert t["predicted_per_second"] == pytest.approx(bmoe["tok_s"]) and t["predicted_ms"] > 0, t


def test_timings_come_with_every_openai_answer_and_per_token_when_asked(server: Server) -> None:
    chat = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": N}
    r = server.client().chat.completions.create(model="x", **chat)
    agree(r.model_extra["timings"], r.model_extra["bmoe"])
    done = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": N}).json()
    agree(done["timings"], done["bmoe"])
    # streamed: the first chunk opens the turn with content null (as llama-server's), the last has the timings,
    # or the usage chunk after it when include_usage asks for one
    first, *chunks = events(server, "/v1/chat/completions", chat)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": None} and "timings" not in first
    assert [c for c in chunks if "timings" in c] == chunks[-1:]
    agree(chunks[-1]["timings"], chunks[-1]["bmoe"])
    *_, last, used = events(server, "/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}})
    assert "timings" not in last and used["choices"] == [] and used["timings"]["predicted_n"] == N
    # timings_per_token: each token's chunk has the timings so far, on the OpenAI routes and /completion alike
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", {"prompt": PROMPT, "max_tokens": N}),
                       ("/completion", {"prompt": PROMPT, "n_predict": N})):
        got = events(server, path, {**body, "timings_per_token": True})
        pieces = [e["timings"] for e in got if "timings" in e and e.get("stop") is not True]
        assert [t["predicted_n"] for t in pieces[:-1 if path != "/completion" else None]] == list(range(1, N + 1))
        assert all(t["prompt_n"] == pieces[-1]["prompt_n"] > 0 for t in pieces), pieces
        assert pieces[0]["predicted_ms"] < pieces[N - 1]["predicted_ms"] and pieces[0]["prompt_ms"] > 0
    # Anthropic's clients get Anthropic's shapes only
    m = post(server, "/v1/messages", {"max_tokens": 2, "messages": chat["messages"]}).json()
    assert "timings" not in m and m["type"] == "message"


def decoded(server: Server, text: str) -> str:
    """`text` as the model's tokens (BOS added where the vocabulary adds one) detokenize."""
    ids = post(server, "/tokenize", {"content": text, "add_special": True}).json()["tokens"]
    return post(server, "/detokenize", {"tokens": ids}).json()["content"]


def test_verbose_answers_carry_llama_servers_native_object(server: Server) -> None:
    chat = {"messages": [{"role": "system", "content": "Book"}, {"role": "user", "content": "hello there"}],
            "max_tokens": N}
    plain = post(server, "/v1/chat/completions", chat).json()
    assert "__verbose" not in plain
    got = post(server, "/v1/chat/completions", {**chat, "verbose": True}).json()
    v = got["__verbose"]
    # the prompt as its tokens decode (BOS's text first where the vocabulary adds one, as llama-server shows it)
    assert v["prompt"] == decoded(server, post(server, "/apply-template", chat).json()["prompt"])
    assert "Book" in v["prompt"]
    assert v["content"] == got["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert v["tokens_predicted"] == got["usage"]["completion_tokens"] and v["stop"] is True
    assert v["generation_settings"]["n_predict"] == N and v["timings"]["predicted_n"] == v["tokens_predicted"]
    # streamed: on the last chunk, with the whole text
    *chunks, last = events(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": N, "verbose": True})
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert last["__verbose"]["content"] == text and last["__verbose"]["prompt"] == decoded(server, PROMPT)
    assert not any("__verbose" in c for c in chunks)


def test_a_prompt_past_the_context_is_llama_servers_error_and_openais(server: Server) -> None:
    long = [{"role": "user", "content": "hello " * 5000}]
    for body in ({"messages": long}, {"messages": long, "stream": True}):
        err = error_of(post(server, "/v1/chat/completions", body), 400)
        assert err["type"] == "exceed_context_size_error" and err["code"] == "context_length_exceeded", err
        assert err["n_ctx"] == 4096 < err["n_prompt_tokens"], err
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model="x", messages=long)
    assert e.value.code == "context_length_exceeded"
    err = error_of(post(server, "/completion", {"prompt": "hello " * 5000}), 400)
    assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == 4096 < err["n_prompt_tokens"]


# ---- /tokenize, /detokenize, /apply-template, /props ---------------------------------------------


def test_tokenize_detokenize_and_apply_template(server: Server) -> None:
    plain = post(server, "/tokenize", {"content": PROMPT}).json()["tokens"]
    pieces = post(server, "/tokenize", {"content": PROMPT, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == plain
    text = "".join(p["piece"] for p in pieces)  # as llama-server's: a piece's leading space is kept
    assert text.strip() == PROMPT and post(server, "/detokenize", {"tokens": plain}).json() == {"content": text}
    # a piece that is not whole UTF-8 comes as its bytes
    odd = "unicode 媽 and emoji 🤗"
    pieces = post(server, "/tokenize", {"content": odd, "with_pieces": True}).json()["tokens"]
    raw = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces)
    assert raw.decode().strip() == odd and any(isinstance(p["piece"], list) for p in pieces), pieces
    assert error_of(post(server, "/detokenize", {"tokens": [-1]}), 400)["param"] == "tokens"
    err = error_of(post(server, "/tokenize", {"content": "x", "parse_special": False}), 400)
    assert err["param"] == "parse_special"
    messages = [{"role": "user", "content": "hello there"}]
    prompt = post(server, "/apply-template", {"messages": messages}).json()["prompt"]
    assert "hello there" in prompt
    # the template's text is what the chat route decodes: as many tokens as its usage counts
    used = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()["usage"]
    assert len(post(server, "/tokenize", {"content": prompt, "add_special": True}).json()["tokens"]) == \
        used["prompt_tokens"]
    # and as the chat route renders it without the generation prompt (add_generation_prompt: false)
    bare = post(server, "/apply-template", {"messages": messages, "add_generation_prompt": False}).json()["prompt"]
    assert prompt.startswith(bare) and len(bare) < len(prompt), (bare, prompt)
    used = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1,
                                                 "add_generation_prompt": False}).json()["usage"]
    assert len(post(server, "/tokenize", {"content": bare, "add_special": True}).json()["tokens"]) == \
        used["prompt_tokens"]


def test_props_tell_the_truth_about_the_server(server: Server, small_moe) -> None:
    p = httpx.get(server.url + "/props", headers=auth()).json()
    assert p["default_generation_settings"]["n_ctx"] == 4096 and p["total_slots"] == 1
    assert p["model_path"] == str(small_moe) and p["model_alias"] == small_moe.stem
    assert p["default_generation_settings"]["params"]["temperature"] == 0  # greedy by default, as bmoe-cli
    shown = post(server, "/api/show", {"model": small_moe.stem}).json()  # the GGUF's template, read the Ollama way
    assert p["chat_template"] == shown["template"] and p["chat_template"]
    assert httpx.get(server.url + "/props").status_code == 401  # behind the key as every API route


# ---- the OpenAI routes without /v1 ---------------------------------------------------------------


def test_the_openai_client_with_llama_servers_base_url(server: Server, small_moe) -> None:
    bare = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)
    assert [m.id for m in bare.models.list()] == [small_moe.stem]
    assert bare.models.retrieve(small_moe.stem).id == small_moe.stem
    msgs = [{"role": "user", "content": "hello there"}]
    want = server.client().chat.completions.create(model="x", messages=msgs, max_tokens=N).choices[0].message.content
    before = metric(server, 'bmoe_requests_total{route="/chat/completions",status="200"}')
    assert bare.chat.completions.create(model="x", messages=msgs, max_tokens=N).choices[0].message.content == want
    assert metric(server, 'bmoe_requests_total{route="/chat/completions",status="200"}') == before + 1
    r = bare.responses.create(model="x", input="hello there", max_output_tokens=N)
    assert r.output_text and bare.responses.retrieve(r.id).id == r.id
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).chat.completions.create(
            model="x", messages=msgs, max_tokens=1)


def test_input_tokens_count_what_the_answer_would_decode(server: Server) -> None:
    msgs = [{"role": "user", "content": "hello there"}]
    used = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"):
        assert post(server, path, {"messages": msgs}).json() == {"input_tokens": used}
    r = server.client().responses.create(model="x", input="hello there", instructions="Be brief.", max_output_tokens=1)
    count = server.client().responses.input_tokens.count(model="x", input="hello there", instructions="Be brief.")
    assert count.input_tokens == r.usage.input_tokens and count.object == "response.input_tokens"
    assert error_of(post(server, "/v1/chat/completions/input_tokens", {"messages": []}), 400)["param"] == "messages"


# ---- CORS, with a key ----------------------------------------------------------------------------


def preflight(server: Server, origin: str, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.options(server.url + path, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                                     "Access-Control-Request-Headers": "authorization,content-type"})


def test_cors_answers_the_allowed_page_and_no_other(server: Server) -> None:
    for path in ("/v1/chat/completions", "/completion", "/chat/completions"):
        r = preflight(server, APP, path)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP, (path, r.text)
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = post(server, "/v1/chat/completions", chat, origin=APP)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP
    assert "x-queue-position" in r.headers["access-control-expose-headers"].lower()
    # the page still needs the key, and it can read why it was refused
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, headers={"origin": APP}, timeout=60)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == APP
    # another page: its preflight gets no CORS header (200, as llama-server's) and no answer carries one (its
    # browser reads none)
    r = preflight(server, "http://evil.example")
    assert r.status_code == 200 and not any(h.startswith("access-control-") for h in r.headers)
    r = post(server, "/v1/chat/completions", chat, origin="http://evil.example")
    assert "access-control-allow-origin" not in r.headers
