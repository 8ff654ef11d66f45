"""Same-run A/B of bmoe-cli env variants on the Qwen shape: median per-token wall/compute/stall/mgmt."""
import csv, os, statistics as st, subprocess, sys
from pathlib import Path
from bmoe.tools import bench_sys
from bmoe.base.units import MiB
M = "/work/models/qwen3-30b-a3b-like-q4_k_m.gguf"
PY = sys.executable
variants = {k: v for k, v in (x.split("=", 1) for x in sys.argv[2:])}
rounds = int(sys.argv[1])
h = bench_sys.find_cgroup()
res = {}
for rnd in range(rounds):
    for name, env_s in variants.items():
        env = dict(os.environ)
        for kv in env_s.split(","):
            if kv:
                k, _, v = kv.partition(":")
                env[k] = v
        bench_sys.drop_file_cache([Path(M)])
        out = Path(f"/tmp/envab-{name}-{rnd}.csv")
        cg = bench_sys.Cgroup(h, f"{bench_sys.CGROUP_PREFIX}envab-{os.getpid()}-{rnd}-{name}", 4000 * MiB)
        extra = os.environ.get("EXTRA", "").split()
        argv = cg.wrap([PY, "-m", "bmoe.cli", "-m", M, "-p", "Write a story about a dragon who learns to bake bread.",
                        "-t", "2", "--csv", str(out), "-n", "32", "--io-threads", "4", "--cache-mb", "2000", "--no-warm-start", *extra])
        r = subprocess.run(argv, env=env, capture_output=True, text=True)
        cg.remove()
        rows = [x for x in csv.DictReader(open(out)) if x.get("wall_ms")][1:]
        med = {c: st.median(float(x[c]) for x in rows) for c in ("wall_ms", "compute_ms", "stall_ms", "mgmt_ms", "io_ms")}
        med["MiB"] = st.median(float(x["read_bytes"]) for x in rows) / MiB
        res.setdefault(name, []).append(med)
        print(name, rnd, r.returncode, {k: round(v, 1) for k, v in med.items()}, r.stdout.strip()[:60].replace("\n", " "), flush=True)
for name, meds in res.items():
    print(name, "median wall", round(st.median(m["wall_ms"] for m in meds), 1), "compute", round(st.median(m["compute_ms"] for m in meds), 1))
