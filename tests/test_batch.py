"""Several requests decoding together (`--parallel`): Model.batch, the scheduler and bmoe-server,
on real llama.cpp with real lanes and shared memory."""

from __future__ import annotations

import threading

import httpx
import pytest

import bmoe
from bmoe.api import Ask, Chunk, Model
from bmoe.base.model_files import read_model_files
from bmoe.base.units import MiB
from bmoe.server.http_errors import QueueFull
from bmoe.server.scheduler import Batching, Job, Position, Scheduler
from tests.conftest import SlabCheck
from tests.test_server import FLAGS, KEY, Server, auth, metric

PROMPTS = ["Once upon a time there was a king", "The river ran fast and cold past the old mill",
           "def add(a, b):", "In the year 1800 the town council decided"]
N = 24
FAST = {"threads": 2, "n_ctx": 256}
CASES = [("qwen3moe", "q8_0", 1), ("qwen3moe", "q8_0", 4), ("llama", "q4_0", 4), ("gpt-oss", "mxfp4", 4)]


def answers(m: Model, prompts: list[str], n: int = N) -> list[str]:
    return [c.text for c in m.batch([m.prepare(Ask(p, max_tokens=n)) for p in prompts])]


@pytest.mark.parametrize("arch,quant,lanes", CASES)
def test_a_streamed_batch_of_four_equals_plain_llama_cpp_on_the_same_batch(synth, arch: str, quant: str,
                                                                          lanes: int) -> None:
    path = str(synth(arch=arch, quant=quant, layers=4, experts=8, top_k=2))
    with bmoe.load(path, stream=False, parallel=4, **FAST) as plain:
        want = answers(plain, PROMPTS)
    assert len(set(want)) == 4 and all(w.strip() for w in want)
    third = read_model_files(path).expert_bytes / 3 / MiB
    with bmoe.load(path, parallel=4, cache_mb=third, force=True, io_threads=lanes, **FAST) as m:
        check = SlabCheck(m.engine)
        assert answers(m, PROMPTS) == want
        assert check.checked and not check.bad, check.bad[:3]


def test_a_batch_of_one_is_the_request_alone(small_moe) -> None:
    path = str(small_moe)
    with bmoe.load(path, cache_mb=1, **FAST) as one:
        want = one.generate(PROMPTS[0], max_tokens=N)
    with bmoe.load(path, parallel=2, cache_mb=1, **FAST) as m:
        alone = m.generate(PROMPTS[0], max_tokens=N)
        assert alone == want  # each sequence has a KV of its own: a second one changes nothing
        assert answers(m, PROMPTS[:1]) == [alone]
        with pytest.raises(bmoe.ConfigError, match="a batch of 3 needs as many KV sequences"):
            answers(m, PROMPTS[:3])


class Collect:
    """A job's events, and an Event set when it ended."""

    def __init__(self) -> None:
        self.events: list[object] = []
        self.ended = threading.Event()

    def __call__(self, item: object) -> None:
        self.events.append(item)
        if isinstance(item, Exception) or (isinstance(item, Chunk) and item.stats is not None):
            self.ended.set()

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, Chunk))

    @property
    def last(self) -> Chunk:
        return self.events[-1]


def serve(m: Model, prompts: list[str], mode: str, queue: int = 4, n: int = N) -> tuple[Scheduler, list[Collect]]:
    """Submit every prompt before the scheduler starts: all are admitted at its first turn."""
    sched = Scheduler(m, queue, on_fatal=lambda e: None, batching=mode)
    got = [Collect() for _ in prompts]
    for p, c in zip(prompts, got):
        sched.submit(Job(m.prepare(Ask(p, max_tokens=n)), c))
    sched.start()
    return sched, got


@pytest.fixture(scope="module")
def model(small_moe) -> Model:
    path = str(small_moe)
    with bmoe.load(path, parallel=3, cache_mb=1, io_threads=2, **FAST) as m:
        yield m


@pytest.mark.parametrize("mode", ["batch", "turns"])
def test_the_scheduler_batches_or_takes_turns_and_each_way_equals_its_reference(model: Model, mode: str) -> None:
    prompts = PROMPTS[:3]
    sched, got = serve(model, prompts, mode)
    try:
        for c in got:
            assert c.ended.wait(600)
    finally:
        sched.close()
        sched.join()
    texts = [c.text for c in got]
    # batched: what Model.batch gives for the same composition; in turns: each request alone
    want = answers(model, prompts) if mode == "batch" else [model.generate(p, max_tokens=N) for p in prompts]
    assert texts == want
    assert all(c.last.finish_reason == "length" and c.last.stats.completion_tokens == N for c in got)
    assert sched.batching.steps[mode] > 0 and sched.batching.steps["batch" if mode == "turns" else "turns"] == 0
    assert all(s.kv_tokens for s in model.slots) and not any(s.busy for s in model.slots)


