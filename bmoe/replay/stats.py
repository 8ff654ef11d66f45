"""What a route trace says: previous-token reuse, expert concentration, next-layer router recall, LRU
hit rate by budget.

`bmoe-bench routes PATH` prints `report` and `bmoe-demo --stats` its own summary; `replay` runs a
trace through the live cache and is what `bmoe-bench policies` (bmoe.replay.policies) is built on.
A route_trace v1 file names each layer's expert bytes, so it replays with no model file
(`regions_for`); a bmoe trace needs its model's GGUF table.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bmoe.base.model_files import read_model_files
from bmoe.base.units import MiB
from bmoe.streaming.cache_policy import Policy
from bmoe.streaming.expert_cache import WARM_PROMPT_ROWS, ExpertCache, Region, file_regions, layout
from bmoe.streaming.route_trace import Trace

BUDGETS_PCT = (10, 25, 50, 75)


@dataclass(frozen=True)
class ReplayBudget:
    """A cache budget as a share of the expert bank (`pct`) or in MiB (`mib`); `label` prints it."""

    pct: float | None = None
    mib: float | None = None

    @classmethod
    def parse(cls, text: str) -> ReplayBudget:
        """`25` or `25%`: a share of all expert bytes; `1300MiB` or `1300M`: MiB."""
        t = text.strip()
        for unit in ("MiB", "M"):
            if t.endswith(unit):
                return cls(mib=float(t[: -len(unit)]))
        return cls(pct=float(t.rstrip("%")))

    def bytes(self, bank: int) -> int:
        return int(self.mib * MiB) if self.mib is not None else int(bank * (self.pct or 0) / 100)

    @property
    def label(self) -> str:
        return f"{self.mib:g} MiB" if self.mib is not None else f"{self.pct:g}%"


def trace_regions(t: Trace) -> list[Region]:
    """One region per MoE layer holding whole experts of the trace's `expert_bytes`, laid out as a
    running cache lays them out: the replay of a v1 trace without its model file."""
    n = int(t.header["n_expert"])
    regions, offset = [], 0
    for layer in t.layers:
        eb = t.expert_bytes[layer]
        regions.append(Region(f"blk.{layer}.ffn_exps", layer, "ffn_exps", 0, offset, n, eb))
        offset += n * eb
    layout(regions)
    return regions


def regions_for(t: Trace, model: str | Path | None = None) -> list[Region]:
    """The expert regions a replay of `t` charges: from `model` when given, else from the trace's own
    expert bytes (v1), else from the model file the trace names."""
    if model is None and t.expert_bytes and all(t.expert_bytes.get(layer) for layer in t.layers):
        return trace_regions(t)
    m = model or t.header.get("model")
    if not m or not Path(m).exists():
        raise ValueError(f"the trace's model {m or '(none named)'} does not exist and the trace does not give "
                         f"its expert bytes; pass the model with -m")
    return file_regions(read_model_files(m))


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
    from bmoe.workers import routers

    try:
        found = routers.load_routers([model], t.header["arch"], t.layers)
        pred = routers.Predictor(found, int(t.header["top_k"]), rescale)
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


def start_after_prompt(cache: ExpertCache, t: Trace) -> None:
    """The trace's prompt as one batch, as live: each layer plans the union of the prompt tokens'
    experts, those its last WARM_PROMPT_ROWS tokens did not route admitted cold."""
    for layer in t.layers:
        experts = sorted({e for step in t.prompt for e in step.get(layer, ())})
        tail = {e for step in t.prompt[-WARM_PROMPT_ROWS:] for e in step.get(layer, ())}
        cache.commit(cache.plan(layer, experts, set(experts) - tail))


def replay(t: Trace, regions: list[Region], budget: ReplayBudget | float, policy: str | Policy = "lru",
           predictions: list[list[list[tuple[int, list[int]]]]] | None = None,
           prefill: bool = False) -> tuple[float, float]:
    """Hit rate and MiB read per token of a cache policy over the trace's decode tokens, for a
    budget (a bare number: a share of all expert bytes).

    The replay runs the live ExpertCache (without memory), so its numbers are the cache's.
    `predictions[step][i]` lists (layer, experts) hints given to the cache before layer i's routing.
    With `prefill`, decode starts after the prompt (`start_after_prompt`); a trace without prompt
    rows (bmoe's JSON traces hold decode only) gets a pass that routes every expert of every layer,
    as a prompt of a few dozen tokens does. That pass is not counted.
    """
    b = budget if isinstance(budget, ReplayBudget) else ReplayBudget(pct=budget)
    cache = ExpertCache(None, regions, b.bytes(sum(r.nbytes for r in regions)), policy)
    if prefill and t.prompt:
        start_after_prompt(cache, t)
    elif prefill:
        for layer in t.layers:
            cache.commit(cache.plan(layer, list(range(cache.n_expert(layer)))))
    cache.reset_stats()
    read = 0
    for step, routes in enumerate(t.routes):
        for i, layer in enumerate(t.layers):
            for hint_layer, experts in predictions[step][i] if predictions else ():
                cache.predict(hint_layer, experts)
            missing = cache.plan(layer, sorted(set(routes.get(layer, ()))))
            read += sum(cache.read_bytes(k) for k in missing)
            cache.commit(missing)
    return cache.stats.hit_pct, read / MiB / max(1, len(t.routes))


def report(path: str | Path, model: str | Path | None = None) -> str:
    t = Trace.read(path)
    regions = regions_for(t, model)
    lines = [f"routes: {path} ({len(t.routes)} tokens, {len(t.layers)} MoE layers, "
             f"{t.header['n_expert']} experts, top-{t.header['top_k']})",
             f"previous-token reuse: {previous_token_reuse(t):.1f}% (uniform routing: {uniform_reuse(t):.1f}%)",
             f"busiest quarter of a layer's experts: {busiest_quarter(t):.1f}% of its routes"]
    try:
        lines.append(f"next-layer router recall: {next_layer_recall(t, model or t.header['model']):.1f}% "
                     f"(router input used as is: "
                     f"{next_layer_recall(t, model or t.header['model'], rescale=False):.1f}%)")
    except ValueError as e:
        lines.append(f"next-layer router recall: n/a ({e})")
    curve = [(pct, *replay(t, regions, pct, prefill=bool(t.prompt))) for pct in BUDGETS_PCT]
    lines.append("LRU hit rate by budget (share of expert bytes): " + ", ".join(
        f"{pct}%: {hit:.1f}% hit ({mib:.2f} MiB/token)" for pct, hit, mib in curve))
    return "\n".join(lines)
