"""Closing a model while it generates: Model.close from another thread, the interpreter's exit with
a stream going, and bmoe-server's shutdown (bounded, a second signal acting).

The Model cases run 50 times each in a process of their own (tests/close_driver.py), so a crash
is a failed test, not a dead pytest; the server case runs a real bmoe-server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import psutil

import bmoe
from tests.conftest import REPO, bmoe_segments, still_running
from tests.test_server import FLAGS, LONG, Server, _first_token, _stream

TRIES = 50


def drive(mode: str, model: object) -> None:
    r = subprocess.run([sys.executable, "-m", "tests.close_driver", mode, str(model), str(TRIES)],
                       capture_output=True, text=True, timeout=900, cwd=REPO,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert r.returncode == 0, f"exit {r.returncode} (negative: killed by that signal)\n{r.stderr[-3000:]}"
    assert r.stdout.split() == [w for i in range(TRIES) for w in ("ok", str(i))]


def test_close_from_another_thread_mid_stream_raises_model_closed_and_frees_everything(small_moe) -> None:
    before = bmoe_segments()
    drive("thread", small_moe)
    assert bmoe_segments() == before


def test_the_interpreter_exiting_mid_stream_closes_the_model_cleanly(small_moe) -> None:
    before = bmoe_segments()
    drive("exit", small_moe)
    assert bmoe_segments() == before


def test_a_closed_model_refuses_new_generations(small_moe) -> None:
    m = bmoe.load(str(small_moe), cache_mb=1, threads=1, io_threads=2)
    assert m.close() and m.close()  # idempotent
    for call in (lambda: m.generate("hello", max_tokens=2), lambda: next(iter(m.stream("hello", max_tokens=2)))):
        try:
            call()
        except bmoe.ModelClosed as e:
            assert "closed" in str(e)
        else:
            raise AssertionError("a closed model generated")


def test_a_second_sigterm_ends_a_stuck_shutdown_at_once_and_frees_the_shared_memory(small_moe) -> None:
    """The lanes are stopped (SIGSTOP) mid-stream, so the running decode waits for reads that do not
    come and the first SIGTERM's cancel cannot stop it; the second SIGTERM ends the process at
    once, well before the --shutdown-timeout bound, with its lanes killed and /dev/shm clean."""
    before = bmoe_segments()
    s = Server("-m", str(small_moe), *FLAGS, "--lane-timeout", "600", "--shutdown-timeout", "600",
               "--drain-seconds", "0")
    lanes = s.workers()
    assert len(lanes) == 2 and bmoe_segments() - before
    with _killed_at_the_end(s, lanes), httpx.Client(timeout=600) as h, _stream(h, s, LONG) as r:
        _first_token(r.iter_lines())
        for lane in lanes:
            lane.suspend()
        s.proc.send_signal(signal.SIGTERM)
        _said(s, "shutting down")
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        rc = s.proc.wait(600)
        took = time.monotonic() - t0
    assert rc == 143, s.stderr
    assert took < 300, f"the second SIGTERM took {took:.0f} s to end the process"
    assert bmoe_segments() == before
    assert not still_running(lanes)


def test_a_stuck_shutdown_ends_at_its_bound_and_frees_the_shared_memory(small_moe) -> None:
    """As above with one SIGTERM: the process ends once --shutdown-timeout has passed, not when the
    stuck read would have (the lanes' 600 s --lane-timeout). Where the cancel stops the decode
    between two reads, the model's close is what is stuck (waiting on the stopped lanes); the bound
    must free the shared memory then too (CI caught it leaking the slab's name 4 runs in 10)."""
    before = bmoe_segments()
    s = Server("-m", str(small_moe), *FLAGS, "--lane-timeout", "600", "--shutdown-timeout", "2",
               "--drain-seconds", "0")
    lanes = s.workers()
    with _killed_at_the_end(s, lanes), httpx.Client(timeout=600) as h, _stream(h, s, LONG) as r:
        _first_token(r.iter_lines())
        for lane in lanes:
            lane.suspend()
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        rc = s.proc.wait(600)
        took = time.monotonic() - t0
    assert rc == 143, s.stderr
    assert 2 <= took < 300, f"the shutdown took {took:.0f} s"
    assert "did not end within 2 s" in s.stderr
    assert bmoe_segments() == before, s.stderr
    assert not still_running(lanes)


def _said(s: Server, text: str) -> None:
    """Wait (as long as it takes) until the server's stderr, read on the Server's own thread, holds `text`."""
    while text not in s.stderr:
        assert s.proc.poll() is None, s.stderr
        time.sleep(0.01)


@contextlib.contextmanager
def _killed_at_the_end(s: Server, lanes: list[psutil.Process]) -> Iterator[None]:
    """A test that fails in the block leaves no stuck server, nor lanes stopped for good (SIGKILL ends
    a stopped process too); one that passes leaves them to the checks after it."""
    try:
        yield
    except BaseException:
        for p in lanes:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        s.proc.kill()
        s.proc.wait()
        raise
