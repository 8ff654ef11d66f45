"""bmoe-server's Prometheus metrics: request and generation totals, the last generation's telemetry, and
gauges read when scraped (queue, running generations, batching, the expert cache, the KV); and beside
them llama-server's own series (bmoe.server.llama_metrics)."""

from __future__ import annotations

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from bmoe.api import GenerationStats, Model
from bmoe.server.llama_metrics import LlamaSeries
from bmoe.server.scheduler import Scheduler


class Metrics:
    """The Prometheus registry of one server: totals, the last request's telemetry, queue and cache gauges,
    llama-server's series; `started`: when the process started (Unix seconds, llama-server's
    Process-Start-Time-Unix header)."""

    def __init__(self, model: Model, sched: Scheduler) -> None:
        r = self.registry = CollectorRegistry()
        self.started = int(psutil.Process().create_time())
        self.llama = LlamaSeries(sched)
        r.register(self.llama)
        self.requests = Counter("bmoe_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.generations = Counter("bmoe_generations", "generations run, by finish reason", ["finish_reason"],
                                   registry=r)
        self.generated = Counter("bmoe_generated_tokens", "tokens generated", registry=r)
        self.prefilled = Counter("bmoe_prefill_tokens", "prompt tokens decoded (a reused KV prefix is not)",
                                 registry=r)
        self.slow_readers = Counter("bmoe_slow_readers", "responses cut because the client left them unread past "
                                    "--write-timeout", registry=r)
        self.read = Counter("bmoe_read_bytes", "expert bytes read from flash while decoding", registry=r)
        self.decode_s = Counter("bmoe_decode_seconds", "wall time of the decode tokens", registry=r)
        self.stall_s = Counter("bmoe_stall_seconds", "decode time lost waiting for expert reads", registry=r)
        self.last = Gauge("bmoe_last_request", "the last generation's telemetry (tok_s, mib_per_token, "
                          "cache_hit_pct, stall_s_per_token, prefill_s)", ["measure"], registry=r)
        Gauge("bmoe_queue_waiting", "requests waiting for a KV sequence", registry=r).set_function(
            lambda: len(sched.waiting))
        Gauge("bmoe_generating", "generations running", registry=r).set_function(lambda: len(sched.active))
        steps = Gauge("bmoe_decode_steps", "decode steps with two or more generations running, by how they ran "
                      "(batch: together; turns: the oldest alone)", ["mode"], registry=r)
        for mode in sched.batching.steps:
            def count(m: str = mode) -> int:
                return sched.batching.steps[m]
            steps.labels(mode).set_function(count)
        Gauge("bmoe_cache_resident_bytes", "expert bytes resident in the cache", registry=r).set_function(
            lambda: model.stats.engine.resident_bytes)
        Gauge("bmoe_cache_budget_bytes", "the expert cache budget", registry=r).set_function(
            lambda: model.stats.engine.budget_bytes)
        Gauge("bmoe_kv_tokens", "tokens in the KV, every sequence's", registry=r).set_function(
            lambda: sum(len(s.kv_tokens) for s in model.slots))

    def generation(self, s: GenerationStats) -> None:
        self.llama.generation(s)
        self.generations.labels(s.finish_reason).inc()
        self.generated.inc(s.completion_tokens)
        self.prefilled.inc(s.prefill_tokens)
        self.read.inc(s.read_mib * 2**20)
        wall = s.completion_tokens / s.tok_s if s.tok_s > 0 else 0.0
        self.decode_s.inc(wall)
        self.stall_s.inc(s.stall_s_per_token * s.completion_tokens)
        for k in ("tok_s", "mib_per_token", "cache_hit_pct", "stall_s_per_token", "prefill_s"):
            self.last.labels(k).set(getattr(s, k))

    def text(self) -> bytes:
        return generate_latest(self.registry)
