"""bmoe-server's grammar checks, on threads of their own so that slow grammars hold up no other request.

llama.cpp's parse of a new grammar can take its whole deadline (bmoe.chat.grammar_check says why).
Run where every request is tokenized (the event loop's default executor, min(32, cores + 4)
threads), seven such grammars took every thread on two cores and a plain completion waited 19 s for
them. Here a request's new grammar is parsed on one of `checkers` threads, each with a checker
process of its own; at most `queue` more wait for one, and a grammar past them gets 503
`grammar_checks_full` at once. A grammar that passed before does not wait: an agent's tool list is
checked once, not once per request.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor

from bmoe.chat import Grammar, GrammarCheck
from bmoe.server.http_errors import ServeError

BOUNDS = "bmoe-server --grammar-checks, --grammar-queue"


class GrammarPool:
    """`checkers` threads that check new grammars, and room for `queue` more to wait; each parse is
    bounded by `timeout_s` (a GrammarError naming the grammar's field and --grammar-timeout past it)."""

    def __init__(self, model_path: str, checkers: int, queue: int, timeout_s: float) -> None:
        self.grammars = GrammarCheck(model_path, timeout_s, checkers, bound="bmoe-server --grammar-timeout")
        self.threads = ThreadPoolExecutor(checkers, thread_name_prefix="bmoe-grammar")
        self.bound = checkers + queue
        self.held = 0  # checks running or waiting; changed on the event loop's thread only

    async def check(self, g: Grammar) -> None:
        """Returns once llama.cpp took `g`; GrammarError when it did not (GrammarCheck.check), ServeError 503
        when `bound` checks are running or waiting already."""
        if self.grammars.known(g):
            return
        if self.held >= self.bound:
            raise ServeError(503, f"{self.held} new grammars are being checked or waiting for a check, the server's "
                             f"bound ({BOUNDS}); send it again later", "server_error", "grammar_checks_full")
        loop = asyncio.get_running_loop()
        self.held += 1
        work = self.threads.submit(self.grammars.check, g)

        def release(_: Future[None]) -> None:  # when the check ends, or is cancelled before it starts
            loop.call_soon_threadsafe(self._release)

        work.add_done_callback(release)
        await asyncio.wrap_future(work)

    def _release(self) -> None:
        self.held -= 1

    def close(self) -> None:
        """Drop the waiting checks, let the running ones end (each within its timeout), stop the checkers."""
        self.threads.shutdown(wait=True, cancel_futures=True)
        self.grammars.close()
