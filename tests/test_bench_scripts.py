"""The scripts under bench/: named by the question they answer, each in bench/README.md with its
command, and each one that still starts (the long runs themselves need a quiet machine and the
64-expert demo model, so only their cheap modes run here)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import REPO

BENCH = REPO / "bench"
SCRIPTS = sorted(p for p in BENCH.iterdir() if p.suffix in (".sh", ".py"))
SHELL = [p for p in SCRIPTS if p.suffix == ".sh"]
PYTHON = [p for p in SCRIPTS if p.suffix == ".py"]


def _run(*args: object, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_no_script_is_named_after_an_issue() -> None:
    named = [str(p.relative_to(BENCH)) for p in BENCH.rglob("*")
             if "reports" not in p.relative_to(BENCH).parts and re.search(r"issue[_-]?\d", p.name, re.I)]
    assert not named, named


def test_every_script_is_in_the_bench_readme_with_a_command() -> None:
    readme = (BENCH / "README.md").read_text()
    missing = [p.name for p in SCRIPTS if f"`{p.name}" not in readme]
    no_command = [p.name for p in SCRIPTS if p.name != "demo64.sh" and f"bench/{p.name}" not in readme]
    assert not missing and not no_command, (missing, no_command)


@pytest.mark.parametrize("script", SHELL, ids=lambda p: p.name)
def test_shell_script_parses(script: Path) -> None:
    r = _run("bash", "-n", script)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("script", PYTHON, ids=lambda p: p.name)
def test_python_script_imports_and_has_help(script: Path) -> None:
    r = _run(sys.executable, script, "--help")
    assert r.returncode == 0 and "usage:" in r.stdout, r.stderr


def test_load_time_runs_through_the_api(small_moe: Path) -> None:
    r = _run(sys.executable, BENCH / "load_time.py", "-m", small_moe, "--rounds", "1", "--cache-mb", "1")
    assert r.returncode == 0, r.stderr
    assert re.search(r"^median load_s: plain [\d.]+ s, streaming [\d.]+ s", r.stdout, re.M), r.stdout


def test_load_time_table_mode_runs(small_moe: Path) -> None:
    r = _run(sys.executable, BENCH / "load_time.py", "-m", small_moe, "--rounds", "1", "--table")
    assert r.returncode == 0, r.stderr
    assert re.search(r"^gguf\.GGUFReader: median [\d.]+ ms", r.stdout, re.M), r.stdout
    assert re.search(r"^bmoe\.base\.gguf_table\.read_table: median [\d.]+ ms", r.stdout, re.M), r.stdout


def test_policy_cost_replays_a_synthetic_layout() -> None:
    r = _run(sys.executable, BENCH / "policy_cost.py", "--synthetic", "--rounds", "1", "--budgets", "25",
             "--policies", "lru,next-use")
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| synthetic |")]
    assert [row.split("|")[3].strip() for row in rows] == ["lru", "next-use"], r.stdout


def test_real_shape_cheap_mode_runs_every_arm_and_reports_bounds(small_moe: Path, tmp_path: Path) -> None:
    out = tmp_path / "shape"
    # (no cache: every token reads, so the I/O bound is defined; a cache that holds the small model's every
    # expert may have read them all in the background before the 4 tokens decode)
    r = _run(sys.executable, BENCH / "real_shape.py", "--cheap", "--no-original", "-m", small_moe, "--out", out,
             "--bmoe", f"a={REPO}", "--bmoe", f"b={REPO}", "--cache-mb", "0", timeout=300)
    assert r.returncode == 0, r.stderr
    rows = {(x["arm"], x["cap"]): x for x in json.loads((out / "results.json").read_text())["summary"]}
    assert set(rows) == {("a", 0), ("b", 0), ("plain", 0)}, rows
    for arm in ("a", "b"):
        x = rows[(arm, 0)]
        assert x["ok"] == 1 and x["tok_s"] > 0 and x["mib_per_token"] is not None and x["compute_bound"] > 0, x
        assert x["io_bound"] > 0 and x["share_of_lower_bound"] > 0, x
    report = (out / "report.md").read_text()
    assert re.search(r"^\| uncapped \| b \| 1/1 \| \*\*[\d.]+\*\*", report, re.M), report
    assert "compute bound: warm, no limit" in report and "| b | " in report.split("Same-run ratios")[1], report
    assert "**no**" not in report, report  # every arm's text is plain llama.cpp's


def test_page_size_runs_both_arms_and_the_small_one_maps_no_2_mib_entries(small_moe: Path, tmp_path: Path) -> None:
    out = tmp_path / "pages"
    r = _run(sys.executable, BENCH / "page_size.py", "-m", small_moe, "--rounds", "1", "-n", "4", "--out", out,
             timeout=300)
    assert r.returncode == 0, r.stderr
    runs = json.loads((out / "runs.json").read_text())
    assert sorted(x["arm"] for x in runs) == ["large", "small"], runs
    assert all(x["tokens"] == 4 and x["s_per_token"] > 0 for x in runs), runs
    assert [x["pmd_mapped_mib"] for x in runs if x["arm"] == "small"] == [0], runs  # 4 KiB pages only
    assert "same text in every run: True" in (out / "summary.md").read_text()


def test_bytes_by_cause_replays_a_recorded_routing(small_moe: Path, tmp_path: Path) -> None:
    from bmoe.streaming.route_trace import Trace

    trace = tmp_path / "small.route.csv"
    r = _run(sys.executable, "-m", "bmoe.cli", "-m", small_moe, "-p", "Write a story about a dragon.", "-n", "6",
             "-t", "1", "--cache-mb", "1", "--route-trace", trace)
    assert r.returncode == 0 and trace.is_file(), r.stderr
    t = Trace.read(trace)
    prompt = {(layer, e) for row in t.prompt for layer, es in row.items() for e in es}
    decode = {(layer, e) for row in t.routes for layer, es in row.items() for e in es}
    lookups = sum(len(set(es)) for row in t.routes for es in row.values()) / len(t.routes)

    def rows(cache_mb: str) -> dict[str, float]:
        r = _run(sys.executable, BENCH / "bytes_by_cause.py", "-m", small_moe, "--trace", trace, "--cache-mb", cache_mb)
        assert r.returncode == 0, r.stderr
        found = re.findall(r"^\| ([A-Za-z -]+(?:, [a-z]+ charge)?(?:, prompt cold but its last 2)?) \| [\d.]+ "
                           r"\| ([\d.]+) \| \d+ \| \d+ of \d+ \|$", r.stdout, re.M)
        return {name: float(misses) for name, misses in found}

    names = {"original LRU", "bmoe next-use", "bmoe lru",
             *(f"{p} order, {c}" for p in ("next-use", "lru")
               for c in ("slot charge", "exact charge", "slot charge, prompt cold but its last 2"))}
    tight, roomy = rows("0.05"), rows("1000")
    assert set(tight) == names == set(roomy), (tight, roomy)
    # 0.05 MiB holds no expert between tokens: every lookup is read; 1000 MiB holds all: each expert the
    # prompt did not route is read once
    assert all(abs(m - lookups) < 0.051 for m in tight.values()), (tight, lookups)
    assert all(abs(m - len(decode - prompt) / len(t.routes)) < 0.051 for m in roomy.values()), (roomy, decode - prompt)


def test_hook_costs_counts_the_stops_and_calls_per_token(small_moe: Path, tmp_path: Path) -> None:
    out = tmp_path / "costs.json"
    r = _run(sys.executable, BENCH / "hook_costs.py", "--json", out, "--", "-m", small_moe, "-n", "6", "-t", "1",
             "--cache-mb", "0.6", "--force", "--no-overlap")
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["tokens"] == 6 and res["wall_ms"] > 0, res
    # serial streaming with a cache below the working set: every one of the 4 MoE layers stops and routes, each token;
    # no read is in flight when a layer's routing node is asked about, so the compiled filter says yes itself, and
    # Python routes each (none is all resident: nothing to replay)
    assert res["hook"]["stops (graph splits)"] == 4 == res["hook"]["stops answered in C"], res["hook"]
    assert res["functions"]["StreamingStops.on_route"]["calls"] == 4, res["functions"]
    assert res["functions"].get("StreamingStops.replay_hit", {"calls": 0})["calls"] == 0, res["functions"]
    assert re.search(r"^StreamingStops\.on_route +4\.0 ", r.stderr, re.M), r.stderr


def _bench_module(name: str) -> ModuleType:
    """A bench script imported as a module, for its pieces that do not time anything."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("args", "said"), [
    (["--phases", "b,a"], "in that order"), (["--phases", "a,e"], "some of a,b,c,d"),
    (["--clients", "0"], "--clients must be at least 1"), (["--cap-mib", "-1"], "0 or more"),
    (["-m", "/nonexistent.gguf"], "no model at /nonexistent.gguf")])
