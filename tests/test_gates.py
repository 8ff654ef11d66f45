"""Byte-identity gates: streamed output equals plain llama.cpp (`--no-stream`) token for token."""

from __future__ import annotations

from functools import lru_cache

import pytest

from bmoe.coordinator import Engine, Result, Settings
from bmoe.synth import ARCHES

PROMPT = ("In the valley below the mountains, a small village kept an old tradition: every spring the "
          "farmers walked to the river and sang")
N_PREDICT = 48
MIN_TOKENS = 32
MiB = 1 << 20

CASES = [(arch, "q8_0") for arch in ARCHES] + [
    ("qwen3moe", "q4_0"), ("qwen3moe", "f16"), ("llama", "q4_0"), ("llama", "f16"), ("gpt-oss", "mxfp4"),
]


def generate(path: str, **kw: object) -> tuple[Result, Engine]:
    """One greedy run; the engine is returned closed, for its final counters."""
    e = Engine(Settings(model=path, n_ctx=256, threads=2, **kw))
    try:
        toks = e.prompt_tokens(PROMPT, chat=False)
        assert len(toks) >= 13
        return e.generate(toks, N_PREDICT), e
    finally:
        e.close()


@lru_cache(maxsize=None)
def reference(path: str) -> Result:
    res, _ = generate(path, stream=False)
    assert len(res.ids) >= MIN_TOKENS, "the reference must not stop early, or the gate proves little"
    return res


@pytest.mark.parametrize("lanes", [1, 4])
@pytest.mark.parametrize("budget", ["zero", "third", "all"])
@pytest.mark.parametrize("arch,quant", CASES)
def test_streamed_equals_plain(synth, arch: str, quant: str, budget: str, lanes: int) -> None:
    path = str(synth(arch=arch, quant=quant, layers=4, experts=8, top_k=2))
    ref = reference(path)
    probe = Engine(Settings(model=path, n_ctx=256, threads=2, cache_mb=1e6))
    expert_bytes = sum(r.nbytes for r in probe.streamer.cache.regions)
    probe.close()
    cache_mb = {"zero": 0.0, "third": expert_bytes / 3 / MiB, "all": expert_bytes * 1.1 / MiB}[budget]
    res, _ = generate(path, cache_mb=cache_mb, io_threads=lanes)
    assert res.ids == ref.ids
    assert res.text == ref.text
    hits = sum(s.hits for s in res.steps)
    misses = sum(s.lookups - s.hits for s in res.steps)
    if budget == "zero":
        assert all(s.read_bytes > 0 for s in res.steps), "with no cache every token reads its experts"
    if budget == "third":
        assert hits > 0 and misses > 0, "a third of the experts must force misses and still hit"
