"""llama-server's Prometheus series (`llamacpp:*`) on bmoe-server's /metrics, beside bmoe's own `bmoe_*`:
the dashboards and alerts written for llama-server read the same names with the same meanings.

Where bmoe measures something else, the help line says what: a prompt's tokens are the ones decoded (the
KV prefix reused is `prompt_tokens_cached_total`; embeddings inputs count as prompts, as llama-server's),
`n_decode_total` counts decode steps, prefills and embeddings inputs (a decode each), and `n_tokens_max` is a
gauge (llama-server types it a counter without the `_total` a counter's name ends in, which the Prometheus
library does not write). The speculative series count `--draft`'s drafts as llama-server counts its own (0
without it): tokens drafted, drafts accepted, verify steps, and once a generation verified drafts the labeled
accepted-per-position counter. As llama-server's, the two throughput gauges are averaged over the window between
two scrapes: each scrape starts a new one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from bmoe.api import GenerationStats
from bmoe.server.scheduler import Scheduler

PREFIX = "llamacpp:"


class LlamaSeries(Collector):
    """llama-server's series over the generations `generation` is told of and `sched`'s queue and steps."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.lock = threading.Lock()  # generations end on the scheduler's thread, scrapes on the event loop's
        self.prompt, self.cached, self.predicted, self.n_tokens_max = 0, 0, 0, 0
        self.prompt_s, self.predicted_s = 0.0, 0.0
        self.drafted, self.accepted, self.verify_steps = 0, 0, 0
        self.per_pos: list[int] = []  # accepted drafts by draft position (llama-server's n_accepted_per_pos)
        self.window = (0, 0.0, 0, 0.0)  # since the last scrape: prompt tokens and seconds, predicted and seconds

    def generation(self, s: GenerationStats) -> None:
        decode_s = s.completion_tokens / s.tok_s if s.tok_s > 0 else 0.0
        with self.lock:
            self.prompt += s.prefill_tokens
            self.cached += s.prompt_tokens - s.prefill_tokens
            self.predicted += s.completion_tokens
            self.prompt_s += s.prefill_s
            self.predicted_s += decode_s
            self.n_tokens_max = max(self.n_tokens_max, s.kv_tokens)
            self.drafted += s.drafted
            self.accepted += s.accepted
            self.verify_steps += s.verify_steps
            self.per_pos += [0] * (len(s.accepted_per_pos) - len(self.per_pos))
            for i, n in enumerate(s.accepted_per_pos):
                self.per_pos[i] += n
            p, ps, g, gs = self.window
            self.window = (p + s.prefill_tokens, ps + s.prefill_s, g + s.completion_tokens, gs + decode_s)

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            (p, ps, g, gs), self.window = self.window, (0, 0.0, 0, 0.0)
            totals = self.prompt, self.cached, self.prompt_s, self.predicted, self.predicted_s, self.n_tokens_max
            drafts, per_pos = (self.drafted, self.accepted, self.verify_steps), list(self.per_pos)
        prompt, cached, prompt_s, predicted, predicted_s, n_tokens_max = totals
        sched = self.sched
        prompt, prompt_s = prompt + sched.embedded_tokens, prompt_s + sched.embedded_s  # embeddings cost a prompt too
        counters = (
            ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", prompt),
            ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache (the KV prefix)", cached),
            ("prompt_seconds_total", "Total time spent processing prompts", prompt_s),
            ("tokens_predicted_total", "Number of generation tokens processed", predicted),
            ("tokens_predicted_seconds_total", "Total time spent generating tokens", predicted_s),
            ("n_decode_total", "Decode steps (one llama.cpp batch each, whatever runs in it), prompt prefills and "
             "embeddings inputs",
             sched.decodes + sched.prefills),
            ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", drafts[0]),
            ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model",
             drafts[1]),
            ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps", drafts[2]),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        if per_pos:  # as llama-server's: only once a generation verified drafts
            by_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos_total",
                                         "Accepted tokens per draft position", labels=["position"])
            for i, n in enumerate(per_pos):
                by_pos.add_metric([str(i)], n)
            yield by_pos
        gauges = (
            ("n_tokens_max", "Largest observed sequence length (prompt + generation)", n_tokens_max),
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s since the last scrape",
             p / ps if ps > 0 else 0.0),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s since the last scrape",
             g / gs if gs > 0 else 0.0),
            ("requests_processing", "Number of requests processing", len(sched.active)),
            ("requests_deferred", "Number of requests deferred (waiting for a KV sequence)", len(sched.waiting)),
            ("n_busy_slots_per_decode", "Average number of sequences decoded per decode step",
             sched.decoding / max(sched.decodes, 1)),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