def test_replicas_refuses_bad_arguments_before_it_starts_anything(args: list[str], said: str, tmp_path: Path) -> None:
    r = _run(sys.executable, BENCH / "replicas.py", "--out", tmp_path / "out", *args)
    assert r.returncode == 2 and said in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="HAProxy is not installed (apt-get install haproxy)")
def test_replicas_stops_saying_why_when_flash_limit_cannot_cap(tmp_path: Path) -> None:
    """flash-limit's exit 99 (no cap can be set here, e.g. the model on tmpfs or no root) ends the benchmark before
    anything starts, with flash-limit's reason: numbers without the cap would not be the disk-bound ones."""
    stub = tmp_path / "flash-limit"
    stub.write_text('#!/bin/sh\necho "flash-limit: no blkio or io cgroup controller here" >&2\nexit 99\n')
    stub.chmod(0o755)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    r = _run(sys.executable, BENCH / "replicas.py", "--out", tmp_path / "out", "-m", model, "--flash-limit", stub)
    assert r.returncode == 1, r.stderr
    assert "cannot cap reads here (exit 99): flash-limit: no blkio or io cgroup controller here" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_replicas_quick_mode_and_the_defaults_it_derives(tmp_path: Path) -> None:
    m = _bench_module("replicas")
    a = m.parse_args(["--out", str(tmp_path), "--quick", "--store", "sqlite"])
    assert (a.clients, a.turns, a.tokens, a.cap_mib, a.cache_mb) == (2, 2, 8, 1000, 3000)
    assert a.parallel == a.clients and a.mem_limit_mb == a.cache_mb + 1200 and a.phases == ["a", "b", "c", "d"]
    a = m.parse_args(["--out", str(tmp_path), "--clients", "6", "--mem-limit-mb", "0", "--store", "sqlite"])
    assert (a.parallel, a.mem_limit_mb, a.cap_mib) == (6, 0, 20)


