"""Embeddings as llama-server --embedding serves them, on a real bmoe-server with the experts streamed
through a 1 MiB cache: the official `openai` client on `/v1/embeddings`, raw HTTP on llama-server's
native `/embeddings`; every vector equal to llama-cpp-python's own `Llama(embedding=True,
pooling_type=...)` on the same file (tests/plain_llama.py), pooled, normalized or per token; each
input shape llama-server takes, each it refuses, the bounds, the fields' fates; and generation on
the same server unchanged by the embeddings between its requests."""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import llama_cpp
import numpy as np
import openai.types.embedding_create_params as embedding_params
import pytest

import bmoe
from bmoe.api import Ask, Chunk
from bmoe.base import Cancelled
from bmoe.generation.embedding import normalized
from bmoe.server.embeddings import EMBED_INPUTS_MAX, EmbeddingsBody
from bmoe.server.request_base import known_fields
from bmoe.server.scheduler import EmbedAsk, Embedded, Job, Scheduler
from tests.conftest import run_cli
from tests.plain_llama import plain_llama
from tests.test_server import KEY, Server, auth
from tests.test_server_fields import fates_in_the_docs, named
from tests.test_server_llama_ops import llama_series

FLAGS = ["-t", "1", "--io-threads", "2", "--cache-mb", "1", "-c", "512"]  # a 1 MiB cache: the experts stream
TEXTS = ["Once upon a time there was a king", "hello world", "The sky is blue because"]
POOLING = {"none": llama_cpp.LLAMA_POOLING_TYPE_NONE, "mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN,
           "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS, "last": llama_cpp.LLAMA_POOLING_TYPE_LAST}


def plain(model: Path, pooling: str, texts: list[str]) -> list[np.ndarray]:
    """llama-cpp-python's own embeddings, unnormalized, each text alone (a batch of one sequence, as bmoe
    decodes each input), with the flash attention llama.cpp's default chooses on a CPU."""
    llm = plain_llama(model, embedding=True, pooling_type=POOLING[pooling], n_ctx=512, n_batch=512, n_ubatch=512,
                      n_threads=1, n_threads_batch=1, flash_attn=True)
    try:
        return [np.array(llm.embed(t), dtype=np.float32) for t in texts]
    finally:
        llm.close()


@pytest.fixture(scope="module")
def server(small_moe: Path) -> Iterator[Server]:
    s = Server("-m", str(small_moe), *FLAGS, "--embedding", "--pooling", "mean", env={"BMOE_API_KEY": KEY})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def per_token(small_moe: Path) -> Iterator[Server]:
    s = Server("-m", str(small_moe), *FLAGS, "--embeddings", "--pooling", "none", env={"BMOE_API_KEY": KEY})
    yield s
    s.stop()


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=auth(), timeout=120)


def vectors(r: httpx.Response) -> list[np.ndarray]:
    assert r.status_code == 200, r.text
    return [np.array(d["embedding"], dtype=np.float32) for d in r.json()["data"]]


# ---- lossless ------------------------------------------------------------------------------------


@pytest.mark.parametrize("pooling", list(POOLING))
def test_every_pooling_equals_plain_llama_with_the_experts_streamed(small_moe: Path, pooling: str) -> None:
    with bmoe.load(str(small_moe), embedding=True, pooling=pooling, cache_mb=1, threads=1, n_ctx=512,
                   io_threads=2, warm_start=False) as m:
        got = m.embed(TEXTS, normalize=-1)
        s = m.stats
        assert s.streaming and 0 < s.cache_budget_mib < s.engine.full_bytes / 2**20, "the experts stream"
        m.generate("hello", max_tokens=2)
        assert not llama_cpp.llama_get_embeddings(m.engine.context), "generation decodes without embeddings"
    want = plain(small_moe, pooling, TEXTS)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and np.array_equal(g, w), pooling


def test_a_cancel_stops_the_decode_in_flight_and_leaves_the_engine_as_it_was(small_moe: Path) -> None:
    """A client that leaves (or a shutdown) stops an input's decode mid-graph, not after it: the cancel comes
    as the decode begins (the streamer's begin_batch), and the next embeddings and generations are whole."""
    with bmoe.load(str(small_moe), embedding=True, pooling="mean", cache_mb=1, threads=1, n_ctx=512,
                   io_threads=2, warm_start=False) as m:
        st = m.engine.streamer
        assert st is not None
        begun: list[int] = []
        begin = st.begin_batch

        def begin_then_cancel(n: int, trunk: bool = True) -> None:
            begun.append(n)
            m.driver.interrupt_alone()
            begin(n, trunk)

        st.begin_batch = begin_then_cancel  # type: ignore[method-assign] - the cancel's moment, on this thread
        with pytest.raises(Cancelled):  # one input: only a stop mid-decode ends it without its vector
            m.embed(TEXTS[:1], cancelled=lambda: bool(begun))
        st.begin_batch = begin  # type: ignore[method-assign]
        assert len(begun) == 1
        got = m.embed(TEXTS, normalize=-1)
        m.generate("hello", max_tokens=2)
        assert not llama_cpp.llama_get_embeddings(m.engine.context)
    assert all(np.array_equal(g, w) for g, w in zip(got, plain(small_moe, "mean", TEXTS), strict=True))


