"""A request's jobs on their way through the scheduler as the event loop sees them: submitted with one queue
their events arrive on, each tagged with its job's index (`enqueue`), and awaited until they answer or their
client leaves (`answered`). The generation routes' whole answers (one job, or one per choice: `n`, several
prompts) and the embeddings routes take this one path."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TypeVar

from fastapi import Request as HttpRequest

from bmoe.api import Request
from bmoe.server.http_errors import QueueFull, ServeError, ShuttingDown, serve_error
from bmoe.server.scheduler import EmbedAsk, Job, JobEvent, Scheduler

_T = TypeVar("_T")
Tagged = tuple[int, JobEvent]  # an event and the index of the job it is for


def enqueue(sched: Scheduler, reqs: Sequence[Request | EmbedAsk], param: str = "n"
            ) -> tuple[list[Job], asyncio.Queue[Tagged], int]:
    """`reqs` submitted as jobs, in order: the jobs, the queue their events arrive on (from the scheduler's
    thread, tagged with the job's index), and the requests ahead of the first; a full queue or a shutdown as its
    ServeError (the jobs already submitted are taken back). More jobs than the server holds at once (its KV
    sequences and its queue) could never be admitted: a 400 naming `param`, the field that asked for them."""
    most = sched.capacity + sched.size
    if len(reqs) > most:
        raise ServeError(400, f"{param}: {len(reqs)} answers in one request; this server holds {most} requests at "
                         "once (bmoe-server --parallel plus --queue)", param=param)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Tagged] = asyncio.Queue()
    jobs: list[Job] = []

    def delivering(i: int) -> Callable[[JobEvent], None]:
        def deliver(item: JobEvent) -> None:  # on the scheduler's thread
            loop.call_soon_threadsafe(events.put_nowait, (i, item))
        return deliver

    ahead = 0
    try:
        for i, req in enumerate(reqs):
            job = Job(req, delivering(i))
            waiting = sched.submit(job)
            jobs.append(job)
            ahead = waiting if i == 0 else ahead
    except (QueueFull, ShuttingDown) as e:
        for job in jobs:
            sched.cancel(job)
        raise serve_error(e) from None
    return jobs, events, ahead


async def answered(request: HttpRequest, sched: Scheduler, jobs: Sequence[Job], events: asyncio.Queue[Tagged],
                   took: Callable[[int, JobEvent], _T | None]) -> _T:
    """The jobs' events handed to `took` (with their job's index) until it returns the answer; a failure as its
    ServeError (the other jobs cancelled), and a client that leaves cancels them all (a 499)."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while True:
            get = asyncio.ensure_future(events.get())
            await asyncio.wait((get, gone), return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                raise ServeError(499, "the client closed the connection", code="client_gone")
            i, item = get.result()
            if isinstance(item, Exception):
                raise serve_error(item)
            if (answer := took(i, item)) is not None:
                return answer
    except BaseException:
        for job in jobs:
            sched.cancel(job)
        raise
    finally:
        gone.cancel()


async def _disconnected(request: HttpRequest) -> None:
    """Returns when the client has gone (the body is read: nothing else comes before that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
