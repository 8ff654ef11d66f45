"""`--sleep-idle-seconds N`: llama-server's sleep mode. After N seconds with no request that needs the model
in flight or queued, the model is released (bmoe.api.Model.sleep: the engine closed as at shutdown, nothing
left in /dev/shm), so a server left running on a phone hands its memory back; the next request that needs
it loads it again with the same settings (Model.wake) before it runs, concurrent ones waiting for that one
load.

Which requests need the model is said where the routes are declared (bmoe.server.app: `awake` among a
route's dependencies); /health, /props (its `is_sleeping`), /models, /metrics and the events feed answer
without waking it. The sleep itself is decided on the scheduler's thread when it is idle
(Scheduler.on_idle), so it never closes the engine under a step.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable

from bmoe.api import Model
from bmoe.base import BmoeError
from bmoe.server.http_errors import ServeError, shutting_down

WAKE_FIX = "the model could not be loaded again after sleeping (bmoe-server --sleep-idle-seconds)"


class Sleep:
    """When `model` sleeps and wakes: `idle_s` seconds after its last user left (None: never); `before`
    runs first (what must be read from the model while it is loaded), `closed` says the server is stopping
    (no wake then)."""

    def __init__(self, model: Model, idle_s: float | None, before: Callable[[], object] = lambda: None,
                 closed: Callable[[], bool] = lambda: False, clock: Callable[[], float] = time.monotonic) -> None:
        self.model, self.idle_s, self.before, self.closed, self.clock = model, idle_s, before, closed, clock
        self.cond = threading.Condition()
        self.users = 0  # requests in flight that need the model
        self.last = clock()  # when the last one left (or the server started)
        self.changing = False  # a sleep or a wake is under way

    async def awake(self) -> AsyncIterator[None]:
        """A route's dependency: the model is loaded (woken if asleep) and stays so until the response ends."""
        with self.cond:
            self.users += 1
        try:
            await asyncio.to_thread(self._wake)
            yield
        finally:
            with self.cond:
                self.users -= 1
                self.last = self.clock()

    def _wake(self) -> None:
        """Wait out a sleep or wake under way; load the model if it sleeps (one request loads, the rest wait)."""
        with self.cond:
            while self.changing:
                self.cond.wait()
            if not self.model.asleep:
                return
            if self.closed():
                raise shutting_down()
            self.changing = True
        try:
            t0 = time.perf_counter()
            self.model.wake()
            self.model.notice(f"awake: the model loaded again in {time.perf_counter() - t0:.1f} s")
        except (BmoeError, OSError) as e:
            raise ServeError(503, f"{WAKE_FIX}: {e}", "server_error", code="model_not_loaded") from None
        finally:
            with self.cond:
                self.changing = False
                self.last = self.clock()
                self.cond.notify_all()

    def idle(self) -> None:
        """The scheduler is idle (on its thread): sleep when nobody has needed the model for idle_s seconds;
        else, awake, let an adaptive cache budget follow the room (Model.follow_memory)."""
        with self.cond:
            due = (self.idle_s is not None and not self.users and not self.changing and not self.model.asleep
                   and self.clock() - self.last >= self.idle_s)
            if due:
                self.changing = True
        if not due:
            self.model.follow_memory()
            return
        try:
            self.before()
            self.model.sleep()
            self.model.notice(f"sleeping: the model released after {self.idle_s:g} s idle; the next request that "
                              "needs it loads it again")
        finally:
            with self.cond:
                self.changing = False
                self.cond.notify_all()
