"""
How much of a decode's compute is the page size its weights are mapped with? Issue 49's compute tax.

Plain llama.cpp (`bmoe-cli --no-stream`) decodes the same prompt twice per round from a warm page
cache, in two states of that cache, arms interleaved:

- `large`: the file read sequentially (as `cat` does, read-ahead on): where the file system keeps large
  folios (ext4 on Linux 6.x) and the device's read-ahead is wide enough, llama.cpp's mapping gets 2 MiB
  entries (`FilePmdMapped` in /proc/PID/smaps_rollup, sampled mid-run);
- `small`: the file read with POSIX_FADV_RANDOM, which caches it in 4 KiB pages: the page size a
  streaming run's dense weights (read that way by bmoe.memory.dense) and its shared-memory slab (tmpfs
  with huge pages off, the default) have.

Same code, same bytes, same machine: the ratio of the two compute times is what 4 KiB pages cost a
decode here, the part of the streaming tax no change in bmoe's Python can remove.

    python bench/page_size.py -m /work/models/qwen3-30b-a3b-like-q4_k_m.gguf --rounds 3 --out DIR
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import threading
from pathlib import Path

from bmoe.tools import bench_numbers
from bmoe.tools.bench_report import cell, write_summary
from bmoe.tools.bench_sys import drop_file_cache, read_into_page_cache


def cache_file(path: Path, small: bool) -> None:
    """Drop the file from the page cache, then read it whole: in 4 KiB pages (`small`) or read ahead."""
    drop_file_cache([path])
    read_into_page_cache(path, os.POSIX_FADV_RANDOM if small else os.POSIX_FADV_SEQUENTIAL)


def pmd_mapped_kib(pid: int) -> int | None:
    """FilePmdMapped of a process, KiB (None once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    m = re.search(r"^FilePmdMapped:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) if m else None


def run_one(a: argparse.Namespace, arm: str) -> dict:
    cache_file(a.model, arm == "small")
    argv = [sys.executable, "-m", "bmoe.cli", "-m", str(a.model), "-p", a.prompt, "-n", str(a.tokens),
            "-t", str(a.threads), "--no-stream"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[int] = []

    def sample() -> None:  # the mapping's 2 MiB entries, once the load has mapped and touched the file
        while proc.poll() is None:
            kib = pmd_mapped_kib(proc.pid)
            if kib is not None:
                seen.append(kib)
            threading.Event().wait(1.0)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out, err = proc.communicate()
    t.join()
    if proc.returncode != 0:
        raise SystemExit(f"{arm}: exit {proc.returncode}\n{err[-2000:]}")
    gen = bench_numbers.run_numbers(out)
    if gen["tokens"] is None:
        raise SystemExit(f"{arm}: no generation line in\n{out[-2000:]}")
    return {"arm": arm, "tokens": gen["tokens"], "s_per_token": gen["s_per_token"],
            "pmd_mapped_mib": max(seen, default=0) // 1024, "text": out.split("\ngeneration:")[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("-p", "--prompt", default="Write a story about a robot")
    ap.add_argument("-n", "--tokens", type=int, default=48)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for rnd in range(a.rounds):
        for arm in (("small", "large") if rnd % 2 == 0 else ("large", "small")):
            rec = {"round": rnd, **run_one(a, arm)}
            runs.append(rec)
            print(f"round {rnd} {arm}: {rec['s_per_token']:.4f} s/token, {rec['pmd_mapped_mib']} MiB mapped in "
                  "2 MiB entries", file=sys.stderr, flush=True)
    by = {arm: [r for r in runs if r["arm"] == arm] for arm in ("small", "large")}
    ratios = [s["s_per_token"] / g["s_per_token"] for s, g in zip(by["small"], by["large"])]
    lines = [f"# Page size and decode compute: {a.model.name}, plain llama.cpp, -n {a.tokens}, -t {a.threads}",
             "", "| arm | s/token (each round) | median | MiB in 2 MiB entries |", "|---|---|---:|---:|"]
    for arm, rs in by.items():
        each = ", ".join(format(r["s_per_token"], ".4f") for r in rs)
        lines.append(f"| {arm} | {each} | "
                     f"{cell(statistics.median(r['s_per_token'] for r in rs), '.4f')} | "
                     f"{max(r['pmd_mapped_mib'] for r in rs)} |")
    lines += ["", f"small ÷ large per round: {', '.join(f'{x:.3f}' for x in ratios)}; same text in every run: "
              f"{len({r['text'] for r in runs}) == 1}"]
    write_summary(a.out, runs, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
