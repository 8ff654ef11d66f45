"""The coordinator's side of the spec-gate process, and the recall governor that can switch it off.

Layer l's router input is copied into a slot of a small shared-memory ring (the
coordinator's only cost) and announced with a msgpack notice; predictions come
back on a pipe and are picked up whenever the coordinator next looks (it never
waits for one). A gate that dies or stops answering turns the feature off for the
run; so does a recall below the floor after the warm-up.
"""

from __future__ import annotations

import ctypes
import math
import os
import select
import subprocess
import time
from collections.abc import Callable

import msgpack

from bmoe import workers
from bmoe.base.model_files import ModelFiles
from bmoe.base.settings import SpecSettings
from bmoe.shm_cache import Slab
from bmoe.streaming.gating import Gating

RING_SLOTS = 8
HANG_S = 5.0


class SpecGate:
    """One spec-gate worker process and its ring."""

    def __init__(self, files: ModelFiles, layers: list[int], n_embd: int, spec: SpecSettings,
                 shm_backend: str, notice: Callable[[str], None], gating: Gating | None = None) -> None:
        self.notice = notice
        self.confidence = Confidence(files.n_expert, spec.precision)
        self.n_embd = n_embd
        self.warmup = spec.warmup
        self.recall_min = spec.recall_min
        self.active = False
        self.disabled_below: float | None = None  # set when the governor fired
        self.predicted = self.hits = self.scored = 0
        self._seq = 0
        self._sent: dict[int, float] = {}
        self.ring = Slab(RING_SLOTS * n_embd * 4, shm_backend)
        self.proc: subprocess.Popen | None = None
        gate_args = ["--gating", gating.func, "--groups", "{},{}".format(*gating.groups)] if gating else []
        cmd = workers.command("bmoe.workers.spec_gate", "--ring", self.ring.name,
                              "--slots", str(RING_SLOTS), "--embd", str(n_embd), "--arch", files.arch,
                              "--top-k", str(files.n_expert_used), "--layers", ",".join(map(str, layers)),
                              *gate_args, *[str(p) for p in files.paths])
        try:  # a signal while the gate starts (it reads every router) must not leave it or the ring behind
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self.pid = self.proc.pid
            self.unpacker = msgpack.Unpacker()
            hello = self._hello(timeout=60.0)
        except BaseException:
            self.close()
            raise
        if hello is None:
            self._stop(f"the spec-gate process did not start (exit code {self.proc.poll()})")
        elif not hello[1]:
            self._stop(f"--spec-gate off: {hello[2]}")
        else:
            self.active = True

    @property
    def fd(self) -> int:
        assert self.proc is not None and self.proc.stdout is not None  # read only while it runs (stdout=PIPE)
        return self.proc.stdout.fileno()

    def _hello(self, timeout: float) -> list | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for msg in self.unpacker:
                return msg
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None
            self.unpacker.feed(chunk)
        return None

    def send(self, layer: int, addr: int, route_seq: int) -> None:
        """Copy a router-input row into the ring and ask for the next layer's prediction."""
        if not self.active:
            return
        self._seq += 1
        slot = self._seq % RING_SLOTS
        ctypes.memmove(self.ring.base + slot * self.n_embd * 4, addr, self.n_embd * 4)
        now = time.monotonic()
        oldest = min(self._sent.values(), default=now)
        if now - oldest > HANG_S and not select.select([self.fd], [], [], 0)[0]:
            self._stop(f"spec-gate (pid {self.pid}) did not answer for {HANG_S:g} s; --spec-gate off for this run")
            return
        self._sent[self._seq] = now
        assert self.proc is not None and self.proc.stdin is not None  # active: it runs (stdin=PIPE)
        try:
            self.proc.stdin.write(msgpack.packb([route_seq, layer, slot]))
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            self._stop(f"spec-gate (pid {self.pid}) exited with code {self.proc.poll()}; --spec-gate off for this run")

    def receive(self) -> list[tuple[int, int, list[int], list[float]]]:
        """Predictions that arrived: (route seq at request time, layer, expert ids, their probabilities)."""
        if not self.active:
            return []
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            assert self.proc is not None  # active: it runs
            self._stop(f"spec-gate (pid {self.pid}) exited with code {self.proc.wait()}; --spec-gate off for this run")
            return []
        self.unpacker.feed(chunk)
        self._sent.clear()  # it answers the newest request and drops the others
        return [(seq, layer, ids, probs) for seq, layer, ids, probs in self.unpacker if ids]  # (the last layer: none)

    def score(self, predicted: set[int], routed: set[int]) -> None:
        """Recall bookkeeping; after the warm-up a recall under the floor latches the feature off."""
        self.predicted += len(predicted)
        self.hits += len(predicted & routed)
        self.scored += 1
        if self.active and self.scored >= self.warmup and self.recall_pct < self.recall_min:
            self.disabled_below = self.recall_min
            self._stop(f"--spec-gate off: router prediction recall {self.recall_pct:.1f}% after "
                       f"{self.scored} predictions is below --spec-recall-min {self.recall_min:g}%")

    @property
    def recall_pct(self) -> float:
        return 100.0 * self.hits / self.predicted if self.predicted else 0.0

    def _stop(self, why: str) -> None:
        self.active = False
        self.notice(why)
        self._end_process()

    def _end_process(self) -> None:
        p, self.proc = self.proc, None
        if p is None:
            return
        assert p.stdin is not None and p.stdout is not None  # started with both pipes
        try:
            p.stdin.close()
        except OSError:
            pass
        try:
            p.wait(2.0)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        p.stdout.close()

    def close(self) -> None:
        try:
            self._end_process()
        finally:
            self.ring.close()


class Confidence:
    """Which predicted experts are worth a speculative read, learned from how often guesses came true.

    A wrong guess costs a whole read on a flash that is usually the bottleneck, and the guesses
    that matter are the ones for experts the cache lacks: those are the predictor's weakest (the
    cache already holds what is routed often). So every predicted expert that was absent when
    the prediction came in is scored against the layer's routing, per band of router probability
    (a quarter octave, relative to a uniform 1/n_expert), and only bands whose measured precision
    reaches the floor are read. A band is trusted once it holds MIN_SAMPLES outcomes; every band
    above a trusted one is trusted too (precision grows with probability). Scoring does not depend
    on reading, so a band can become trusted without ever being read.
    """

    BANDS_PER_OCTAVE = 4
    LOWEST = -3  # octaves below uniform: everything under 1/(8 n_expert) shares the first band
    BANDS = 8 * BANDS_PER_OCTAVE  # up to 32x uniform
    MIN_SAMPLES = 16

    def __init__(self, n_expert: int, min_precision_pct: float) -> None:
        self.n_expert = n_expert
        self.floor = min_precision_pct / 100.0
        self.seen = [0] * self.BANDS
        self.right = [0] * self.BANDS
        self.trusted_from = 0 if self.floor <= 0 else self.BANDS  # the lowest trusted band

    def band(self, prob: float) -> int:
        octaves = math.log2(max(prob * self.n_expert, 1e-9)) - self.LOWEST
        return min(self.BANDS - 1, max(0, int(octaves * self.BANDS_PER_OCTAVE)))

    def worth(self, band: int) -> bool:
        return band >= self.trusted_from

    def score(self, band: int, routed: bool) -> None:
        self.seen[band] += 1
        self.right[band] += routed
        if self.floor > 0:
            self.trusted_from = next((b for b in range(self.BANDS) if self.seen[b] >= self.MIN_SAMPLES
                                      and self.right[b] >= self.floor * self.seen[b]), self.BANDS)
