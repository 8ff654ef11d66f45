"""How far is each cache policy from Belady on real models' routing, and what do the traces say?

Replays route_trace v1 traces (default: the team's shared traces of gemma-4-26b-a4b and gpt-oss-120b,
recorded on a phone) through every policy, the next-token oracle and Belady's MIN at phone-sized
budgets and shares of the expert bank, with no model file; adds what the traces say about reuse
(how soon an expert comes back, by how often it was routed before) and what --drop-cold would save.
Writes DIR/report.md, DIR/policies.md and DIR/hit_by_budget.png (with matplotlib).

    python bench/real_routes.py --out bench/reports/DATE-real-routing
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from bmoe.replay import lossy_prices, policies
from bmoe.replay import stats as route_stats
from bmoe.replay.stats import ReplayBudget
from bmoe.streaming.route_trace import Trace

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"
BUDGETS = "1300MiB,1900MiB,4000MiB,10,25"


def reuse_by_count(t: Trace) -> list[str]:
    """Decode lookups by how often the expert was routed before (prompt included): the share routed
    again at its layer within 1, 4 and 16 tokens, or never in the trace: what a frequency can tell."""
    steps = t.prompt + t.routes
    uses: dict[tuple[int, int], list[int]] = defaultdict(list)
    for s, step in enumerate(steps):
        for layer in t.layers:
            for e in set(step.get(layer, [])):
                uses[(layer, e)].append(s)
    gaps: dict[str, list[int]] = defaultdict(list)
    for at in uses.values():
        for i, s in enumerate(at):
            if s >= len(t.prompt):
                bucket = "0 (first use)" if i == 0 else "1-3" if i < 4 else "4+"
                gaps[bucket].append(at[i + 1] - s if i + 1 < len(at) else 10**9)
    rows = ["| routed before | decode lookups | again next token | within 4 | within 16 | not again in the trace |",
            "| --- | --- | --- | --- | --- | --- |"]
    for name in ("0 (first use)", "1-3", "4+"):
        g = np.array(gaps[name])
        rows.append(f"| {name} | {len(g)} | {100 * np.mean(g <= 1):.0f}% | {100 * np.mean(g <= 4):.0f}% | "
                    f"{100 * np.mean(g <= 16):.0f}% | {100 * np.mean(g == 10**9):.0f}% |")
    return rows


def chart(rows: list[policies.Row], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    traces = list(dict.fromkeys(r.trace for r in rows))
    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4.2))
    for ax, name in zip(np.atleast_1d(axes), traces):
        mine = [r for r in rows if r.trace == name and r.budget.endswith("MiB")]
        budgets = list(dict.fromkeys(r.budget for r in mine))
        for pname in dict.fromkeys(r.policy for r in mine):
            ys = [next(r.hit_pct for r in mine if r.policy == pname and r.budget == b) for b in budgets]
            ax.plot([float(b.split()[0]) for b in budgets], ys, marker="o", label=pname,
                    linestyle="--" if pname in ("belady", "next-token-oracle") else "-")
        ax.set_title(name)
        ax.set_xlabel("cache (MiB)")
        ax.set_ylabel("decode hit %")
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="*", help=f"route_trace v1 files (default: {SHARED}/*.csv)")
    ap.add_argument("--budgets", default=BUDGETS, help=f"as bmoe-bench policies --budgets (default {BUDGETS})")
    ap.add_argument("--drop-cold", default="0.05,0.1,0.2", help="F values to price (default 0.05,0.1,0.2)")
    ap.add_argument("--out", required=True, help="report directory")
    a = ap.parse_args(argv)
    paths = a.traces or sorted(str(p) for p in SHARED.glob("*.csv"))
    if not paths:
        ap.error(f"no traces given and none in {SHARED}")
    budgets = [ReplayBudget.parse(x) for x in a.budgets.split(",")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = policies.simulate(paths, budgets, progress=lambda s: print(s, file=sys.stderr))
    table = policies.policy_table(rows)
    (out / "policies.md").write_text(table + "\n")
    prices = lossy_prices.prices(paths, budgets, [float(x) for x in a.drop_cold.split(",")])
    lines = ["# Cache policies on real routing\n", f"`python bench/real_routes.py --out {a.out}` "
             f"({time.perf_counter() - t0:.0f} s); traces: {', '.join(Path(p).name for p in paths)}\n", table]
    for p in paths:
        t = Trace.read(p)
        lines += [f"\n## What {Path(p).name} says\n",
                  f"{len(t.prompt)} prompt tokens, {len(t.routes)} decode tokens, {len(t.layers)} MoE layers × "
                  f"{t.header['n_expert']} experts, top-{t.header['top_k']}, "
                  f"{sum(t.expert_bytes.values()) * t.header['n_expert'] / 2**20:.0f} MiB of experts. "
                  f"Previous-token reuse {route_stats.previous_token_reuse(t):.1f} % (uniform routing: "
                  f"{route_stats.uniform_reuse(t):.1f} %); a layer's busiest quarter of experts takes "
                  f"{route_stats.busiest_quarter(t):.1f} % of its routes.\n", *reuse_by_count(t)]
    lines += ["\n## --drop-cold on these routes (default policy)\n", lossy_prices.price_table(prices)]
    if chart(rows, out / "hit_by_budget.png"):
        lines.append("\n![hit % by cache size](hit_by_budget.png)")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'report.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
