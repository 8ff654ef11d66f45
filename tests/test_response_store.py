"""The Responses API's store (bmoe.server.response_store) counts what it holds (issue 50): every field of
a kept response, as the memory Python gives it (tracemalloc), not a proxy; its bounds on count and
bytes drop the least recently used; a response larger than the whole bound is not kept, and a
follow-up to it is the usual 400."""

from __future__ import annotations

import gc
import json
import tracemalloc
import uuid
from typing import Any

import pytest

from bmoe.server.http_errors import ServeError
from bmoe.server.response_store import ENTRY_BYTES, ResponseStore


def response(**fields: Any) -> dict[str, Any]:
    """A Response object as ResponsesShape makes one, with `fields` in it."""
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "status": "completed", "instructions": None,
            "output": [{"id": "msg_1", "type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": "hi", "annotations": [], "logprobs": []}]}],
            "tools": [], "metadata": {}, **fields}


def conversation(n: int, text: str = "hello") -> list[dict[str, Any]]:
    return [{"type": "message", "role": "user" if i % 2 == 0 else "assistant", "content": text} for i in range(n)]


def traced(make: Any) -> tuple[Any, int]:
    """What `make()` returns and the bytes it still holds allocated once it has returned."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        out = make()
        gc.collect()
        return out, tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("shape", ["many small", "large fields", "past the count"])
def test_what_the_store_counts_is_the_memory_it_holds(shape: str) -> None:
    """Whatever a response carries (big instructions, many tools, metadata at its bounds, long
    conversations, any script), the bytes the store says it holds are at least what tracemalloc sees it
    allocate, and at most ENTRY_BYTES an entry more; far less than the objects it was given."""
    meta = {f"{i:064d}": "v" * 512 for i in range(16)}
    if shape == "large fields":
        kept = [(response(instructions="x" * 200_000, tools=[{"type": "function", "name": f"f{i}",
                                                                "parameters": {"type": "object"}}
                                                               for i in range(300)], metadata=meta),
                 conversation(2000, "héllo wörld ✓ 你好")) for _ in range(20)]
    else:
        kept = [(response(metadata={"k": str(i)}), conversation(3)) for i in range(3000 if shape == "past the count"
                                                                                    else 500)]
    text = json.dumps(kept)
    _, given = traced(lambda: json.loads(text))  # what they take as objects, parsed as a request's body is

    def fill() -> ResponseStore:
        store = ResponseStore(most=1000, bound=1 << 30)
        for r, c in kept:
            assert store.keep(r, c)
        return store

    store, used = traced(fill)
    n = len(store.kept)
    assert n == min(len(kept), 1000)
    assert store.held - n * ENTRY_BYTES <= used <= store.held, (used, store.held, n)
    if shape == "large fields":
        assert store.held < given, "JSON bytes take less than the objects"


def test_every_field_is_counted_and_one_past_the_bound_is_not_kept() -> None:
    store = ResponseStore(most=10, bound=100_000)
    for big in ({"instructions": "x" * 100_000}, {"tools": [{"name": "t" * 50_000}] * 2},
                {"reasoning": {"effort": "low", "note": "y" * 100_000}}):
        r = response(**big)
        assert not store.keep(r, conversation(1)), big
        assert store.held == 0 and not store.kept
        with pytest.raises(ServeError) as e:
            store.items(r["id"])
        assert e.value.status == 400 and e.value.param == "previous_response_id"
        assert "send the whole conversation as input" in e.value.message
    r = response()
    assert not store.keep(r, conversation(1, "z" * 100_000)), "the conversation is counted too"
    assert not ResponseStore(most=0).keep(response(), conversation(1)), "--store-responses 0 keeps none"


def test_the_least_recently_used_go_first_within_both_bounds() -> None:
    one = ResponseStore.size((b"", b"")) + 2_000  # about the size of each entry below
    store = ResponseStore(most=3, bound=4 * one)
    rs = [response(instructions=str(i) * 1500) for i in range(5)]
    for r in rs[:3]:
        store.keep(r, conversation(1))
    store.get(rs[0]["id"])  # used: now the most recent
    store.keep(rs[3], conversation(1))  # past the count: rs[1] goes
    assert list(store.kept) == [rs[i]["id"] for i in (2, 0, 3)]
    store.items(rs[2]["id"])
    store.keep(rs[4], conversation(1, "w" * 2 * one))  # past the bytes: the two least recently used go
    assert list(store.kept) == [rs[2]["id"], rs[4]["id"]] and store.held <= store.bound
    assert store.held == sum(map(store.size, store.kept.values()))
    store.drop(rs[4]["id"])
    store.drop(rs[2]["id"])
    assert store.held == 0
    with pytest.raises(ServeError) as e:
        store.drop(rs[2]["id"])
    assert e.value.status == 404 and e.value.code == "not_found"


def test_a_kept_response_reads_back_as_it_was_given() -> None:
    store = ResponseStore()
    r = response(instructions="naïve ✓ 😀", metadata={"k": "v"}, temperature=0.5, top_p=None)
    items = [*conversation(2, "你好"), {"type": "reasoning", "summary": [], "encrypted_content": "\ud800 lone"}]
    store.keep(r, items)
    assert store.get(r["id"]) == r and store.items(r["id"]) == items
    assert store.get(r["id"]) is not store.get(r["id"]), "each use decodes its own copy"