def test_the_openai_client_gets_plain_llamas_vectors_normalized(server: Server, small_moe: Path) -> None:
    want = [normalized(v, 2) for v in plain(small_moe, "mean", TEXTS)]
    r = server.client().embeddings.create(model="anything", input=TEXTS)  # the client asks for base64
    assert [d.index for d in r.data] == [0, 1, 2] and r.object == "list" and r.model == small_moe.stem
    for d, w in zip(r.data, want, strict=True):
        assert np.array_equal(np.array(d.embedding, dtype=np.float32), w)
        assert abs(float(np.sum(w.astype(np.float64) ** 2)) - 1) < 1e-5
    n = sum(len(post(server, "/tokenize", {"content": t, "add_special": True}).json()["tokens"]) for t in TEXTS)
    assert r.usage.prompt_tokens == r.usage.total_tokens == n
    floats = post(server, "/v1/embeddings", {"input": TEXTS, "encoding_format": "float"})
    assert all(np.array_equal(g, w) for g, w in zip(vectors(floats), want, strict=True))
    raw = post(server, "/v1/embeddings", {"input": TEXTS[0], "embd_normalize": -1})
    assert np.array_equal(vectors(raw)[0], plain(small_moe, "mean", TEXTS[:1])[0])
    b64 = post(server, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"}).json()["data"][0]
    assert b64["encoding_format"] == "base64"
    assert np.array_equal(np.frombuffer(base64.b64decode(b64["embedding"]), "<f4"), want[0])


def test_the_native_route_gives_each_tokens_vector_unnormalized(per_token: Server, small_moe: Path) -> None:
    want = plain(small_moe, "none", TEXTS[:2])
    for path in ("/embeddings", "/embedding"):
        r = post(per_token, path, {"input": TEXTS[:2]})
        assert r.status_code == 200, r.text
        got = r.json()
        assert [g["index"] for g in got] == [0, 1]
        for g, w in zip(got, want, strict=True):
            assert np.array_equal(np.array(g["embedding"], dtype=np.float32), w)
    r = post(per_token, "/v1/embeddings", {"input": TEXTS[0]})
    assert r.status_code == 400 and "pooling none" in r.json()["error"]["message"]
    # llama-server's `content` answers natively on /v1/embeddings too
    r = post(per_token, "/v1/embeddings", {"content": TEXTS[0]})
    assert np.array_equal(np.array(r.json()[0]["embedding"], dtype=np.float32), want[0])


def test_generation_on_an_embedding_server_is_unchanged(server: Server, small_moe: Path) -> None:
    ask = {"prompt": TEXTS[0], "max_tokens": 8}
    before = post(server, "/v1/completions", ask).json()["choices"][0]["text"]
    assert vectors(post(server, "/v1/embeddings", {"input": TEXTS}))
    assert post(server, "/v1/completions", ask).json()["choices"][0]["text"] == before
    cli = run_cli("-m", str(small_moe), "-p", TEXTS[0], "-n", "8", "--no-stream", *FLAGS)
    assert cli.returncode == 0 and before in cli.stdout, cli.stderr


def test_embeddings_between_a_generations_steps_change_neither(small_moe: Path) -> None:
    """The scheduler as the server runs it, two KV sequences: an embeddings job submitted at a generation's
    second token runs before its third (the next turn admits it), on the other sequence."""
    with bmoe.load(str(small_moe), embedding=True, pooling="mean", parallel=2, cache_mb=1, threads=1, n_ctx=512,
                   io_threads=2, warm_start=False) as m:
        alone = m.run(m.prepare(Ask(TEXTS[0], max_tokens=12))).text
        sched = Scheduler(m, 4, on_fatal=lambda e: None)
        sched.start()
        pieces: list[str] = []
        at: list[int] = []
        got: list[np.ndarray] = []
        ended, embedded = threading.Event(), threading.Event()

        def on_embedded(item: Any) -> None:
            if isinstance(item, Embedded):
                at.append(len(pieces))
                got.extend(item.vectors)
                embedded.set()

        def on_chunk(item: Any) -> None:
            if isinstance(item, Chunk):
                pieces.append(item.text)
                if len(pieces) == 2:
                    sched.submit(Job(EmbedAsk([m.tokenize(t) for t in TEXTS], -1), on_embedded))
                if item.stats is not None:
                    ended.set()

        sched.submit(Job(m.prepare(Ask(TEXTS[0], max_tokens=12)), on_chunk))
        assert ended.wait(300) and embedded.wait(300)
        sched.close()
        sched.join()
    assert at == [2], "between the second and the third token"
    assert "".join(pieces) == alone
    assert all(np.array_equal(g, w) for g, w in zip(got, plain(small_moe, "mean", TEXTS), strict=True))


# ---- inputs --------------------------------------------------------------------------------------


def test_an_embeddings_request_counts_as_llama_servers_prompt(server: Server) -> None:
    """llama-server's series count an embeddings input as a prompt decoded: its tokens and time, one decode
    an input, no token predicted (its suite's test_metrics_embedding_prompt_is_counted)."""
    _, before = llama_series(server)
    r = post(server, "/v1/embeddings", {"input": ["hello world", "goodbye world"]})
    assert r.status_code == 200, r.text
    _, after = llama_series(server)
    grew = {name[len("llamacpp:"):]: after[name][1] - before[name][1] for name in before}
    assert grew["prompt_tokens_total"] == r.json()["usage"]["prompt_tokens"] > 0
    assert grew["n_decode_total"] == 2 and grew["tokens_predicted_total"] == 0 and grew["prompt_seconds_total"] > 0


def test_every_input_shape_llama_server_takes(server: Server) -> None:
    hello = post(server, "/tokenize", {"content": "hello world", "add_special": True}).json()["tokens"]
    one = vectors(post(server, "/v1/embeddings", {"input": "hello world"}))[0]
    same = [hello, {"prompt_string": "hello world"}, {"content": [{"type": "text", "text": "hello "},
                                                                 {"type": "text", "text": "world"}]}]
    got = vectors(post(server, "/v1/embeddings", {"input": same}))
    assert len(got) == 3 and all(np.array_equal(g, one) for g in got)
    # a list holding a number is one input: strings (only the first with its special tokens) and ids
    more = post(server, "/tokenize", {"content": " and more"}).json()["tokens"]
    mixed = vectors(post(server, "/v1/embeddings", {"input": ["hello world", *more, " and more"]}))
    assert len(mixed) == 1
    ids = vectors(post(server, "/v1/embeddings", {"input": [*hello, *more, *more]}))[0]
    assert np.array_equal(mixed[0], ids)
    assert len(vectors(post(server, "/v1/embeddings", {"input": [hello, [*hello, "more"]]}))) == 2


@pytest.mark.parametrize("body,field,words", [
    ({"input": []}, "input", "empty"),
    ({}, "input", "required"),
    ({"input": {"content": "text"}}, "input", "content parts"),
    ({"input": {"content": [{"type": "unknown"}]}}, "input", "text only"),
    ({"input": {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}}, "input",
     "text only"),
    ({"input": {"prompt_string": "x", "multimodal_data": ["AAAA"]}}, "input", "text only"),
    ({"input": [10**9]}, "input", "not a token id"),
    ({"input": [[]]}, "input", "no tokens"),
    ({"input": "This is a test " * 200}, "input", "too large"),
    ({"input": ["x"] * (EMBED_INPUTS_MAX + 1)}, "input", f"at most {EMBED_INPUTS_MAX}"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", ""),
    ({"input": "x", "embd_normalize": -5}, "embd_normalize", ""),
    ({"input": "x", "dimensions": 7}, "dimensions", "this model's embeddings have"),
])
def test_a_bad_input_is_a_400_naming_its_field(server: Server, body: dict, field: str, words: str) -> None:
    r = post(server, "/v1/embeddings", body)
    assert r.status_code == 400 and named(r, field) and words in r.json()["error"]["message"], r.text


def test_a_server_without_embedding_says_which_flag(small_moe: Path) -> None:
    s = Server("-m", str(small_moe), *FLAGS, env={"BMOE_API_KEY": KEY})
    try:
        for path in ("/v1/embeddings", "/embeddings", "/embedding"):
            r = post(s, path, {"input": "hello"})
            assert r.status_code == 501 and "--embedding" in r.json()["error"]["message"], r.text
    finally:
        s.stop()
    pooled = run_cli("-m", str(small_moe), "-p", "x", "--pooling", "mean")
    assert pooled.returncode == 2 and "--pooling" in pooled.stderr and "--embedding" in pooled.stderr
    cli = run_cli("-m", str(small_moe), "-p", "x", "--embedding")
    assert cli.returncode == 2 and "bmoe-server --embedding" in cli.stderr


# ---- every field -----------------------------------------------------------------------------------

LLAMA_SERVER = ("content", "embd_normalize", "encoding_format")  # its README's /embeddings and /v1/embeddings
VALUES = {"dimensions": 128, "encoding_format": "base64", "user": "u", "embd_normalize": 0, "content": "hello"}


def test_every_documented_field_is_honoured_or_refused_by_name(server: Server) -> None:
    documented = set(embedding_params.EmbeddingCreateParams.__annotations__) | set(LLAMA_SERVER)
    fields = documented - {"model", "input"}
    silent = []
    for field in sorted(fields):
        body = {field: VALUES[field]} if field == "content" else {"input": "hello", field: VALUES[field]}
        r = post(server, "/v1/embeddings", body)
        if r.status_code == 400:
            assert named(r, field), r.text
        else:
            assert r.status_code == 200, f"{field}: {r.text}"
            silent += [] if field in known_fields(EmbeddingsBody, {}) else [field]
    assert not silent
    missing = fields - fates_in_the_docs().get("/v1/embeddings", set())
    assert not missing, f"docs/server.md's \"Every field's fate\" does not list: {sorted(missing)}"
