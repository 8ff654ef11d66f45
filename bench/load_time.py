#!/usr/bin/env python3
"""How long does a load take, with and without streaming (warm page cache)?

`bmoe.load(...).stats.load_s` for plain llama.cpp (streaming off) and for streaming (warm-up
capture, GGUF table, slab, window, lanes, cache sizing), alternating, --rounds times, after one
unmeasured load of each to warm the page cache. The difference is bmoe's own load work.
`--table` times instead what reading the GGUF's tensor table costs: `gguf.GGUFReader` (which
parses every key-value pair, the tokenizer's arrays included) against `bmoe.base.gguf_table`.

    python bench/load_time.py -m ~/.cache/bmoe/smollm2-135m-moe-e64-k8-r2.gguf --rounds 5
    python bench/load_time.py -m ~/.cache/bmoe/smollm2-135m-moe-e64-k8-r2.gguf --rounds 7 --table
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import bmoe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cache-mb", type=float, default=1300)
    ap.add_argument("--table", action="store_true", help="time reading the GGUF's tensor table instead")
    a = ap.parse_args()
    if a.table:
        return table(Path(a.model), a.rounds)
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


def table(path: Path, rounds: int) -> int:
    """gguf.GGUFReader against bmoe.base.gguf_table.read_table, alternating, warm page cache."""
    import gguf

    from bmoe.base.gguf_table import read_table

    readers = {"gguf.GGUFReader": gguf.GGUFReader, "bmoe.base.gguf_table.read_table": read_table}
    times: dict[str, list[float]] = {k: [] for k in readers}
    for rnd in range(rounds + 1):
        for name, read in readers.items():
            t0 = time.perf_counter()
            read(path)
            if rnd:  # round 0 warms the page cache
                times[name].append(time.perf_counter() - t0)
    for name, v in times.items():
        print(f"{name}: median {statistics.median(v) * 1e3:.1f} ms (min {min(v) * 1e3:.1f}, "
              f"max {max(v) * 1e3:.1f}; {rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
