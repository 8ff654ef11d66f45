"""Why does bmoe read more bytes per decoded token than the C++ original on the same routing?

Replays one run's routing (a route_trace v1 written by `bmoe-cli --route-trace X.csv`, prompt rows
included) on the model file's own expert layout, token by token, through:

- `bmoe <policy>`: this tree's ExpertCache with that policy (no memory behind it: its decisions, its
  reads); what `bmoe-cli --cache-policy <policy>` reads on that routing;
- `<policy> order, slot charge`: whole experts evicted in the policy's own order, before each
  layer's reads, each charged its slots (the expert + 2 pages per slice) as bmoe charges them: the
  cache without its slot-index pools (groups of layers with the same tensor sizes, and classes
  within them), whose indices an expert of another pool cannot take;
- `<policy> order, exact charge`: the same, each expert charged its own bytes (as the original does);
- `<policy> order, slot charge, prompt cold but its last N`: the prompt's experts admitted at the cold
  end (as reads ahead are), those of its last N tokens (`--warm-prompt`) as uses: what decode gains
  when the cache does not take the whole prompt's routing for hot;
- `original LRU`: the C++ original's cache (BigMoeOnEdge, expert_stream_source.cpp): one LRU list of
  whole experts, the prompt's ids promoted token-major, each expert charged its bytes, evicted after
  the layer's reads while over budget (never one the layer just used). With `--original-trace`
  (the original's own `--route-trace` of the same prompt) the model's misses are checked against the
  original's recorded residency, token by token.

A miss reads the expert's 4 KiB-aligned supersets (both programs read those). Then the differences
between rows are the bytes each cause costs. With `--bmoe-csv` / `--original-csv` (the programs' own
per-token CSVs of runs on that routing, e.g. bench/real_shape.py's runs/) the live bytes per token
are shown beside the replay's. Also: what the cache holds when decode starts (per program: experts
held, and how many of the first decode token's experts are among them).

    python bench/bytes_by_cause.py -m MODEL --trace bmoe.route.csv [--original-trace orig.route.csv] \\
        [--cache-mb 2000] [--policies next-use,lru] [--bmoe-csv run.csv] [--original-csv run.csv]
"""

from __future__ import annotations

import argparse
import csv
import io
import statistics
import sys
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bmoe.base.model_files import read_model_files  # noqa: E402
from bmoe.base.telemetry import read_csv  # noqa: E402
from bmoe.base.units import MiB  # noqa: E402
from bmoe.replay.stats import start_after_prompt  # noqa: E402
from bmoe.streaming.cache_policy import make_policy  # noqa: E402
from bmoe.streaming.expert_cache import ExpertCache, Region, expert_charges, file_regions  # noqa: E402
from bmoe.streaming.route_trace import Trace  # noqa: E402

Misses = list[list[tuple[int, int]]]  # per decode token: the (layer, expert) read


class Shape:
    """The model's expert layout: each layer's slices, what a miss reads, what each program charges."""

    def __init__(self, regions: list[Region]) -> None:
        self.regions = regions
        self.by_layer: dict[int, list[int]] = defaultdict(list)
        for i, r in enumerate(regions):
            self.by_layer[r.layer].append(i)
        self.exact = {lay: sum(regions[i].expert_bytes for i in idx) for lay, idx in self.by_layer.items()}
        self.slot = expert_charges(regions)
        self.pools = len({r.kind for r in regions})

    def read_bytes(self, layer: int, e: int) -> int:
        """A miss's reads: each slice's superset at the direct-I/O alignment."""
        return sum(self.regions[i].read_bytes(e) for i in self.by_layer[layer])


def prompt_ids(t: Trace, layer: int) -> list[int]:
    """The prompt rows' ids at the layer, token-major (the order a prompt batch routes them)."""
    return [e for row in t.prompt for e in row.get(layer, ())]


def bmoe_cache(t: Trace, shape: Shape, budget: int, policy: str) -> tuple[Misses, set[tuple[int, int]]]:
    """The tree's ExpertCache on the routing: the prompt as one batch per layer (as live), then each decode token."""
    c = ExpertCache(None, shape.regions, budget, policy)
    start_after_prompt(c, t)
    held = set(c.index_of)
    out: Misses = []
    for routes in t.routes:
        got: list[tuple[int, int]] = []
        for layer in t.layers:
            missing = c.plan(layer, sorted(set(routes.get(layer, ()))))
            got += sorted({(layer, e) for _, _, e in missing})
            c.commit(missing)
        out.append(got)
    return out, held


