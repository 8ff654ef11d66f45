"""Closing a model while it generates: Model.close from another thread, and the interpreter's exit
with a stream going.

Each case runs 50 times in a process of its own (tests/close_driver.py), so a crash is a failed
test, not a dead pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys

import bmoe
from tests.conftest import REPO, bmoe_segments

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
