from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import psutil
import pytest

from bmoe.shm_cache import SHM_DIR, SHM_PREFIX

REPO = Path(__file__).resolve().parent.parent


def bmoe_segments() -> set[str]:
    """Segments this test session could own: its own, or those of processes that have ended.

    A segment of another live process (another bmoe run on the machine) is not ours to judge.
    """
    if not SHM_DIR.is_dir():
        return set()
    out = set()
    for p in SHM_DIR.glob(f"{SHM_PREFIX}*"):
        owner = p.name.split("-")[1]
        if not owner.isdigit() or int(owner) == os.getpid() or not psutil.pid_exists(int(owner)) \
                or _is_descendant(int(owner)):
            out.add(p.name)
    return out


def _is_descendant(pid: int) -> bool:
    try:
        return any(a.pid == os.getpid() for a in psutil.Process(pid).parents())
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def synth(model_dir: Path) -> Callable[..., Path]:
    """Write (once per session) a synthetic model for these parameters."""
    from bmoe.synth import write_model

    made: dict[tuple, Path] = {}

    def make(**kw: object) -> Path:
        key = tuple(sorted(kw.items()))
        if key not in made:
            name = "-".join(f"{k}{v}" for k, v in key) or "default"
            made[key] = write_model(model_dir / f"{name}.gguf", **kw)
        return made[key]

    return make


@pytest.fixture(autouse=True)
def no_leaked_segments() -> None:
    """Every test must leave /dev/shm as it found it."""
    before = bmoe_segments()
    yield
    leaked = bmoe_segments() - before
    assert not leaked, f"shared memory left behind: {sorted(leaked)}"


def run_cli(*args: str, timeout: float = 240, **kw: object) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "bmoe.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO, **kw)
