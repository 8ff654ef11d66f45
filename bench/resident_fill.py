"""
With a budget that holds every expert: how fast does decode run while the cache fills and once it
is filled, against plain llama.cpp?

Same-run A/B on the 64-expert demo (or `-m`), no memory limit, the file read whole (warm in the page
cache) just before each run.
Arms alternate, `--rounds` each, each a fresh `bmoe-cli` process:

- `plain`: `--no-stream` (llama.cpp reading the mapped file), one-shot with `--csv`;
- `oneshot`: bmoe with `--cache-mb` above the model's experts, one-shot: the slab fills behind the
  decode; until it holds a layer, the layer reads the page cache through llama.cpp's own mapping,
  and the fill waits for idle time, so every token of this run is one "while filling";
- `session`: the same in `--session` mode, the way a filled cache is reached: a first request
  (while filling), then the session idles (its idle ticks read the rest) until `cache_resident_mib`
  stops growing, then the same request again (filled);
- `preload`: `--preload` reads every expert before the first token;
- `slab`: the same with the file dropped from the page cache first, so every layer reads the slab
  (with the file warm a layer reads the page cache's pages through llama.cpp's mapping, where the
  kernel maps 2 MiB pages; the slab's shared memory has 4 KiB ones).

Reports, per arm, the median ms/token against plain's over the same token indices (share: 1.0 is
plain's speed), the resident MiB, how long the session's idle fill took, and whether the texts
agree (the one-shot arms with each other, the session's two answers with each other).

    python bench/resident_fill.py --rounds 3 --out bench/reports/$(date +%F)-resident
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bmoe.tools.bench_report import write_summary
from bmoe.tools.bench_sys import drop_file_cache

REPO = Path(__file__).resolve().parent.parent
DEMO = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bmoe" / "smollm2-135m-moe-e64-k8-r2.gguf"
PROMPT = "Write a story about a dragon who learns to bake bread."
FLAGS = ["--no-warm-start", "--io-threads", "4"]
ARMS = {"plain": ["--no-stream"], "oneshot": FLAGS, "session": FLAGS, "preload": [*FLAGS, "--preload"],
        "slab": [*FLAGS, "--preload"]}
RESIDENT = re.compile(r"resident ([0-9.]+) MiB")


def cli(a: argparse.Namespace, arm: str) -> list[str]:
    flags = ARMS[arm] + ([] if arm == "plain" else ["--cache-mb", str(a.cache_mb)])
    return [sys.executable, "-m", "bmoe.cli", "-m", str(a.model), "-n", str(a.n_predict), "-t", str(a.threads),
            *flags]


def check_length(arm: str, wall: list[float], a: argparse.Namespace) -> None:
    if len(wall) < a.n_predict // 2:
        raise SystemExit(f"{arm}: {len(wall)} tokens of {a.n_predict} (the model ended early): choose another prompt")


def oneshot(arm: str, rnd: int, a: argparse.Namespace) -> dict:
    csv_path = a.out / f"{arm}-{rnd}.csv"
    r = subprocess.run([*cli(a, arm), "-p", PROMPT, "--csv", str(csv_path)], capture_output=True, text=True, cwd=REPO)
    if r.returncode != 0:
        raise SystemExit(f"{arm}: exit {r.returncode}\n{r.stderr[-2000:]}")
    wall = [float(x["wall_ms"]) for x in csv.DictReader(open(csv_path)) if x.get("wall_ms")]
    check_length(arm, wall, a)
    m = RESIDENT.search(r.stdout + r.stderr)
    return {"arm": arm, "round": rnd, "wall_ms": wall, "resident_mib": float(m.group(1)) if m else 0.0,
            "text": r.stdout.split("\ngeneration:")[0]}


class Session:
    """A `bmoe-cli --session` process: requests in, its BMOE_ lines out."""

    def __init__(self, argv: list[str]) -> None:
        self.p = subprocess.Popen([*argv, "--session"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, cwd=REPO)
        self.read_until("BMOE_READY")
        self.next_id = 0

    def read_until(self, tag: str) -> tuple[dict, list[dict]]:
        """Lines up to the first `tag` line: (its JSON, the BMOE_PROGRESS lines before it)."""
        assert self.p.stdout is not None
        steps = []
        for line in self.p.stdout:
            name, _, body = line.partition(" ")
            if name == "BMOE_PROGRESS":
                steps.append(json.loads(body))
            elif name == "BMOE_ERROR":
                raise SystemExit(f"session: {body}")
            elif name == tag:
                return json.loads(body), steps
        raise SystemExit(f"session ended before {tag} (exit {self.p.wait()})")

    def generate(self, n: int) -> tuple[dict, list[dict]]:
        assert self.p.stdin is not None
        self.next_id += 1
        self.p.stdin.write(json.dumps({"cmd": "generate", "id": self.next_id, "prompt": PROMPT, "n_predict": n,
                                       "clear_kv": True}) + "\n")
        self.p.stdin.flush()
        return self.read_until("BMOE_DONE")

    def close(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps({"cmd": "close"}) + "\n")
        self.p.stdin.close()
        self.p.wait()


def session(rnd: int, a: argparse.Namespace) -> dict:
    """First request while filling, idle until the cache stops growing, the same request filled."""
    s = Session(cli(a, "session"))
    try:
        done1, steps1 = s.generate(a.n_predict)
        t0, before = time.perf_counter(), -1.0
        while True:  # the session's idle ticks fill; a one-token request reads how far
            time.sleep(a.poll_s)
            resident = s.generate(1)[0]["cache_resident_mib"]
            if resident == before:
                break
            before = resident
        fill_s = time.perf_counter() - t0 - a.poll_s
        done2, steps2 = s.generate(a.n_predict)
    finally:
        s.close()
    first, second = [x["wall_ms"] for x in steps1], [x["wall_ms"] for x in steps2]
    check_length("session", first, a)
    return {"arm": "session", "round": rnd, "wall_ms": first, "filled_wall_ms": second,
            "resident_mib": done1["cache_resident_mib"], "filled_resident_mib": done2["cache_resident_mib"],
            "fill_s": fill_s, "text": done1["text"], "filled_text": done2["text"]}


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
    ap.add_argument("--poll-s", type=float, default=2.0, help="the session's idle time between looks (default 2)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    for rnd in range(a.rounds):
        order = list(ARMS) if rnd % 2 == 0 else list(reversed(ARMS))
        for arm in order:
            if arm == "slab":  # out of the page cache: the preload reads the device, every layer the slab
                drop_file_cache([a.model])
            else:  # the file warm (a page cache nothing maps may be reclaimed within a minute)
                subprocess.run(["cat", str(a.model)], stdout=subprocess.DEVNULL, check=True)
            rec = session(rnd, a) if arm == "session" else oneshot(arm, rnd, a)
            runs.append(rec)
            print(f"{arm} round {rnd}: median {med(rec['wall_ms'][a.skip:]):.1f} ms/token, "
                  f"resident {rec['resident_mib']:.0f} MiB", file=sys.stderr, flush=True)
    by = {arm: [r for r in runs if r["arm"] == arm] for arm in ARMS}

    def share(key: str, rs: list[dict]) -> tuple[float, float, float]:
        """(the arm's median ms/token, plain's over the same tokens, plain's ÷ the arm's), medians over rounds."""
        n = min(len(r[key]) for r in rs)
        mine = med([med(r[key][a.skip:n]) for r in rs])
        ref = med([med(r["wall_ms"][a.skip:n]) for r in by["plain"]])
        return mine, ref, ref / mine

    rows = [("oneshot: every token while filling", share("wall_ms", by["oneshot"]), by["oneshot"], "resident_mib"),
            ("session, 1st request: while filling", share("wall_ms", by["session"]), by["session"], "resident_mib"),
            ("session, 2nd request: filled", share("filled_wall_ms", by["session"]), by["session"],
             "filled_resident_mib"),
            ("preload: filled before the first token", share("wall_ms", by["preload"]), by["preload"], "resident_mib"),
            ("slab: preload, the file dropped first", share("wall_ms", by["slab"]), by["slab"], "resident_mib")]
    oneshots = [r for r in runs if r["arm"] != "session"]
    summary: dict[str, object] = {
        "model": str(a.model), "n_predict": a.n_predict, "threads": a.threads, "cache_mb": a.cache_mb,
        "rounds": a.rounds, "same_text_oneshot": len({r["text"] for r in oneshots}) == 1,
        "same_text_session": all(r["text"] == r["filled_text"] for r in by["session"]),
        "session_fill_s": [round(r["fill_s"], 1) for r in by["session"]],
        "rows": {name: {"ms": ms, "plain_ms": ref, "share": sh, "resident_mib": [r[key] for r in rs]}
                 for name, (ms, ref, sh), rs, key in rows}}
    lines = [f"# Every expert resident: {a.model.name}, -n {a.n_predict}, -t {a.threads}, --cache-mb {a.cache_mb}, "
             f"{a.rounds} rounds", "", "| arm | ms/token | plain, same tokens | share | resident MiB (each run) |",
             "|---|---:|---:|---:|---|"]
    for name, (ms, ref, sh), rs, key in rows:
        lines.append(f"| {name} | {ms:.1f} | {ref:.1f} | {sh:.3f} | {', '.join(f'{r[key]:.0f}' for r in rs)} |")
    lines += ["", f"The session's idle fill took {summary['session_fill_s']} s (to a resident size that no longer "
              "grew, polled with one-token requests).",
              f"Same text in the one-shot runs: {summary['same_text_oneshot']}; the session's two answers the same "
              f"in every round: {summary['same_text_session']}.", "",
              "share = plain's median ms/token over the same token indices ÷ the arm's (1.0: plain's speed); "
              f"the first {a.skip} tokens are left out."]
    write_summary(a.out, runs, lines, summary)


if __name__ == "__main__":
    main()
