"""Spec-gate: predicts the next MoE layer's experts from the current layer's router input.

Run as `python -m bmoe.workers.spec_gate --ring NAME ... FILE...` so `ps` shows its
role. The coordinator copies layer l's router input into slot s of the shared ring
and sends `[seq, layer, slot]` (msgpack, stdin); the gate answers
`[seq, next_layer, [ids...], [probs...]]` on stdout (most probable first). When several requests are waiting only the
newest is answered: an older one would arrive too late to be of use. It owns no
cache state and exits on EOF, so it never outlives its coordinator.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys

import msgpack
import numpy as np

from bmoe.shm_cache import open_segment
from bmoe.workers import routers


def _newest(fd: int, unpacker: msgpack.Unpacker) -> list | None:
    """Block for a request, then drain what else is already there; None on EOF."""
    latest = None
    wait = None
    while True:
        ready, _, _ = select.select([fd], [], [], wait)
        if not ready:
            return latest
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return None
        unpacker.feed(chunk)
        for msg in unpacker:
            latest = msg
        wait = 0 if latest is not None else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bmoe.workers.spec_gate")
    ap.add_argument("--ring", required=True)
    ap.add_argument("--slots", type=int, required=True)
    ap.add_argument("--embd", type=int, required=True)
    ap.add_argument("--arch", required=True)
    ap.add_argument("--top-k", type=int, required=True)
    ap.add_argument("--layers", required=True, help="comma-separated MoE layers")
    ap.add_argument("--no-rescale", action="store_true")
    ap.add_argument("--gating", choices=routers.GATINGS, default="softmax", help="the layers' gating op")
    ap.add_argument("--groups", default="0,0", help="expert_group_count,expert_group_used_count (0,0: no limit)")
    ap.add_argument("files", nargs="+")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator stops us by closing stdin
    out = sys.stdout.buffer
    try:
        layers = [int(x) for x in a.layers.split(",")]
        count, used = (int(x) for x in a.groups.split(","))
        predictor = routers.Predictor(routers.load_routers(a.files, a.arch, layers), a.top_k, not a.no_rescale,
                                      a.gating, (count, used))
    except (routers.RouterError, OSError, ValueError) as e:
        out.write(msgpack.packb(["hello", False, str(e)]))
        out.flush()
        return 0
    ring = np.frombuffer(open_segment(a.ring), dtype=np.float32).reshape(a.slots, a.embd)
    out.write(msgpack.packb(["hello", True, ""]))
    out.flush()
    fd = sys.stdin.fileno()
    unpacker = msgpack.Unpacker()
    while True:
        msg = _newest(fd, unpacker)
        if msg is None:
            return 0
        seq, layer, slot = msg
        got = predictor.predict(layer, ring[slot].copy())
        # every request is answered, the last MoE layer's with nothing to predict: a request left
        # unanswered looks, after the coordinator's next idle while, like a gate that hung
        answer = [seq, got.layer, got.ids.tolist(), got.probs.tolist()] if got is not None else [seq, layer, [], []]
        out.write(msgpack.packb(answer))
        out.flush()


if __name__ == "__main__":
    sys.exit(main())
