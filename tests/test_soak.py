"""Soak (opt-in: `python -m pytest -m soak -s`): one session serving 200 requests with random cancels.

Checks that every request is answered (DONE, or a non-fatal ERROR such as a full context), that the
slab's resident bytes never pass the budget plus one layer's working set, and that after a warm-up
the session's RSS stays within 10 %, its open file descriptors do not grow and its worker
processes are the same ones throughout.
"""

from __future__ import annotations

import os
import random
import statistics
import time

import psutil
import pytest

from bmoe.base.model_files import read_model_files
from bmoe.base.units import MiB
from bmoe.edges.session_client import SessionClient
from bmoe.shm_cache import segments_of
from bmoe.streaming.expert_cache import file_regions, working_sets
from tests.conftest import REPO, bmoe_segments

REQUESTS, WARMUP = 200, 30
WORDS = ("river stone king winter market lantern harbour garden letter bridge forest candle engine "
         "mountain clock painter sailor village storm silver").split()


def slab_resident(pid: int) -> int:
    return sum(p.stat().st_blocks * 512 for p in segments_of(pid))


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.soak
@pytest.mark.timeout(1800)
def test_session_soak(synth) -> None:
    path = str(synth(arch="qwen3moe", layers=4, experts=16, top_k=2))
    files = read_model_files(path)
    layer_ws = max(working_sets(file_regions(files), files.n_expert_used).values())
    budget_mb = round(files.expert_bytes / 3 / MiB, 1)
    rng = random.Random(7)
    before = bmoe_segments()
    t0 = time.monotonic()
    s = SessionClient(["-m", path, "-t", "1", "--io-threads", "2", "--cache-mb", str(budget_mb), "-c", "512"],
                      cwd=str(REPO))
    proc = psutil.Process(s.proc.pid)
    workers = sorted(c.pid for c in proc.children())
    rss: list[int] = []
    fd_counts: list[int] = []
    peak_resident = 0
    outcomes = {"done": 0, "cancelled": 0, "error": 0}
    try:
        for rid in range(1, REQUESTS + 1):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
            n = rng.randint(4, 24)
            cancel_at = rng.choice([None, None, None, 0, 1, 3])  # 0: cancel before the first token
            s.send({"cmd": "generate", "id": rid, "prompt": prompt, "n_predict": n,
                    "clear_kv": rng.random() < 0.6})
            if cancel_at == 0:
                s.send({"cmd": "cancel"})
            for tag, ev in s.events_until(rid, timeout=120):
                if tag == "PROGRESS":
                    peak_resident = max(peak_resident, slab_resident(s.proc.pid))
                    if cancel_at and ev["step"] == cancel_at:
                        s.send({"cmd": "cancel"})
            assert tag in ("DONE", "ERROR"), (rid, tag, ev)
            if tag == "ERROR":
                assert ev["fatal"] is False and ev["id"] == rid, ev
                outcomes["error"] += 1
            else:
                outcomes["cancelled" if ev["cancelled"] else "done"] += 1
            if rid > WARMUP:
                rss.append(proc.memory_info().rss)
                fd_counts.append(fds(s.proc.pid))
            assert sorted(c.pid for c in proc.children()) == workers, f"workers changed at request {rid}"
        assert s.close() == 0
    finally:
        s.kill()
    elapsed = time.monotonic() - t0
    base = statistics.median(rss[:10])
    print(f"\nsoak: {REQUESTS} requests in {elapsed:.0f} s: {outcomes}; budget {budget_mb} MiB + one layer "
          f"{layer_ws / MiB:.2f} MiB, peak resident {peak_resident / MiB:.2f} MiB; RSS after warm-up "
          f"{min(rss) / MiB:.1f}-{max(rss) / MiB:.1f} MiB (base {base / MiB:.1f}); fds {min(fd_counts)}-"
          f"{max(fd_counts)}; workers {len(workers)}")
    assert sum(outcomes.values()) == REQUESTS and outcomes["cancelled"] > 0 and outcomes["done"] > 0
    assert 0 < peak_resident <= budget_mb * MiB + layer_ws
    assert max(rss) <= 1.1 * base and min(rss) >= 0.9 * base
    assert max(fd_counts) <= fd_counts[0]
    assert not s.stray and not bmoe_segments() - before
