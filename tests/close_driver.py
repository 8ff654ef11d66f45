"""Closing a Model while a `stream()` consumer in another thread is decoding, many times over, in a
process of its own (for test_close.py: a crash fails the test instead of killing pytest).

    python -m tests.close_driver thread|exit MODEL TRIES

- thread: each try loads MODEL, starts a consumer thread on a long stream and closes the model from
  this thread at a point the consumer signals (as its stream starts, or after its 1st or 3rd
  chunk). The consumer must get ModelClosed, close() must return True, and nothing may be left:
  no segment of this process under /dev/shm, no child process.
- exit: each try forks a child that loads MODEL, starts the consumer in a daemon thread and, once
  a chunk arrived, lets the interpreter exit with the stream going (Model's finalizer closes it).
  The child must exit 0, not by a signal, leaving no segment and no worker behind.

Prints `ok TRY` per try; the first failure ends the run with a message and exit 1.
"""

from __future__ import annotations

import os
import sys
import threading

import psutil

import bmoe
from bmoe.shm_cache import segments_of

PROMPT = "Once upon a time there was a king who ruled a land of rivers and hills " * 4
FAST = {"cache_mb": 1, "threads": 1, "io_threads": 2}
CLOSE_AFTER = (0, 1, 3)  # chunks the consumer has when the close comes (0: as its stream starts)


def segments(pid: int) -> list[str]:
    return sorted(p.name for p in segments_of(pid))


class Consumer(threading.Thread):
    """Iterates `model.stream` and records how it ended; `reached` is set once it holds `after` chunks."""

    def __init__(self, model: bmoe.Model, after: int, daemon: bool = False) -> None:
        super().__init__(name="consumer", daemon=daemon)
        self.model, self.after = model, after
        self.reached = threading.Event()
        self.outcome = "running"

    def run(self) -> None:
        try:
            chunks = self.model.stream(PROMPT, max_tokens=400)
            if self.after == 0:
                self.reached.set()
            for i, _ in enumerate(chunks, 1):
                if i == self.after:
                    self.reached.set()
            self.outcome = "ended without an error"
        except bmoe.ModelClosed:
            self.outcome = "ModelClosed"
        except BaseException as e:  # noqa: BLE001 - reported by the driver
            self.outcome = f"{type(e).__name__}: {e}"
        finally:
            self.reached.set()


def fail(msg: str) -> None:
    print(f"close-driver: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def close_from_a_thread(model_path: str, tries: int) -> None:
    me = psutil.Process()
    for i in range(tries):
        model = bmoe.load(model_path, **FAST)
        c = Consumer(model, CLOSE_AFTER[i % len(CLOSE_AFTER)])
        c.start()
        c.reached.wait()
        closed = model.close()
        c.join()
        if c.outcome != "ModelClosed" or not closed:
            fail(f"try {i}: the consumer's stream {c.outcome}; close() returned {closed}")
        if segments(os.getpid()) or me.children():
            fail(f"try {i}: left {segments(os.getpid())} and {me.children()}")
        print(f"ok {i}", flush=True)


def exit_mid_stream(model_path: str, tries: int) -> None:
    for i in range(tries):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: load, stream in a daemon thread, exit while it runs
            os.close(r)
            model = bmoe.load(model_path, **FAST)
            os.write(w, " ".join(str(p) for _, p in model.stats.engine.workers).encode())
            os.close(w)
            c = Consumer(model, CLOSE_AFTER[1 + i % 2], daemon=True)
            c.start()
            c.reached.wait()
            sys.exit(0)  # the interpreter's exit, the stream still going
        os.close(w)
        with os.fdopen(r, "rb") as f:
            workers = [int(p) for p in f.read().split()]
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status) or os.waitstatus_to_exitcode(status) != 0:
            fail(f"try {i}: the child ended with {os.waitstatus_to_exitcode(status)} (negative: by that signal)")
        alive = [p for p in workers if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if segments(pid) or len(workers) != 2 or alive:
            fail(f"try {i}: left {segments(pid)}; workers {workers}, alive {alive}")
        print(f"ok {i}", flush=True)


if __name__ == "__main__":
    mode, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    {"thread": close_from_a_thread, "exit": exit_mid_stream}[mode](path, n)
