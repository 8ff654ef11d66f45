"""Does a restart with a usage profile hit the cache as a warm run does, and is its first token no later?

Per round, each `bmoe-cli --session` in a fresh cgroup of `--mem-limit-mb` on a cold page cache, the
same prompt every time (`-n` tokens, a new chat each: the prompt is prefilled again):

- warm:      a session with an empty `--usage-dir`: the prompt once (cold), then again in the same
             process (the warm run); its usage profile is written at exit;
- profile:   a new session with a copy of that profile: it fills the cache in the background; the
             prompt is sent at once (`--wait` 0) or once the fill says it is done (`--wait` S: at
             most S seconds after BMOE_READY);
- none:      a new session with `--no-warm-start`, the prompt sent after the same wait.

The profile and none sessions alternate (their order flips every round). Reported per arm: the
cache hit % of the first `-n` decode tokens (`BMOE_DONE.cache_hit_pct`), prefill s, TTFT
(`load_s + prefill_s`) and the request-to-first-token time; profile's hits ÷ the warm run's, and its
TTFT ÷ none's.

    python bench/restart_with_usage_profile.py --out bench/reports/$(date +%F)-scale/warm-start \\
        --cache-mb 1300 --rounds 3 --wait 0 --wait 30
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bmoe.base.units import MiB  # noqa: E402
from bmoe.edges.session_client import SessionClient  # noqa: E402
from bmoe.tools.bench_sys import Cgroup, drop_file_cache, find_cgroup, remove_all_cgroups  # noqa: E402

DEMO = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bmoe" / "smollm2-135m-moe-e64-k8-r2.gguf"
PROMPT = "Write a story about a dragon who learns to bake bread."


def say(msg: str) -> None:
    print(f"warm-start: {msg}", file=sys.stderr, flush=True)


def generation(s: SessionClient, n: int, gid: int) -> dict:
    t0 = time.perf_counter()
    first = None
    done: dict = {}
    for tag, ev in s.generate(gid, PROMPT, timeout=3600, n_predict=n, clear_kv=True):
        if tag == "PROGRESS" and first is None:
            first = time.perf_counter() - t0
        elif tag == "DONE":
            done = {k: v for k, v in ev.items() if k != "text"}
        elif tag == "ERROR":
            raise RuntimeError(ev.get("msg"))
    return {"hit_pct": done.get("cache_hit_pct"), "prefill_s": done.get("prefill_s"), "load_s": done.get("load_s"),
            "tok_s": done.get("tok_s"), "ttft_s": done["load_s"] + done["prefill_s"], "first_token_s": first,
            "tokens": done.get("tokens")}


def fill_done(s: SessionClient) -> bool:
    return "warm start: " in s.stderr and "experts read in" in s.stderr


def run(a: argparse.Namespace, cg_parent, tmp: Path, arm: str, flags: list[str], wait: float) -> dict:
    drop_file_cache([a.model])
    with Cgroup(cg_parent, f"bmoe-bench-warm-{os.getpid()}", a.mem_limit_mb * MiB) as cg:
        s = SessionClient(["-m", str(a.model), *flags], python=cg.python(tmp), cwd=str(REPO))
        try:
            rec: dict = {"arm": arm, "flags": flags, "ready_load_s": s.ready["load_s"]}
            t0 = time.perf_counter()
            if wait:
                if arm == "profile":
                    while not fill_done(s) and time.perf_counter() - t0 < wait:
                        time.sleep(0.1)  # the fill's own notice is the event; stderr is read on a thread
                    rec["fill_done"] = fill_done(s)
                else:
                    time.sleep(wait if a.same_wait else 0)
            rec["waited_s"] = time.perf_counter() - t0
            rec["first"] = generation(s, a.n_predict, 1)
            if arm == "warm":
                rec["second"] = generation(s, a.n_predict, 2)
        finally:
            rec["exit"] = s.close()
            rec["notices"] = [line for line in s.stderr.splitlines() if "warm start" in line or "usage profile" in line]
            rec["oom_kills"] = cg.oom_kills()
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, default=DEMO)
    ap.add_argument("--mem-limit-mb", type=int, default=2500)
    ap.add_argument("--cache-mb", default="1300")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("-n", "--n-predict", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--wait", type=float, action="append",
                    help="seconds after BMOE_READY before the prompt (profile: until the fill is done, at most "
                         "this); repeat for several (default: 0)")
    ap.add_argument("--same-wait", action=argparse.BooleanOptionalAction, default=True,
                    help="none waits as long as profile may (default)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    waits = a.wait or [0.0]
    cg_parent = find_cgroup()
    if cg_parent is None:
        ap.error("no memory cgroup here (run as root where cgroup v1 or v2 has the memory controller)")
    a.out.mkdir(parents=True, exist_ok=True)
    tmp = a.out / ".tmp"
    tmp.mkdir(exist_ok=True)
    common = ["-t", str(a.threads), "--io-threads", str(a.io_threads), "--cache-mb", a.cache_mb]
    records: list[dict] = []
    load0 = os.getloadavg()[0]
    try:
        for r in range(a.rounds):
            made = tmp / f"usage-{r}"
            shutil.rmtree(made, ignore_errors=True)
            say(f"round {r + 1}: warm (cold prompt, then the same prompt again)")
            rec = run(a, cg_parent, tmp, "warm", [*common, "--usage-dir", str(made)], 0)
            rec["round"] = r + 1
            records.append(rec)
            say(f"  hits cold {rec['first']['hit_pct']:.1f}%, warm {rec['second']['hit_pct']:.1f}%")
            for wait in waits:
                arms = ["profile", "none"] if r % 2 == 0 else ["none", "profile"]
                for arm in arms:
                    if arm == "profile":
                        use = tmp / f"use-{r}"
                        shutil.rmtree(use, ignore_errors=True)
                        shutil.copytree(made, use)
                        flags = [*common, "--usage-dir", str(use)]
                    else:
                        flags = [*common, "--no-warm-start"]
                    say(f"round {r + 1}: {arm}, wait {wait:g} s")
                    rec = run(a, cg_parent, tmp, arm, flags, wait)
                    rec.update(round=r + 1, wait=wait)
                    records.append(rec)
                    say(f"  hits {rec['first']['hit_pct']:.1f}%, TTFT {rec['first']['ttft_s']:.2f} s, "
                        f"waited {rec['waited_s']:.1f} s")
            (a.out / "results.json").write_text(json.dumps(records, indent=1))
    finally:
        remove_all_cgroups()
        shutil.rmtree(tmp, ignore_errors=True)
    (a.out / "results.json").write_text(json.dumps(records, indent=1))
    (a.out / "report.md").write_text(render(a, records, load0, os.getloadavg()[0]))
    say(f"wrote {a.out / 'report.md'}")
    return 0


def _med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def render(a: argparse.Namespace, records: list[dict], load0: float, load1: float) -> str:
    warm = [r for r in records if r["arm"] == "warm"]
    L = ["# A restart with a usage profile against a warm run", "",
         f"`python bench/restart_with_usage_profile.py {' '.join(sys.argv[1:])}`", "",
         f"Model {a.model.name}; each session in a fresh {a.mem_limit_mb} MiB cgroup on a cold page cache, "
         f"`--cache-mb {a.cache_mb} -t {a.threads} --io-threads {a.io_threads}`, prompt {PROMPT!r}, "
         f"{a.n_predict} tokens; {a.rounds} round(s); 1-minute load average {load0:.1f} at start, "
         f"{load1:.1f} at end.", "",
         "| arm | wait s | runs | hit % (first tokens) | ÷ warm run | prefill s | TTFT s | ÷ none "
         "| request → first token s |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    hw = _med([r["second"]["hit_pct"] for r in warm])
    L.append(f"| cold (first prompt of warm) | 0 | {len(warm)} | {_med([r['first']['hit_pct'] for r in warm]):.1f} | "
             f"{_med([r['first']['hit_pct'] for r in warm]) / hw:.2f} | "
             f"{_med([r['first']['prefill_s'] for r in warm]):.2f} | "
             f"{_med([r['first']['ttft_s'] for r in warm]):.2f} | | "
             f"{_med([r['first']['first_token_s'] for r in warm]):.2f} |")
    L.append(f"| warm run (same prompt again) | | {len(warm)} | {hw:.1f} | 1.00 | "
             f"{_med([r['second']['prefill_s'] for r in warm]):.2f} | | | "
             f"{_med([r['second']['first_token_s'] for r in warm]):.2f} |")
    for wait in sorted({r["wait"] for r in records if "wait" in r}):
        none = [r for r in records if r["arm"] == "none" and r["wait"] == wait]
        tn = _med([r["first"]["ttft_s"] for r in none])
        for arm in ("profile", "none"):
            rs = [r for r in records if r["arm"] == arm and r["wait"] == wait]
            h, t = _med([r["first"]["hit_pct"] for r in rs]), _med([r["first"]["ttft_s"] for r in rs])
            L.append(f"| {arm} | {wait:g} | {len(rs)} | {h:.1f} | {h / hw:.2f} | "
                     f"{_med([r['first']['prefill_s'] for r in rs]):.2f} | {t:.2f} | {t / tn:.2f} | "
                     f"{_med([r['first']['first_token_s'] for r in rs]):.2f} |")
    L += ["", "Every run in order:", "",
          "| round | arm | wait s | waited s | hit % | prefill s | TTFT s | exit | OOM |",
          "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        for key in ("first", "second") if r["arm"] == "warm" else ("first",):
            g = r[key]
            L.append(f"| {r['round']} | {r['arm']}{' (again)' if key == 'second' else ''} | {r.get('wait', 0):g} | "
                     f"{r.get('waited_s', 0):.1f} | {g['hit_pct']:.1f} | {g['prefill_s']:.2f} | {g['ttft_s']:.2f} | "
                     f"{r['exit']} | {r['oom_kills']} |")
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    sys.exit(main())
