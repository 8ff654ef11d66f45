"""`--replay-routes TRACE` (bmoe.streaming.route_replay) and route_trace v1 written by `--route-trace PATH.csv`.

Replaying a model's own trace on the same prompt must reproduce the model exactly: the same experts,
and weights that after the layer's own normalisation are the ones it applied (a sum-normalised
qwen3moe and a softmax-after-top-k gpt-oss). The routes recorded during a replay are the trace's,
prompt rows then decode tokens, wrapping around.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bmoe.base.errors import ConfigError
from bmoe.base.model_files import read_model_files
from bmoe.base.settings import from_keywords
from bmoe.base.units import MiB
from bmoe.streaming.expert_cache import file_regions, working_sets
from bmoe.streaming.route_trace import V1_MAGIC, TokenRoutes, Trace
from bmoe.tools import bench_config, bench_run
from tests.conftest import run_cli

PROMPT = "The engineers tested the bridge with heavy trucks and measured how far the deck would bend"
SHORT = "A cat sat"
FLAGS = ("-c", "512", "-t", "1", "--io-threads", "1", "--cache-mb", "1")  # a third of the experts: misses


def text(r) -> str:
    assert r.returncode == 0, r.stderr
    return r.stdout.split("\ngeneration:")[0]


def rows(t: Trace) -> list[TokenRoutes]:
    return t.prompt + t.routes


def record(model: str, path: Path, n: int = 12, prompt: str = PROMPT, *flags: str):
    return run_cli("-m", model, "-p", prompt, "-n", str(n), *FLAGS, "--route-trace", str(path), *flags)


@pytest.fixture(scope="module")
def qwen(synth) -> str:
    return str(synth(arch="qwen3moe", layers=4, experts=8, top_k=2))


def test_a_csv_route_trace_is_v1_with_prompt_rows_weights_and_expert_bytes(qwen, tmp_path) -> None:
    x = tmp_path / "x.csv"
    traced = record(qwen, x)
    plain = run_cli("-m", qwen, "-p", PROMPT, "-n", "12", "-c", "512", "-t", "1", "--no-stream")
    assert text(traced) == text(plain), "tracing is lossless"
    assert x.read_text().splitlines()[0] == V1_MAGIC
    t = Trace.read(x)
    files = read_model_files(qwen)
    n_tokens = int(re.search(r"generation: (\d+) tokens", traced.stdout).group(1))
    assert len(t.routes) == n_tokens and len(t.prompt) > 10 and t.layers == [0, 1, 2, 3]
    assert t.header["n_expert"] == 8 and t.header["top_k"] == 2 and t.header["arch"] == "qwen3moe"
    assert t.expert_bytes == {layer: files.expert_bytes // (8 * 4) for layer in t.layers}
    # every decode token routes every layer; a prompt token every layer but the last (llama.cpp
    # computes the last layer for the logits' row only), the prompt's last token all of them
    assert all(sorted(r) == t.layers for r in t.routes + t.prompt[-1:])
    assert all(sorted(r) == t.layers[:-1] for r in t.prompt[:-1])
    for r, w in zip(rows(t), (t.prompt_weights or []) + (t.weights or [])):
        assert sorted(w) == sorted(r)
        for layer, ex in r.items():
            assert len(ex) == 2 == len(w[layer]) and all(0 <= e < 8 for e in ex)
            assert abs(sum(w[layer]) - 1) < 1e-6 and w[layer][0] >= w[layer][1] > 0


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_replaying_the_models_own_trace_reproduces_the_model(synth, tmp_path, arch: str) -> None:
    """The same experts, and weights written so that the layer's own normalisation (qwen3moe: divided
    by their sum; gpt-oss: a softmax of the top-k) gives the shares it applied: byte-identical text.
    The trace recorded during the replay is the replayed one, prompt and decode."""
    model = str(synth(arch=arch, layers=4, experts=8, top_k=2))
    x, y = tmp_path / "x.csv", tmp_path / "y.csv"
    own = text(record(model, x))
    replayed = record(model, y, 12, PROMPT, "--replay-routes", str(x))
    assert "replaying the routing of" in replayed.stderr
    assert text(replayed) == own
    tx, ty = Trace.read(x), Trace.read(y)
    assert ty.prompt == tx.prompt and ty.routes == tx.routes
    assert "moe-cache:" in replayed.stdout and "MiB/token" in replayed.stdout


def test_a_replay_takes_the_trace_rows_in_order_and_wraps(qwen, tmp_path) -> None:
    """Another prompt, and more tokens than the trace holds: token t of the run (prompt, then decode)
    routes as trace row t mod its length, wherever that row has the layer."""
    x, y = tmp_path / "x.csv", tmp_path / "y.csv"
    assert record(qwen, x, 6).returncode == 0
    tx = Trace.read(x)
    s = rows(tx)
    r = record(qwen, y, 2 * len(s), SHORT, "--replay-routes", str(x))
    assert r.returncode == 0, r.stderr
    got = rows(Trace.read(y))
    assert len(got) > 2 * len(s), "the run wraps around the trace at least twice"
    compared = 0
    for t, row in enumerate(got):
        want = s[t % len(s)]
        for layer, ex in row.items():
            if layer in want:
                assert ex == want[layer], (t, layer)
                compared += 1
    assert compared > 2 * len(s) * 3


def test_a_trace_that_does_not_fit_the_model_is_refused_at_start(qwen, tmp_path) -> None:
    x = tmp_path / "x.csv"
    assert record(qwen, x, 4).returncode == 0
    lines = x.read_text().splitlines()
    head, body = [ln for ln in lines if ln.startswith("#") or ln.startswith("turn,")], \
                 [ln for ln in lines if ln[:1].isdigit()]

    wide = tmp_path / "wide.csv"  # one routed expert beyond the model's 8
    cells = body[5].split(",")
    cells[5] = "8"
    wide.write_text("\n".join(head + body[:5] + [",".join(cells)] + body[6:]) + "\n")
    r = run_cli("-m", qwen, "-p", PROMPT, "-n", "4", *FLAGS, "--replay-routes", str(wide))
    assert r.returncode == 1 and "expert 8" in r.stderr and "8 experts per layer" in r.stderr, r.stderr

    short = tmp_path / "short.csv"  # three MoE layers for the model's four
    keep = [ln for ln in head if "layer=3 " not in ln] + [ln for ln in body if ln.split(",")[3] != "3"]
    short.write_text("\n".join(keep) + "\n")
    r = run_cli("-m", qwen, "-p", PROMPT, "-n", "4", *FLAGS, "--replay-routes", str(short))
    assert r.returncode == 1 and "routes 3 MoE layers and this model has 4" in r.stderr, r.stderr

    r = run_cli("-m", qwen, "-p", PROMPT, "-n", "4", *FLAGS, "--replay-routes", str(tmp_path / "none.csv"))
    assert r.returncode == 1 and "cannot read it" in r.stderr, r.stderr


def test_the_server_refuses_a_replay(qwen, tmp_path, capsys) -> None:
    from bmoe.server import main as server

    with pytest.raises(SystemExit) as e:
        server.main(["-m", qwen, "--replay-routes", str(tmp_path / "x.csv")])
    assert e.value.code == 2 and "benchmark mode" in capsys.readouterr().err


def test_settings_that_cannot_replay_are_refused() -> None:
    for kw, words in ((dict(stream=False), "stream=False"), (dict(drop_cold=0.1), "lossy"),
                      (dict(parallel=2), "parallel=2"), (dict(prompt_cache="/tmp/pc"), "prompt_cache")):
        with pytest.raises(ConfigError, match=words):
            from_keywords("m.gguf", replay_routes="t.csv", **kw)
    assert from_keywords("m.gguf", replay_routes="t.csv").replay_routes == "t.csv"


def test_bmoe_bench_run_takes_a_replay_like_any_setting(tmp_path) -> None:
    """Its trace path is made absolute (a --checkout run starts in another tree) and read before any run."""
    cfg = bench_config.parse_config("r=--replay-routes t.csv --cache-mb 100")
    assert cfg.flags == ["--replay-routes", str(Path("t.csv").absolute()), "--cache-mb", "100"]
    with pytest.raises(bench_run.BenchError, match="--replay-routes"):
        bench_run.check_cli_flags([cfg], [])
    x = tmp_path / "t.csv"
    x.write_text(f"{V1_MAGIC}\n# model=m arch=qwen3moe n_layer=1 n_expert=8 n_expert_used=2\n"
                 "# layer=0 expert_bytes=1 dense_bytes=0\n0,1,0,0,0,3,0.6,0,1\n0,1,0,0,1,5,0.4,0,1\n")
    bench_run.check_cli_flags([bench_config.parse_config(f"r=--replay-routes {x}")], [])


def test_a_trace_of_fewer_experts_per_token_sizes_the_working_set_by_its_top_k(synth, tmp_path) -> None:
    """gpt-oss-120b's trace routes 2 of the model's 4: a token reads half the model's working set, so
    a cache between the two runs (it was refused as below one token's working set)."""
    model = str(synth(arch="qwen3moe", layers=4, experts=8, top_k=4))
    regions = file_regions(read_model_files(model))
    two, four = (sum(working_sets(regions, k).values()) / MiB for k in (2, 4))
    trace = tmp_path / "x.csv"
    assert record(model, trace, 4, PROMPT, "--cache-mb", "0").returncode == 0
    t = Trace.read(trace)
    t.header["top_k"] = 2
    for step in t.prompt + t.routes:
        for layer in step:
            step[layer] = step[layer][:2]
    t.write_v1(trace)
    between = f"{(two + four) / 2:.3f}"
    r = run_cli("-m", model, "-p", SHORT, "-n", "4", "-c", "512", "-t", "1", "--cache-mb", between,
                "--replay-routes", str(trace))
    assert r.returncode == 0, r.stderr
    refused = run_cli("-m", model, "-p", SHORT, "-n", "4", "-c", "512", "-t", "1", "--cache-mb", between)
    assert refused.returncode != 0 and "one token's working set" in refused.stderr