def test_replicas_runs_haproxy_with_the_repository_config_and_only_an_admin_socket_added(tmp_path: Path) -> None:
    m = _bench_module("replicas")
    config = (REPO / "deploy" / "haproxy.cfg").read_text()
    sock = tmp_path / "haproxy.sock"
    derived = m.admin_config(config, sock)
    added = f"    stats socket {sock} mode 600 level admin\n"
    assert derived.count(added) == 1 and derived.replace(added, "") == config
    assert derived.index(added) == derived.index("\nglobal\n") + len("\nglobal\n")
    if shutil.which("haproxy"):
        (tmp_path / "haproxy.cfg").write_text(derived)
        r = _run("haproxy", "-c", "-f", tmp_path / "haproxy.cfg")
        assert r.returncode == 0, r.stdout + r.stderr


def test_replicas_counts_a_phase_from_its_requests() -> None:
    m = _bench_module("replicas")
    A = m.Asked
    asked = [A("b", 0, 0, 0, "k0", 0.0, replica="r1", outcome="ok", first_s=1.0, completion_tokens=10,
               prompt_tokens=100),
             A("b", 0, 0, 1, "k0", 2.0, replica="r1", outcome="ok", first_s=2.5, completion_tokens=10,
               prompt_tokens=200, cached_tokens=150),
             A("b", 1, 0, 0, "k1", 0.0, replica="r2", outcome="cut", first_s=4.0, error="cut"),
             A("b", 1, 0, 0, "k1", 5.0, replica="r1", outcome="ok", first_s=8.0, completion_tokens=10,
               prompt_tokens=100, resent=True),
             A("b", 1, 0, 1, "k1", 9.0, replica="r2", outcome="ok", first_s=9.5, completion_tokens=10,
               prompt_tokens=200, cached_tokens=50),
             A("b", 2, 0, 0, "k2", 0.0, replica="", outcome="failed", error="503")]
    s = m.summarize("b", asked, 8.0)
    assert (s["requests"], s["ok"], s["cut"], s["failed"], s["resent"], s["resent_ok"]) == (6, 4, 1, 1, 1, 1)
    assert s["generated_tokens"] == 40 and s["tok_s"] == 5.0
    assert s["later_turns_cached_pct"] == 50.0  # (150 + 50) of the later turns' 400 prompt tokens
    assert s["by_replica"] == {"r1": 3, "r2": 1}
    assert s["conversations_on_one_replica"] == "1/2"  # client 1's moved from r1 to r2
    assert s["first_text_s_median"] == 0.75  # of 1.0, 0.5, 3.0 and 0.5
