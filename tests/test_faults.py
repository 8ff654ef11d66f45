"""Fault injection on real lane processes: killed, hung, or failing over and over."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from bmoe.base.errors import LaneError
from bmoe.coordinator import Engine
from tests.conftest import complete, load, per_token, reference

PROMPT = "On the far side of the lake there was a workshop where clocks were repaired by hand"


FLAGS = ("-c", 256, "-t", 2)


@pytest.fixture(scope="module")
def model(small_moe) -> str:
    return str(small_moe)


@pytest.fixture(scope="module")
def plain(model: str) -> tuple[int, ...]:
    return reference(model, PROMPT, 32, *FLAGS).ids


def run_with(model: str, injure, *flags: object) -> tuple[tuple[int, ...], int]:
    """Generate with no cache (every token reads) and `injure(engine, step)` after each token."""
    with load(model, *FLAGS, "--cache-mb", 0, "--io-threads", 2, *flags) as m:
        res = complete(m, PROMPT, 32, on_chunk=per_token(lambda i: injure(m.engine, i)))
        return res.ids, m.engine.streamer.pool.restarts


def test_killed_lane_is_replaced_and_output_unchanged(model: str, plain: tuple[int, ...]) -> None:
    killed = []

    def injure(e: Engine, i: int) -> None:
        if i == 5:
            lane = e.streamer.pool.lanes[1]
            killed.append(lane.pid)
            os.kill(lane.pid, signal.SIGKILL)

    # a generous --lane-timeout: the replacement must not also be taken for hung while a loaded
    # machine starts it (that made restarts 2 once, beside another benchmark)
    ids, restarts = run_with(model, injure, "--lane-timeout", 600)
    assert ids == plain
    assert killed and restarts == 1
    assert not psutil.pid_exists(killed[0])

def test_hung_lane_is_replaced_and_output_unchanged(model: str, plain: tuple[int, ...]) -> None:
    """A lane that stops answering (SIGSTOP) is found by --lane-timeout, killed and replaced, and
    its reads re-issued: the output does not change.

    The test waits on the event itself, the run finishing (it cannot finish before the stopped
    lane is replaced). A watchdog resumes the stopped lane after a generous 600 s, so a product
    that never notices the hang fails the test instead of hanging it. The timeout stays short
    (1.5 s: the test's run time is mostly this wait), and nothing else depends on machine speed:
    on a machine so loaded that a healthy lane leaves a read unanswered for 1.5 s, that lane is
    replaced too, which is harmless (its reads are re-issued), so the test checks that the stopped
    lane was among those replaced, not how many were, and lifts the pool's cap on replacements
    for this run (the cap has its own test below)."""
    stopped: list[int] = []
    resumed: list[int] = []
    finished = threading.Event()

    def watchdog(pid: int) -> None:
        if not finished.wait(600):
            resumed.append(pid)
            os.kill(pid, signal.SIGCONT)

    def injure(e: Engine, i: int) -> None:
        if i == 3:
            e.streamer.pool.max_restarts = 1000
            lane = e.streamer.pool.lanes[0]
            stopped.append(lane.pid)
            os.kill(lane.pid, signal.SIGSTOP)
            threading.Thread(target=watchdog, args=(lane.pid,), daemon=True).start()

    m = load(model, *FLAGS, "--cache-mb", 0, "--io-threads", 2, "--lane-timeout", 1.5)
    try:
        res = complete(m, PROMPT, 32, on_chunk=per_token(lambda i: injure(m.engine, i)))
        finished.set()
        pool = m.engine.streamer.pool
        after = pool.lanes[0].pid
        restarts = pool.restarts
    finally:
        finished.set()
        m.close()
    assert not resumed, "the stopped lane was not replaced in 600 s"
    assert res.ids == plain
    assert stopped and after != stopped[0] and restarts >= 1
    assert not psutil.pid_exists(stopped[0]), "the hung process was killed and reaped, not left stopped"


def test_lanes_failing_again_and_again_end_the_run_clearly(model: str) -> None:
    def injure(e: Engine, i: int) -> None:
        for lane in e.streamer.pool.lanes:
            os.kill(lane.pid, signal.SIGKILL)

    with pytest.raises(LaneError, match=r"lanes have failed \d+ times in this run"):
        run_with(model, injure)


@pytest.fixture
def one_lane(tmp_path):
    """A real lane process over a real slab of 16 pages and a file of 16 random pages: (pool, slab, data)."""
    from bmoe.shm_cache import Slab
    from bmoe.streaming.lanes import LanePool

    data = os.urandom(16 * 4096)
    f = tmp_path / "f.bin"
    f.write_bytes(data)
    slab = Slab(16 * 4096)
    pool = LanePool(1, slab.name, [str(f)], odirect=False)
    try:
        yield pool, slab, data
    finally:
        pool.close()
        slab.close()


def test_lane_serves_demand_before_queued_speculation_and_drops_cancelled_orders(one_lane) -> None:
    """Real lane process, real slab: orders sent while the lane is stopped are served demand first,
    then speculative in order; the cancelled speculative ones are never read."""
    from bmoe.workers.io_lane import CANCELLED

    pool, slab, data = one_lane
    lane = pool.lanes[0]
    lane.proc.send_signal(signal.SIGSTOP)
    page = lambda i: [(0, i * 4096, 4096, i * 4096, 4096, 0, 0, 0)]  # noqa: E731
    spec = [pool.send(0, page(i), speculative=True) for i in range(5)]
    demand = pool.send(0, page(8))
    lane.cancel([spec[2], spec[3]])
    lane.proc.send_signal(signal.SIGCONT)
    order: list[int] = []
    deadline = time.monotonic() + 600
    while len(order) < 6 and time.monotonic() < deadline:
        pool.poll(0.5)
        for oid in list(pool.done):
            order.append(oid)
            nbytes = pool.take(oid).nbytes
            assert (nbytes == CANCELLED) == (oid in (spec[2], spec[3]))
    assert order == [spec[2], spec[3], demand, spec[0], spec[1], spec[4]]
    for i in (0, 1, 4, 8):
        assert slab.mm[i * 4096:(i + 1) * 4096] == data[i * 4096:(i + 1) * 4096]
    for i in (2, 3):
        assert slab.mm[i * 4096:(i + 1) * 4096] == bytes(4096), "a cancelled order read nothing"


def test_answers_that_come_with_a_replacements_hello_are_taken(one_lane) -> None:
    """A replaced lane is sent its re-issued orders before its hello is read; a quick lane answers
    them before the coordinator reads at all, so the hello and the answers come in one read. Those
    answers must be taken then: no select reports them again, and the run stalled until
    --lane-timeout (30 s) took the healthy lane for hung (5 of 150 runs of
    test_lanes_failing_again_and_again_end_the_run_clearly)."""
    import fcntl
    import select
    import struct
    import termios

    import msgpack

    pool, slab, data = one_lane
    lane = pool.lanes[0]
    lane.proc.send_signal(signal.SIGSTOP)  # the order stays unanswered until the lane is replaced
    order = pool.send(0, [(0, 4096, 4096, 4096, 4096, 0, 0, 0)])
    os.kill(lane.pid, signal.SIGKILL)
    hello = pool._hello

    def hello_once_the_answer_is_there(new: object) -> None:
        """Read nothing until the replacement has written its hello and its answer."""
        fd = new.stdout.fileno()
        said = len(msgpack.packb(["hello", 0, new.pid, False]))
        while struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0] <= said:
            select.select([fd], [], [])
            time.sleep(0.001)  # data is there, but maybe only the hello yet
        hello(new)

    pool._hello = hello_once_the_answer_is_there
    pool.poll(600)  # sees the old lane's end, replaces it, re-issues the order
    assert pool.restarts == 1 and order in pool.done, "the answer read with the hello was dropped"
    assert pool.take(order)[0] == 4096 and slab.mm[4096:8192] == data[4096:8192]


def test_a_layers_orders_reach_each_lane_in_one_write(model: str, plain: tuple[int, ...]) -> None:
    """Under overlap a layer sends gate/up and down orders (and reads ahead) to each lane; they are
    held and written once per lane, since every write wakes a lane that takes the CPU."""
    m = load(model, *FLAGS, "--cache-mb", 0, "--io-threads", 2, "--overlap")
    e = m.engine
    writes: list[int] = []  # lane index of every write to a lane's stdin
    sent: list[int] = []  # order ids
    try:
        st = e.streamer
        for lane in st.pool.lanes:
            inner = lane.proc.stdin.write
            lane.proc.stdin.write = lambda data, i=lane.index, inner=inner: (writes.append(i), inner(data))[1]
        send, route = st.pool.send, e.hook.stops.on_route
        st.pool.send = lambda *a, **k: sent.append(send(*a, **k)) or sent[-1]
        per_layer: list[tuple[int, int]] = []  # (orders sent, writes) per routing

        def on_route(layer, ids) -> None:
            n_sent, n_writes = len(sent), len(writes)
            route(layer, ids)
            per_layer.append((len(sent) - n_sent, len(writes) - n_writes))

        e.hook.stops.on_route = on_route
        assert complete(m, PROMPT, 32).ids == plain
    finally:
        m.close()
    assert any(orders > 2 for orders, _ in per_layer), "more orders than lanes in some layer"
    assert all(n_writes <= 2 for _, n_writes in per_layer), per_layer
