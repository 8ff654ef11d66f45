#!/usr/bin/env python3
"""Issue 13, fast load: how long a load takes with and without streaming, warm page cache.

`bmoe.load(...).stats.load_s` for plain llama.cpp (streaming off) and for streaming (warm-up
capture, GGUF table, slab, window, lanes, cache sizing), alternating, --rounds times, after one
unmeasured load of each to warm the page cache. The difference is bmoe's own load work.

    python bench/issue13_load.py -m bench/models/demo64.gguf --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys

import bmoe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cache-mb", type=float, default=1300)
    a = ap.parse_args()
    kinds = {"plain": dict(stream=False),
             "stream": dict(cache_mb=a.cache_mb, io_threads=4)}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for rnd in range(a.rounds + 1):
        for name, kw in kinds.items():
            with bmoe.load(a.model, threads=2, notice=lambda s: None, **kw) as m:
                if rnd:  # round 0 warms the page cache
                    times[name].append(m.stats.load_s)
                    print(f"round {rnd} {name}: load_s {m.stats.load_s:.3f}", file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"median load_s: plain {med['plain']:.3f} s, streaming {med['stream']:.3f} s, "
          f"bmoe's own load work {med['stream'] - med['plain']:.3f} s ({a.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
