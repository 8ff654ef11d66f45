"""How long a connection may sit without a request: uvicorn's HTTP protocol (h11) with a deadline for
a request's head.

uvicorn times out an idle keep-alive connection only after a response, and any byte that arrives
restarts its clock: a client that connects and sends nothing, or sends its headers a byte at a time,
holds a connection for ever, and `--max-connections` of them shut every other client out (503). Here
the clock starts when the connection opens (and again after each response) and stops only when a
request's whole head has arrived; past `--idle-timeout` the connection is closed.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeadDeadline(H11Protocol):
    """h11 with a deadline from connecting (or the last response) to a complete request head."""

    deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is in: the request has its answer's time
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self.deadline = self.loop.call_later(self.timeout_keep_alive, self._expired)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expired(self) -> None:
        self.deadline = None
        if self.conn.their_state is h11.IDLE:
            self.timeout_keep_alive_handler()
