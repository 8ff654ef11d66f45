"""bmoe-bench: real runs on a tiny synthetic model, with and without a cgroup memory limit."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bmoe.base import telemetry
from bmoe.tools import bench, bench_config, bench_io, bench_numbers, bench_sys

REPO = Path(__file__).resolve().parent.parent
FIELDS = {"config", "flags", "repeat", "phase", "round", "tok_s", "s_per_token_median", "s_per_token_p95",
          "mib_per_token", "cache_hit_pct", "stall_s_per_token", "peak_mem_mib", "peak_rss_mib",
          "peak_shm_mib", "peak_cgroup_mib", "exit_status", "ok", "elapsed_s"}
LIMIT = 1800  # s: only keeps a hung run from hanging the suite; no test measures speed
SECTIONS = ["# bmoe-bench report", "## Command", "## Machine", "## Model", "## Memory limit",
            "## O_DIRECT read bandwidth", "## Results", "## Runs"]


@pytest.fixture(scope="module")
def tiny(small_moe) -> Path:
    return small_moe


def cgroup_usable() -> bench_sys.CgroupHierarchy | None:
    h = bench_sys.find_cgroup()
    if h is None or not h.parent.is_dir():
        return None
    try:
        bench_sys.probe_cgroup(h)
    except bench_sys.LimitError:
        return None
    return h


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def our_cgroups(h: bench_sys.CgroupHierarchy, pid: int) -> list[Path]:
    return sorted(h.parent.glob(f"{bench_sys.CGROUP_PREFIX}{pid}-*"))


def bench_cmd(model: Path, out: Path, *extra: str) -> list[str]:
    # -t 1: on a busy 2-core machine llama.cpp's spinning thread pool makes -t 2 very slow
    return [sys.executable, "-m", "bmoe.tools.bench", "run", "-m", str(model), "-p", "Once upon a time", "-n", "6",
            "--common", "-t 1 -c 256", "--config", "c0=--cache-mb 0", "--config", "c1=--cache-mb 1",
            "--warmup", "0", "--bw-mb", "4", "--bw-threads", "1,2", "--drop-caches", "file",
            "--out", str(out), *extra]


# ---- pure parts --------------------------------------------------------------------------------

def test_parse_config_accepts_name_and_shell_flags() -> None:
    c = bench_config.parse_config("c1g=--cache-mb 1024 --io-threads 4")
    assert (c.name, c.flags) == ("c1g", ["--cache-mb", "1024", "--io-threads", "4"])
    assert bench_config.parse_config("plain=").flags == []
    assert bench_config.parse_config("q='--cache-mb' \"0\"").flags == ["--cache-mb", "0"]


@pytest.mark.parametrize("text, why", [
    ("--cache-mb 0", "NAME="), ("=--cache-mb 0", "NAME="), ("a b=--cache-mb 0", "name"),
    ("a=--cache-mb '0", "cannot split"), ("a=-n 5", "set by bmoe-bench"), ("a=--csv=x.csv", "set by bmoe-bench"),
])
def test_parse_config_rejects_bad_syntax(text: str, why: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=why):
        bench_config.parse_config(text)


def test_bad_config_is_a_usage_error(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bench.main(["run", "-m", str(tiny), "--config", "no-equals-sign"])
    assert e.value.code == 2
    assert "expected NAME='FLAGS'" in capsys.readouterr().err


def test_missing_model_and_duplicate_names_are_clear_errors(tiny: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["run", "-m", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "o")]) == 1
    assert "does not exist; check the -m path" in capsys.readouterr().err
    assert bench.main(["run", "-m", str(tiny), "--config", "mmap=--cache-mb 0", "--out", str(tmp_path / "o")]) == 1
    assert "--no-baseline" in capsys.readouterr().err
    assert bench.main(["run", "-m", str(tiny), "--config", "x=--no-such-flag", "--out", str(tmp_path / "o")]) == 1
    assert "bmoe-cli rejects its flags" in capsys.readouterr().err


def test_schedule_is_round_robin() -> None:
    cs = [bench_config.Config(n, []) for n in ("a", "b", "c")]
    plan = bench_config.schedule(cs, warmup=1, repeats=2)
    assert [(p, r, c.name) for p, r, c in plan] == [
        ("warmup", 0, "a"), ("warmup", 0, "b"), ("warmup", 0, "c"),
        ("measure", 0, "a"), ("measure", 0, "b"), ("measure", 0, "c"),
        ("measure", 1, "a"), ("measure", 1, "b"), ("measure", 1, "c")]


STDOUT = """ some generated words generation: 9 tokens, 9.9 s/token (0.1 tok/s)
generation: 4 tokens, 0.0250 s/token (40.00 tok/s)
moe-stream: read 8.00 MiB (2.00 MiB/token), decode 0.0250 s/token (compute 0.0100 + cache mgmt 0.0010 + flash I/O 0.0140 s/token, 142.9 MiB/s) stall_s/tok=0.0031
moe-cache: 37.5% hit, resident 1.2 MiB
"""  # noqa: E501 - the moe-stream line as bmoe-cli prints it, in one piece
CSV = """step,steps,wall_ms,io_ms,compute_ms,read_bytes,cache_hit_pct,stall_ms,mgmt_ms
1,4,10.0,1,1,100,0,0,0
2,4,20.0,1,1,100,0,0,0
3,4,30.0,1,1,100,0,0,0
4,4,40.0,1,1,100,0,0,0
# summary tokens=4 s/tok=0.0250
"""


def test_run_numbers_from_summary_and_csv() -> None:
    r = bench_numbers.run_numbers(STDOUT)
    assert r["tokens"] == 4 and r["tok_s"] == 40.0 and r["s_per_token"] == 0.025
    assert r["s_per_token_p95"] == 0.025 and r["p95_source"] == "summary"
    assert r["mib_read"] == 8.0 and r["mib_per_token"] == 2.0 and r["stall_s_per_token"] == 0.0031
    assert r["cache_hit_pct"] == 37.5 and r["cache_resident_mib"] == 1.2
    r = bench_numbers.run_numbers(STDOUT, CSV)
    assert r["p95_source"] == "csv"
    assert r["s_per_token_median"] == pytest.approx(0.025)
    assert r["s_per_token_p95"] == pytest.approx(0.0385)
    assert r["steady_mib_per_token"] == pytest.approx(100 / (1 << 20))
    assert r["tok_s"] == pytest.approx(40.0) and r["s_per_token"] == pytest.approx(0.025)
    steady = bench_numbers.run_numbers(STDOUT, CSV, skip_tokens=2)
    assert steady["s_per_token_median"] == pytest.approx(0.035) and steady["tok_s"] == pytest.approx(40.0)
    assert bench_numbers.run_numbers(STDOUT, CSV, skip_tokens=9)["s_per_token_median"] == pytest.approx(0.025)
    serial = bench_numbers.run_numbers(STDOUT.replace(" stall_s/tok=0.0031", ""))
    assert serial["mib_per_token"] == 2.0 and serial["stall_s_per_token"] is None
    assert bench_numbers.run_numbers("error\n")["tok_s"] is None
    first_token = ("prefill_tokens", "prefill_s", "prefill_tok_s", "load_s", "bmoe_load_s", "ttft_s")
    assert all(r[k] is None for k in first_token), "a CSV from before the keys existed has none of them"


def test_lanes_busy_share_is_the_overlap_io_over_lanes_times_wall() -> None:
    """Under --overlap, moe-stream's flash I/O is the lanes' summed busy time: 0.0140 s/token of
    reading by 2 lanes in 0.0250 s/token is 28 % busy. Serial I/O is blocked time: no share."""
    rec = {"phase": "measure", "ok": True, **bench_numbers.run_numbers(STDOUT)}
    cs = [bench_config.Config("o", ["--io-threads", "2"]), bench_config.Config("s", ["--io-threads", "2"]),
          bench_config.Config("b", ["--no-stream"])]
    runs = [{**rec, "config": c.name} for c in cs]
    by = {x["config"]: x for x in bench_numbers.summarize(cs, runs, {2: 100.0}, common=["--no-overlap"])}
    assert by["s"]["lanes_busy_pct"] is None and by["b"]["lanes_busy_pct"] is None
    cs[0] = bench_config.Config("o", ["--io-threads", "2", "--overlap"])
    by = {x["config"]: x for x in bench_numbers.summarize(cs, runs, {2: 100.0}, common=["--no-overlap"])}
    assert by["o"]["lanes_busy_pct"] == pytest.approx(28.0) and by["s"]["lanes_busy_pct"] is None


def test_run_numbers_reads_ahead_from_stdout_or_the_stderr_notice() -> None:
    prefetch = "moe-prefetch: 2.00 MiB speculative, 3/4 experts useful (75.0%)"
    gate = "moe-spec-gate: 81.5% router prediction recall (auto-disabled below 75%)"
    # --spec-gate without --prefetch: bmoe-cli gives the moe-prefetch numbers as a notice on stderr
    r = bench_numbers.run_numbers(STDOUT + gate + "\n", stderr=f"bmoe: {prefetch}\n")
    assert r["spec_mib_per_token"] == 0.5 and r["useful_pct"] == 75.0
    assert r["spec_recall_pct"] == 81.5 and r["spec_disabled"] is True
    both = bench_numbers.run_numbers(STDOUT + prefetch + "\n", stderr=f"bmoe: {prefetch.replace('2.00', '8.00')}\n")
    assert both["spec_mib_per_token"] == 0.5 and both["spec_recall_pct"] is None
    assert bench_numbers.run_numbers("", stderr=f"bmoe: {prefetch}\n")["spec_mib_per_token"] is None


def test_bandwidth_reads_aligned_expert_slices(tiny: Path) -> None:
    ts = bench_io.expert_tensors([tiny])
    assert len(ts) == 4 * 3 and all(t.n_expert == 8 for t in ts)
    for t in ts:
        off, n = t.request(3)
        assert off % 4096 == 0 and n % 4096 == 0
        assert off <= t.offset + 3 * t.slice_bytes and off + n >= t.offset + 4 * t.slice_bytes
    b = bench_io.measure([tiny], ts, total_mb=2, threads=2)
    assert b.mib_s > 0 and b.bytes >= 2 << 20 and b.threads == 2


def test_balloon_holds_memory_until_closed() -> None:
    with bench_sys.Balloon(48 << 20) as b:
        p = psutil.Process(b.proc.pid)
        assert p.memory_info().rss >= 48 << 20
    assert b.proc.poll() is not None


# ---- real runs ---------------------------------------------------------------------------------

def check_results(out: Path, limit: bool) -> dict:
    doc = json.loads((out / "results.json").read_text())
    runs = doc["runs"]
    assert [r["config"] for r in runs] == ["mmap", "c0", "c1", "mmap", "c0", "c1"], "runs must alternate"
    assert [r["repeat"] for r in runs] == [0, 0, 0, 1, 1, 1]
    for r in runs:
        assert FIELDS <= r.keys(), FIELDS - r.keys()
        assert r["ok"] and r["exit_status"] == 0, r.get("stderr_tail")
        assert r["tok_s"] > 0 and r["s_per_token_p95"] >= r["s_per_token_median"] > 0
        assert r["peak_mem_mib"] > 0
        if r["config"] == "mmap":
            assert r["flags"] == ["--no-stream"] and r["mib_per_token"] is None
        else:
            assert r["mib_per_token"] > 0
        assert (r["peak_cgroup_mib"] is not None and r["peak_cgroup_mib"] > 0) == limit
    by = {s["config"]: s for s in doc["summary"]}
    assert by["c1"]["cache_hit_pct"] is not None and by["c0"]["cache_hit_pct"] is None
    assert by["mmap"]["speedup_vs_mmap"] == pytest.approx(1.0)
    for s in doc["summary"]:  # time to first token, from every run's CSV summary
        assert s["ttft_s_median"] > s["load_s_median"] >= s["bmoe_load_s_median"] > 0, s
        assert s["prefill_tok_s_median"] > 0 and s["prefill_tokens"] == runs[0]["prefill_tokens"] > 1, s
        assert s["ttft_vs_mmap"] == pytest.approx(s["ttft_s_median"] / by["mmap"]["ttft_s_median"])
    assert by["c0"]["io_bound_tok_s"] > 0 and by["c0"]["bw_threads"] == 2
    # no cache: every token reads, and under overlap (the default) the lanes' busy share shows
    assert 0 < by["c0"]["lanes_busy_pct"] <= 100.5 and by["mmap"]["lanes_busy_pct"] is None
    assert set(doc["bandwidth"]["used"]) == {"1", "2"}
    report = (out / "report.md").read_text()
    pos = [report.find(s) for s in SECTIONS]
    assert -1 not in pos and pos == sorted(pos), dict(zip(SECTIONS, pos))
    assert "bmoe-bench run -m" in report and "| c1 |" in report
    ttft = report[report.index("### Time to first token"):]
    assert "| config | prompt tokens | TTFT s | TTFT ÷ mmap |" in ttft
    assert f"| c1 | {by['c1']['prefill_tokens']:.0f} | {by['c1']['ttft_s_median']:.3f} | " \
           f"{by['c1']['ttft_vs_mmap']:.3f} |" in ttft
    assert "| # | phase | round | config | exit | tok/s | TTFT s |" in report
    assert (out / "runs").is_dir()
    return doc


def test_real_run_without_limit(tiny: Path, tmp_path: Path) -> None:
    r = subprocess.run(bench_cmd(tiny, tmp_path / "out", "--repeats", "2"), capture_output=True, text=True,
                       timeout=LIMIT, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "[6/6] measure round 2/2, config c1" in r.stderr
    assert r.stderr.count(", TTFT ") == 6, r.stderr  # each run's progress line
    doc = check_results(tmp_path / "out", limit=False)
    assert doc["memory_limit"]["method"] is None
    # a run's numbers from its real CSV: the derived keys are the summary line's arithmetic
    rec = doc["runs"][-1]
    runs = tmp_path / "out" / "runs"
    csv_text = (runs / rec["csv_file"]).read_text()
    got = bench_numbers.run_numbers((runs / rec["stdout_file"]).read_text(), csv_text)
    line = telemetry.read_csv(csv_text)[1]
    assert got["ttft_s"] == pytest.approx(line["load_s"] + line["prefill_s"]) == rec["ttft_s"]
    assert got["prefill_tok_s"] == pytest.approx(line["prefill_tokens"] / line["prefill_s"])
    assert got["bmoe_load_s"] == pytest.approx(line["load_s"] - line["llama_load_s"])
    assert (got["prefill_s"], got["load_s"], got["prefill_tokens"]) == (line["prefill_s"], line["load_s"],
                                                                        line["prefill_tokens"])


def test_a_configuration_runs_from_its_own_checkout(tiny: Path, tmp_path: Path) -> None:
    """--checkout NAME=DIR: that configuration's bmoe-cli is the other tree's (a code A/B in one run),
    and so are the I/O lanes it starts (they start without the cwd on their path)."""
    other = tmp_path / "other"
    shutil.copytree(REPO / "bmoe", other / "bmoe", ignore=shutil.ignore_patterns("__pycache__"))
    for module, mark in (("cli.py", "from the other checkout"), ("workers/io_lane.py", "lane of the other checkout")):
        path = other / "bmoe" / module
        path.write_text(path.read_text().replace("def main(argv: list[str] | None = None) -> int:\n",
                                                 "def main(argv: list[str] | None = None) -> int:\n"
                                                 f"    print({mark!r}, file=sys.stderr)\n", 1))
    r = subprocess.run(bench_cmd(tiny, tmp_path / "out", "--repeats", "1", "--warmup", "0", "--config", "b=",
                                 "--checkout", f"b={other}"), capture_output=True, text=True, timeout=LIMIT,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    errs = {rec["config"]: (tmp_path / "out" / "runs" / rec["stderr_file"]).read_text() for rec in doc["runs"]}
    assert "from the other checkout" in errs["b"] and "from the other checkout" not in errs["c1"]
    assert "lane of the other checkout" in errs["b"] and "lane of the other checkout" not in errs["c1"]
    assert [c["checkout"] for c in doc["configs"] if c["name"] == "b"] == [str(other.resolve())]
    assert f"(from `{other.resolve()}`)" in (tmp_path / "out" / "report.md").read_text()
    bad = subprocess.run(bench_cmd(tiny, tmp_path / "x", "--checkout", f"c1={tmp_path}"), capture_output=True,
                         text=True, timeout=LIMIT, cwd=tmp_path)
    assert bad.returncode == 2 and "holds no bmoe/cli.py" in bad.stderr


def test_real_run_under_cgroup_limit(tiny: Path, tmp_path: Path) -> None:
    h = cgroup_usable()
    if h is None:
        pytest.skip("no writable memory cgroup here")
    before = set(h.parent.glob(f"{bench_sys.CGROUP_PREFIX}*"))
    p = subprocess.Popen(bench_cmd(tiny, tmp_path / "out", "--repeats", "2", "--mem-limit-mb", "2000",
                                   "--limit-method", "cgroup"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    _out, err = p.communicate(timeout=LIMIT)
    assert p.returncode == 0, err
    doc = check_results(tmp_path / "out", limit=True)
    assert doc["memory_limit"]["method"] == f"cgroup-v{h.version}"
    assert all(r["oom_kills"] == 0 for r in doc["runs"])
    assert not our_cgroups(h, p.pid), "per-run cgroups must be removed"
    assert set(h.parent.glob(f"{bench_sys.CGROUP_PREFIX}*")) <= before
    assert "2000 MiB via cgroup" in (tmp_path / "out" / "report.md").read_text()


def test_oom_killed_run_is_recorded_as_failure(tiny: Path, tmp_path: Path) -> None:
    h = cgroup_usable()
    if h is None:
        pytest.skip("no writable memory cgroup here")
    cmd = [sys.executable, "-m", "bmoe.tools.bench", "run", "-m", str(tiny), "-n", "4", "--no-baseline",
           "--config", "tight=-t 1 --cache-mb 0", "--warmup", "0", "--repeats", "1", "--no-bandwidth",
           "--drop-caches", "file", "--mem-limit-mb", "24", "--limit-method", "cgroup", "--out", str(tmp_path / "o")]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    _, err = p.communicate(timeout=LIMIT)
    assert p.returncode == 1, err
    doc = json.loads((tmp_path / "o" / "results.json").read_text())
    (run,) = doc["runs"]
    assert not run["ok"] and run["exit_status"] != 0 and "stderr_tail" in run
    assert run["oom_kills"] >= 1
    assert "## Failures" in (tmp_path / "o" / "report.md").read_text()
    assert not our_cgroups(h, p.pid)


def test_ctrl_c_stops_the_run_and_removes_the_cgroup(tiny: Path, tmp_path: Path) -> None:
    h = cgroup_usable()
    if h is None:
        pytest.skip("no writable memory cgroup here")
    cmd = [sys.executable, "-m", "bmoe.tools.bench", "run", "-m", str(tiny), "-n", "32000", "--no-baseline",
           "--config", "long=-t 1 -c 32768 --cache-mb 0", "--warmup", "0", "--repeats", "2", "--no-bandwidth",
           "--drop-caches", "file", "--mem-limit-mb", "2000", "--limit-method", "cgroup", "--out", str(tmp_path / "o")]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    members: list[int] = []
    deadline = time.monotonic() + LIMIT
    # wait until the run's cgroup holds the coordinator and its two I/O lanes (the default --io-threads)
    while time.monotonic() < deadline and len(members) < 3 and p.poll() is None:
        for cg in our_cgroups(h, p.pid):
            try:
                members = [int(x) for x in (cg / "cgroup.procs").read_text().split()]
            except (OSError, ValueError):
                pass
        time.sleep(0.1)
    assert p.poll() is None, "the run ended before it could be interrupted: " + p.communicate()[1]
    assert len(members) >= 3, f"the coordinator and its lanes never ran inside the cgroup: {members}"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=LIMIT)
    assert p.returncode == 130, err
    assert not our_cgroups(h, p.pid)
    # a cgroup is removed only once empty: every member has exited (no waiting needed)
    assert not [pid for pid in members if alive(pid)]
    assert "Interrupted" in (tmp_path / "o" / "report.md").read_text()


def test_help_has_examples_and_room_for_more_commands() -> None:
    r = subprocess.run([sys.executable, "-m", "bmoe.tools.bench", "run", "--help"], capture_output=True, text=True,
                       timeout=LIMIT)
    assert r.returncode == 0 and "examples:" in r.stdout and "--mem-limit-mb" in r.stdout
    r = subprocess.run([sys.executable, "-m", "bmoe.tools.bench", "--help"], capture_output=True, text=True,
                       timeout=LIMIT)
    assert "run" in r.stdout and "routes" in r.stdout
