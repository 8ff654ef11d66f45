"""The Responses API's store bounds the server's memory (issue 50): a real bmoe-server, filled past its
`--store-responses-mb` with large requests that are valid (metadata at OpenAI's bounds, long
instructions, many input items: reasoning items carrying their summary parts and an opaque
`encrypted_content`, as OpenAI's clients send them back), grows its resident memory by the bound and
SLACK_MIB at most, while the oldest responses go and the newest stay readable. Only the key's holders
read or drop a kept response."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

from tests.test_server import FLAGS, KEY, METADATA_AT_BOUNDS, Server, auth, error_of, metric

BOUND_MB = 8  # --store-responses-mb
BODY_KB = 512  # each request's body, about
FILL = 2 * BOUND_MB * 1024 // BODY_KB  # requests that bring twice the bound
WARM = 4  # requests of the same shape, not stored, before the baseline
# what the process may grow besides the store: a request's own objects while it is answered and the
# allocator's free lists they leave (a 512 KiB body of small items is a few MiB of Python objects)
SLACK_MIB = 16
PART = {"type": "summary_text", "text": ""}  # the smallest valid part: much Python for little JSON


@pytest.fixture(scope="module")
def server(small_moe) -> Iterator[Server]:
    s = Server("-m", str(small_moe), *FLAGS, "--store-responses-mb", str(BOUND_MB), env={"BMOE_API_KEY": KEY})
    yield s
    s.stop()


INSTRUCTIONS = "Answer briefly and plainly. " * 20
ITEMS = 100  # reasoning items in each request's input


def large(i: int, store: bool) -> dict[str, Any]:
    """A request of about BODY_KB that costs few tokens: most of it is what the model does not read (empty
    summary parts, encrypted_content)."""
    parts = (BODY_KB * 1024 - 40_000) // 36 // ITEMS
    reasoning = [{"type": "reasoning", "id": f"rs_{i}_{j}", "summary": [PART] * parts, "encrypted_content": "e" * 200}
                 for j in range(ITEMS)]
    return {"input": [*reasoning, {"type": "message", "role": "user", "content": f"question {i}"}],
            "instructions": INSTRUCTIONS, "metadata": METADATA_AT_BOUNDS, "max_output_tokens": 1, "store": store}


def respond(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.url + "/v1/responses", json=body, headers=auth(), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_filling_the_store_grows_memory_by_its_bound_at_most(server: Server) -> None:
    proc = psutil.Process(server.proc.pid)
    for i in range(WARM):
        respond(server, large(i, store=False))
    base = proc.memory_info().rss
    grew, ids = 0, []
    for i in range(FILL):
        ids.append(respond(server, large(i, store=True))["id"])
        grew = max(grew, proc.memory_info().rss - base)
    held, kept = metric(server, "bmoe_stored_response_bytes"), metric(server, "bmoe_stored_responses")
    assert held <= BOUND_MB << 20 and kept < FILL, "the fill passed the bound: the oldest went"
    assert grew <= (BOUND_MB + SLACK_MIB) << 20, f"grew {grew / 2**20:.1f} MiB holding {held / 2**20:.1f} MiB"
    assert all(re.fullmatch(r"resp_[0-9a-f]{32}", rid) for rid in ids) and len(set(ids)) == FILL

    # the newest are kept whole (every field as it was answered), the oldest are the usual 400 and 404
    got = httpx.get(f"{server.url}/v1/responses/{ids[-1]}", headers=auth(), timeout=60).json()
    assert got["metadata"] == METADATA_AT_BOUNDS and got["instructions"] == INSTRUCTIONS
    follow = respond(server, {"previous_response_id": ids[-1], "input": "and?", "instructions": INSTRUCTIONS,
                              "max_output_tokens": 1})
    assert follow["usage"]["input_tokens_details"]["cached_tokens"] > 0, "it went on from the kept conversation"
    r = httpx.post(server.url + "/v1/responses", headers=auth(), timeout=60,
                   json={"previous_response_id": ids[0], "input": "and?", "max_output_tokens": 1})
    assert "send the whole conversation as input" in error_of(r, 400)["message"]
    error_of(httpx.get(f"{server.url}/v1/responses/{ids[0]}", headers=auth(), timeout=60), 404)


def test_only_the_keys_holders_read_or_drop_a_kept_response(server: Server) -> None:
    rid = respond(server, {"input": "hello", "max_output_tokens": 1})["id"]
    at = f"{server.url}/v1/responses/{rid}"
    for wrong in ({}, auth("not-the-key")):
        error_of(httpx.get(at, headers=wrong, timeout=60), 401)
        error_of(httpx.delete(at, headers=wrong, timeout=60), 401)
    assert httpx.get(at, headers=auth(), timeout=60).json()["id"] == rid, "still kept"
    assert httpx.delete(at, headers=auth(KEY), timeout=60).json()["deleted"]
