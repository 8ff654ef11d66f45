"""With a budget that holds every expert: how fast does decode run once the cache is filled, and
what does filling it cost the tokens decoded meanwhile, against plain llama.cpp?

Same-run A/B on the 64-expert demo (or `-m`), no memory limit, the file warm in the page cache:
`plain` is `--no-stream` (llama.cpp reading the mapped file), `fill` is bmoe with `--cache-mb`
above the model's experts (the cache reads what is not resident in the background, layer by
layer, and binds each complete layer to read its experts by their own ids), `preload` reads every
expert before the first token (`--preload`). Arms alternate, `--rounds` each; each run is a fresh
`bmoe-cli` process with `--csv`. Per run: the token where the fill's last read landed (the last
with read bytes), the median s/token of the tokens after it (filled) and up to it (filling); plain's
median over the same token indices is the reference for each. Reports medians over rounds, the
ratios (speed share of plain) and whether every run printed the same text.

    python bench/resident_fill.py --rounds 3 --out bench/reports/$(date +%F)-resident
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bmoe" / "smollm2-135m-moe-e64-k8-r2.gguf"
PROMPT = "Write a story about a dragon who learns to bake bread."
ARMS = {"plain": ["--no-stream"],
        "fill": ["--no-warm-start", "--io-threads", "4"],
        "preload": ["--no-warm-start", "--io-threads", "4", "--preload"]}


def run(arm: str, rnd: int, a: argparse.Namespace) -> dict:
    csv_path = a.out / f"{arm}-{rnd}.csv"
    flags = ARMS[arm] + ([] if arm == "plain" else ["--cache-mb", str(a.cache_mb)])
    cmd = [sys.executable, "-m", "bmoe.cli", "-m", str(a.model), "-p", PROMPT, "-n", str(a.n_predict),
           "-t", str(a.threads), "--csv", str(csv_path), *flags]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if r.returncode != 0:
        raise SystemExit(f"{arm}: exit {r.returncode}\n{r.stderr[-2000:]}")
    rows = [x for x in csv.DictReader(open(csv_path)) if x.get("wall_ms")]
    wall = [float(x["wall_ms"]) for x in rows]
    if len(wall) < a.n_predict // 2:
        raise SystemExit(f"{arm}: {len(wall)} tokens of {a.n_predict} (the model ended early): choose another prompt")
    reads = [i for i, x in enumerate(rows) if float(x["read_bytes"]) > 0]
    return {"arm": arm, "round": rnd, "wall_ms": wall, "fill_end": reads[-1] if reads else -1,
            "text": r.stdout.split("\ngeneration:")[0]}


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, default=DEMO)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", "--n-predict", type=int, default=160)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--cache-mb", type=int, default=8000, help="a budget above the model's experts (default 8000)")
    ap.add_argument("--skip", type=int, default=2, help="first tokens left out of every median (default 2)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cat", str(a.model)], stdout=subprocess.DEVNULL, check=True)  # the file warm
    runs: list[dict] = []
    for rnd in range(a.rounds):
        order = list(ARMS) if rnd % 2 == 0 else list(reversed(ARMS))
        for arm in order:
            rec = run(arm, rnd, a)
            runs.append(rec)
            print(f"{arm} round {rnd}: median {med(rec['wall_ms'][a.skip:]):.1f} ms/token, "
                  f"fill's last read at token {rec['fill_end']}", file=sys.stderr, flush=True)
    plain = [r for r in runs if r["arm"] == "plain"]
    summary: dict[str, object] = {"model": str(a.model), "n_predict": a.n_predict, "threads": a.threads,
                                  "cache_mb": a.cache_mb, "rounds": a.rounds,
                                  "same_text": len({r["text"] for r in runs}) == 1}
    lines = [f"# Every expert resident: {a.model.name}, -n {a.n_predict}, -t {a.threads}, {a.rounds} rounds", "",
             "| arm | fill's last read (token) | filling ms/token | plain same tokens | share | "
             "filled ms/token | plain same tokens | share |", "|---|---|---|---|---|---|---|---|"]
    for arm in ("fill", "preload"):
        rs = [r for r in runs if r["arm"] == arm]
        end = int(med([max(r["fill_end"], a.skip) for r in rs]))
        filling = med([med(r["wall_ms"][a.skip:end + 1]) for r in rs]) if end > a.skip else float("nan")
        filled = med([med(r["wall_ms"][max(end + 1, a.skip):]) for r in rs])
        p_filling = med([med(r["wall_ms"][a.skip:end + 1]) for r in plain]) if end > a.skip else float("nan")
        p_filled = med([med(r["wall_ms"][max(end + 1, a.skip):]) for r in plain])
        summary[arm] = {"fill_end": end, "filling_ms": filling, "plain_filling_ms": p_filling,
                        "filling_share": p_filling / filling, "filled_ms": filled, "plain_filled_ms": p_filled,
                        "filled_share": p_filled / filled, "fill_ends": [r["fill_end"] for r in rs]}
        lines.append(f"| {arm} | {end} | {filling:.1f} | {p_filling:.1f} | {p_filling / filling:.3f} | {filled:.1f} | "
                     f"{p_filled:.1f} | {p_filled / filled:.3f} |")
    lines += ["", f"Same text in all {len(runs)} runs: {summary['same_text']}.", "",
              "share = plain's median s/token over the same token indices ÷ the arm's (1.0: plain's speed)."]
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    (a.out / "runs.json").write_text(json.dumps(runs))
    (a.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
