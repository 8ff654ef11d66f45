"""Routing traces: recorded through the real hook, checked against the model's own routers."""

from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from bmoe.replay import stats as route_stats
from bmoe.shm_cache import PAGE
from bmoe.streaming.cache_policy import POLICIES
from bmoe.streaming.route_trace import Trace
from bmoe.workers import routers
from tests.conftest import run_cli

PROMPT = "The engineers tested the bridge with heavy trucks and measured how far the deck would bend"


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_trace_records_routes_and_router_inputs(synth, tmp_path, arch: str) -> None:
    model = str(synth(arch=arch, layers=4, experts=8, top_k=2))
    trace_path = tmp_path / "t.jsonl"
    traced = run_cli("-m", model, "-p", PROMPT, "-n", "16", "--cache-mb", "1", "--route-trace", str(trace_path))
    plain = run_cli("-m", model, "-p", PROMPT, "-n", "16", "--no-stream")
    assert traced.returncode == 0, traced.stderr
    assert traced.stdout.split("\ngeneration:")[0] == plain.stdout.split("\ngeneration:")[0], "tracing is lossless"
    t = Trace.read(trace_path)
    n_tokens = int(re.search(r"generation: (\d+) tokens", traced.stdout).group(1))
    assert len(t.routes) == n_tokens and t.layers == [0, 1, 2, 3]
    assert all(len(step[layer]) == 2 for step in t.routes for layer in t.layers)
    assert t.hidden.shape == (n_tokens, 4, t.header["n_embd"])
    # the captured router input reproduces the layer's own routing exactly
    rs = routers.load_routers([model], arch, t.layers)
    for step, r in enumerate(t.routes):
        for i, layer in enumerate(t.layers):
            logits = rs[layer].weight @ t.hidden[step, i] + (0 if rs[layer].bias is None else rs[layer].bias)
            assert set(np.argsort(-logits, kind="stable")[:2].tolist()) == set(r[layer])


