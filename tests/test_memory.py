"""Resident memory stays bounded by the budget, measured from the segment after every token."""

from __future__ import annotations

from bmoe.base.units import MiB
from bmoe.streaming.expert_cache import working_sets
from tests.conftest import complete, load, per_token

PROMPT = "Describe how a river carves a canyon over many thousands of years of slow and patient work"


def test_resident_bytes_never_exceed_budget_plus_one_layer(synth) -> None:
    path = synth(arch="qwen3moe", layers=6, experts=32, top_k=2, embd=128, ff=384)
    with load(path, "-c", 512, "--cache-mb", 1e6) as probe:
        expert_bytes = sum(r.nbytes for r in probe.engine.streamer.cache.regions)
    budget_mb = expert_bytes / 5 / MiB
    with load(path, "-c", 512, "--cache-mb", budget_mb, "--io-threads", 2) as m:
        e = m.engine
        resident: list[int] = []
        complete(m, PROMPT, 64, on_chunk=per_token(lambda i: resident.append(e.stats().resident_bytes)))
        one_layer = max(working_sets(e.streamer.cache.regions, 2).values())
        assert expert_bytes >= 4 * e.stats().budget_bytes
        assert len(resident) >= 64
        assert max(resident) <= e.stats().budget_bytes + one_layer, (max(resident), e.stats().budget_bytes, one_layer)
        assert max(resident) > e.stats().budget_bytes // 2, "the cache should actually fill up"
        assert e.streamer.cache.stats.evictions > 0