def test_cancelling_one_of_a_batch_leaves_the_others_running(model: Model) -> None:
    sched = Scheduler(model, 4, on_fatal=lambda e: None, batching="batch")
    first, second = Collect(), Collect()
    jobs = [Job(model.prepare(Ask(PROMPTS[0], max_tokens=N)), first),
            Job(model.prepare(Ask(PROMPTS[1], max_tokens=N)), second)]

    def cancel_after_three(item: object) -> None:
        second(item)
        if sum(isinstance(e, Chunk) for e in second.events) == 3:
            sched.cancel(jobs[1])

    jobs[1].deliver = cancel_after_three
    for j in jobs:
        sched.submit(j)
    sched.start()
    try:
        assert first.ended.wait(600) and second.ended.wait(600)
    finally:
        sched.close()
        sched.join()
    assert second.last.finish_reason == "cancelled" and second.last.stats.completion_tokens <= 4
    assert first.last.finish_reason == "length" and first.last.stats.completion_tokens == N
    slot = jobs[1].gen.slot
    assert model.engine.kv_len(slot.seq) == len(slot.kv_tokens) == 0  # rolled back: nothing was reused


def test_the_queue_holds_its_size_beyond_the_running_sequences(model: Model) -> None:
    sched = Scheduler(model, 1, on_fatal=lambda e: None)
    got = [Collect() for _ in range(4)]
    jobs = [Job(model.prepare(Ask(p, max_tokens=4)), c) for p, c in zip(PROMPTS, got)]
    assert [sched.submit(j) for j in jobs[:3]] == [0, 0, 0]  # three sequences free: they run at once
    try:
        assert sched.submit(jobs[3]) == 3  # the queue's one place
        with pytest.raises(QueueFull):
            sched.submit(Job(jobs[0].req, Collect()))
    finally:
        sched.close()
    assert all(isinstance(c.events[0], Exception) for c in got)  # ShuttingDown: none ran
    assert not any(isinstance(e, Position) for c in got for e in c.events)


def test_auto_batching_takes_the_cheaper_mode_and_keeps_measuring_the_other() -> None:
    cached = [True]
    b = Batching("auto", lambda: cached[0], phase=4, settle=1, explore_every=3)
    assert b.best() == "batch"  # nothing measured: every expert cached, so compute-bound
    cost = {"batch": 0.30, "turns": 0.10}  # seconds per step; a batch step makes 4 tokens

    def run(steps: int) -> list[str]:
        modes = []
        for _ in range(steps):
            mode = b.choose()
            modes.append(mode)
            b.record(mode, 4 if mode == "batch" else 1, cost[mode])
        return modes

    modes = run(64)
    assert modes[:4] == ["turns"] * 4  # the other mode is tried first: nothing known of it
    assert b.cost["batch"] == pytest.approx(0.075) and b.cost["turns"] == pytest.approx(0.10)
    assert b.best() == "batch" and modes[-1] == "batch"
    assert modes.count("turns") == 4 * (1 + (64 // 4 - 1) // 4)  # a phase of turns every fourth phase
    cost["batch"] = 0.8  # the regime changed (say the budget shrank): a batch now costs more per token
    modes = run(64)
    assert b.best() == "turns" and modes[-4:] != ["batch"] * 4
    cost["batch"] = 0.41  # 0.1025 per token: within the margin of turns' 0.10, so turns stays
    run(64)
    assert b.best() == "turns"


def test_the_server_runs_requests_together_with_parallel(small_moe) -> None:
    path = str(small_moe)
    s = Server("-m", path, *FLAGS, "--parallel", "2", "--batching", "batch", env={"BMOE_API_KEY": KEY})
    try:
        health = httpx.get(s.url + "/health").json()
        assert health["parallel"] == 2 and health["generating"] == 0
        first = s.client().completions.create(model="x", prompt=PROMPTS[0], max_tokens=400, stream=True)
        next(iter(first))  # it runs
        other = s.client().completions.create(model="x", prompt=PROMPTS[1], max_tokens=16)
        rest = list(first)
        assert other.choices[0].finish_reason == "length" and other.usage.completion_tokens == 16
        assert rest[-1].choices[0].finish_reason == "length"
        assert metric(s, 'bmoe_decode_steps{mode="batch"}') > 0
        assert httpx.get(s.url + "/metrics", headers=auth()).status_code == 200
    finally:
        assert s.stop() == 143
