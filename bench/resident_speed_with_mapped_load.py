"""Does a start that maps the model without reading it change the output or the decode speed?

Same-run A/B on the 64-expert demo (or `-m`) with every expert resident (`--cache-mb 6000 --preload`),
no memory limit, warm page cache: `mapped` is bmoe's start (llama.cpp maps the file without reading
it, bmoe reads the dense weights ahead); `read` is the fallback, llama.cpp reading the whole file,
forced by making bmoe.seam's registry check fail (`REGISTRY_API_VERSION` set to -1 in that process,
the path a layout bmoe does not know takes). The arms alternate, `--rounds` each (order flipped every
round); each run is a fresh `bmoe-cli` process. Reports each arm's median tok/s and s/token, the
ratio, and whether every run's text is the same.

    python bench/resident_speed_with_mapped_load.py --rounds 5 --out bench/reports/$(date +%F)-scale/resident-ab
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bmoe" / "smollm2-135m-moe-e64-k8-r2.gguf"
PROMPT = "Write a story about a dragon who learns to bake bread."
FORCE_READ = "import bmoe.seam as s, sys; s.REGISTRY_API_VERSION = -1; from bmoe.cli import main; sys.exit(main())"
GEN = re.compile(r"^generation: (\d+) tokens, ([\d.]+) s/token \(([\d.]+) tok/s\)", re.M)


def one(arm: str, a: argparse.Namespace) -> dict:
    args = ["-m", str(a.model), "-p", PROMPT, "-n", str(a.n_predict), "-t", str(a.threads), "--cache-mb", "6000",
            "--preload", "--no-warm-start"]
    cmd = [sys.executable, "-m", "bmoe.cli", *args] if arm == "mapped" else [sys.executable, "-c", FORCE_READ, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    m = GEN.search(r.stdout)
    rec = {"arm": arm, "exit": r.returncode, "text": r.stdout.split("\ngeneration:")[0],
           "whole_file_notice": "loading the whole model file" in r.stderr}
    if m:
        rec.update(tokens=int(m.group(1)), s_per_token=float(m.group(2)), tok_s=float(m.group(3)))
    else:
        rec["stderr"] = r.stderr[-1500:]
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, default=DEMO)
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()[0]
    runs = []
    for r in range(a.rounds):
        for arm in (("mapped", "read") if r % 2 == 0 else ("read", "mapped")):
            rec = one(arm, a)
            rec["round"] = r + 1
            runs.append(rec)
            print(f"resident-ab: round {r + 1} {arm}: {rec.get('tok_s', 'failed')} tok/s", file=sys.stderr, flush=True)
    (a.out / "results.json").write_text(json.dumps(runs, indent=1))
    med = {arm: statistics.median([x["tok_s"] for x in runs if x["arm"] == arm and "tok_s" in x])
           for arm in ("mapped", "read")}
    same = len({x["text"] for x in runs}) == 1
    L = ["# Mapped (not read) start against llama.cpp's reading load: output and resident decode speed", "",
         f"`python bench/resident_speed_with_mapped_load.py {' '.join(sys.argv[1:])}`", "",
         f"Model {a.model.name}, `-n {a.n_predict} -t {a.threads} --cache-mb 6000 --preload --no-warm-start`, no "
         f"memory limit, warm page cache, {a.rounds} rounds alternating; 1-minute load average {load0:.1f} at start, "
         f"{os.getloadavg()[0]:.1f} at end.", "",
         "| arm | runs | median tok/s | min–max | whole-file notice |", "|---|---:|---:|---|---|"]
    for arm in ("mapped", "read"):
        xs = [x["tok_s"] for x in runs if x["arm"] == arm and "tok_s" in x]
        L.append(f"| {arm} | {len(xs)} | {med[arm]:.2f} | {min(xs):.2f}–{max(xs):.2f} | "
                 f"{sum(x['whole_file_notice'] for x in runs if x['arm'] == arm)}/{len(xs)} |")
    L += ["", f"mapped ÷ read: {med['mapped'] / med['read']:.3f}; every run's text identical: {same}.", "",
          "| round | arm | tok/s | s/token |", "|---:|---|---:|---:|"]
    L += [f"| {x['round']} | {x['arm']} | {x.get('tok_s', '–')} | {x.get('s_per_token', '–')} |" for x in runs]
    (a.out / "report.md").write_text("\n".join(L) + "\n")
    print(f"resident-ab: wrote {a.out / 'report.md'}", file=sys.stderr)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
