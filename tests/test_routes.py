"""Routing traces: recorded through the real hook, checked against the model's own routers."""

from __future__ import annotations

import re

import numpy as np
import pytest

from bmoe.replay import stats as route_stats
from bmoe.streaming import routers
from bmoe.streaming.route_trace import Trace
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
    rs = routers.load([model], arch, t.layers)
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
