#!/usr/bin/env python3
"""Does bmoe finish, with plain llama.cpp's text, under a memory limit that another process squeezes mid-run?

Each run: a fresh memory cgroup with --limit-mb; `bmoe-cli` (default flags: `--cache-mb auto`,
which adapts; add flags with --flags) decodes -n tokens inside it, from a cold page cache; when
token --at is out, a balloon process in the same cgroup takes --balloon-mb of locked anonymous
memory, and frees it when token --until is out (--balloon-mb 0: no balloon). The run must finish
(no OOM kill) and print the text plain llama.cpp prints (`--no-stream`, no limit). The report gives
tok/s before, during and after the squeeze from the per-token CSV, each run's budget changes, the
coordinator's major page faults per decode token (dense weights faulted back in), and the
cgroup's OOM kills and peak.

    python bench/memory_squeeze.py -m ~/.cache/bmoe/smollm2-135m-moe-e64-k8-r2.gguf --runs 5 --out bench/reports/DATE-memory-limits/adversary

bench/memory_limits.sh runs it for every case of the memory-limit report.
"""  # noqa: E501 - the command above is kept on one line, to be copied whole

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bmoe.base import telemetry
from bmoe.base.units import MiB
from bmoe.tools import bench_sys

PROMPT = "Write a story about a dragon who learns to bake bread."


def say(msg: str) -> None:
    print(f"memory_squeeze: {msg}", file=sys.stderr, flush=True)


def plain_text(model: str, n: int, flags: list[str]) -> str:
    r = subprocess.run([sys.executable, "-m", "bmoe.cli", "-m", model, "-p", PROMPT, "-n", str(n), "--no-stream",
                        "--progress", *flags], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"the --no-stream reference failed: {r.stderr[-500:]}")
    return telemetry.parse_output(r.stdout).answer


