"""
Does n-gram drafting (`--draft ngram`) pay, and does its gate keep it from costing? Issue 52's numbers.

Same-run A/B on the 64-expert demo (or `-m`), a prompt that asks the model to copy a ~330-token passage
with two words changed (bench/prompts/copy_edit.txt: what prompt lookup drafts best), greedy, chat mode.
Two settings, arms interleaved, `--rounds` each, every run a fresh `bmoe-cli` process:

- `resident`: `--cache-mb` above the model's experts, no memory limit, the file warm: compute is the limit;
- `limited`: `--cache-mb 1300` under a 2500 MiB memory cgroup, the file dropped before each run: the
  flash is (part of) the limit, and each drafted row's experts add to a layer's reads.

Arms: `off` (no drafts), `ngram` (`--draft ngram --draft-max N`, the gate on: the default way to draft)
and, with `--no-gate-arm` left out, `ngram-always` (`--no-draft-gate`: drafting every step, to show what
the gate saves where drafts do not pay).

Reports per setting and arm the median tok/s over rounds, the ratio to `off` in the same round, the drafts'
acceptance (accepted ÷ drafted), tokens per verify step (1 + accepted, over the steps that drafted), the
MiB read for experts only drafted rows routed per accepted token, MiB/token, and whether every run wrote
the same text as `off`.

    python bench/drafts.py --rounds 3 --out bench/reports/$(date +%F)-drafts
    # MTP drafts at a phone's flash, on a model with an MTP layer:
    python bench/drafts.py -m q36-mtp.gguf --draft mtp --draft-max 2 --settings limited --cache-mb auto \
        --mem-limit-mb 4000 --cap-mib 700 -n 64 --prompt bench/prompts/free_story.txt --no-gate-arm --out DIR
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
import subprocess
import sys
from pathlib import Path

from bmoe.base.units import MiB
from bmoe.demo.build import built_path
from bmoe.tools import bench_sys
from bmoe.tools.bench_numbers import median_of
from bmoe.tools.bench_report import cell, write_summary

REPO = Path(__file__).resolve().parent.parent
PROMPT = REPO / "bench" / "prompts" / "copy_edit.txt"
SETTINGS = ("resident", "limited")
TOK_S = re.compile(r"^generation: (\d+) tokens, [0-9.]+ s/token \(([0-9.]+) tok/s\)", re.M)
MIB_TOK = re.compile(r"^moe-stream: read [0-9.]+ MiB \(([0-9.]+) MiB/token\)", re.M)
GATE = re.compile(r"draft gate: (.*)$", re.M)  # the gate's decisions, as the run's notices tell them
FLASH_LIMIT = Path("/work/shared/tools/flash-limit")


def arms(a: argparse.Namespace) -> dict[str, list[str]]:
    out = {"off": [], a.draft: ["--draft", a.draft, "--draft-max", str(a.draft_max)]}
    if not a.no_gate_arm:
        out[f"{a.draft}-always"] = [*out[a.draft], "--no-draft-gate"]
    return out


def command(a: argparse.Namespace, setting: str, flags: list[str], csv_path: Path) -> list[str]:
    cache = str(a.resident_cache_mb if setting == "resident" else a.cache_mb)
    return [sys.executable, "-m", "bmoe.cli", "-m", str(a.model), "-f", str(a.prompt), "--chat", "-n", str(a.n_predict),
            "-t", str(a.threads), "--io-threads", "4", "--no-warm-start", "--cache-mb", cache, "--csv", str(csv_path),
            *flags]


def run_one(a: argparse.Namespace, cg: bench_sys.CgroupHierarchy | None, setting: str, arm: str,
            flags: list[str], rnd: int) -> dict:
    csv_path = a.out / f"{setting}-{arm}-{rnd}.csv"
    argv = command(a, setting, flags, csv_path)
    group = None
    if setting == "limited":
        bench_sys.drop_file_cache([a.model])
        if a.cap_mib:
            argv = [str(FLASH_LIMIT), str(a.cap_mib), "--file", str(a.model), "--", *argv]
        if cg is not None:
            group = bench_sys.Cgroup(cg, f"{bench_sys.CGROUP_PREFIX}drafts-{setting}-{arm}-{rnd}", a.mem_limit_mb * MiB)
            argv = group.wrap(argv)
    else:
        subprocess.run(["cat", str(a.model)], stdout=subprocess.DEVNULL, check=True)
    try:
        r = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
    finally:
        peak = group.peak_bytes() if group else None
        if group:
            group.remove()
    if r.returncode != 0:
        raise SystemExit(f"{setting}/{arm}: exit {r.returncode}\n{r.stderr[-2000:]}")
    m, mib = TOK_S.search(r.stdout), MIB_TOK.search(r.stdout)
    if m is None:
        raise SystemExit(f"{setting}/{arm}: no generation line in\n{r.stdout[-2000:]}")
    rows = list(csv.DictReader(open(csv_path)))
    drafted = [int(x.get("drafted") or 0) for x in rows]
    accepted = [int(x.get("accepted") or 0) for x in rows]
    extra = sum(int(x.get("draft_extra_bytes") or 0) for x in rows)
    steps = [1 + acc for d, acc in zip(drafted, accepted) if d > 0]
    return {"setting": setting, "arm": arm, "round": rnd, "tokens": int(m.group(1)), "tok_s": float(m.group(2)),
            "mib_per_token": float(mib.group(1)) if mib else None, "drafted": sum(drafted),
            "accepted": sum(accepted), "verify_steps": len(steps),
            "tokens_per_verify": statistics.mean(steps) if steps else None,
            "extra_mib_per_accepted": extra / MiB / sum(accepted) if sum(accepted) else None,
            "peak_cgroup_mib": round(peak / MiB) if peak else None, "text": r.stdout.split("\ngeneration:")[0],
            "gate": GATE.findall(r.stderr)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, default=None, help="default: the 64-expert demo (built when missing)")
    ap.add_argument("--prompt", type=Path, default=PROMPT, help=f"the prompt's file (default {PROMPT.name})")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", "--n-predict", type=int, default=200)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--draft", choices=("ngram", "mtp"), default="ngram",
                    help="n-gram drafts, or the model's MTP layer's (a model with one: bmoe-synth --like ... --mtp)")
    ap.add_argument("--draft-max", type=int, default=4)
    ap.add_argument("--resident-cache-mb", type=int, default=8000, help="above the model's experts (default 8000)")
    ap.add_argument("--cache-mb", default="1300",
                    help="the limited setting's cache (default 1300; auto: bmoe's choice within the memory limit)")
    ap.add_argument("--mem-limit-mb", type=int, default=2500, help="the limited setting's memory cgroup (default 2500)")
    ap.add_argument("--cap-mib", type=int, default=0,
                    help=f"the limited setting's disk reads capped at this many MiB/s ({FLASH_LIMIT}; default 0: none)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="which settings (default resident,limited)")
    ap.add_argument("--no-gate-arm", action="store_true", help="leave out the ungated arm (DRAFT-always)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if a.model is None:
        a.model = built_path(64, 8)
    a.out.mkdir(parents=True, exist_ok=True)
    cg = bench_sys.find_cgroup()
    if cg is None:
        print("drafts: no writable cgroup here: the limited setting runs without a memory limit", file=sys.stderr)
    settings = [s for s in a.settings.split(",") if s]
    runs: list[dict] = []
    for rnd in range(a.rounds):
        for setting in settings:
            order = list(arms(a).items())
            for arm, flags in (order if rnd % 2 == 0 else order[::-1]):
                rec = run_one(a, cg, setting, arm, flags, rnd)
                runs.append(rec)
                print(f"round {rnd} {setting} {arm}: {rec['tok_s']:.2f} tok/s, accepted {rec['accepted']} of "
                      f"{rec['drafted']} drafted", file=sys.stderr, flush=True)
    cap = f", limited at flash-limit {a.cap_mib} MiB/s" if a.cap_mib else ""
    lines = [f"# {a.draft} drafts: {a.model.name}, {a.prompt.name}, -n {a.n_predict}, -t {a.threads}, --draft-max "
             f"{a.draft_max}, {a.rounds} rounds{cap}", "",
             "| setting | arm | tok/s (median) | ÷ off, per round | accepted ÷ drafted | tokens per verify | "
             "extra MiB per accepted | MiB/token | same text as off |", "|---|---|---:|---|---:|---:|---:|---:|---|"]
    summary = []
    for setting in settings:
        off = {r["round"]: r for r in runs if r["setting"] == setting and r["arm"] == "off"}
        for arm in arms(a):
            rs = [r for r in runs if r["setting"] == setting and r["arm"] == arm]
            ratios = [r["tok_s"] / off[r["round"]]["tok_s"] for r in rs]
            drafted, accepted = sum(r["drafted"] for r in rs), sum(r["accepted"] for r in rs)
            row = {"setting": setting, "arm": arm, "tok_s": median_of([r["tok_s"] for r in rs]), "ratios": ratios,
                   "acceptance": accepted / drafted if drafted else None,
                   "tokens_per_verify": median_of([r["tokens_per_verify"] for r in rs]),
                   "extra_mib_per_accepted": median_of([r["extra_mib_per_accepted"] for r in rs]),
                   "mib_per_token": median_of([r["mib_per_token"] for r in rs]),
                   "same_text": all(r["text"] == off[r["round"]]["text"] for r in rs)}
            summary.append(row)
            lines.append(f"| {setting} | {arm} | {cell(row['tok_s'])} | {', '.join(f'{x:.2f}' for x in ratios)} | "
                         f"{cell(row['acceptance'])} | {cell(row['tokens_per_verify'])} | "
                         f"{cell(row['extra_mib_per_accepted'])} | {cell(row['mib_per_token'], '.1f')} | "
                         f"{row['same_text']} |")
    lines += ["", "The gate's decisions, per run (the run's `draft gate:` notices):", ""]
    lines += [f"- {r['setting']} {r['arm']} round {r['round']}: " + ("; ".join(r["gate"]) or "none")
              for r in runs if r["arm"] == a.draft]
    write_summary(a.out, runs, lines, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
