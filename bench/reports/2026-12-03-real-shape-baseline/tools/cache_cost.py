"""What ExpertCache.plan + commit cost per decode token on a recorded routing, as the tree's code is and
with the eviction that picks a victim of the needed slot pool (ExpertCache._evict_for) switched off
(victims then come in the policy's order only; the other pool's freed index is given back instead).
Best of --rounds, one process, no model load (the routing replayed as bench/bytes_by_cause.py does).

    python bench/reports/2026-12-03-real-shape-baseline/tools/cache_cost.py -m MODEL --trace X.route.csv
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

import bytes_by_cause as bbc  # noqa: E402

from bmoe.base.model_files import read_model_files  # noqa: E402
from bmoe.base.units import MiB  # noqa: E402
from bmoe.streaming.expert_cache import ExpertCache, file_regions  # noqa: E402
from bmoe.streaming.route_trace import Trace  # noqa: E402


def replay(t: Trace, shape: bbc.Shape, budget: int, policy: str, group_lock: bool) -> tuple[float, float]:
    saved = ExpertCache._evict_for
    if not group_lock:
        ExpertCache._evict_for = lambda self, g, cls: None  # type: ignore[method-assign]
    try:
        c = ExpertCache(None, shape.regions, budget, policy)
        for layer in t.layers:
            ids = bbc.prompt_ids(t, layer)
            if ids:
                c.commit(c.plan(layer, sorted(set(ids))))
        clock = time.perf_counter_ns
        plan = commit = 0
        for routes in t.routes:
            for layer in t.layers:
                experts = sorted(set(routes.get(layer, ())))
                t0 = clock()
                missing = c.plan(layer, experts)
                t1 = clock()
                c.commit(missing)
                commit += clock() - t1
                plan += t1 - t0
        n = max(1, len(t.routes))
        return plan / n / 1e6, commit / n / 1e6
    finally:
        ExpertCache._evict_for = saved  # type: ignore[method-assign]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", type=Path, required=True)
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--cache-mb", type=float, default=2000)
    p.add_argument("--policies", default="next-use,lru")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    t = Trace.read(a.trace)
    shape = bbc.Shape(file_regions(read_model_files(a.model)))
    print("| policy | slot-pool eviction | plan ms/token | commit ms/token |\n|---|---|---:|---:|")
    for pol in a.policies.split(","):
        for lock in (True, False):
            plan, commit = min((replay(t, shape, int(a.cache_mb * MiB), pol, lock) for _ in range(a.rounds)),
                               key=sum)
            print(f"| {pol} | {'as is' if lock else 'off'} | {plan:.2f} | {commit:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
