"""SIGINT/SIGTERM at every point of a run: load, warm-up capture, spec-gate start, prefill, session idle.

Each must end with the conventional exit code (130 / 143), no shared memory left in /dev/shm and no
worker process alive. tests/signal_driver.py sends the signal at a known point; the decode case is in
test_cli.py and the mid-generation session case in test_session.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from bmoe.base import telemetry
from bmoe.edges.session_client import SessionClient
from tests.conftest import REPO, bmoe_segments, still_running

PROMPT = "The lighthouse keeper wrote in his log every night about the ships and the weather " * 12
SIGNALS = [("SIGTERM", 143), ("SIGINT", 130)]
WORKERS = ("bmoe.workers.io_lane", "bmoe.workers.spec_gate")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, small_moe) -> str:
    """A copy under a name of its own: a worker still running after the test is found by it."""
    src = small_moe
    dst = tmp_path_factory.mktemp("signals") / "signals-model.gguf"
    dst.write_bytes(Path(src).read_bytes())
    return str(dst)


def workers_of(model: str) -> list[psutil.Process]:
    """Worker processes (anyone's child, or orphans) running on this model file."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or ())
        if model in cmd and any(w in cmd for w in WORKERS):
            out.append(p)
    return out


def driver_pids(stderr: str, phase: str) -> list[int]:
    line = next(x for x in stderr.splitlines() if x.startswith(f"signal-driver: {phase} "))
    pids = line.split("workers=")[1]
    return [int(p) for p in pids.split(",") if p]


@pytest.mark.parametrize("sig,code", SIGNALS)
@pytest.mark.parametrize("phase,flags,n_workers", [
    ("load", [], 0),
    ("capture", [], 0),
    ("spec-start", ["--spec-gate", "--spec-recall-min", "0"], 3),  # two lanes and the gate starting
    ("prefill", ["--overlap", "--prefetch", "1", "--spec-gate", "--spec-recall-min", "0"], 3),
])
def test_signal_during_start_and_prefill(model: str, phase: str, flags: list[str], n_workers: int,
                                         sig: str, code: int) -> None:
    before = bmoe_segments()
    r = subprocess.run([sys.executable, "-m", "tests.signal_driver", phase, sig, "-m", model, "-p", PROMPT,
                        "-n", "4", "-c", "1024", "-t", "1", "--io-threads", "2", "--cache-mb", "2", *flags],
                       capture_output=True, text=True, timeout=600, cwd=REPO,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
    pids = driver_pids(r.stderr, phase)
    assert r.returncode == code, r.stderr[-2000:]
    assert len(pids) == n_workers, r.stderr[-2000:]
    assert not r.stdout, "nothing was generated"
    assert bmoe_segments() == before
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not workers_of(model)


@pytest.mark.parametrize("sig,code", SIGNALS)
def test_signal_while_a_session_is_idle(model: str, sig: str, code: int) -> None:
    before = bmoe_segments()
    s = SessionClient(["-m", model, "-t", "1", "--io-threads", "2", "--cache-mb", "2", "--spec-gate",
                       "--spec-recall-min", "0"], cwd=str(REPO))
    try:
        _evs, (tag, _done) = s.ask(1, "hello there", n_predict=4)
        assert tag == "DONE"
        kids = [c for c in psutil.Process(s.proc.pid).children()
                if any(w in " ".join(c.cmdline()) for w in WORKERS)]
        assert len(kids) == 3
        s.proc.send_signal(getattr(signal, sig))
        rc = s.proc.wait(600)
    finally:
        s.kill()
    assert rc == code, s.stderr[-2000:]
    tag, ev = telemetry.parse_tagged(s.lines[-1])
    assert tag == "ERROR" and ev["fatal"] is True and ev["id"] == -1 and sig in ev["msg"]
    assert bmoe_segments() == before
    assert not still_running(kids) and not workers_of(model)
