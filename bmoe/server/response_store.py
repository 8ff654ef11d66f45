"""The responses `POST /v1/responses` keeps for `previous_response_id` and `GET /v1/responses/{id}`.

Its bound is on memory, not on a proxy for it (issue 50): a kept response is held as the compact JSON
bytes of everything kept (the whole Response object, the conversation to go on from) and decoded when
it is used, so what the store counts (`held`) is what it holds. Python objects cost 10-20 times their
JSON, and a proxy that counted only part of the fields let 60 requests grow the server by 200 MiB past
a 32 MiB bound. Each entry also costs ENTRY_BYTES besides its two byte strings (its id, the pair, the
dict's slot and ordering node), checked against tracemalloc by tests/test_response_store.py.

The ids are `resp_`, a uuid4 and the replica's name (bmoe.server.replica): 122 bits from the system's random
source: a response can be read, continued or dropped only by a client that was given its id, and no route
lists them. Every client with the key (or, without a key, every client the server answers) shares the one
store; docs/server.md's Security section says what that means.

This in-memory store is the default; `--response-store sqlite:PATH` (bmoe.server.response_sqlite) keeps them in
a file the replicas on one machine share, `redis://...` (bmoe.server.response_redis) in a Redis server replicas
on several machines share, across restarts. Each is a `KeptResponses`, all the routes know of a store. The routes
call a store off the event loop (on asyncio's threads: a shared store's call can wait seconds for another replica's
write), so every store is safe to call from several threads at once.
"""

from __future__ import annotations

import abc
import json
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

from bmoe.server.http_errors import ServeError

KEPT = 100  # responses kept at most (--store-responses)
KEPT_MB = 32  # MiB they take together at most (--store-responses-mb)
ENTRY_BYTES = 512  # what an entry costs besides its two byte strings' own size
TTL_S = 30 * 86400  # a shared store's --store-responses-ttl default: as long as OpenAI keeps a stored response


def encoded(value: Any) -> bytes:
    """`value` as the compact JSON bytes a store keeps."""
    # surrogatepass: a lone surrogate a client sent (JSON's "\ud800") is kept as it came
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def decoded(blob: bytes) -> Any:
    return json.loads(blob.decode("utf-8", "surrogatepass"))


def not_kept(rid: str, param: str, which: str) -> ServeError:
    """`rid` is not in the store (`which`: what the store keeps, in its words): for previous_response_id
    (`param`) a 400, for GET and DELETE a 404."""
    return ServeError(400 if param else 404, f"{param or 'the response'}: {rid!r} is not among the responses this "
                      f"server keeps ({which}); send the whole conversation as input instead",
                      param=param or None, code=None if param else "not_found")


class KeptResponses(Protocol):
    """A store of responses, as the routes use it (bmoe.server.app, responses_wire): in memory (ResponseStore) or
    shared by replicas (bmoe.server.response_sqlite, bmoe.server.response_redis)."""

    @property
    def held(self) -> int:
        """The bytes it counts against its bound."""

    def keep(self, response: dict[str, Any], items: Sequence[dict[str, Any]]) -> bool:
        """Keeps `response` and its conversation under the response's id; False when it is not kept."""

    def items(self, rid: str) -> list[dict[str, Any]]:
        """The conversation of `rid` to go on from (400 naming previous_response_id when it is not kept)."""

    def get(self, rid: str) -> dict[str, Any]:
        """The Response object of `rid` (404 when it is not kept)."""

    def drop(self, rid: str) -> None:
        """Forgets `rid` (404 when it is not kept)."""

    def __len__(self) -> int:
        """Responses kept."""

    def close(self) -> None:
        """Lets go of what the store holds open (nothing is lost: a shared store's file stays)."""