def policy_order(t: Trace, shape: Shape, budget: int, policy: str, charge: dict[int, int], warm_prompt: int = -1
                 ) -> tuple[Misses, set[tuple[int, int]]]:
    """Whole experts evicted in the policy's own order before each layer's reads (the current layer's
    kept), each charged `charge[layer]`: a cache with no slot pools, the policy deciding alone. With
    `warm_prompt` >= 0 the prompt's experts enter at the cold end (as reads ahead do) except those of
    its last `warm_prompt` tokens."""
    pol = make_policy(policy, sorted(shape.by_layer))
    resident: set[tuple[int, int]] = set()
    used = 0

    def step(layer: int, experts: list[int], cold: frozenset[int] = frozenset()) -> list[tuple[int, int]]:
        nonlocal used
        pol.begin(layer)
        keys = [(layer, ri, e) for ri in shape.by_layer[layer] for e in experts]
        missing = sorted({e for e in experts if (layer, e) not in resident})
        for k in keys:
            if (layer, k[2]) in resident:
                pol.touch(k)
        need = charge[layer] * len(missing)
        if used + need > budget:
            for k in pol.victims(layer):
                if used + need <= budget:
                    break
                ek = (k[0], k[2])
                if ek not in resident or (k[0] == layer and k[2] in experts):
                    continue
                resident.discard(ek)
                used -= charge[k[0]]
                for ri in shape.by_layer[k[0]]:
                    pol.forget((k[0], ri, k[2]))
        for e in missing:
            resident.add((layer, e))
            used += charge[layer]
            for ri in shape.by_layer[layer]:
                pol.admit((layer, ri, e), speculative=e in cold)
        return [(layer, e) for e in missing]

    for layer in t.layers:
        ids = prompt_ids(t, layer)
        if ids:
            last = {e for row in t.prompt[len(t.prompt) - warm_prompt:] for e in row.get(layer, ())}
            step(layer, sorted(set(ids)), frozenset(set(ids) - last) if warm_prompt >= 0 else frozenset())
    held = set(resident)
    out: Misses = []
    for routes in t.routes:
        out.append([m for layer in t.layers for m in step(layer, sorted(set(routes.get(layer, ()))))])
    return out, held


def original_lru(t: Trace, shape: Shape, budget: int) -> tuple[Misses, set[tuple[int, int]]]:
    """The C++ original's LRU (ExpertStreamSource::load_layer, serial and overlap alike)."""
    order: OrderedDict[tuple[int, int], None] = OrderedDict()  # last = most recent
    stamp: dict[tuple[int, int], int] = {}
    used = gen = 0

    def load(layer: int, ids: list[int]) -> list[tuple[int, int]]:
        nonlocal used, gen
        gen += 1
        seen: set[int] = set()
        miss = []
        for e in ids:
            k = (layer, e)
            if e in seen:
                order.move_to_end(k)
                continue
            seen.add(e)
            stamp[k] = gen
            if k in order:
                order.move_to_end(k)
            else:
                order[k] = None
                used += shape.exact[layer]
                miss.append(k)
        while used > budget and order:
            k = next(iter(order))
            if stamp[k] == gen:
                break
            del order[k]
            used -= shape.exact[k[0]]
        return miss

    for layer in t.layers:
        ids = prompt_ids(t, layer)
        if ids:
            load(layer, ids)
    held = set(order)
    return [[m for layer in t.layers for m in load(layer, list(routes.get(layer, ())))] for routes in t.routes], held


def recorded_misses(path: Path, layers: list[int]) -> list[set[tuple[int, int]]]:
    """A route_trace v1's decode rows that the recording run had to read (residency 0), per token."""
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    by_step: dict[int, set[tuple[int, int]]] = defaultdict(set)
    steps = set()
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        if row["phase"] != "1":
            continue
        steps.add(int(row["step"]))
        if row["residency"] == "0":
            by_step[int(row["step"])].add((int(row["layer"]), int(row["expert"])))
    return [by_step[s] for s in sorted(steps)]


