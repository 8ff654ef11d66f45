"""`bmoe-bench policies --guesses`: how well the routing seen so far guesses a layer's misses
(bmoe.streaming.route_guess).

A trace is replayed through the live ExpertCache (the default policy, no memory behind it), and
after each layer routes, RouteGuess (fed the same routing, the prompt's rows first) names the next
layer's experts at each threshold. Counted per decode token, among the experts the cache lacks
when the guess is made: the misses the next layer has, the guesses, how many guesses are misses
(recall: of the misses; precision: of the guesses) and the guessed bytes its layer did not route.
The cache itself is not changed by the guesses, so every threshold sees the same misses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bmoe.base.settings import DEFAULT_POLICY
from bmoe.base.units import MiB
from bmoe.replay.stats import ReplayBudget, regions_for, start_after_prompt
from bmoe.streaming.expert_cache import ExpertCache
from bmoe.streaming.route_guess import RouteGuess
from bmoe.streaming.route_trace import Trace


@dataclass
class GuessRow:
    trace: str
    budget: str
    threshold: float
    misses: float  # per decode token
    guesses: float
    recall_pct: float
    precision_pct: float
    unused_mib: float  # guessed bytes per token the next layer did not route


def score_guesses(path: str, budget: ReplayBudget, thresholds: tuple[float, ...],
                  model: str | None = None) -> list[GuessRow]:
    """One row per threshold for one trace and budget."""
    t = Trace.read(path)
    if not t.routes:
        raise ValueError(f"{path} holds no decode tokens; record a longer run")
    regions = regions_for(t, model)
    n = int(t.header["n_expert"])
    bank = sum(r.nbytes for r in regions)
    cache = ExpertCache(None, regions, budget.bytes(bank), DEFAULT_POLICY)
    start_after_prompt(cache, t)
    guessers = [RouteGuess(t.layers, n, th) for th in thresholds]
    for row in t.prompt:
        for layer in t.layers:
            for g in guessers:
                g.observe(layer, np.array([row.get(layer, [])], dtype=np.int64))
    counts = np.zeros((len(thresholds), 3))  # guesses, of them misses, unused bytes
    misses = 0
    charge = {r.layer: 0 for r in regions}
    for r in regions:
        charge[r.layer] += r.expert_bytes
    for routes in t.routes:
        for i, layer in enumerate(t.layers):
            cache.commit(cache.plan(layer, sorted(set(routes.get(layer, ())))))
            for g in guessers:
                g.observe(layer, np.array([routes.get(layer, [])], dtype=np.int64))
            if i + 1 == len(t.layers):
                continue
            nxt = t.layers[i + 1]
            routed = set(routes.get(nxt, ()))
            absent = {e for e in range(n) if not cache.resident[nxt][e]}
            misses += len(routed & absent)
            for k, g in enumerate(guessers):
                guessed = {e for e, _ in g.guess(layer)} & absent
                counts[k] += (len(guessed), len(guessed & routed), len(guessed - routed) * charge[nxt])
    steps = len(t.routes)
    name = path.rsplit("/", 1)[-1].split(".")[0]
    return [GuessRow(name, budget.label, th, misses / steps, c[0] / steps, 100 * c[1] / max(1, misses),
                     100 * c[1] / max(1, c[0]), c[2] / MiB / steps) for th, c in zip(thresholds, counts)]


def guess_table(rows: list[GuessRow]) -> str:
    out = ["| trace | cache | threshold | misses/token | guesses/token | recall % | precision % | unused MiB/token |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r.trace} | {r.budget} | {r.threshold:g} | {r.misses:.1f} | {r.guesses:.1f} | "
                   f"{r.recall_pct:.1f} | {r.precision_pct:.1f} | {r.unused_mib:.1f} |")
    return "\n".join(out)
