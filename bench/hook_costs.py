"""Where does the coordinator's time go per decoded token: each function of the hook path, its calls and
wall time per token, and how often the graph stops?

Runs `bmoe-cli` in this process with a timer around each function of the streaming path (the eval
hook, StreamingStops, Streamer, ExpertCache, the policy, ReadAhead, OrdersInFlight, the lane pool,
LaneStats) and a count of the eval hook's calls (ask=True: every node of every graph) and of the nodes
it stops at (each stop splits ggml's compute there), and the coordinator process's CPU time, major
page faults and context switches (getrusage). Times are inclusive (a caller's include its
callees') and each timer adds about a microsecond, so a function called thousands of times a token
reads somewhat high; the calls are exact. Per decode token, over tokens `--from-token`..last (the
prefill left out), printed as a table and written to `--json`.

    python bench/hook_costs.py [--from-token 1] [--json OUT.json] -- -m MODEL -p PROMPT -n 32 --cache-mb 2000 ...

Everything after `--` is bmoe-cli's command line. It times the bmoe its Python imports: run it with
the venv of the checkout to be measured (`../bmoe-main/.venv/bin/python bench/hook_costs.py ...`).
"""

from __future__ import annotations

import argparse
import atexit
import functools
import importlib
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

# (module, class or None, function): the streaming path, outermost first; each tree times those it has
# (the names of older checkouts kept, so one script measures both sides of an A/B)
TARGETS = [
    ("bmoe.coordinator", "Engine", "step"),
    ("bmoe.coordinator", "Engine", "_decode"),
    ("bmoe.coordinator", "Engine", "_choose"),
    ("bmoe.seam.eval_hook", "EvalHook", "_callback"),
    ("bmoe.seam.ggml_mirror", None, "ids_view"),
    ("bmoe.seam.graph", "EvalHook", "_callback"),
    ("bmoe.seam.graph", None, "routing_ids"),
    ("bmoe.seam.graph", None, "write_ids"),
    ("bmoe.engine.graph_stops", "StreamingStops", "skip_route"),
    ("bmoe.engine.graph_stops", "StreamingStops", "reroute"),
    ("bmoe.engine.graph_stops", "StreamingStops", "on_route"),
    ("bmoe.engine.graph_stops", "StreamingStops", "slot_ids"),
    ("bmoe.engine.graph_stops", "StreamingStops", "wait_pending"),
    ("bmoe.engine.graph_stops", "StreamingStops", "on_wait"),
    ("bmoe.streaming.graph_stops", "StreamingStops", "skip_route"),
    ("bmoe.streaming.graph_stops", "StreamingStops", "reroute"),
    ("bmoe.streaming.graph_stops", "StreamingStops", "on_route"),
    ("bmoe.streaming.graph_stops", "StreamingStops", "replay_hit"),
    ("bmoe.streaming.graph_stops", "StreamingStops", "_demand"),
    ("bmoe.streaming.graph_stops", "StreamingStops", "_send"),
    ("bmoe.streaming.graph_stops", "StreamingStops", "slot_ids"),
    ("bmoe.streaming.graph_stops", "StreamingStops", "wait_pending"),
    ("bmoe.streaming.graph_stops", "StreamingStops", "on_wait"),
    ("bmoe.streaming.streamer", "Streamer", "begin_batch"),
    ("bmoe.streaming.streamer", "Streamer", "wait"),
    ("bmoe.streaming.streamer", "Streamer", "run_through"),
    ("bmoe.streaming.streamer", "Streamer", "skip"),
    ("bmoe.streaming.streamer", "Streamer", "on_route"),
    ("bmoe.streaming.streamer", "Streamer", "tick"),
    ("bmoe.streaming.streamer", "Streamer", "_send_demand"),
    ("bmoe.streaming.streamer", "Streamer", "_wait"),
    ("bmoe.streaming.streamer", "Streamer", "_collect"),
    ("bmoe.streaming.streamer", "Streamer", "slot_ids"),
    ("bmoe.streaming.streamer", "Streamer", "on_wait"),
    ("bmoe.streaming.streamer", "Streamer", "follow"),
    ("bmoe.streaming.expert_cache", "ExpertCache", "plan"),
    ("bmoe.streaming.expert_cache", "ExpertCache", "_reserve"),
    ("bmoe.streaming.expert_cache", "ExpertCache", "_make_room"),
    ("bmoe.streaming.expert_cache", "ExpertCache", "_take"),
    ("bmoe.streaming.expert_cache", "ExpertCache", "_evict_for"),
    ("bmoe.streaming.expert_cache", "ExpertCache", "_evict"),
    ("bmoe.streaming.expert_cache", "ExpertCache", "_drop"),
    ("bmoe.streaming.expert_cache", "ExpertCache", "commit"),
    ("bmoe.streaming.expert_cache", "ExpertCache", "slot_ids"),
    ("bmoe.streaming.expert_cache", "ExpertCache", "release_evicted"),
    ("bmoe.streaming.cache_policy", "NextUse", "begin"),
    ("bmoe.streaming.cache_policy", "NextUse", "_refresh"),
    ("bmoe.streaming.cache_policy", "CycleLFU", "_settle"),
    ("bmoe.streaming.cache_policy", "CycleLFU", "touch"),
    ("bmoe.streaming.cache_policy", "CycleLFU", "admit"),
    ("bmoe.streaming.cache_policy", "CycleLFU", "forget"),
    ("bmoe.streaming.cache_policy", "LRU", "touch"),
    ("bmoe.streaming.cache_policy", "LRU", "admit"),
    ("bmoe.streaming.readahead", "ReadAhead", "on_route"),
    ("bmoe.streaming.readahead", "ReadAhead", "after_demand"),
    ("bmoe.streaming.readahead", "ReadAhead", "pump"),
    ("bmoe.streaming.readahead", "ReadAhead", "on_done"),
    ("bmoe.streaming.orders", "OrdersInFlight", "spread"),
    ("bmoe.streaming.orders", "OrdersInFlight", "reads_for"),
    ("bmoe.streaming.orders", "OrdersInFlight", "send"),
    ("bmoe.streaming.orders", "OrdersInFlight", "pop"),
    ("bmoe.streaming.lanes", "LanePool", "hold"),
    ("bmoe.streaming.lanes", "LanePool", "flush"),
    ("bmoe.streaming.lanes", "LanePool", "poll"),
    ("bmoe.streaming.lanes", "LanePool", "take"),
    ("bmoe.streaming.lanes", "Lane", "_write"),
    ("bmoe.streaming.lane_stats", "LaneStats", "answered"),
    ("bmoe.streaming.lane_stats", "LaneStats", "sample_depth"),
]


