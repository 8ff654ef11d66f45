"""The soak's smoke: bench/soak.py for 10 seconds of mixed traffic on the 16-expert demo with one
fault of each kind (spec-gate stopped, a lane killed, the cgroup squeezed, the prompt cache's disk
full, the usage folder read-only until shutdown). Every check of its verdict must hold; the long run
(30 minutes) is the opt-in benchmark (bench/README.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_ten_seconds_of_traffic_with_every_fault_lose_nothing(tmp_path: Path, demo16: Path) -> None:
    out = tmp_path / "soak"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "soak.py"), "--seconds", "10", "--sample-s", "1",
                        "--clients", "2", "--max-tokens", "12", "-m", str(demo16),
                        "--out", str(out)], capture_output=True, text=True, cwd=REPO)
    report = (out / "report.md").read_text() if (out / "report.md").exists() else r.stdout + r.stderr
    verdict = report.split("## Verdict", 1)[1].split("## Ledger", 1)[0]
    assert r.returncode == 0 and "| **no** |" not in verdict, report
    faults = report.split("## Faults", 1)[1].split("## Probes", 1)[0]
    staged = [f for f in ("stop-gate", "kill-lane", "squeeze", "disk-full", "usage-ro") if f"| {f} |" in faults]
    assert len(staged) == 5, faults
    if os.geteuid() == 0:
        assert "skipped" not in faults, f"as root every fault can be staged here:\n{faults}"
    assert " 0 failed" in verdict and "SIGKILL lane pid" in faults and "SIGSTOP spec-gate pid" in faults