def major_faults(pid: int) -> int:
    """Major page faults of a process so far (/proc/PID/stat, field 12)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[9])


def one_run(h: bench_sys.CgroupHierarchy, a: argparse.Namespace, i: int, out: Path) -> dict:
    csv_path = out / f"run{i}.csv"
    bench_sys.drop_file_cache([Path(a.model)])
    bench_sys.drop_all_caches()
    cmd = [sys.executable, "-m", "bmoe.cli", "-m", a.model, "-p", PROMPT, "-n", str(a.n), "--progress",
           "--csv", str(csv_path), *a.flags]
    with bench_sys.Cgroup(h, f"bmoe-adversary-{i}-{time.monotonic_ns()}", int(a.limit_mb * MiB)) as cg:
        t0 = time.monotonic()
        proc = subprocess.Popen(cg.wrap(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        balloon: bench_sys.Balloon | None = None
        squeeze = {}
        stdout = []
        faults: dict[int, int] = {}
        try:
            for line in proc.stdout:
                stdout.append(line)
                ev = telemetry.parse_tagged(line)
                if not ev or ev[0] != "PROGRESS":
                    continue
                step = ev[1]["step"]
                faults[step] = major_faults(proc.pid)
                if step == a.at and balloon is None and a.balloon_mb > 0:
                    balloon = bench_sys.Balloon(int(a.balloon_mb * MiB), cgroup=cg)
                    squeeze["taken_at_s"] = round(time.monotonic() - t0, 2)
                    say(f"run {i}: balloon of {a.balloon_mb:g} MiB in the cgroup after token {step}")
                elif step == a.until and balloon is not None:
                    balloon.close()
                    squeeze["freed_at_s"] = round(time.monotonic() - t0, 2)
                    say(f"run {i}: balloon freed after token {step}")
        finally:
            if balloon is not None:
                balloon.close()
            err = proc.stderr.read()
            rc = proc.wait()
        oom, peak = cg.oom_kills(), cg.peak_bytes()
    rows, _ = telemetry.read_csv(csv_path.read_text()) if csv_path.exists() else ([], {})
    (out / f"run{i}.err").write_text(err)
    (out / f"run{i}.out").write_text("".join(stdout))

    def tok_s(lo: int, hi: int) -> float | None:
        ms = [r["wall_ms"] for r in rows if lo <= r["step"] <= hi]
        return round(len(ms) / (sum(ms) / 1e3), 3) if ms else None

    budgets = [r.get("cache_budget_mib", 0.0) for r in rows]
    steps = sorted(faults)
    return {
        "run": i, "exit": rc, "oom_kills": oom, "peak_mib": round((peak or 0) / MiB),
        "answer": telemetry.parse_output("".join(stdout)).answer, "tokens": len(rows),
        "tok_s_before": tok_s(1, a.at), "tok_s_during": tok_s(a.at + 1, a.until),
        "tok_s_after": tok_s(a.until + 1, a.n),
        "budget_start_mib": budgets[0] if budgets else None, "budget_min_mib": min(budgets) if budgets else None,
        "budget_end_mib": budgets[-1] if budgets else None,
        "budget_changes": [x[len("bmoe: "):] for x in err.splitlines() if "cache budget" in x],
        "major_faults_per_token": round((faults[steps[-1]] - faults[steps[0]]) / (steps[-1] - steps[0]), 1)
        if len(steps) > 1 else None,
        **squeeze,
    }


def med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def report(a: argparse.Namespace, runs: list[dict], plain: str) -> str:
    lines = [f"# bmoe under a squeezed memory limit ({time.strftime('%Y-%m-%d %H:%M')})", "",
             f"`{' '.join(sys.argv)}`", "",
             f"Model {a.model}, cgroup limit {a.limit_mb:g} MiB, bmoe-cli flags `{' '.join(a.flags) or '(defaults)'}`, "
             f"{a.n} tokens of \"{PROMPT}\"; " + (
                 f"a balloon takes {a.balloon_mb:g} MiB of locked memory in the same cgroup after token {a.at} and "
                 f"frees it after token {a.until}." if a.balloon_mb > 0 else "no balloon.") +
             " Cold page cache before each run.", "",
             "| run | exit | OOM kills | text = --no-stream | tok/s before | during | after "
             "| budget start → min → end MiB | major faults/token | cgroup peak MiB |",
             "|---:|---:|---:|:---:|---:|---:|---:|---|---:|---:|"]
    for r in runs:
        lines.append(f"| {r['run']} | {r['exit']} | {r['oom_kills']} | {'yes' if r['answer'] == plain else 'NO'} | "
                     f"{r['tok_s_before']} | {r['tok_s_during']} | {r['tok_s_after']} | "
                     f"{r['budget_start_mib']} → {r['budget_min_mib']} → {r['budget_end_mib']} | "
                     f"{r['major_faults_per_token']} | {r['peak_mib']} |")
    lines += ["", f"Medians: tok/s before {med([r['tok_s_before'] for r in runs])}, during "
                  f"{med([r['tok_s_during'] for r in runs])}, after {med([r['tok_s_after'] for r in runs])}; "
                  f"OOM kills in all: {sum(r['oom_kills'] or 0 for r in runs)}; "
                  f"identical text: {sum(r['answer'] == plain for r in runs)}/{len(runs)}.", "",
              "Budget changes (bmoe's stderr notices):", ""]
    for r in runs:
        lines += [f"- run {r['run']}:"] + [f"  - {c}" for c in r["budget_changes"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--limit-mb", type=float, default=3000)
    ap.add_argument("--balloon-mb", type=float, default=900)
    ap.add_argument("--at", type=int, default=10)
    ap.add_argument("--until", type=int, default=40)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--flags", default="-t 2 --io-threads 4",
                    help="bmoe-cli flags for every run (default: %(default)s)")
    ap.add_argument("--ref-flags", default="-t 2", help="flags of the --no-stream reference (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("bench/out/memory-squeeze"))
    a = ap.parse_args()
    a.flags = a.flags.split()
    h = bench_sys.find_cgroup()
    if h is None:
        raise SystemExit("no memory cgroup hierarchy here: this benchmark needs one")
    bench_sys.probe_cgroup(h)
    a.out.mkdir(parents=True, exist_ok=True)
    say("reference: --no-stream, no limit")
    plain = plain_text(a.model, a.n, a.ref_flags.split())
    runs = []
    for i in range(1, a.runs + 1):
        say(f"run {i}/{a.runs}")
        runs.append(one_run(h, a, i, a.out))
        r = runs[-1]
        say(f"run {i}: exit {r['exit']}, {r['oom_kills']} OOM kills, "
            f"text {'same' if r['answer'] == plain else 'DIFFERENT'}, "
            f"budget {r['budget_start_mib']} -> {r['budget_min_mib']} -> {r['budget_end_mib']} MiB")
    (a.out / "results.json").write_text(json.dumps({"argv": sys.argv, "runs": runs, "plain": plain}, indent=1))
    (a.out / "report.md").write_text(report(a, runs, plain))
    say(f"report in {a.out / 'report.md'}")
    bad = [r for r in runs if r["exit"] != 0 or r["oom_kills"] or r["answer"] != plain]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
