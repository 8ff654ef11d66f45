"""What a route trace says: previous-token reuse, expert concentration, next-layer router recall, LRU
hit rate by budget.

`bmoe-bench routes PATH` prints `report` and `bmoe-demo --stats` its own summary; `replay` runs a
trace through the live cache and is what `bmoe-bench policies` (bmoe.replay.policies) is built on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bmoe.base.model_files import open_model
from bmoe.base.units import MiB
from bmoe.streaming.cache_policy import Policy
from bmoe.streaming.expert_cache import ExpertCache, Region, file_regions
from bmoe.streaming.route_trace import Trace

BUDGETS_PCT = (10, 25, 50, 75)


def previous_token_reuse(t: Trace) -> float:
    """Share of a token's routed experts the previous token also routed at that layer."""
    same = total = 0
    for prev, cur in zip(t.routes, t.routes[1:]):
        for layer in t.layers:
            now = set(cur.get(layer, ()))
            same += len(now & set(prev.get(layer, ())))
            total += len(now)
    return 100.0 * same / total if total else 0.0


def uniform_reuse(t: Trace) -> float:
    """`previous_token_reuse` if routing were uniformly random (top_k / n_expert): its scale."""
    return 100.0 * int(t.header["top_k"]) / int(t.header["n_expert"])


def busiest_quarter(t: Trace) -> float:
    """Share of a layer's routes taken by its busiest quarter of experts, averaged over layers:
    how much a cache holding the popular experts could serve."""
    n_expert = int(t.header["n_expert"])
    shares = []
    for layer in t.layers:
        ids = [e for step in t.routes for e in step.get(layer, ())]
        if ids:
            counts = np.sort(np.bincount(ids, minlength=n_expert))[::-1]
            shares.append(counts[: max(1, n_expert // 4)].sum() / counts.sum())
    return 100.0 * float(np.mean(shares)) if shares else 0.0


def next_layer_recall(t: Trace, model: str | Path, rescale: bool = True) -> float:
    """Share of layer l+1's routed experts that the spec-gate's predictor picks from layer l's router input."""
    if t.hidden is None:
        raise ValueError("the trace has no hidden states (.hidden.npy); re-record it with --route-trace")
    from bmoe.streaming import routers

    try:
        pred = routers.Predictor(routers.load([model], t.header["arch"], t.layers), int(t.header["top_k"]), rescale)
    except routers.RouterError as e:
        raise ValueError(f"{e}; offline recall needs F32/F16 routers") from None
    hit = total = 0
    for step, routes in enumerate(t.routes):
        for i, layer in enumerate(t.layers):
            h = t.hidden[step, i]
            p = None if np.isnan(h).any() else pred.predict(layer, h)
            if p is None or not routes.get(p.layer):
                continue
            actual = set(routes[p.layer])
            hit += len(set(p.ids.tolist()) & actual)
            total += len(actual)
    return 100.0 * hit / total if total else 0.0


def replay(t: Trace, regions: list[Region], budget_pct: float, policy: str | Policy = "lru",
           predictions: list[list[list[tuple[int, list[int]]]]] | None = None,
           prefill: bool = False) -> tuple[float, float]:
    """Hit rate and MiB read per token of a cache policy, for a budget as a share of all expert bytes.

    The replay runs the live ExpertCache (without memory), so its numbers are the cache's.
    `predictions[step][i]` lists (layer, experts) hints given to the cache before layer i's routing.
    With `prefill`, decode starts after a pass that routed every expert of every layer, as a
    prompt of a few dozen tokens does in a live run (the trace holds decode tokens only); that
    pass is not counted.
    """
    total = sum(r.nbytes for r in regions)
    cache = ExpertCache(None, regions, int(total * budget_pct / 100), policy)
    if prefill:
        for layer in t.layers:
            cache.commit(cache.plan(layer, list(range(max(regions[i].n_expert for i in cache.by_layer[layer])))))
        cache.reset_stats()
    read = 0
    for step, routes in enumerate(t.routes):
        for i, layer in enumerate(t.layers):
            for hint_layer, experts in predictions[step][i] if predictions else ():
                cache.predict(hint_layer, experts)
            missing = cache.plan(layer, sorted(set(routes.get(layer, ()))))
            read += sum(cache.charge(ri, e) for _, ri, e in missing)
            cache.commit(missing)
    return cache.stats.hit_pct, read / MiB / max(1, len(t.routes))


def report(path: str | Path, model: str | Path | None = None) -> str:
    t = Trace.read(path)
    model = model or t.header["model"]
    regions = file_regions(open_model(model))
    lines = [f"routes: {path} ({len(t.routes)} tokens, {len(t.layers)} MoE layers, "
             f"{t.header['n_expert']} experts, top-{t.header['top_k']})",
             f"previous-token reuse: {previous_token_reuse(t):.1f}%"]
    try:
        lines.append(f"next-layer router recall: {next_layer_recall(t, model):.1f}% "
                     f"(router input used as is: {next_layer_recall(t, model, rescale=False):.1f}%)")
    except ValueError as e:
        lines.append(f"next-layer router recall: n/a ({e})")
    curve = [(pct, *replay(t, regions, pct)) for pct in BUDGETS_PCT]
    lines.append("LRU hit rate by budget (share of expert bytes): " + ", ".join(
        f"{pct}%: {hit:.1f}% hit ({mib:.2f} MiB/token)" for pct, hit, mib in curve))
    return "\n".join(lines)
