"""Drive a `bmoe-cli --session` subprocess from Python. Imports no llama.cpp."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

from bmoe.base import telemetry


class SessionError(RuntimeError):
    """The session process ended, or answered something other than the protocol expects."""


SessionEvent = tuple[str, dict[str, Any]]


class SessionClient:
    """Drive a `bmoe-cli --session` subprocess.

        with SessionClient(["-m", "model.gguf", "--cache-mb", "500"]) as s:
            print(s.ready["arch"])
            for tag, ev in s.generate(1, "Why is the sky blue?", n_predict=32):
                if tag == "PROGRESS":
                    print(ev["text"])

    stdout and stderr are read on their own threads (so neither pipe can fill up and stall the
    session); `lines` keeps every stdout line, `stray` the ones that are not protocol lines.
    """

    def __init__(self, args: list[str], *, ready_timeout: float = 600.0, cwd: str | None = None,
                 env: dict[str, str] | None = None, python: str = sys.executable) -> None:
        env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([python, "-m", "bmoe.cli", "--session", *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env)
        self.lines: list[str] = []
        self.stray: list[str] = []
        self._stderr: list[bytes] = []
        self._events: queue.Queue[SessionEvent | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._read_stdout, daemon=True),
                         threading.Thread(target=self._read_stderr, daemon=True)]
        for t in self._threads:
            t.start()
        self.ready: dict[str, Any] = {}
        try:
            tag, obj = self.next_event(ready_timeout)
            if tag != "READY":
                raise SessionError(f"expected BMOE_READY, got BMOE_{tag} {obj}")
            self.ready = obj
        except BaseException:
            self.kill()
            raise

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None  # stdout=PIPE
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.lines.append(line)
            ev = telemetry.parse_tagged(line)
            if ev is None:
                self.stray.append(line)
            else:
                self._events.put(ev)
        self._events.put(None)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None  # stderr=PIPE
        for raw in self.proc.stderr:
            self._stderr.append(raw)

    @property
    def stderr(self) -> str:
        return b"".join(self._stderr).decode("utf-8", errors="replace")

    def next_event(self, timeout: float | None = 300.0) -> SessionEvent:
        """The next protocol line; SessionError when the process ended or nothing came in time."""
        try:
            ev = self._events.get(timeout=timeout)
        except queue.Empty:
            raise SessionError(f"no line from the session in {timeout} s") from None
        if ev is None:
            self._events.put(None)  # stay at end of stream
            self.proc.wait()
            raise SessionError(f"the session ended (exit {self.proc.returncode}); stderr:\n{self.stderr[-2000:]}")
        return ev

    def send(self, obj: dict[str, Any] | str | bytes) -> None:
        """A request (dict → one JSON line; str/bytes sent as they are, newline added if missing)."""
        if isinstance(obj, dict):
            data = (json.dumps(obj) + "\n").encode()
        else:
            data = obj.encode("utf-8", "surrogateescape") if isinstance(obj, str) else obj
            if not data.endswith(b"\n"):
                data += b"\n"
        assert self.proc.stdin is not None  # stdin=PIPE
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def generate(self, id: int, prompt: str, timeout: float | None = 300.0, **opts: Any) -> Iterator[SessionEvent]:
        """Send a generate request; iterate its events up to and including its DONE or ERROR
        (or a fatal ERROR). Options: n_predict, think, clear_kv, lossless."""
        self.send({"cmd": "generate", "id": id, "prompt": prompt, **opts})
        return self.events_until(id, timeout)

    def events_until(self, id: int, timeout: float | None = 300.0) -> Iterator[SessionEvent]:
        while True:
            tag, obj = self.next_event(timeout)
            yield tag, obj
            if (tag in ("DONE", "ERROR") and obj.get("id") == id) or (tag == "ERROR" and obj.get("fatal")):
                return

    def ask(self, id: int, prompt: str, **opts: Any) -> tuple[list[SessionEvent], SessionEvent]:
        """generate() collected: (all events, the final DONE/ERROR event)."""
        evs = list(self.generate(id, prompt, **opts))
        return evs, evs[-1]

    def close(self, timeout: float = 120.0) -> int:
        """Send close, wait for the process to end, return its exit code."""
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "close"})
                assert self.proc.stdin is not None  # stdin=PIPE
                self.proc.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._join()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._join()

    def _join(self) -> None:
        for t in self._threads:
            t.join(10)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            assert f is not None  # all three are pipes
            try:
                f.close()
            except (OSError, ValueError):
                pass

    def __enter__(self) -> SessionClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
