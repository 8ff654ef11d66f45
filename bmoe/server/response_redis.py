"""`--response-store redis://HOST:PORT/DB`: the Responses API's kept responses in Redis, which replicas on several
machines share (docs/deploy.md), as replicas on one machine share bmoe.server.response_sqlite's file. It needs
the `redis` client (`pip install 'bmoe[redis]'`) and a Redis server (Debian's `redis-server`).

It keeps what the other stores keep (bmoe.server.response_store: each response's conversation and Response
object as compact JSON) under the same bounds: at most `most` responses taking `bound` bytes of JSON (and their
ids) together, the least recently used (kept or read, by any replica) dropped first, one larger than `bound`
alone not kept; each expires `ttl` seconds after it was kept. Each operation is one Lua script, so replicas
that keep, read and drop at once see one order of them. Under the key prefix `bmoe:responses:` it holds a hash
per response (`r:<id>`: items, response) and three indexes: `used` and `expires` (sorted sets of the ids by last
use and by expiry) and `sizes` (a hash of each id's bytes, whose sum is `total`). A single Redis server (the
scripts name keys they build, which Redis Cluster does not route). Time is the replicas' wall clock, as for the
SQLite file. An operation waits at most TIMEOUT_S for Redis, then the request gets 503.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bmoe.base import ConfigError
from bmoe.server.http_errors import ServeError
from bmoe.server.response_store import TTL_S, SharedStore

KEY_PREFIX = "bmoe:responses:"
TIMEOUT_S = 5.0

# drop(id): one response and its index entries; purge(now): every expired one
_LIB = """
local p = ARGV[1]
local function drop(id)
  local size = tonumber(redis.call('HGET', p .. 'sizes', id) or '0')
  redis.call('DEL', p .. 'r:' .. id)
  redis.call('ZREM', p .. 'used', id)
  redis.call('ZREM', p .. 'expires', id)
  redis.call('HDEL', p .. 'sizes', id)
  redis.call('DECRBY', p .. 'total', size)
end
local function purge(now)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', p .. 'expires', '-inf', now)) do drop(id) end
end
local function live(id, now)
  local at = redis.call('ZSCORE', p .. 'expires', id)
  return at and tonumber(at) > now
end
"""
# ARGV: prefix, now, id, items, response, size, ttl, most, bound
_KEEP = _LIB + """
local now, id, size = tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[6])
purge(now)
if redis.call('HEXISTS', p .. 'sizes', id) == 1 then drop(id) end
redis.call('HSET', p .. 'r:' .. id, 'items', ARGV[4], 'response', ARGV[5])
redis.call('ZADD', p .. 'used', now, id)
redis.call('ZADD', p .. 'expires', now + tonumber(ARGV[7]), id)
redis.call('HSET', p .. 'sizes', id, size)
redis.call('INCRBY', p .. 'total', size)
while redis.call('ZCARD', p .. 'used') > tonumber(ARGV[8]) or
      tonumber(redis.call('GET', p .. 'total')) > tonumber(ARGV[9]) do
  drop(redis.call('ZRANGE', p .. 'used', 0, 0)[1])
end
"""
# ARGV: prefix, now, id, field: the field of a live response, marked used now; false when none
_FIND = _LIB + """
local now, id = tonumber(ARGV[2]), ARGV[3]
if not live(id, now) then return false end
redis.call('ZADD', p .. 'used', now, id)
return redis.call('HGET', p .. 'r:' .. id, ARGV[4])
"""
# ARGV: prefix, now, id: 1 when a live response was dropped
_DROP = _LIB + """
local now, id = tonumber(ARGV[2]), ARGV[3]
if not live(id, now) then return 0 end
drop(id)
return 1
"""
# ARGV: prefix, now: {responses, bytes} once the expired are gone
_COUNT = _LIB + """
purge(tonumber(ARGV[2]))
return {redis.call('ZCARD', p .. 'used'), tonumber(redis.call('GET', p .. 'total') or '0')}
"""


class RedisResponses(SharedStore):
    """The kept responses in the Redis server at `url` (redis://HOST:PORT/DB), within `most` responses and `bound`
    bytes, each for `ttl` seconds (`clock`: wall time, which every replica reads alike)."""

    def __init__(self, url: str, most: int, bound: int, ttl: float = TTL_S,
                 clock: Callable[[], float] = time.time) -> None:
        try:
            import redis  # the redis extra: imported only by a server that uses Redis
        except ImportError:
            raise ConfigError(f"--response-store {url}: the redis client is missing; install it: pip install "
                              "'bmoe[redis]'") from None
        self.failed: tuple[type[Exception], ...] = (redis.RedisError,)
        self.url, self.most, self.bound, self.ttl, self.clock = url, most, bound, ttl, clock
        self.which = f"the last {most} stored in Redis, {bound / 2**20:g} MiB at most, each for {ttl:g} s"
        try:
            self.db = redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
            self.db.ping()
            self.scripts = {name: self.db.register_script(code) for name, code in
                            (("keep", _KEEP), ("find", _FIND), ("drop", _DROP), ("count", _COUNT))}
        except (redis.RedisError, ValueError) as e:
            raise ConfigError(f"--response-store {url}: cannot use it as a store ({e}); give the URL of a running "
                              "Redis server, e.g. redis://127.0.0.1:6379/0") from None

    def _run(self, name: str, *args: Any) -> Any:
        """One script, atomic in Redis; a Redis error is a 503."""
        try:
            return self.scripts[name](args=[KEY_PREFIX, self.clock(), *args])
        except self.failed as e:
            raise ServeError(503, f"the response store (Redis) failed: {e}; send the request again", "server_error",
                             "store_unavailable") from None

    def _put(self, rid: str, items: bytes, response: bytes, size: int) -> None:
        self._run("keep", rid, items, response, size, self.ttl, self.most, self.bound)

    def _blob(self, rid: str, field: str) -> bytes | None:
        blob = self._run("find", rid, field)
        assert blob is None or isinstance(blob, bytes)
        return blob

    def _remove(self, rid: str) -> bool:
        return bool(self._run("drop", rid))

    @property
    def held(self) -> int:
        return int(self._run("count")[1])

    def __len__(self) -> int:
        return int(self._run("count")[0])

    def close(self) -> None:
        self.db.close()
