"""How soon does the first token come with the mapped load, with llama.cpp's reading load, and with plain mmap?

Same-run A/B on the 64-expert demo (or `-m`): a ~400-token prompt (bench/prompts/prefill_400.txt),
`-n 1 -t 2 -c 4096`, each run a fresh `bmoe-cli` in a fresh cgroup of `--mem-limit-mb` (2500) on a
cold page cache. Arms (alternating, their order reversed every other round):

- `mapped`: bmoe's start (llama.cpp maps the file without reading it; `--cache-mb 1300 --io-threads 4`);
- `read`:   the same with the fallback forced (bmoe.seam's registry check made to fail in that
            process: llama.cpp reads the whole file at load, as before issue 21);
- `mmap`:   plain llama.cpp (`--no-stream`);
- `base`:   with `--base DIR`, the bmoe source tree at DIR (e.g. `git archive <commit> | tar -x -C DIR`)
            run the `mapped` arm's command, for a before/after.

TTFT = `load_s + prefill_s` from each run's CSV `# summary` (as bmoe-bench defines it). Writes
results.json and report.md (medians, each arm ÷ mmap per round and in medians).

    python bench/first_token_by_load_kind.py --rounds 3 --out bench/reports/$(date +%F)-scale/first-token
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bmoe.base.units import MiB  # noqa: E402
from bmoe.tools.bench_sys import Cgroup, drop_file_cache, find_cgroup, remove_all_cgroups  # noqa: E402

DEMO = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bmoe" / "smollm2-135m-moe-e64-k8-r2.gguf"
FORCE_READ = "import bmoe.seam as s, sys; s.REGISTRY_API_VERSION = -1; from bmoe.cli import main; sys.exit(main())"


def run(a: argparse.Namespace, cg_parent, arm: str, csv: Path) -> dict:
    common = ["-m", str(a.model), "-f", str(a.prompt_file), "-n", "1", "-t", str(a.threads), "-c", "4096",
              "--csv", str(csv)]
    stream = ["--cache-mb", str(a.cache_mb), "--io-threads", str(a.io_threads)]
    env = dict(os.environ)
    if arm == "mmap":
        cmd = [sys.executable, "-m", "bmoe.cli", *common, "--no-stream"]
    elif arm == "read":
        cmd = [sys.executable, "-c", FORCE_READ, *common, *stream, "--no-warm-start"]
    elif arm == "base":
        env["PYTHONPATH"] = str(a.base)
        cmd = [sys.executable, "-m", "bmoe.cli", *common, *stream]
    else:
        cmd = [sys.executable, "-m", "bmoe.cli", *common, *stream, "--no-warm-start"]
    drop_file_cache([a.model])
    csv.unlink(missing_ok=True)
    with Cgroup(cg_parent, f"bmoe-bench-first-token-{os.getpid()}", a.mem_limit_mb * MiB) as cg:
        r = subprocess.run(cg.wrap(cmd), capture_output=True, text=True, env=env, cwd="/tmp")
        oom = cg.oom_kills()
    rec = {"arm": arm, "exit": r.returncode, "oom_kills": oom, "load_avg": os.getloadavg()[0],
           "whole_file_notice": "loading the whole model file" in r.stderr}
    summary = next((line for line in csv.read_text().splitlines() if line.startswith("# summary")), None) \
        if csv.exists() else None
    if summary is None:
        rec["stderr"] = r.stderr[-1500:]
        return rec
    kv = dict(x.split("=", 1) for x in summary.split()[2:] if "=" in x)
    rec.update({k: float(kv[k]) for k in ("prefill_s", "load_s", "llama_load_s")})
    rec["ttft_s"] = rec["load_s"] + rec["prefill_s"]
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, default=DEMO)
    ap.add_argument("-f", "--prompt-file", type=Path, default=REPO / "bench" / "prompts" / "prefill_400.txt")
    ap.add_argument("--mem-limit-mb", type=int, default=2500)
    ap.add_argument("--cache-mb", type=float, default=1300)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--base", type=Path, help="another bmoe source tree to run as the `base` arm")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out, a.model, a.prompt_file = a.out.resolve(), a.model.resolve(), a.prompt_file.resolve()
    cg_parent = find_cgroup()
    if cg_parent is None:
        ap.error("no memory cgroup here (run as root where cgroup v1 or v2 has the memory controller)")
    arms = ["mapped", "read", "mmap"] + (["base"] if a.base else [])
    a.out.mkdir(parents=True, exist_ok=True)
    load0, runs = os.getloadavg()[0], []
    try:
        for r in range(a.rounds):
            for arm in (arms if r % 2 == 0 else arms[::-1]):
                rec = run(a, cg_parent, arm, a.out / "run.csv")
                rec["round"] = r + 1
                runs.append(rec)
                print(f"first-token: round {r + 1} {arm}: TTFT {rec.get('ttft_s', 'failed')}",
                      file=sys.stderr, flush=True)
    finally:
        remove_all_cgroups()
        (a.out / "run.csv").unlink(missing_ok=True)
    (a.out / "results.json").write_text(json.dumps(runs, indent=1))
    ok = [x for x in runs if "ttft_s" in x]
    med = {arm: {k: statistics.median(x[k] for x in ok if x["arm"] == arm) for k in ("ttft_s", "prefill_s", "load_s",
                                                                                     "llama_load_s")}
           for arm in arms if any(x["arm"] == arm for x in ok)}
    L = ["# First token: mapped load, llama.cpp's reading load, plain mmap", "",
         f"`python bench/first_token_by_load_kind.py {' '.join(sys.argv[1:])}`", "",
         f"Model {a.model.name}, prompt {a.prompt_file.name}, `-n 1 -t {a.threads} -c 4096`, streaming arms "
         f"`--cache-mb {a.cache_mb:g} --io-threads {a.io_threads}`, each run in a fresh {a.mem_limit_mb} MiB cgroup "
         f"on a cold page cache; {a.rounds} rounds; 1-minute load average {load0:.1f} at start, "
         f"{os.getloadavg()[0]:.1f} at end.", "",
         "| arm | runs | median TTFT s | ÷ mmap | prefill s | load s | llama.cpp load s |",
         "|---|---:|---:|---:|---:|---:|---:|"]
    for arm, m in med.items():
        L.append(f"| {arm} | {sum(x['arm'] == arm for x in ok)} | {m['ttft_s']:.2f} | "
                 f"{m['ttft_s'] / med['mmap']['ttft_s']:.2f} | {m['prefill_s']:.2f} | {m['load_s']:.2f} | "
                 f"{m['llama_load_s']:.2f} |")
    L += ["", "Per round, TTFT ÷ the same round's mmap:", "", "| round | " + " | ".join(arms) + " |",
          "|---:|" + "---:|" * len(arms)]
    for r in range(1, a.rounds + 1):
        by = {x["arm"]: x for x in ok if x["round"] == r}
        mm = by.get("mmap", {}).get("ttft_s")
        L.append(f"| {r} | " + " | ".join(f"{by[arm]['ttft_s']:.2f} ({by[arm]['ttft_s'] / mm:.2f})"
                                          if arm in by and mm else "–" for arm in arms) + " |")
    L += ["", "Every run in order: " + "; ".join(f"{x['round']} {x['arm']} TTFT {x.get('ttft_s', float('nan')):.2f} s "
                                                  f"(load average {x['load_avg']:.1f}, exit {x['exit']}, "
                                                  f"OOM {x['oom_kills']})" for x in runs), ""]
    (a.out / "report.md").write_text("\n".join(L))
    print(f"first-token: wrote {a.out / 'report.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
