"""`--response-store sqlite:PATH`: the Responses API's kept responses in an SQLite file that the replicas on one
machine share, so a `previous_response_id` goes on on whichever replica the router picks, and a replica's
restart loses none (docs/deploy.md).

The file is SQLite's own format through the standard library (no server to run): in WAL mode (readers never
wait for the writer; several processes may use it at once; not on a network file system, where SQLite's
locks do not hold: one store per machine, or Redis for several), each store operation one short transaction
(a write waits up to BUSY_S for another process's, then is a 503). It holds what the in-memory store holds
(bmoe.server.response_store: each response's conversation and Response object as compact JSON), under the
same bounds: at most `most` responses taking `bound` bytes of JSON (and their ids) together, the least
recently used (kept or read, by any replica) dropped first, one larger than `bound` alone not kept; and each
expires `ttl` seconds after it was kept. The file itself is that plus SQLite's pages and its write-ahead log
(checkpointed as it goes; cut back to JOURNAL_LIMIT), and keeps its largest size, reusing freed pages.

It is made readable and writable by its owner only (it holds conversations); the replicas sharing it run as
that user. The operations take a millisecond or so, but a write waits while another replica writes (up to
BUSY_S): the routes call them off the event loop (bmoe.server.response_store), under a lock, so the routes'
threads share the one connection; the metrics' counts read on a second one.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator

from bmoe.base import ConfigError
from bmoe.server.http_errors import ServeError
from bmoe.server.response_store import TTL_S, SharedStore

TABLE = "bmoe_responses_v1"  # a later layout gets a table of its own name
BUSY_S = 5.0  # how long a write waits for another process's
JOURNAL_LIMIT = 64 << 20  # bytes the write-ahead log is cut back to after a checkpoint

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    id TEXT PRIMARY KEY, items BLOB NOT NULL, response BLOB NOT NULL,
    size INTEGER NOT NULL, used REAL NOT NULL, expires REAL NOT NULL);
CREATE INDEX IF NOT EXISTS {TABLE}_used ON {TABLE} (used);
"""


class SqliteResponses(SharedStore):
    """The kept responses in the SQLite file at `path` (made if missing), within `most` responses and `bound`
    bytes, each for `ttl` seconds (`clock`: wall time, which every process sharing the file reads alike)."""

    def __init__(self, path: str, most: int, bound: int, ttl: float = TTL_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.path, self.most, self.bound, self.ttl, self.clock = path, most, bound, ttl, clock
        self.lock, self.counting = threading.Lock(), threading.Lock()
        self.which = f"the last {most} stored in {path}, {bound / 2**20:g} MiB at most, each for {ttl:g} s"
        try:
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))  # private before SQLite writes a byte
            self.db = sqlite3.connect(path, timeout=BUSY_S, isolation_level=None, check_same_thread=False)
            mode = self.db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode != "wal":
                raise sqlite3.OperationalError(f"it cannot be put in WAL mode (it is in {mode!r} mode)")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute(f"PRAGMA journal_size_limit={JOURNAL_LIMIT}")
            self.db.executescript(_SCHEMA)
            self.counts = sqlite3.connect(path, timeout=BUSY_S, isolation_level=None, check_same_thread=False)
        except (OSError, sqlite3.Error) as e:
            raise ConfigError(f"--response-store sqlite:{path}: cannot use it as a store ({e}); give a writable file "
                              "on a local disk") from None

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (taken at once: BEGIN IMMEDIATE); an SQLite error is a 503 naming the file."""
        with self.lock:
            try:
                self.db.execute("BEGIN IMMEDIATE")
                try:
                    yield self.db
                except BaseException:
                    self.db.execute("ROLLBACK")
                    raise
                self.db.execute("COMMIT")
            except sqlite3.Error as e:
                raise ServeError(503, f"the response store (SQLite, {self.path}) failed: {e}; send the request "
                                 "again", "server_error", "store_unavailable") from None

    def _put(self, rid: str, items: bytes, response: bytes, size: int) -> None:
        now = self.clock()
        with self._transaction() as db:
            db.execute(f"DELETE FROM {TABLE} WHERE expires <= ?", (now,))
            db.execute(f"INSERT OR REPLACE INTO {TABLE} VALUES (?, ?, ?, ?, ?, ?)", (rid, items, response, size, now,
                                                                                      now + self.ttl))
            count, total = db.execute(f"SELECT count(*), total(size) FROM {TABLE}").fetchone()
            gone = []
            for old, n in db.execute(f"SELECT id, size FROM {TABLE} ORDER BY used, id"):
                if count <= self.most and total <= self.bound:
                    break
                gone.append((old,))
                count, total = count - 1, total - n
            db.executemany(f"DELETE FROM {TABLE} WHERE id = ?", gone)

    def _blob(self, rid: str, field: str) -> bytes | None:
        now = self.clock()
        with self._transaction() as db:
            row = db.execute(f"SELECT {field} FROM {TABLE} WHERE id = ? AND expires > ?", (rid, now)).fetchone()
            if row is not None:
                db.execute(f"UPDATE {TABLE} SET used = ? WHERE id = ?", (now, rid))
        return None if row is None else bytes(row[0])

    def _remove(self, rid: str) -> bool:
        with self._transaction() as db:
            return bool(db.execute(f"DELETE FROM {TABLE} WHERE id = ? AND expires > ?", (rid, self.clock())).rowcount)

    def _total(self, what: str) -> int:
        """A count for the metrics, on a connection of its own: a reader never waits for a write in WAL mode, so
        a scrape does not wait behind a route's write that waits for another replica's."""
        with self.counting:
            row = self.counts.execute(f"SELECT {what} FROM {TABLE} WHERE expires > ?", (self.clock(),)).fetchone()
            return int(row[0])

    @property
    def held(self) -> int:
        return self._total("total(size)")

    def __len__(self) -> int:
        return self._total("count(*)")

    def close(self) -> None:
        with self.lock, self.counting:
            self.db.close()
            self.counts.close()
