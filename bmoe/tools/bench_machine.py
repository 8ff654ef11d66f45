"""What a benchmark ran on: the machine (CPU, memory, kernel, versions, git commit, file system
of the model) and the model's sizes, recorded so a number can be told apart from its setting."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

from bmoe.base import MiB
from bmoe.tools import bench_io


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001
        return None


def _git(repo: Path) -> str | None:
    try:
        rev = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _filesystem(path: Path) -> str:
    best = ("", "?", "?")
    try:
        real = str(path.resolve())
        for line in Path("/proc/self/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                best = (mnt, dev, fstype)
    except OSError:
        pass
    return f"{best[1]} ({best[2]}) mounted at {best[0] or '?'}"


def machine_info(model: Path) -> dict:
    """The machine at the start of a benchmark, and the file system the model is read from."""
    import psutil

    vm = psutil.virtual_memory()
    return {"cores": os.cpu_count(), "cpu": _cpu_model(), "ram_mib": round(vm.total / MiB),
            "available_mib_at_start": round(vm.available / MiB), "kernel": platform.release(),
            "platform": platform.platform(), "python": platform.python_version(),
            "llama-cpp-python": _version("llama-cpp-python"), "bmoe": _version("bmoe"),
            "bmoe_git": _git(Path(__file__).resolve().parent.parent),
            "loadavg_at_start": list(os.getloadavg()), "model_filesystem": _filesystem(model),
            "hostname": platform.node()}


def model_info(model: Path, shards: list[Path], tensors: list[bench_io.ExpertSpan]) -> dict:
    """The model's size, expert and other bytes, and the expert slice sizes the runs read."""
    expert, total = bench_io.tensor_bytes(shards)
    slices: dict[int, int] = {}
    for t in tensors:
        slices[t.slice_bytes] = slices.get(t.slice_bytes, 0) + 1
    desc = ", ".join(f"{b / 1024:.1f} KiB × {n} tensors" for b, n in sorted(slices.items())) or "no expert tensors"
    n_exp = sorted({t.n_expert for t in tensors})
    return {"path": str(model), "shards": [str(p) for p in shards],
            "size_mib": sum(p.stat().st_size for p in shards) / MiB, "expert_mib": expert / MiB,
            "non_expert_mib": (total - expert) / MiB, "n_expert": n_exp[0] if len(n_exp) == 1 else n_exp,
            "expert_tensors": len(tensors), "slice_desc": desc}