class Timers:
    """Calls and nanoseconds per function, the hook's node and stop counts, and a snapshot at each token."""

    def __init__(self) -> None:
        self.acc: dict[str, list[int]] = {}
        self.nodes = {"nodes (ask=True)": 0, "stops (graph splits)": 0}
        self.snaps: list[tuple[bool, dict[str, list[int]], dict[str, float], int]] = []

    def wrap(self, name: str, fn: Any) -> Any:
        rec = self.acc.setdefault(name, [0, 0])
        clock = time.perf_counter_ns

        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                rec[0] += 1
                rec[1] += clock() - t0
        return timed

    def install(self) -> None:
        for mod, cls, attr in TARGETS:
            try:
                m = importlib.import_module(mod)
            except ModuleNotFoundError:  # not in this tree
                continue
            owner = getattr(m, cls) if cls else m
            fn = owner.__dict__.get(attr) if cls else getattr(m, attr, None)
            if fn is None:  # not in this tree's code
                continue
            name = f"{cls}.{attr}" if cls else f"{mod.rsplit('.', 1)[1]}.{attr}"
            setattr(owner, attr, self.wrap(name, fn))
        try:
            from bmoe.seam import eval_hook as graph
        except ImportError:  # a tree from before the hook had its own module
            from bmoe.seam import graph  # type: ignore[no-redef]
        from bmoe.streaming import streamer

        callback = graph.EvalHook._callback
        nodes = self.nodes

        hooks: list[Any] = []

        def counted(hook: Any, t: int, ask: bool, user: int) -> bool:
            r = callback(hook, t, ask, user)
            if hook not in hooks:
                hooks.append(hook)
            if hook.stops is not None and ask:
                nodes["nodes (ask=True)"] += 1
                nodes["stops (graph splits)"] += bool(r)
            return r

        def in_c() -> dict[str, float]:
            """The routing stops the compiled filter said yes to without asking Python (a tree before it: none)."""
            n = sum(getattr(getattr(h, "filter", None), "stops_in_c", 0) for h in hooks)
            return {"stops (graph splits)": nodes["stops (graph splits)"] + n, "stops answered in C": n}
        graph.EvalHook._callback = counted  # type: ignore[method-assign]  # the class, before any hook exists
        take = streamer.Streamer.take_counters

        def take_counters(st: Any, step: bool = False) -> Any:
            ru = resource.getrusage(resource.RUSAGE_SELF)
            proc = {"coordinator CPU ms": 1000 * (ru.ru_utime + ru.ru_stime), "major faults": ru.ru_majflt,
                    "voluntary switches": ru.ru_nvcsw, "involuntary switches": ru.ru_nivcsw}
            self.snaps.append((step, {k: list(v) for k, v in self.acc.items()}, {**self.nodes, **in_c(), **proc},
                               time.perf_counter_ns()))
            return take(st, step)
        streamer.Streamer.take_counters = take_counters  # type: ignore[method-assign]

    def per_token(self, first: int) -> dict:
        """From the end of decode token first-1 (0: the prefill's end) to the last token's end."""
        ends = [i for i, s in enumerate(self.snaps) if not s[0]]
        if not ends:
            return {}
        start = ends[-1] + first - 1
        steps = [s for s in self.snaps[start + 1:] if s[0]]
        if start >= len(self.snaps) or not steps:
            return {}
        a, b, n = self.snaps[start], self.snaps[-1], len(steps)
        funcs = {}
        for k, (calls, ns) in b[1].items():
            c0, n0 = a[1].get(k, [0, 0])
            if calls > c0:
                funcs[k] = {"calls": (calls - c0) / n, "ms": (ns - n0) / n / 1e6}
        return {"tokens": n, "from_token": first, "wall_ms": (b[3] - a[3]) / n / 1e6,
                "hook": {k: (b[2][k] - a[2][k]) / n for k in b[2]}, "functions": funcs}


