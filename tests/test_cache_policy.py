"""Cache policies on small hand-made access sequences, inside the real ExpertCache (no memory behind it)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest

from bmoe.cache_policy import POLICIES, Predictive, make_policy
from bmoe.tools.policy_bounds import Belady
from bmoe.expert_cache import RESIDENT, ExpertCache, Region, layout
from bmoe.shm_cache import PAGE
from tests.conftest import run_cli

N_EXPERT = 8


def regions(layers: int, kinds: int = 1) -> list[Region]:
    """`kinds` expert tensors per layer, every slice exactly one page (charge = PAGE)."""
    out = []
    for layer in range(layers):
        for k in range(kinds):
            out.append(Region(f"blk.{layer}.k{k}.weight", layer, f"k{k}", 0, (layer * kinds + k) * N_EXPERT * PAGE,
                              N_EXPERT, PAGE))
    layout(out)
    return out


def run(policy, steps: list[list[list[int]]], budget_slices: int, kinds: int = 1,
        check: bool = True) -> ExpertCache:
    """Replay steps[token][layer] = experts; after each layer, the budget holds unless only pinned slices remain."""
    n_layers = len(steps[0])
    cache = ExpertCache(None, regions(n_layers, kinds), budget_slices * PAGE, policy)
    for step in steps:
        for layer, experts in enumerate(step):
            missing = cache.plan(layer, experts)
            cache.commit(missing)
            want = set(cache.layer_slices(layer, experts))
            resident = {(lay, ri, e) for lay, ris in cache.by_layer.items() for ri in ris
                        for e in range(N_EXPERT) if cache.state[ri][e] == RESIDENT}
            assert want <= resident
            if check:
                assert cache.used == len(resident) * PAGE
                assert cache.used <= cache.budget or resident == want, "over budget with unpinned slices left"
    return cache


def random_steps(seed: int, tokens: int = 40, layers: int = 4, k: int = 2) -> list[list[list[int]]]:
    """Skewed routing with some reuse of the previous token's experts, like real MoE traces."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(N_EXPERT, 0.7), size=layers)
    out, prev = [], None
    for _ in range(tokens):
        step = []
        for layer in range(layers):
            if prev is not None and rng.random() < 0.4:
                step.append(sorted(prev[layer]))
            else:
                step.append(sorted(rng.choice(N_EXPERT, size=k, replace=False, p=p[layer]).tolist()))
        out.append(step)
        prev = step
    return out


def future_of(steps: list[list[list[int]]]) -> dict[tuple[int, int], list[int]]:
    n = len(steps[0])
    fut: dict[tuple[int, int], list[int]] = {}
    for s, step in enumerate(steps):
        for layer, experts in enumerate(step):
            for e in experts:
                fut.setdefault((layer, e), []).append(s * n + layer)
    return fut


def old_lru(steps: list[list[list[int]]], budget_slices: int) -> list[tuple[int, frozenset]]:
    """The cache's LRU before policies existed (an OrderedDict of slices), as a reference."""
    lru: OrderedDict[tuple[int, int], None] = OrderedDict()
    trail = []
    for step in steps:
        for layer, experts in enumerate(step):
            want = [(layer, e) for e in experts]
            missing = [k for k in want if k not in lru]
            for k in want:
                if k in lru:
                    lru.move_to_end(k)
            for k in list(lru):
                if len(lru) + len(missing) <= budget_slices:
                    break
                if k not in want:
                    del lru[k]
            for k in missing:
                lru[k] = None
            trail.append((len(want) - len(missing), frozenset(lru)))
    return trail


@pytest.mark.parametrize("seed", range(3))
def test_lru_reproduces_the_old_cache_exactly(seed: int) -> None:
    steps = random_steps(seed)
    ref = old_lru(steps, budget_slices=7)
    cache = ExpertCache(None, regions(4), 7 * PAGE, "lru")
    trail = []
    for step in steps:
        for layer, experts in enumerate(step):
            hits0 = cache.stats.hits
            cache.commit(cache.plan(layer, experts))
            resident = frozenset((layer_, e) for layer_, ris in cache.by_layer.items() for ri in ris
                                 for e in range(N_EXPERT) if cache.state[ri][e] == RESIDENT)
            trail.append((cache.stats.hits - hits0, resident))
    assert trail == ref


def test_cyclic_pattern_defeats_lru_but_not_the_layer_cycle() -> None:
    """Each layer always routes the same 2 experts; the cache holds 3 of the 4 layers: LRU's worst case."""
    steps = [[[0, 1]] * 4] * 30
    hit = {name: run(name, steps, budget_slices=6).stats.hit_pct for name in ("lru", "cycle", "cycle-lfu", "next-use")}
    assert hit["lru"] == 0.0
    assert hit["cycle"] > 60 and hit["cycle-lfu"] > 60 and hit["next-use"] > 60
    belady = run(Belady(range(4), future_of(steps)), steps, budget_slices=6).stats.hit_pct
    assert belady >= hit["cycle"]


