"""What bmoe's ExpertCache evicts, and through which path, in one decode token of a recorded routing:
each eviction's pool, how many tokens ago its expert was last routed, and whether `_make_room` (the
policy's order) or `_evict_for` (the first of the needed slot pool in that order) chose it; and which
experts last routed by the prompt are still held before that token.

    python bench/reports/2026-12-03-real-shape-baseline/tools/pool_lock_probe.py -m MODEL --trace X.route.csv \
        [--token 10] [--policy lru] [--cache-mb 2000]
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

import bytes_by_cause as bbc  # noqa: E402

from bmoe.base.model_files import read_model_files  # noqa: E402
from bmoe.base.units import MiB  # noqa: E402
from bmoe.streaming.expert_cache import ExpertCache, file_regions  # noqa: E402
from bmoe.streaming.route_trace import Trace  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", type=Path, required=True)
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--token", type=int, default=10, help="decode token to watch, 1-based (default 10)")
    p.add_argument("--policy", default="lru")
    p.add_argument("--cache-mb", type=float, default=2000)
    a = p.parse_args()
    t = Trace.read(a.trace)
    shape = bbc.Shape(file_regions(read_model_files(a.model)))
    c = ExpertCache(None, shape.regions, int(a.cache_mb * MiB), a.policy)
    last: dict[tuple[int, int], int] = {}
    for layer in t.layers:
        ids = bbc.prompt_ids(t, layer)
        if ids:
            c.commit(c.plan(layer, sorted(set(ids))))
        for e in set(ids):
            last[(layer, e)] = 0
    watch = a.token
    seen: list[tuple[int, int, str, int]] = []
    drop = c._drop

    def logged(key: tuple[int, int, int]) -> None:
        layer, ri, e = key
        if ri == c.by_layer[layer][0]:  # once per expert (its first slice)
            caller = traceback.extract_stack()[-3].name
            seen.append((c.group_of[layer], watch - last.get((layer, e), 0), caller, layer))
        drop(key)
    for s, routes in enumerate(t.routes[:watch], start=1):
        if s == watch:
            stale = [k for k in c.index_of if last.get(k) == 0]
            print(f"before token {watch}: {len(c.index_of)} experts held; {len(stale)} last routed by the prompt, "
                  f"by pool {dict(collections.Counter(c.group_of[lay] for lay, _ in stale))}, "
                  f"layers {sorted({lay for lay, _ in stale})}")
            c._drop = logged  # type: ignore[method-assign]
        for layer in t.layers:
            experts = sorted(set(routes.get(layer, ())))
            c.commit(c.plan(layer, experts))
            for e in experts:
                last[(layer, e)] = s
    by = collections.Counter((g, age, caller) for g, age, caller, _ in seen)
    print(f"token {watch}: {len(seen)} experts evicted; (pool, tokens since last routed, chosen by): count")
    for k, n in by.most_common():
        print(f"  {k}: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