def test_bench_routes_reports_reuse_recall_and_lru_curve(small_moe, tmp_path) -> None:
    import subprocess
    import sys

    model = str(small_moe)
    trace_path = tmp_path / "t.jsonl"
    assert run_cli("-m", model, "-p", PROMPT, "-n", "24", "--cache-mb", "0",
                   "--route-trace", str(trace_path)).returncode == 0
    r = subprocess.run([sys.executable, "-m", "bmoe.tools.bench", "routes", str(trace_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    reuse = float(re.search(r"previous-token reuse: ([\d.]+)%", r.stdout).group(1))
    recall = float(re.search(r"next-layer router recall: ([\d.]+)%", r.stdout).group(1))
    curve = [float(x) for x in re.findall(r"(\d+)%: ([\d.]+)% hit", r.stdout) for x in x[1:]]
    assert 0 <= reuse <= 100 and 0 < recall <= 100
    assert len(curve) == 4 and curve[-1] >= curve[0] and curve[-1] > 0


def test_concentration_figures_of_a_trace() -> None:
    """Layer 0 sends 3 of 4 routes to expert 0; layer 1 spreads evenly over the 8 experts."""
    routes = [{0: [0, 1], 1: [0, 1]}, {0: [0, 2], 1: [2, 3]}, {0: [0, 3], 1: [4, 5]}, {0: [0, 4], 1: [6, 7]}]
    t = Trace({"top_k": 2, "n_expert": 8}, [0, 1], routes, None)
    assert route_stats.uniform_reuse(t) == 25.0
    # the busiest 2 of 8 experts: 5 of layer 0's 8 routes, 2 of layer 1's 8
    assert route_stats.busiest_quarter(t) == pytest.approx(100 * (5 / 8 + 2 / 8) / 2)
    assert route_stats.previous_token_reuse(t) == pytest.approx(100 * 3 / 12)


EXCERPT = Path(__file__).parent / "data" / "gpt-oss-120b-excerpt.route.csv"


def test_a_route_trace_v1_file_reads_as_its_rows_say() -> None:
    """Pinned with the file's own lines: `# ... n_layer=36 n_expert=128 n_expert_used=2`,
    `# layer=0 expert_bytes=13219200 ...` and the rows of step 83 and 85 at layer 0."""
    t = Trace.read(EXCERPT)
    assert (t.header["arch"], t.header["n_expert"], t.header["top_k"]) == ("gpt-oss", 128, 2)
    assert t.layers == list(range(36)) and t.expert_bytes[0] == 13219200 and t.dense_bytes[0] == 23280128
    assert len(t.prompt) == 2 and len(t.routes) == 12
    lines = EXCERPT.read_text().splitlines()
    first = [x.split(",") for x in lines if x.startswith("0,0,83,0,")]
    assert t.prompt[0][0] == [int(r[5]) for r in first]
    assert t.prompt_weights[0][0] == [float(r[6]) for r in first]
    decode = [x.split(",") for x in lines if x.startswith("0,1,85,0,")]
    assert t.routes[0][0] == [int(r[5]) for r in decode]
    # llama.cpp runs the last layer's experts for the prompt's last token only
    assert 35 not in t.prompt[0] and 35 in t.prompt[1]
    assert all(abs(sum(w) - 1) < 1e-4 for step in t.weights for w in step.values())


def test_a_trace_written_as_v1_reads_back_the_same(tmp_path) -> None:
    t = Trace.read(EXCERPT)
    t.write_v1(tmp_path / "again.csv")
    u = Trace.read(tmp_path / "again.csv")
    assert (u.prompt, u.routes, u.expert_bytes, u.dense_bytes, u.header) == \
        (t.prompt, t.routes, t.expert_bytes, t.dense_bytes, t.header)
    assert all(a[k] == pytest.approx(b[k], rel=1e-5) for a, b in zip(u.weights, t.weights) for k in a)


def plain_lru(t: Trace, capacity: int, pad: int = 0) -> float:
    """Decode hit % of one global LRU of whole experts (each charged its bytes + `pad`), written
    plainly: the prompt's union per layer first (not counted), then each token's layers in turn; a
    layer's routed experts stay."""
    order: OrderedDict[tuple[int, int], None] = OrderedDict()
    used = hits = total = 0
    def visit(layer: int, experts: list[int], count: int) -> None:
        nonlocal used, hits, total
        want = sorted(set(experts))
        hits += count * sum((layer, e) in order for e in want)
        total += count * len(want)
        for e in want:
            if (layer, e) in order:
                order.move_to_end((layer, e))
        for e in want:
            if (layer, e) not in order:
                for k in [k for k in order if not (k[0] == layer and k[1] in want)]:
                    if used + t.expert_bytes[layer] + pad <= capacity:
                        break
                    del order[k]
                    used -= t.expert_bytes[k[0]] + pad
                order[(layer, e)] = None
                used += t.expert_bytes[layer] + pad
    for layer in t.layers:
        visit(layer, [e for step in t.prompt for e in step.get(layer, ())], 0)
    for step in t.routes:
        for layer in t.layers:
            visit(layer, step.get(layer, []), 1)
    return 100.0 * hits / total


def test_a_v1_replay_is_a_whole_expert_lru_of_the_traces_sizes() -> None:
    """With experts of page-multiple sizes (one slot class: nothing but the policy decides), the
    replay's LRU is a plain LRU of whole experts charged as the cache charges them."""
    t = Trace.read(EXCERPT)
    t.expert_bytes = {layer: -(-b // PAGE) * PAGE for layer, b in t.expert_bytes.items()}
    regions = route_stats.trace_regions(t)
    for mib in (300, 1300, 1900):
        hit, _ = route_stats.replay(t, regions, route_stats.ReplayBudget(mib=mib), "lru", prefill=True)
        assert hit == pytest.approx(plain_lru(t, mib * 2**20, 2 * PAGE))


def test_bmoe_bench_policies_replays_a_v1_trace_without_its_model(tmp_path) -> None:
    """No GGUF: the header's expert bytes are the cache's regions; every policy and Belady, and
    --drop-cold's price, per budget."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "bmoe.tools.bench", "policies", str(EXCERPT), "--budgets",
                        "1300MiB,10", "--drop-cold", "0.2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = {m[0]: [float(x) for x in re.findall(r"([\d.]+)% / ", m[1])]
            for m in re.findall(r"^\| ([a-z][\w-]*) \| (.*)$", r.stdout, re.M) if m[0] in (*POLICIES, "belady")}
    assert set(rows) == {*POLICIES, "belady"} and "| 1300 MiB: hit" in r.stdout
    assert all(h <= b + 1e-9 for hits in rows.values() for h, b in zip(hits, rows["belady"]))
    assert re.search(r"\| gpt-oss-120b-excerpt \| 1300 MiB \| 0.2 \| [\d.]+ \([\d.]+\) \| [\d.]+% \| [\d.]+% \|",
                     r.stdout)
