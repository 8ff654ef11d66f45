"""What does a cache policy alone cost per token, here and in an earlier tree?

`bmoe-bench policies` times a whole replay, the cache's own bookkeeping included. This records
every call the cache makes on the policy during the same replays (demo64's three traces as
bench/traces.sh records them, by default those in bench/reports/2026-11-29-issue8/traces/; with
the prefill pass, `predict` told the temporal hints), then times replaying only those calls on a
fresh policy, best of R, minus the replay loop's own cost. `--against DIR` times the same calls
on the policy classes of another source tree (e.g. `git archive REV bmoe | tar -x -C DIR`); each
victim must come out the same, or the run stops. `--synthetic` replays a layout larger than
demo64 (48 layers x 128 experts x 3 tensors, top-8, skewed random routing) instead.

    python bench/policy_cost.py -m demo64.gguf --against /tmp/before > policy_cost.md
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from bmoe.base.model_files import read_model_files
from bmoe.base.units import MiB
from bmoe.replay.policies import temporal_hints
from bmoe.replay.stats import replay
from bmoe.shm_cache import PAGE
from bmoe.streaming import cache_policy
from bmoe.streaming.expert_cache import ExpertCache, Region, file_regions, layout
from bmoe.streaming.route_trace import Trace

TRACES = Path(__file__).parent / "reports/2026-11-29-issue8/traces"
Call = tuple[Any, ...]


class Recorder:
    """A policy that logs every call the cache makes on it (and each victim it gives) before passing it on."""

    def __init__(self, inner: cache_policy.Policy) -> None:
        self.inner, self.log = inner, []

    @property
    def layer(self) -> int | None:
        return self.inner.layer

    def begin(self, layer: int) -> None:
        self.log.append(("begin", layer))
        self.inner.begin(layer)

    def touch(self, key: cache_policy.Key) -> None:
        self.log.append(("touch", key))
        self.inner.touch(key)

    def admit(self, key: cache_policy.Key, speculative: bool = False) -> None:
        self.log.append(("admit", key, speculative))
        self.inner.admit(key, speculative)

    def forget(self, key: cache_policy.Key) -> None:
        self.log.append(("forget", key))
        self.inner.forget(key)

    def predict(self, keys: list[cache_policy.Key]) -> None:
        self.log.append(("predict", list(keys)))
        self.inner.predict(keys)

    def victims(self, layer: int | None) -> Iterator[cache_policy.Key]:
        self.log.append(("victims", layer))
        for key in self.inner.victims(layer):
            self.log.append(("next", key))
            yield key


class Replayed:
    """Gives the recorded victims back and does nothing else: the cost of the replay loop itself."""

    def __init__(self, log: list[Call]) -> None:
        walks: list[list[cache_policy.Key]] = []
        for call in log:
            if call[0] == "victims":
                walks.append([])
            elif call[0] == "next":
                walks[-1].append(call[1])
        self.walks = iter(walks)

    def victims(self, layer: int | None) -> Iterator[cache_policy.Key]:
        return iter(next(self.walks))

    def begin(self, *args: Any) -> None: ...
    touch = admit = forget = predict = begin


def run(log: list[Call], policy: Any) -> float:
    """Seconds to make the recorded calls on `policy`; every victim must be the recorded one."""
    walk: Iterator[cache_policy.Key] = iter(())
    t0 = time.perf_counter()
    for call in log:
        if call[0] == "next":
            if next(walk) != call[1]:
                raise SystemExit(f"{type(policy).__name__}: a different victim than recorded")
        elif call[0] == "victims":
            walk = policy.victims(call[1])
        else:
            getattr(policy, call[0])(*call[1:])
    return time.perf_counter() - t0


def load_policies(tree: str) -> ModuleType:
    """bmoe/streaming/cache_policy.py of another source tree, as a module of its own."""
    spec = importlib.util.spec_from_file_location("cache_policy_against", Path(tree) / "bmoe/streaming/cache_policy.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def synthetic(layers: int = 48, experts: int = 128, kinds: int = 3, top_k: int = 8, tokens: int = 40,
              seed: int = 0) -> tuple[list[Region], list[list[list[int]]]]:
    """Page-sized slices and skewed routing (a Dirichlet(0.3) preference per layer)."""
    regions = [Region(f"blk.{lay}.k{k}.weight", lay, f"k{k}", 0, (lay * kinds + k) * experts * PAGE, experts, PAGE)
               for lay in range(layers) for k in range(kinds)]
    layout(regions)
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(experts, 0.3), size=layers)
    steps = [[sorted(rng.choice(experts, size=top_k, replace=False, p=p[lay]).tolist()) for lay in range(layers)]
             for _ in range(tokens)]
    return regions, steps


def synthetic_replay(regions: list[Region], steps: list[list[list[int]]], pct: int,
                     policy: Recorder) -> tuple[float, float]:
    """`route_stats.replay` for a synthetic layout (hit %, MiB read per token): a prefill pass that
    routes every expert, then the steps."""
    cache = ExpertCache(None, regions, int(sum(r.nbytes for r in regions) * pct / 100), policy)
    for lay in range(len(steps[0])):
        cache.commit(cache.plan(lay, list(range(regions[0].n_expert))))
    cache.reset_stats()
    read = 0
    for step in steps:
        for lay, experts in enumerate(step):
            missing = cache.plan(lay, experts)
            read += sum(cache.read_bytes(k) for k in missing)
            cache.commit(missing)
    return cache.stats.hit_pct, read / MiB / len(steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", help="the traces' model (demo64); not needed with --synthetic")
    ap.add_argument("--against", metavar="DIR", help="also time the policies of this source tree")
    ap.add_argument("--policies", default=",".join(cache_policy.POLICIES))
    ap.add_argument("--budgets", default="25,50")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--traces", type=Path, default=TRACES,
                    help="directory of story/factual/code.jsonl (default: %(default)s)")
    a = ap.parse_args()
    other = load_policies(a.against) if a.against else None
    sources = [("this", cache_policy)] + ([("against", other)] if other else [])
    print("| trace | budget | policy | hit % | MiB/token | " + " | ".join(f"{s} µs/token" for s, _ in sources)
          + (" | this/against |" if other else " |"))
    print("|---|---:|---|---:|---:|" + "---:|" * len(sources) + ("---:|" if other else ""))
    runs = ["synthetic"] if a.synthetic else ["story", "factual", "code"]
    regions = None if a.synthetic else file_regions(read_model_files(a.model))
    for name in runs:
        if a.synthetic:
            sregions, steps = synthetic()
            layers, n_tokens = list(range(len(steps[0]))), len(steps)
        else:
            t = Trace.read(a.traces / f"{name}.jsonl")
            layers, n_tokens, hints = t.layers, len(t.routes), temporal_hints(t)
        for pct in (int(b) for b in a.budgets.split(",")):
            for pname in a.policies.split(","):
                rec = Recorder(cache_policy.POLICIES[pname](layers))
                if a.synthetic:
                    hit, mib = synthetic_replay(sregions, steps, pct, rec)
                else:
                    hit, mib = replay(t, regions, pct, rec, hints if pname == "predict" else None, True)
                loop = min(run(rec.log, Replayed(rec.log)) for _ in range(a.rounds))
                best = {s: float("inf") for s, _ in sources}
                for _ in range(a.rounds):
                    for s, mod in sources:
                        best[s] = min(best[s], run(rec.log, mod.POLICIES[pname](layers)))
                us = {s: (v - loop) * 1e6 / n_tokens for s, v in best.items()}
                cells = " | ".join(f"{us[s]:.0f}" for s, _ in sources)
                ratio = f" | {us['this'] / us['against']:.2f} |" if other else " |"
                print(f"| {name} | {pct}% | {pname} | {hit:.1f} | {mib:.1f} | {cells}{ratio}", flush=True)


if __name__ == "__main__":
    main()