def live_mib(path: Path) -> list[float]:
    rows, _ = read_csv(path.read_text())
    return [r.get("read_bytes", 0.0) / MiB for r in rows if "wall_ms" in r]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", type=Path, required=True, help="the GGUF the routing was recorded on")
    p.add_argument("--trace", type=Path, required=True,
                   help="route_trace v1 with prompt rows (bmoe-cli --route-trace X.csv)")
    p.add_argument("--original-trace", type=Path,
                   help="the original's --route-trace of the same prompt (checks its model)")
    p.add_argument("--cache-mb", type=float, default=2000)
    p.add_argument("--policies", default="next-use,lru", help="bmoe policies to replay (default next-use,lru)")
    p.add_argument("--bmoe-csv", type=Path, help="bmoe's per-token CSV of a live run on this routing")
    p.add_argument("--original-csv", type=Path, help="the original's per-token CSV of a live run on this routing")
    p.add_argument("--tokens", type=int, default=32, help="per-token columns shown (default 32)")
    p.add_argument("--warm-prompt", type=int, default=2, metavar="N",
                   help="also replay each policy's order with the prompt's experts admitted cold except its last N "
                        "tokens' (default 2; -1: leave that row out)")
    a = p.parse_args(argv)
    for f in (a.model, a.trace, a.original_trace, a.bmoe_csv, a.original_csv):
        if f is not None and not f.is_file():
            p.error(f"no file at {f}")
    t = Trace.read(a.trace)
    if not t.prompt:
        p.error(f"{a.trace} has no prompt rows: record it as route_trace v1 (a .csv path) from a fresh start")
    shape = Shape(file_regions(read_model_files(a.model)))
    budget = int(a.cache_mb * MiB)
    policies = [x.strip() for x in a.policies.split(",") if x.strip()]

    runs: list[tuple[str, Callable[[], tuple[Misses, set]]]] = [
        ("original LRU", lambda: original_lru(t, shape, budget))]
    for pol in policies:
        runs += [(f"bmoe {pol}", lambda pol=pol: bmoe_cache(t, shape, budget, pol)),
                 (f"{pol} order, slot charge", lambda pol=pol: policy_order(t, shape, budget, pol, shape.slot)),
                 (f"{pol} order, exact charge", lambda pol=pol: policy_order(t, shape, budget, pol, shape.exact))]
        if a.warm_prompt >= 0:
            runs.append((f"{pol} order, slot charge, prompt cold but its last {a.warm_prompt}",
                         lambda pol=pol: policy_order(t, shape, budget, pol, shape.slot, a.warm_prompt)))
    first = {(lay, e) for lay, es in t.routes[0].items() for e in es} if t.routes else set()
    results = {}
    for name, fn in runs:
        misses, held = fn()
        results[name] = (misses, held)

    n = len(t.routes)
    mean_expert = statistics.mean(shape.exact.values()) / MiB
    out = [f"# Bytes per decoded token by cause: `{a.trace.name}` on `{a.model.name}`", "",
           f"`python bench/bytes_by_cause.py {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
           f"{n} decode tokens after a {len(t.prompt)}-token prompt, {len(t.layers)} MoE layers, budget "
           f"{a.cache_mb:g} MiB; one expert {mean_expert:.2f} MiB on average; the cache's slot pools "
           f"(one per kind of expert tensor) on this file: {shape.pools}.", "",
           "| replay | MiB/token | misses/token | experts held at decode start | of token 1's held |",
           "|---|---:|---:|---:|---:|"]
    for name, (misses, held) in results.items():
        mib = sum(shape.read_bytes(lay, e) for tok in misses for lay, e in tok) / MiB / max(1, n)
        out.append(f"| {name} | {mib:.1f} | {sum(map(len, misses)) / max(1, n):.1f} | {len(held)} "
                   f"| {len(first & held)} of {len(first)} |")
    if a.original_trace:
        rec = recorded_misses(a.original_trace, t.layers)
        model = results["original LRU"][0]
        same = sum(1 for x, y in zip(rec, model) if x == set(y))
        out += ["", f"The original-LRU model against the original's own recorded residency "
                f"(`{a.original_trace.name}`): the same set of misses on {same} of {min(len(rec), n)} tokens; "
                f"misses {sum(map(len, rec))} recorded, {sum(map(len, model))} modelled."]
    k = min(a.tokens, n)
    out += ["", f"## MiB read per decode token (first {k})", ""]
    header = "| replay | " + " | ".join(str(i + 1) for i in range(k)) + " |"
    out += [header, "|---|" + "---:|" * k]
    live = [("live bmoe (CSV)", a.bmoe_csv), ("live original (CSV)", a.original_csv)]
    for name, path in live:
        if path is not None:
            mib = live_mib(path)[:k]
            out.append(f"| {name} | " + " | ".join(f"{x:.0f}" for x in mib) + " |")
    for name, (misses, _) in results.items():
        out.append(f"| {name} | " + " | ".join(
            f"{sum(shape.read_bytes(lay, e) for lay, e in tok) / MiB:.0f}" for tok in misses[:k]) + " |")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
