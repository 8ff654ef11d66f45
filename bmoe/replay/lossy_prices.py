"""What `--drop-cold F` would save on a recorded routing, priced in router weight.

A v1 trace (or a bmoe trace recorded with weights) says how much of each token's routing weight
every expert carried. Replayed through the live cache under the default policy, a routed expert
that would have to be read and carries less than F of its token's weight at that layer (never the
token's best) is dropped, as bmoe.streaming.lossy drops it: it is not read and not cached. The
price is the router weight dropped (mean share per token and layer); the gain is the MiB/token not
read against the lossless replay at the same budget. The demo's KL figures (docs/lossy.md) say what
a given dropped weight costs in output; these say how much weight a real model's routing would
give up for how many bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bmoe.base.settings import DEFAULT_POLICY
from bmoe.base.units import MiB
from bmoe.replay.stats import ReplayBudget, regions_for, replay, start_after_prompt
from bmoe.streaming.expert_cache import RESIDENT, ExpertCache, Region
from bmoe.streaming.route_trace import Trace


@dataclass
class Price:
    trace: str
    budget: str
    drop_cold: float
    mib_per_token: float
    lossless_mib_per_token: float
    weight_dropped_pct: float

    @property
    def reads_saved_pct(self) -> float:
        return 100.0 * (1 - self.mib_per_token / self.lossless_mib_per_token) if self.lossless_mib_per_token else 0.0


def drop_cold_replay(t: Trace, regions: list[Region], budget: ReplayBudget, f: float,
                     policy: str = DEFAULT_POLICY) -> tuple[float, float]:
    """MiB read per decode token and the mean router-weight share dropped per token and layer."""
    if t.weights is None:
        raise ValueError("the trace has no router weights; record it with --route-trace PATH.csv "
                         "or use a route_trace v1 file")
    cache = ExpertCache(None, regions, budget.bytes(sum(r.nbytes for r in regions)), policy)
    start_after_prompt(cache, t)
    read = 0
    dropped = 0.0
    visits = 0
    for routes, weights in zip(t.routes, t.weights):
        for layer in t.layers:
            ids, ws = routes.get(layer, []), weights.get(layer, [])
            total = sum(ws) or 1.0
            keep = []
            for rank, (e, w) in enumerate(zip(ids, ws)):
                absent = any(cache.state[ri][e] != RESIDENT for ri in cache.by_layer[layer])
                if rank and absent and w / total < f:
                    dropped += w / total
                else:
                    keep.append(e)
            visits += 1
            missing = cache.plan(layer, sorted(set(keep)))
            read += sum(cache.read_bytes(k) for k in missing)
            cache.commit(missing)
    n = max(1, len(t.routes))
    return read / MiB / n, 100.0 * dropped / max(1, visits)


def prices(paths: list[str], budgets: list[ReplayBudget], fs: list[float], model: str | None = None) -> list[Price]:
    """Every trace × budget × F, each against its lossless replay (default policy)."""
    out = []
    for path in paths:
        t = Trace.read(path)
        regions = regions_for(t, model)
        name = Path(path).name.split(".")[0]
        for b in budgets:
            _, lossless = replay(t, regions, b, DEFAULT_POLICY, prefill=True)
            for f in fs:
                mib, weight = drop_cold_replay(t, regions, b, f)
                out.append(Price(name, b.label, f, mib, lossless, weight))
    return out


def price_table(rows: list[Price]) -> str:
    """Markdown: per trace and budget, reads saved against router weight dropped for each F."""
    out = ["| trace | budget | --drop-cold | MiB/token (lossless) | reads saved | router weight dropped |",
           "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r.trace} | {r.budget} | {r.drop_cold:g} | {r.mib_per_token:.1f} "
                   f"({r.lossless_mib_per_token:.1f}) | {r.reads_saved_pct:.1f}% | {r.weight_dropped_pct:.2f}% |")
    return "\n".join(out)
