"""`bmoe-bench policies`: replay route traces through every cache policy and two bounds.

The bounds need the trace's future, so only the simulator runs them: Belady's MIN (the offline
optimum) and `next-token-oracle` (`next-use` told the next token's routing: what a perfect
next-token predictor could add).

Each policy runs inside the live `ExpertCache` (with no memory behind it), so a simulated hit rate
is what `bmoe-cli --cache-policy NAME` gets on the same routing. Prediction-aware policies are
told, before each layer's routing, what a prefetcher could know at that moment:

- temporal: the previous token's routing at the next PREDICT_AHEAD layers;
- spec-gate: layer l+1's router applied to layer l's router input (the trace's .hidden.npy).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from bmoe.replay.bounds import Belady, NextTokenOracle
from bmoe.replay.stats import ReplayBudget, regions_for, replay
from bmoe.streaming.cache_policy import POLICIES, Policy
from bmoe.streaming.route_trace import Trace
from bmoe.workers import routers

PREDICT_AHEAD = 2
BELADY = "belady"

Hints = list[list[list[tuple[int, list[int]]]]]


@dataclass
class Row:
    trace: str
    policy: str
    budget: str
    hit_pct: float
    mib_per_token: float
    us_per_token: float


def temporal_hints(t: Trace) -> Hints:
    """At step s before layer i: step s-1's routing at layers i+1 .. i+PREDICT_AHEAD."""
    n = len(t.layers)
    out: Hints = []
    for s in range(len(t.routes)):
        prev = t.routes[s - 1] if s else {}
        out.append([[(t.layers[j], prev.get(t.layers[j], [])) for j in range(i + 1, min(n, i + 1 + PREDICT_AHEAD))
                     if prev.get(t.layers[j])] for i in range(n)])
    return out


def spec_gate_hints(t: Trace, model: str | Path | None) -> Hints | None:
    """At step s before layer i: the spec-gate's prediction for layer i+1 from layer i's router input.

    None when the trace has no hidden states or no model file, or the model's routers cannot predict
    (quantized).
    """
    if t.hidden is None or model is None or not Path(model).exists():
        return None
    try:
        pred = routers.Predictor(routers.load_routers([model], t.header["arch"], t.layers), int(t.header["top_k"]))
    except routers.RouterError:
        return None
    out: Hints = [[[] for _ in t.layers] for _ in t.routes]
    for s in range(len(t.routes)):
        for i, layer in enumerate(t.layers):
            h = t.hidden[s, i]
            p = None if np.isnan(h).any() else pred.predict(layer, h)
            if p is not None:
                out[s][i].append((p.layer, p.ids.tolist()))
    return out


def merge_hints(a: Hints, b: Hints | None) -> Hints:
    if b is None:
        return a
    return [[x + y for x, y in zip(sa, sb)] for sa, sb in zip(a, b)]


def belady_future(t: Trace) -> dict[tuple[int, int], list[int]]:
    """(layer, expert) -> positions (step × N + layer position) at which it is routed."""
    n = len(t.layers)
    fut: dict[tuple[int, int], list[int]] = {}
    for s, routes in enumerate(t.routes):
        for i, layer in enumerate(t.layers):
            for e in sorted(set(routes.get(layer, ()))):
                fut.setdefault((layer, e), []).append(s * n + i)
    return fut


def simulate(paths: list[str], budgets: list[ReplayBudget], model: str | None = None,
             progress: Callable[[str], None] = lambda s: None, prefill: bool = True) -> list[Row]:
    """Every policy and Belady at every budget on every trace (after the prompt or a prefill pass,
    see stats.replay). A v1 trace needs no model file; a bmoe trace reads its model's GGUF table."""
    rows = []
    for path in paths:
        t = Trace.read(path)
        if not t.routes:
            raise ValueError(f"{path} holds no decode tokens; record a longer run")
        regions = regions_for(t, model)
        hints = merge_hints(temporal_hints(t), spec_gate_hints(t, model or t.header.get("model")))
        future = belady_future(t)
        name = Path(path).name.split(".")[0]
        for budget in budgets:
            # a built-in policy is given by its name (replay makes it), the oracles as objects
            makers: list[tuple[str, Callable[[], str | Policy]]] = [(p, partial(str, p)) for p in POLICIES]
            makers.append((NextTokenOracle.name,
                           partial(NextTokenOracle, t.layers, future, prefill_tokens=int(prefill))))
            makers.append((BELADY, partial(Belady, t.layers, future, prefill_tokens=int(prefill))))
            for pname, make in makers:
                progress(f"{name}: {pname} at {budget.label} ...")
                t0 = time.perf_counter()
                policy = make()
                wants = isinstance(policy, str) and POLICIES[policy].wants_predictions
                hit, mib = replay(t, regions, budget, policy, hints if wants else None, prefill)
                us = (time.perf_counter() - t0) * 1e6 / len(t.routes)
                rows.append(Row(name, pname, budget.label, hit, mib, us))
    return rows


def policy_table(rows: list[Row]) -> str:
    """One block per trace: hit rate and MiB/token per policy and budget, and the distance to Belady."""
    out = []
    for name in dict.fromkeys(r.trace for r in rows):
        mine = [r for r in rows if r.trace == name]
        budgets = list(dict.fromkeys(r.budget for r in mine))
        best = {r.budget: r.hit_pct for r in mine if r.policy == BELADY}
        lru = {r.budget: r.hit_pct for r in mine if r.policy == "lru"}
        out.append(f"## {name}\n")
        out.append("| policy | " + " | ".join(f"{b}: hit / MiB/tok / vs LRU / to Belady" for b in budgets)
                   + " | mgmt µs/token |")
        out.append("| --- | " + " | ".join("---" for _ in budgets) + " | --- |")
        for pname in dict.fromkeys(r.policy for r in mine):
            cells = []
            us = []
            for b in budgets:
                r = next(x for x in mine if x.policy == pname and x.budget == b)
                us.append(r.us_per_token)
                cells.append(f"{r.hit_pct:.1f}% / {r.mib_per_token:.1f} / {r.hit_pct - lru[b]:+.1f} / "
                             f"{r.hit_pct - best[b]:+.1f}")
            out.append(f"| {pname} | " + " | ".join(cells) + f" | {max(us):.0f} |")
        out.append("")
    return "\n".join(out)