class SharedStore(abc.ABC):
    """What the stores replicas share have in common (bmoe.server.response_sqlite, bmoe.server.response_redis): each
    response kept as two JSON blobs (`items`, `response`) counted by their bytes and its id's, within `most`
    responses and `bound` bytes (`which`: those bounds in words, for a 404); a subclass stores them (`_put`),
    finds one marking it used (`_blob`) and removes one (`_remove`)."""

    most: int
    bound: int
    which: str

    @abc.abstractmethod
    def _put(self, rid: str, items: bytes, response: bytes, size: int) -> None:
        """Stores a response's blobs, then drops the expired and the least recently used past the bounds."""

    @abc.abstractmethod
    def _blob(self, rid: str, field: str) -> bytes | None:
        """`field` (items or response) of the live response `rid`, marked used now; None when it is not kept."""

    @abc.abstractmethod
    def _remove(self, rid: str) -> bool:
        """Removes the live response `rid`; False when it is not kept."""

    def keep(self, response: dict[str, Any], items: Sequence[dict[str, Any]]) -> bool:
        """Keeps `response` and its conversation `items`, dropping the expired and then the least recently used
        past the bounds; False when it is not kept."""
        rid = response["id"]
        blobs = (encoded(list(items)), encoded(response))
        size = len(blobs[0]) + len(blobs[1]) + len(rid)
        if self.most == 0 or size > self.bound:
            return False
        self._put(rid, *blobs, size)
        return True

    def _find(self, rid: str, param: str, field: str) -> bytes:
        blob = self._blob(rid, field)
        if blob is None:
            raise not_kept(rid, param, self.which)
        return blob

    def items(self, rid: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = decoded(self._find(rid, "previous_response_id", "items"))
        return items

    def get(self, rid: str) -> dict[str, Any]:
        response: dict[str, Any] = decoded(self._find(rid, "", "response"))
        return response

    def drop(self, rid: str) -> None:
        if not self._remove(rid):
            raise not_kept(rid, "", self.which)


class ResponseStore:
    """At most `most` responses taking `bound` bytes together, each held as (items, response) JSON bytes,
    the least recently used dropped first; one larger than `bound` alone is not kept. Its calls hold `lock`:
    the routes make them from asyncio's threads."""

    def __init__(self, most: int = KEPT, bound: int = KEPT_MB << 20) -> None:
        self.most, self.bound = most, bound
        self.lock = threading.Lock()
        self.kept: OrderedDict[str, tuple[bytes, bytes]] = OrderedDict()
        self.held = 0  # bytes, every entry's size() together

    @staticmethod
    def size(entry: tuple[bytes, bytes]) -> int:
        """What an entry takes: its byte strings as Python holds them, and ENTRY_BYTES."""
        return sys.getsizeof(entry[0]) + sys.getsizeof(entry[1]) + ENTRY_BYTES

    def keep(self, response: dict[str, Any], items: Sequence[dict[str, Any]]) -> bool:
        """Keeps `response` and its conversation `items` (what a follow-up goes on from) under the
        response's id, dropping the least recently used past the bounds; False when it is not kept."""
        entry = (encoded(list(items)), encoded(response))
        n = self.size(entry)
        if self.most == 0 or n > self.bound:
            return False
        with self.lock:
            self.kept[response["id"]] = entry
            self.held += n
            while len(self.kept) > self.most or self.held > self.bound:
                self.held -= self.size(self.kept.popitem(last=False)[1])
        return True

    def _find(self, rid: str, param: str, take: bool = False) -> tuple[bytes, bytes]:
        """The entry of `rid`, marked used (`take`: removed)."""
        with self.lock:
            entry = self.kept.pop(rid, None) if take else self.kept.get(rid)
            if entry is not None and take:
                self.held -= self.size(entry)
            elif entry is not None:
                self.kept.move_to_end(rid)
        if entry is None:
            raise not_kept(rid, param, f"the last {self.most} stored, {self.bound / 2**20:g} MiB at most, in memory: "
                                       "none from before a restart")
        return entry

    def items(self, rid: str) -> list[dict[str, Any]]:
        """The conversation of response `rid`, to go on from (400 when it is not kept)."""
        items: list[dict[str, Any]] = decoded(self._find(rid, "previous_response_id")[0])
        return items

    def get(self, rid: str) -> dict[str, Any]:
        """The Response object of `rid` as it was answered (404 when it is not kept)."""
        response: dict[str, Any] = decoded(self._find(rid, "")[1])
        return response

    def drop(self, rid: str) -> None:
        """Forgets `rid` (404 when it is not kept)."""
        self._find(rid, "", take=True)

    def __len__(self) -> int:
        return len(self.kept)

    def close(self) -> None:
        """Nothing to let go of: the responses go with the process."""