def test_cycle_lfu_keeps_the_frequent_expert_where_cycle_keeps_the_recent_one() -> None:
    """One layer, room for 3 slices, routing 2: expert 0 every other token, experts 1..7 in rotation."""
    rotation = iter([1 + i % 7 for i in range(200)])
    steps = [[sorted([0, next(rotation)] if t % 2 == 0 else [next(rotation), next(rotation)])] for t in range(40)]
    lfu = run("cycle-lfu", steps, budget_slices=3)
    cyc = run("cycle", steps, budget_slices=3)
    assert cyc.stats.hits == 0, "recency alone gives up expert 0 on every odd token"
    # at token 1 expert 0 still ties the rotating expert (one use each) and goes as the older one;
    # from token 2 on its count leads, so every even token from 4 hits it
    assert lfu.stats.hits == 18
    assert lfu.state[0][0] == RESIDENT


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [3, 8, 14])
def test_belady_bounds_every_policy_and_budgets_hold(seed: int, budget: int) -> None:
    steps = random_steps(seed)
    best = run(Belady(range(4), future_of(steps)), steps, budget, kinds=2).stats.hits  # two tensors per layer
    for name in POLICIES:
        assert run(name, steps, budget, kinds=2).stats.hits <= best, name


def test_speculative_slices_go_first_until_a_demand_hit() -> None:
    for name in POLICIES:
        p = make_policy(name, [0, 1])
        p.begin(0)
        for e in range(3):
            p.admit((0, 0, e))
        p.admit((0, 0, 7), speculative=True)
        assert next(iter(p.victims(0))) == (0, 0, 7), name
        p.begin(1)
        p.begin(0)
        p.touch((0, 0, 7))
        assert next(iter(p.victims(0))) != (0, 0, 7), name
        p.forget((0, 0, 7))
        assert (0, 0, 7) not in list(p.victims(0)), name


def test_predicted_slices_go_last_and_expire_when_their_layer_passed() -> None:
    p = Predictive([0, 1, 2])
    p.begin(0)
    for layer in (1, 2):
        for e in range(3):
            p.admit((layer, 0, e))
    first = next(iter(p.victims(0)))
    p.predict([first])
    order = list(p.victims(0))
    assert order[-1] == first and len(order) == 6
    p.begin(first[0])  # the predicted layer came: the hint is spent
    p.begin(0)
    p.begin(1)
    assert list(p.victims(0)).index(first) < 5


def test_unknown_policy_is_refused_with_the_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown cache policy 'mru'; choose one of lru, "):
        make_policy("mru", [0])
    r = run_cli("--cache-policy", "mru", "-m", "nothing.gguf")
    assert r.returncode == 2
    assert "unknown cache policy 'mru'" in r.stderr and all(name in r.stderr for name in POLICIES)


def test_session_takes_the_cache_policy_flag() -> None:
    from bmoe.flags import build_parser, check

    ap = build_parser()
    assert check(ap, ap.parse_args(["-m", "x.gguf", "--session", "--cache-policy", "cycle"])).cache.policy == "cycle"


def test_bench_policies_replays_a_recorded_trace(synth, tmp_path) -> None:
    model = str(synth(arch="qwen3moe", layers=4, experts=8, top_k=2))
    trace = tmp_path / "t.jsonl"
    rec = run_cli("-m", model, "-p", "The river flows past the mill and the old stone bridge", "-n", "24",
                  "--cache-mb", "0", "--route-trace", str(trace))
    assert rec.returncode == 0, rec.stderr
    out = tmp_path / "p.md"
    r = subprocess.run([sys.executable, "-m", "bmoe.tools.bench", "policies", str(trace), "--budgets", "25,50",
                        "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert out.read_text().strip() == r.stdout.strip()
    rows = {m[0]: [float(x) for x in re.findall(r"([\d.]+)% / ", m[1])]
            for m in re.findall(r"^\| ([a-z][\w-]*) \| (.*)$", r.stdout, re.M) if m[0] != "policy"}
    assert set(rows) == {*POLICIES, "next-token-oracle", "belady"}
    assert all(len(v) == 2 for v in rows.values())
    for name, hits in rows.items():
        assert all(h <= b + 1e-9 for h, b in zip(hits, rows["belady"])), name
    assert rows["belady"][1] > 0
    bad = subprocess.run([sys.executable, "-m", "bmoe.tools.bench", "policies", str(trace), "--budgets", "0,50"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "percentages from 1 to 100" in bad.stderr


def test_next_use_is_not_locked_by_a_prefill_that_read_every_expert() -> None:
    """A prompt routes every expert of every layer once. The layer-cycle order (cycle, cycle-lfu)
    then keeps the first layers' full sets and evicts each later layer's experts right after use;
    next-use weighs how often an expert is routed, so the stale full sets go."""
    layers = 8
    prefill = [[list(range(N_EXPERT))] * layers]
    decode = [[[0, 1]] * layers for _ in range(30)]  # two hot experts per layer, every token
    hits = {}
    for name in ("lru", "cycle-lfu", "next-use"):
        cache = run(name, prefill + decode, budget_slices=3 * layers, check=False)
        hits[name] = cache.stats.hits
    assert hits["next-use"] > hits["cycle-lfu"]
    assert hits["next-use"] >= hits["lru"]
