"""The code passes its linter and its type checker (settings in pyproject.toml: [tool.ruff], [tool.mypy]).

Both run from this interpreter's environment (the `test` extra pins them) in the repository root,
so the suite fails on an unused import, an unsorted import block or a type error like any other
defect. They read the source only: no model is loaded.
"""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *command], cwd=REPO, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing() -> None:
    r = _run("ruff", "check")
    assert r.returncode == 0, (f"ruff check failed (exit {r.returncode}); `python -m ruff check --fix` fixes the "
                               f"safe ones:\n{r.stdout}{r.stderr}")


def test_mypy_finds_nothing() -> None:
    r = _run("mypy")
    assert r.returncode == 0, f"mypy failed (exit {r.returncode}):\n{r.stdout}{r.stderr}"
