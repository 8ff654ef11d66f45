"""Qwen3.6-35B-A3B's shape streamed under a 4000 MiB memory cgroup, against plain llama.cpp (no limit): same text."""
import os, subprocess, sys
from pathlib import Path
from bmoe.tools import bench_sys
from bmoe.base.units import MiB
M = "/work/models/qwen3.6-35b-a3b-like.gguf"
PY = sys.executable
base = [PY, "-m", "bmoe.cli", "-m", M, "-p", "Write a story about a dragon who learns to bake bread.", "-n", "8", "-t", "2"]
h = bench_sys.find_cgroup()
bench_sys.drop_file_cache([Path(M)])
cg = bench_sys.Cgroup(h, f"{bench_sys.CGROUP_PREFIX}q36-{os.getpid()}", 4000 * MiB)
s = subprocess.run(cg.wrap(base + ["--cache-mb", "2000", "--io-threads", "4"]), capture_output=True, text=True)
peak, ooms = cg.peak_bytes(), cg.oom_kills()
cg.remove()
print("streamed exit", s.returncode, "cgroup peak MiB", round((peak or 0) / MiB), "oom kills", ooms)
print(s.stdout)
p = subprocess.run(base + ["--no-stream"], capture_output=True, text=True)
print("plain exit", p.returncode)
print(p.stdout)
t = lambda out: [l for l in out.splitlines() if not l.startswith(("moe-", "bmoe"))][:1]
print("same text:", t(s.stdout) == t(p.stdout), t(s.stdout), t(p.stdout))
