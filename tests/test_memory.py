"""Resident memory stays bounded by the budget, measured from the segment after every token."""

from __future__ import annotations

from bmoe.coordinator import Engine
from bmoe.expert_cache import working_sets
from bmoe.units import MiB
from tests.conftest import settings_for

PROMPT = "Describe how a river carves a canyon over many thousands of years of slow and patient work"


def test_resident_bytes_never_exceed_budget_plus_one_layer(synth) -> None:
    path = synth(arch="qwen3moe", layers=6, experts=32, top_k=2, embd=128, ff=384)
    probe = Engine(settings_for(path, "-c", 512, "--cache-mb", 1e6))
    expert_bytes = sum(r.nbytes for r in probe.streamer.cache.regions)
    probe.close()
    budget_mb = expert_bytes / 5 / MiB
    e = Engine(settings_for(path, "-c", 512, "--cache-mb", budget_mb, "--io-threads", 2))
    try:
        per_token: list[int] = []
        toks = e.prompt_tokens(PROMPT, chat=False)
        res = e.generate(toks, 64, lambda i, s, st: per_token.append(e.resident_bytes()))
        one_layer = max(working_sets(e.streamer.cache.regions, 2).values())
        assert expert_bytes >= 4 * e.budget
        assert len(per_token) >= 64
        assert max(per_token) <= e.budget + one_layer, (max(per_token), e.budget, one_layer)
        assert res.max_resident <= e.budget + one_layer
        assert max(per_token) > e.budget // 2, "the cache should actually fill up"
        assert e.streamer.cache.stats.evictions > 0
    finally:
        e.close()
