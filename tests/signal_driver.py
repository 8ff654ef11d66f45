"""`bmoe-cli` with a signal sent to itself at one chosen point of its start or run (for test_signals.py).

    python -m tests.signal_driver PHASE SIGTERM|SIGINT [bmoe-cli args...]

A signal from outside lands wherever the process happens to be; this one lands at a known place,
so each phase's cleanup is tested every run:

- load:       as llama.cpp's model load returns (Python runs a handler only between bytecodes)
- capture:    inside the warm-up decode's eval callback (the handler's exception is parked on the hook)
- spec-start: while the spec-gate process starts and reads its routers (needs --spec-gate)
- prefill:    inside the prompt's decode, at its first routed layer, with the lanes reading
- idle:       nowhere: the test signals a session that is waiting for requests

Before sending it, the driver writes `signal-driver: PHASE workers=PID,...` (its worker processes
at that moment: every child) on stderr, so the test can check they are gone after the exit.
"""

from __future__ import annotations

import os
import signal
import sys

import llama_cpp
import psutil

from bmoe import cli
from bmoe.seam import capture
from bmoe.streaming import graph_stops, speculation


def workers() -> list[int]:
    """Every child is a worker (one just started may not show its command line yet)."""
    return [c.pid for c in psutil.Process().children()]


def arm(phase: str, sig: int) -> None:
    fired = False

    def fire() -> None:
        nonlocal fired
        if fired:
            return
        fired = True
        print(f"signal-driver: {phase} workers={','.join(map(str, workers()))}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), sig)

    if phase == "load":
        load = llama_cpp.llama_model_load_from_file

        def load_then_fire(*a: object) -> object:
            model = load(*a)
            fire()
            return model

        llama_cpp.llama_model_load_from_file = load_then_fire
    elif phase == "capture":
        visit = capture.Capture.visit

        def visit_and_fire(self: capture.Capture, addr: int) -> None:
            fire()
            visit(self, addr)

        capture.Capture.visit = visit_and_fire
    elif phase == "spec-start":
        hello = speculation.SpecGate._hello

        def fire_then_hello(self: speculation.SpecGate, timeout: float) -> list | None:
            fire()
            return hello(self, timeout)

        speculation.SpecGate._hello = fire_then_hello
    elif phase == "prefill":
        on_route = graph_stops.StreamingStops.on_route

        def route_and_fire(self: graph_stops.StreamingStops, layer: int, ids: object) -> None:
            on_route(self, layer, ids)
            if len(ids) > 1:
                fire()

        graph_stops.StreamingStops.on_route = route_and_fire
    elif phase != "idle":
        raise SystemExit(f"unknown phase {phase}")


if __name__ == "__main__":
    arm(sys.argv[1], getattr(signal, sys.argv[2]))
    sys.exit(cli.main(sys.argv[3:]))
