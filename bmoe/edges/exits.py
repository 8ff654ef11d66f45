"""How a bmoe process ends: its exit codes, SIGINT/SIGTERM turned into exceptions that reach
the code even mid-decode (seam.deliver parks them on the eval hook, which stops the graph), and a
server's bounded shutdown (`Shutdown`), which a second signal cuts short."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable
from os import _exit as exit_at_once  # no interpreter teardown: nothing waits on a stuck thread
from typing import NoReturn

from bmoe.edges import console

EXIT_OK, EXIT_ERROR, EXIT_SIGINT, EXIT_SIGTERM = 0, 1, 130, 143


def install_signal_handlers() -> None:
    """SIGINT / SIGTERM end the process as KeyboardInterrupt / SystemExit(143), even mid-decode. The seam
    is imported here, by the commands that decode, not with this module: a tool that only reads its
    exit codes loads no llama.cpp."""
    from bmoe import seam

    def on_signal(signum: int, _frame: object) -> None:
        seam.deliver(KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(EXIT_SIGTERM))

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


class Shutdown:
    """A bounded end for a process that serves (bmoe-server), started by its first SIGTERM/SIGINT.

    The first signal calls `begin` (stop taking requests, cancel the generation: the process then
    ends on its own) and starts the clock. If the process is still there `bound` seconds later (a
    generation that does not stop: a read that never comes), or when a second signal comes, it
    ends at once: `release` stops the workers and unlinks the shared memory (Model.release_now,
    which leaves llama.cpp's objects to the exit), and the process exits with the first signal's
    code (143 / 130). Its handlers stay installed until the process ends, so a second signal acts
    wherever the shutdown is waiting.
    """

    def __init__(self, bound: float, begin: Callable[[int], None], release: Callable[[], None], prog: str) -> None:
        self.bound, self.begin, self.release, self.prog = bound, begin, release, prog
        self.code: int | None = None  # the first signal's exit code, once one came

    def install(self) -> None:
        """Take SIGTERM and SIGINT for the rest of the process."""
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)

    def on_signal(self, signum: int, _frame: object) -> None:
        """The first signal starts the shutdown, a second ends it at once (also called by a handler of its own
        that comes first: bmoe-server's drain)."""
        if self.code is not None:
            self.now(f"a second {signal.Signals(signum).name} came")
        self.code = EXIT_SIGINT if signum == signal.SIGINT else EXIT_SIGTERM
        _say(console.notice, f"shutting down ({signal.Signals(signum).name}); it takes {self.bound:g} s at most "
                             "(--shutdown-timeout), a second signal ends it at once")
        timer = threading.Timer(self.bound, self.now, (f"the shutdown did not end within {self.bound:g} s",))
        timer.daemon = True
        timer.start()
        self.begin(signum)

    def now(self, why: str) -> NoReturn:
        """End the process at once (from the signal handler or the clock's thread)."""
        code = self.code if self.code is not None else EXIT_ERROR
        try:
            _say(lambda msg: console.error(msg, self.prog),
                 f"{why}; exiting now (workers stopped, shared memory freed)")
            self.release()
        finally:
            exit_at_once(code)


def _say(write: Callable[[str], None], msg: str) -> None:
    """A line from a signal handler: the signal may have interrupted a write to stderr, and Python
    refuses a write that re-enters it (RuntimeError); the line is lost then, never the shutdown."""
    with contextlib.suppress(RuntimeError, OSError):
        write(msg)
