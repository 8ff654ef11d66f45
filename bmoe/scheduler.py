"""One generation at a time for many clients: a worker thread runs admitted jobs through
bmoe.api.Model.run while a bounded queue waits behind it (bmoe-server's requests).

A job's events go to its `deliver` callable, from the worker thread: each Chunk as it comes,
its Position in the queue when that changes (0: it runs), or an exception that ends it
(ConfigError: the request cannot run; ShuttingDown; GenerationFailed: the engine failed, the
scheduler has stopped). No HTTP here: bmoe.server turns events into responses.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

from bmoe.api import Chunk, GenerationStats, Model, Request
from bmoe.settings import ConfigError


class QueueFull(Exception):
    """`ahead` requests are running or waiting and the queue holds `size`."""

    def __init__(self, ahead: int, size: int) -> None:
        super().__init__(f"{ahead} requests are ahead and the queue holds {size}")
        self.ahead, self.size = ahead, size


class ShuttingDown(Exception):
    """The scheduler stopped: a waiting job never runs, a running one was cancelled."""


class GenerationFailed(Exception):
    """The engine failed mid-generation (a lane, the model file): nothing more can run."""


@dataclass(frozen=True)
class Position:
    """How many requests are ahead of a job; 0: it runs."""

    ahead: int


Event = Chunk | Position | Exception


class Job:
    """One admitted request and where its events go."""

    def __init__(self, req: Request, deliver: Callable[[Event], None]) -> None:
        self.req = req
        self.deliver = deliver


class Scheduler:
    """Runs admitted jobs one at a time on a worker thread; up to `size` wait behind the running one.

    `on_fatal` hears of an engine failure (after which the scheduler is closed), `on_generation`
    of each generation's stats, both on the worker thread.
    """

    def __init__(self, model: Model, size: int, on_fatal: Callable[[BaseException], None],
                 on_generation: Callable[[GenerationStats], None] = lambda s: None,
                 reload_fix: str = "restart to load it again") -> None:
        self.model = model
        self.size = size
        self.on_fatal = on_fatal
        self.on_generation = on_generation
        self.reload_fix = reload_fix
        self.cond = threading.Condition()
        self.waiting: deque[Job] = deque()
        self.running: Job | None = None
        self.closed = False
        self.thread = threading.Thread(target=self._work, name="bmoe-generate", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> int:
        """Queue `job`; returns how many requests are ahead of it. QueueFull or ShuttingDown otherwise."""
        with self.cond:
            if self.closed:
                raise ShuttingDown()
            ahead = len(self.waiting) + (self.running is not None)
            if ahead > self.size:
                raise QueueFull(ahead, self.size)
            self.waiting.append(job)
            self.cond.notify()
            return ahead

    def cancel(self, job: Job) -> None:
        """The client is gone: take `job` out of the queue, or stop its generation now."""
        with self.cond:
            if job in self.waiting:
                self.waiting.remove(job)
                self._positions()
            elif self.running is job:
                self.model.cancel(job.req)

    def close(self) -> None:
        """Stop: what waits ends with ShuttingDown, what runs is cancelled; idempotent."""
        with self.cond:
            self.closed = True
            for job in self.waiting:
                job.deliver(ShuttingDown())
            self.waiting.clear()
            if self.running is not None:
                self.model.cancel(self.running.req)
            self.cond.notify_all()

    def join(self) -> None:
        if self.thread.is_alive():
            self.thread.join()

    def _positions(self) -> None:
        base = self.running is not None
        for i, job in enumerate(self.waiting):
            job.deliver(Position(base + i))

    def _work(self) -> None:
        while True:
            with self.cond:
                while not self.waiting and not self.closed:
                    if not self.cond.wait(timeout=0.5):
                        self.model.engine.follow_memory()  # idle: give memory back if the limits ask
                if self.closed:
                    return
                job = self.running = self.waiting.popleft()
                job.deliver(Position(0))
                self._positions()
            try:
                self.model.engine.check_model_unchanged(self.reload_fix)
                self.on_generation(self.model.run(job.req, job.deliver).stats)
            except ConfigError as e:  # checked at admission; the request's all the same
                job.deliver(e)
            except BaseException as e:  # noqa: BLE001 - a lane or the model file failed: stop serving
                job.deliver(GenerationFailed(f"{type(e).__name__}: {e}"))
                self.on_fatal(e)
                self.close()
                return
            finally:
                with self.cond:
                    self.running = None