def table(res: dict) -> str:
    if not res:
        return "hook_costs: no decode tokens were measured"
    lines = [f"per decode token, tokens {res['from_token']}..{res['from_token'] + res['tokens'] - 1} "
             f"({res['tokens']}): wall {res['wall_ms']:.1f} ms; "
             + ", ".join(f"{k} {v:.1f}" for k, v in res["hook"].items()),
             f"{'function':34s} {'calls':>9s} {'ms':>9s} {'us/call':>9s}"]
    for k, v in sorted(res["functions"].items(), key=lambda x: -x[1]["ms"]):
        lines.append(f"{k:34s} {v['calls']:9.1f} {v['ms']:9.2f} {1000 * v['ms'] / v['calls']:9.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    i = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                usage="%(prog)s [--from-token K] [--json PATH] -- BMOE_CLI_ARGS...")
    p.add_argument("--from-token", type=int, default=1, help="first decode token counted (default 1)")
    p.add_argument("--json", type=Path, help="write the per-token numbers here")
    a = p.parse_args(argv[:i])
    if i == len(argv):
        p.error("give bmoe-cli's arguments after --, e.g. -- -m MODEL -n 32 --cache-mb 2000")
    timers = Timers()
    timers.install()

    def report() -> None:
        res = timers.per_token(a.from_token)
        print(table(res), file=sys.stderr)
        if a.json:
            a.json.write_text(json.dumps(res, indent=1))
    atexit.register(report)
    from bmoe.cli import main as cli_main
    return cli_main(argv[i + 1:])


if __name__ == "__main__":
    sys.exit(main())
