"""The scripts under bench/: named by the question they answer, each in bench/README.md with its
command, and each one that still starts (the long runs themselves need a quiet machine and the
64-expert demo model, so only their cheap modes run here)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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
