"""The Responses stores replicas share (issue 53): `--response-store sqlite:PATH` (bmoe.server.response_sqlite) and
`redis://HOST:PORT/DB` (bmoe.server.response_redis), each held to the same rules. Two stores on one place, as two
replicas open it, see each other's responses; a store opened again (a replica's restart) finds them; the bounds
(count, bytes) drop the least recently used, whichever replica used it; a response expires after its ttl; three
processes keeping and reading at once (every read a write too: it marks the response used) lose none and fail
none, which needs each SQLite transaction to take the write lock at its start; a place that cannot be used is a
ConfigError naming it. SQLite's file is its owner's only. Redis runs as Debian's `redis-server` on a free
loopback port (tests/conftest.py's `redis_url`); its cases skip, saying why, where it or the `redis` client
(`pip install 'bmoe[redis]'`) is missing."""

from __future__ import annotations

import multiprocessing
import os
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bmoe.base import ConfigError
from bmoe.server.http_errors import ServeError
from bmoe.server.response_redis import RedisResponses
from bmoe.server.response_sqlite import SqliteResponses
from bmoe.server.response_store import TTL_S
from tests.test_response_store import conversation, response

Store = SqliteResponses | RedisResponses


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        self.now += 1  # every operation is later than the one before
        return self.now


def opened(place: str, most: int = 10, bound: int = 1 << 20, ttl: float = TTL_S,
           clock: Callable[[], float] = time.time) -> Store:
    """The store at `place` (sqlite:PATH or a Redis URL), as bmoe-server opens it."""
    if place.startswith("sqlite:"):
        return SqliteResponses(place.removeprefix("sqlite:"), most, bound, ttl, clock)
    return RedisResponses(place, most, bound, ttl, clock)


@pytest.fixture(params=["sqlite", "redis"])
def places(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[int], str]:
    """places(n): the n-th place of its kind, empty."""
    if request.param == "sqlite":
        return lambda n: f"sqlite:{tmp_path / f'r{n}.db'}"
    url = request.getfixturevalue("redis_url")
    import redis

    def place(n: int) -> str:
        redis.Redis.from_url(f"{url}/{n}").flushdb()
        return f"{url}/{n}"

    return place


def test_two_stores_on_one_place_share_their_responses_and_it_outlives_them(places: Callable[[int], str]) -> None:
    place = places(0)
    a, b = opened(place), opened(place)
    r = response(metadata={"k": "\ud800 lone surrogate, kept as it came"})
    assert a.keep(r, conversation(3))
    assert b.get(r["id"]) == r and b.items(r["id"]) == conversation(3)
    assert len(a) == len(b) == 1 and a.held == b.held > len(r["id"])
    b.drop(r["id"])
    with pytest.raises(ServeError) as e:
        a.items(r["id"])
    assert e.value.status == 400 and e.value.param == "previous_response_id"
    assert "send the whole conversation as input" in e.value.message
    kept = response()
    a.keep(kept, conversation(1))
    a.close()
    b.close()
    again = opened(place)  # a replica's restart
    assert again.get(kept["id"]) == kept
    again.close()
    if place.startswith("sqlite:"):
        path = place.removeprefix("sqlite:")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, "conversations: the owner's only"


def test_the_bounds_drop_the_least_recently_used_by_any_store(places: Callable[[int], str]) -> None:
    place, clock = places(0), Clock()
    a, b = opened(place, 3, clock=clock), opened(place, 3, clock=clock)
    rs = [response() for _ in range(5)]
    for r in rs[:3]:
        a.keep(r, conversation(2))
    b.items(rs[0]["id"])  # read on the other replica: used most recently now
    a.keep(rs[3], conversation(2))
    assert [_kept(b, r) for r in rs[:4]] == [True, False, True, True]
    size = a.held // 3
    small = opened(places(1), 100, 2 * size + size // 2, clock=clock)  # room for 2
    for r in rs[:4]:
        assert small.keep(r, conversation(2))
    assert [_kept(small, r) for r in rs[:4]] == [False, False, True, True] and small.held <= 2 * size + size // 2
    assert not small.keep(response(metadata={"big": "x" * (3 * size)}), []), "larger than the bound: not kept"
    assert not opened(places(2), 0).keep(rs[4], []), "--store-responses 0"


def test_a_response_expires_after_its_ttl(places: Callable[[int], str]) -> None:
    clock = Clock()
    store = opened(places(0), ttl=100, clock=clock)
    old, new = response(), response()
    store.keep(old, [])
    clock.now += 50
    store.keep(new, [])
    assert store.get(old["id"]) == old
    before = store.held
    clock.now += 60  # past old's ttl, not new's; reading old did not extend it
    assert not _kept(store, old) and _kept(store, new) and len(store) == 1
    assert store.held == before // 2, "its bytes are counted no more"
    with pytest.raises(ServeError) as e:
        store.drop(old["id"])
    assert e.value.status == 404


def test_a_place_that_cannot_be_used_is_a_config_error_naming_it(tmp_path: Path) -> None:
    for path in (tmp_path / "missing" / "r.db", tmp_path):
        with pytest.raises(ConfigError, match="cannot use it as a store"):
            SqliteResponses(str(path), 10, 1 << 20)
    pytest.importorskip("redis", reason="the redis client is not installed: pip install 'bmoe[redis]'")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"redis://127.0.0.1:{s.getsockname()[1]}/0"  # nothing listens there
    with pytest.raises(ConfigError, match=f"--response-store {closed}: cannot use it as a store"):
        RedisResponses(closed, 10, 1 << 20)


def _keep_many(place: str, who: int, n: int) -> None:
    store = opened(place, 10_000, 64 << 20)
    for i in range(n):
        assert store.keep(response(id=f"resp_{who}_{i}"), conversation(2))
        assert store.items(f"resp_{who}_{i}") == conversation(2)  # a read that marks it used: a write too
    store.close()


def test_processes_writing_and_reading_at_once_lose_no_response(places: Callable[[int], str]) -> None:
    place, n = places(0), 500
    ctx = multiprocessing.get_context("fork")  # a copy of this process: nothing to import again
    procs = [ctx.Process(target=_keep_many, args=(place, who, n)) for who in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    store = opened(place, 10_000, 64 << 20)
    assert len(store) == 3 * n and store.get(f"resp_2_{n - 1}")["id"] == f"resp_2_{n - 1}"


def _kept(store: Store, r: dict[str, Any]) -> bool:
    try:
        return store.get(r["id"]) == r
    except ServeError as e:
        assert e.status == 404
        return False
