"""How fast does bmoe decode a real model's shape, against the C++ original and plain llama.cpp, at a
phone's, a laptop's and this machine's disk speed; and how far is each from its lower bound?

On a model of a real model's size and shape (`bmoe-synth --like qwen3-30b-a3b`, or `--like gpt-oss-120b`),
every arm decodes the same prompt (`-n 32 -t 2`, 4 lanes, `--cache-mb 2000`) from a cold page cache
(the model file dropped with POSIX_FADV_DONTNEED before each run) in a fresh memory cgroup of
`--mem-limit-mb` (bmoe.tools.bench_sys), at each read cap of `--caps` (0: uncapped; N: the run under
`/work/shared/tools/flash-limit N`, N MiB/s from the disk):

- one arm per `--bmoe NAME=DIR` (a source tree with its own `.venv`: e.g. the new code and a
  `git worktree` of main at the commit before it), its `python -m bmoe.cli`, plus `--bmoe-flags`;
- one arm per `--original NAME='FLAGS'`: BigMoeOnEdge's C++ `bmoe-cli --moe-stream` (`--original-bin`),
  the project bmoe descends from (built outside this repository: /work/cpp-original/README.md);
- `plain`: plain llama.cpp (`bmoe-cli --no-stream`, mmap) under the same limit and cap.

The runs of a round go cap by cap, arm by arm (A, B, C, A, B, C, ...), for `--repeats` rounds; each
round ends with the compute bound: plain llama.cpp with the file read into the page cache first,
no memory limit, no cap (every expert resident and warm). The I/O bound of a run is the cap ÷ its
decode MiB/token (uncapped: the disk's O_DIRECT random-read rate of expert slices with `--lanes`
threads, measured before and after, bmoe.tools.bench_io) and each run's tok/s is also given as a
share of the lower of the two bounds.

Per run (from the programs' own per-token CSV, the same columns in both): tok/s, decode MiB/token,
hit % (each program's own; the original's counts its prefill's lookups too), experts read per
token (decode bytes ÷ the mean expert's bytes: the same measure for both), cache mgmt, compute and
stall s/token (serial runs: the time blocked on reads), the answer's text against plain llama.cpp's.

`--replay-routes TRACE` gives the bmoe arms a recorded routing (a benchmark mode; the model must have
the trace's shape: `bmoe-synth --like TRACE.csv` or the matching `--like NAME`); the original and
plain llama.cpp cannot replay one, so they are left out and the report says so.

`--cheap` (the suite's smoke test): 1 round, 4 tokens, uncapped only, no cgroup, the original only
if its binary exists.

    python bench/real_shape.py -m /work/models/qwen3-30b-a3b-like-q4_k_m.gguf \\
        --bmoe new=. --bmoe main=../bmoe-main --caps 0,700,2000 --repeats 2 --out DIR

Writes DIR/results.json, DIR/report.md and DIR/runs/ (each run's command, stdout, stderr and CSV).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bmoe.base import telemetry  # noqa: E402
from bmoe.base.units import MiB  # noqa: E402
from bmoe.tools import bench_io, bench_sys  # noqa: E402
from bmoe.tools.bench_numbers import median_of  # noqa: E402
from bmoe.tools.bench_report import cell  # noqa: E402

PROMPT = "Write a story about a dragon who learns to bake bread."
FLASH_LIMIT = Path("/work/shared/tools/flash-limit")
ORIGINAL_BIN = Path("/work/cpp-original/build/cli/bmoe-cli")
ANSWER = re.compile(r"^=== answer ===\n(.*?)\n=== perf ===$", re.S | re.M)
HIT = re.compile(r"^moe-cache: ([\d.]+)% hit", re.M)
GEN = re.compile(r"^generation: (\d+) tokens, ([\d.]+) s/token \(([\d.]+) tok/s\)", re.M)


@dataclass
class Arm:
    """One program under test: its kind ('bmoe', 'original', 'plain'), name, where it runs from, flags."""

    name: str
    kind: str
    flags: list[str] = field(default_factory=list)
    tree: Path | None = None  # bmoe and plain: the source tree whose python runs bmoe.cli
    python: str = ""  # that tree's interpreter (its .venv's; this tree's: the one running this script)


def _arm_bmoe(text: str) -> Arm:
    name, eq, where = text.partition("=")
    tree = Path(where or ".").expanduser().resolve()
    if not eq or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=DIR, e.g. main=../bmoe-main")
    python = tree / ".venv" / "bin" / "python"
    if tree == REPO and not python.exists():
        python = Path(sys.executable)  # this tree: the interpreter running this script
    if not (tree / "bmoe" / "cli.py").is_file() or not python.exists():
        raise argparse.ArgumentTypeError(f"{where!r}: need a bmoe checkout with its own venv "
                                         "(cd DIR && python3 -m venv .venv && .venv/bin/pip install -e .)")
    return Arm(name, "bmoe", tree=tree, python=str(python))


def _arm_original(text: str) -> Arm:
    name, eq, flags = text.partition("=")
    if not eq or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME='FLAGS', e.g. orig-overlap='--overlap'")
    return Arm(name, "original", shlex.split(flags))


def _caps(text: str) -> list[int]:
    try:
        caps = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MiB/s numbers, e.g. 0,700,2000 (0 = uncapped)") from None
    if not caps or any(c < 0 for c in caps):
        raise argparse.ArgumentTypeError(f"{text!r}: expected MiB/s numbers >= 0, e.g. 0,700,2000")
    return caps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", type=Path, required=True, help="the GGUF (e.g. bmoe-synth --like qwen3-30b-a3b)")
    p.add_argument("--out", type=Path, required=True, help="folder for report.md, results.json and runs/")
    p.add_argument("--bmoe", type=_arm_bmoe, action="append", default=[], metavar="NAME=DIR",
                   help="a bmoe arm: the checkout DIR with its own .venv (repeat; default: this tree as 'bmoe')")
    p.add_argument("--bmoe-flags", default="",
                   help="bmoe-cli flags added to every bmoe arm (e.g. '--cache-policy lru')")
    p.add_argument("--original", type=_arm_original, action="append", default=[], metavar="NAME='FLAGS'",
                   help="an arm of the C++ original with extra flags (repeat; default: orig='' , its serial default)")
    p.add_argument("--original-bin", type=Path, default=ORIGINAL_BIN, help=f"the C++ bmoe-cli (default {ORIGINAL_BIN})")
    p.add_argument("--no-original", action="store_true", help="leave the C++ original out")
    p.add_argument("--no-plain", action="store_true", help="leave plain llama.cpp under the limit out")
    p.add_argument("--plain-tokens", type=int, default=None,
                   help="tokens for plain llama.cpp under the limit (default -n; it decodes at a few hundredths "
                        "of a token/s)")
    p.add_argument("--plain-repeats", type=int, default=None,
                   help="rounds that run plain llama.cpp under the limit (default: every round)")
    p.add_argument("--no-compute-bound", action="store_true", help="leave out the warm, unlimited plain run")
    p.add_argument("--wait-load", type=float, default=None, metavar="L",
                   help="before each run wait (up to --wait-max s) until the 1-minute load average is below L")
    p.add_argument("--wait-max", type=float, default=600, help="longest wait for --wait-load, seconds (default 600)")
    p.add_argument("--caps", type=_caps, default=[0, 700, 2000],
                   help="read caps in MiB/s, 0 = uncapped (default 0,700,2000)")
    p.add_argument("--repeats", type=int, default=2, help="rounds (default 2)")
    p.add_argument("-n", "--tokens", type=int, default=32)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--lanes", type=int, default=4, help="I/O lanes of both streaming programs (default 4)")
    p.add_argument("--cache-mb", type=int, default=2000)
    p.add_argument("--mem-limit-mb", type=int, default=4000, help="memory cgroup of every limited run (default 4000)")
    p.add_argument("--no-limit", action="store_true", help="no memory cgroup")
    p.add_argument("-p", "--prompt", default=PROMPT)
    p.add_argument("--replay-routes", type=Path, metavar="TRACE",
                   help="bmoe arms replay this route_trace v1 (the original and plain llama.cpp are left out)")
    p.add_argument("--flash-limit", type=Path, default=FLASH_LIMIT, help=f"the read cap tool (default {FLASH_LIMIT})")
    p.add_argument("--bw-mb", type=float, default=512, help="MiB read per bandwidth measurement (default 512)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before a run is killed (default 3600)")
    p.add_argument("--cheap", action="store_true",
                   help="smoke mode: 1 round, 4 tokens, uncapped, no cgroup, the original only if built")
    a = p.parse_args(argv)
    if a.cheap:
        a.repeats, a.tokens, a.caps, a.no_limit, a.bw_mb = 1, 4, [0], True, 16
        a.no_original = a.no_original or not a.original_bin.exists()
    if not a.model.is_file():
        p.error(f"no model at {a.model}; write one with bmoe-synth --like qwen3-30b-a3b -o PATH")
    if not a.bmoe:
        a.bmoe = [_arm_bmoe(f"bmoe={REPO}")]
    if a.replay_routes is not None:
        if not a.replay_routes.is_file():
            p.error(f"no trace at {a.replay_routes}")
        a.replay_routes = a.replay_routes.resolve()
    if not a.no_original and not a.original_bin.exists():
        p.error(f"no C++ original at {a.original_bin}; build it (see /work/cpp-original/README.md) "
                "or pass --no-original")
    if any(a.caps) and not a.flash_limit.exists():
        p.error(f"no flash-limit at {a.flash_limit}; pass --caps 0 or --flash-limit PATH")
    a.model, a.out = a.model.resolve(), a.out.resolve()
    return a


def arms_of(a: argparse.Namespace) -> tuple[list[Arm], list[str]]:
    """The arms in run order, and what was left out and why."""
    arms = list(a.bmoe)
    extra = shlex.split(a.bmoe_flags)
    if a.replay_routes is not None:
        extra += ["--replay-routes", str(a.replay_routes)]
    for arm in arms:
        arm.flags = extra
    left = []
    if a.replay_routes is not None:
        left.append("the C++ original and plain llama.cpp: neither can replay a recorded routing")
    else:
        if not a.no_original:
            arms += a.original or [Arm("orig", "original", [])]
        if not a.no_plain:
            arms.append(Arm("plain", "plain", [], tree=a.bmoe[0].tree, python=a.bmoe[0].python))
    return arms, left


# ---- one run -----------------------------------------------------------------------------------

def command(a: argparse.Namespace, arm: Arm, csv: Path) -> list[str]:
    common = ["-m", str(a.model), "-p", a.prompt, "-t", str(a.threads), "--progress", "--csv", str(csv)]
    if arm.kind == "original":
        return [str(a.original_bin), *common, "-n", str(a.tokens), "--moe-stream", "--io-threads", str(a.lanes),
                "--cache-mb", str(a.cache_mb), *arm.flags]
    cli = [arm.python, "-m", "bmoe.cli", *common]
    if arm.kind == "plain":
        return [*cli, "-n", str(a.plain_tokens or a.tokens), "--no-stream"]
    return [*cli, "-n", str(a.tokens), "--io-threads", str(a.lanes), "--cache-mb", str(a.cache_mb),
            "--no-warm-start", *arm.flags]


def numbers(stdout: str, csv_text: str, streaming: bool, overlap: bool, expert_mib: float) -> dict:
    """One run's figures from its per-token CSV (columns by name: both programs write the contract's);
    the streaming figures only for a streaming run."""
    rows, _ = telemetry.read_csv(csv_text) if csv_text else ([], {})
    rows = [r for r in rows if "wall_ms" in r]
    out: dict = {"tokens": len(rows)}
    m = ANSWER.search(stdout)
    out["text"] = m.group(1) if m else None
    hit = HIT.search(stdout)
    out["hit_pct"] = float(hit.group(1)) if hit else None
    if not rows:
        g = GEN.search(stdout)
        if g:
            out.update(tokens=int(g.group(1)), tok_s=float(g.group(3)))
        return out
    n = len(rows)
    wall = sum(r["wall_ms"] for r in rows) / 1e3

    def per_tok(col: str) -> float | None:
        return sum(r.get(col, 0.0) for r in rows) / 1e3 / n if any(col in r for r in rows) else None

    out["tok_s"] = n / wall if wall > 0 else None
    out["wall_ms_by_token"] = [round(r["wall_ms"], 1) for r in rows]
    if streaming:
        mib = sum(r.get("read_bytes", 0.0) for r in rows) / MiB / n
        out["mib_per_token"] = mib
        out["experts_per_token"] = mib / expert_mib if expert_mib else None
        out["mib_by_token"] = [round(r.get("read_bytes", 0.0) / MiB, 2) for r in rows]
        out["mgmt_s"] = per_tok("mgmt_ms")
        out["compute_s"] = per_tok("compute_ms")
        out["stall_s"] = per_tok("stall_ms") if overlap else per_tok("io_ms")
    return out


def run_one(a: argparse.Namespace, arm: Arm, cap: int, rnd: int, index: int, cg_h, runs: Path,
            expert_mib: float, warm: bool = False) -> dict:
    """One process from a cold page cache (or, `warm`, the file read in first), under the limit and cap."""
    stem = f"{index:03d}-{arm.name}-cap{cap}-r{rnd}" + ("-warm" if warm else "")
    csv = runs / f"{stem}.csv"
    cmd = command(a, arm, csv)
    rec: dict = {"arm": arm.name, "kind": "compute-bound" if warm else arm.kind, "cap": cap, "round": rnd,
                 "index": index, "cmd": shlex.join(cmd), "loadavg_1m": round(os.getloadavg()[0], 2)}
    if warm:
        rec["resident_pct_before"] = warm_file(a.model)
    else:
        bench_sys.drop_file_cache([a.model])
    cgroup = None
    argv = cmd
    if cg_h is not None and not warm:
        cgroup = bench_sys.Cgroup(cg_h, f"{bench_sys.CGROUP_PREFIX}shape-{os.getpid()}-{index}", a.mem_limit_mb * MiB)
        argv = cgroup.wrap(argv)
    if cap and not warm:
        argv = [str(a.flash_limit), str(cap), "--file", str(a.model), "--", *argv]
    (runs / f"{stem}.cmd").write_text(shlex.join(argv) + "\n")
    busy0, own0 = busy_seconds(), children_cpu_seconds()
    t0 = time.monotonic()
    proc = sampler = None
    try:
        with open(runs / f"{stem}.out", "w") as fo, open(runs / f"{stem}.err", "w") as fe:
            proc = subprocess.Popen(argv, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, cwd=arm.tree or runs,
                                    start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
            sampler = bench_sys.TreeSampler(proc.pid, 0.2).start()
            try:
                rc = proc.wait(timeout=a.timeout)
            except subprocess.TimeoutExpired:
                bench_sys.kill_group(proc)
                rc, rec["timed_out"] = proc.returncode, True
    finally:
        if sampler:
            sampler.stop()
        if proc is not None and proc.poll() is None:
            bench_sys.kill_group(proc)
        if cgroup:
            rec["peak_cgroup_mib"] = round((cgroup.peak_bytes() or 0) / MiB, 1)
            rec["oom_kills"] = cgroup.oom_kills()
            cgroup.remove()
    elapsed = time.monotonic() - t0
    others = busy_seconds() - busy0 - (children_cpu_seconds() - own0)
    rec["elapsed_s"] = round(elapsed, 2)
    rec["others_cpu_pct"] = round(100 * others / (elapsed * (os.cpu_count() or 1)), 1) if elapsed > 0 else None
    rec["exit"] = rc
    rec["disk_read_mib"] = round(sampler.read_bytes / MiB, 1) if sampler else None
    stdout = (runs / f"{stem}.out").read_text(errors="replace")
    csv_text = csv.read_text(errors="replace") if csv.exists() else ""
    overlap = (arm.kind == "bmoe" and "--no-overlap" not in arm.flags) or "--overlap" in arm.flags
    rec.update(numbers(stdout, csv_text, arm.kind != "plain", overlap, expert_mib))
    rec["ok"] = rc == 0 and rec.get("tok_s") is not None
    if not rec["ok"]:
        rec["stderr_tail"] = "\n".join((runs / f"{stem}.err").read_text(errors="replace").splitlines()[-8:])
    return rec


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """CPU seconds of this process's finished children (a run's whole process tree once it is reaped)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def wait_for_load(a: argparse.Namespace) -> float | None:
    """With --wait-load, sleep until the 1-minute load average is below it (at most --wait-max s); the wait."""
    if a.wait_load is None:
        return None
    t0 = time.monotonic()
    while os.getloadavg()[0] >= a.wait_load and time.monotonic() - t0 < a.wait_max:
        time.sleep(5)
    return round(time.monotonic() - t0, 1)


def warm_file(path: Path) -> float:
    """Read the file through the page cache; returns the share of it resident afterwards (fincore-free: mincore)."""
    bench_sys.read_into_page_cache(path)
    return resident_pct(path)


def resident_pct(path: Path) -> float:
    """The share of the file's pages in the page cache (mincore over a read-only mapping)."""
    import ctypes
    import mmap

    size = path.stat().st_size
    if size == 0:
        return 100.0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return float("nan")
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                return float("nan")
            return 100.0 * sum(b & 1 for b in vec) / pages
        finally:
            libc.munmap(addr, size)


# ---- the benchmark -----------------------------------------------------------------------------

def mean_expert_mib(model: Path) -> tuple[float, dict]:
    """The mean bytes of one expert (all its slices) over the MoE layers, and the model's byte facts."""
    tensors = bench_io.expert_tensors([model])
    by_layer: dict[str, int] = {}
    n_expert = 1
    for t in tensors:
        layer = t.name.split(".")[1]
        by_layer[layer] = by_layer.get(layer, 0) + t.slice_bytes
        n_expert = t.n_expert
    expert, total = bench_io.tensor_bytes([model])
    mean = statistics.mean(by_layer.values()) / MiB if by_layer else 0.0
    return mean, {"file_bytes": model.stat().st_size, "expert_bytes": expert, "other_bytes": total - expert,
                  "moe_layers": len(by_layer), "n_expert": n_expert, "mean_expert_mib": round(mean, 3)}


def bandwidth(a: argparse.Namespace, when: str) -> float:
    tensors = bench_io.expert_tensors([a.model])
    b = bench_io.measure([a.model], tensors, a.bw_mb, a.lanes, seed=int(time.time()))
    print(f"real_shape: O_DIRECT random expert-slice reads ({when}), {a.lanes} threads: {b.mib_s:.0f} MiB/s "
          f"({b.mode})", file=sys.stderr)
    return b.mib_s


def compute_shares(recs: list[dict]) -> None:
    """Each streaming run's compute s/token over its round's compute bound's s/token (plain llama.cpp's
    whole token, file warm): how much the streaming run's own compute costs beside plain llama.cpp's."""
    plain = {r["round"]: 1 / r["tok_s"] for r in recs if r["kind"] == "compute-bound" and r["ok"] and r.get("tok_s")}
    for r in recs:
        if r["kind"] != "compute-bound" and r.get("compute_s") and r["round"] in plain:
            r["compute_bound_tok_s"] = 1 / plain[r["round"]]
            r["compute_share"] = r["compute_s"] / plain[r["round"]]


def summarize(recs: list[dict], bw: float | None) -> list[dict]:
    """Per (cap, arm): medians over the rounds, bounds and shares."""
    compute_shares(recs)
    cb = median_of([r.get("tok_s") for r in recs if r["kind"] == "compute-bound" and r["ok"]])
    rows = []
    keys = []
    for r in recs:
        if r["kind"] != "compute-bound" and (r["cap"], r["arm"]) not in keys:
            keys.append((r["cap"], r["arm"]))
    for cap, arm in keys:
        rs = [r for r in recs if r["cap"] == cap and r["arm"] == arm and r["kind"] != "compute-bound"]
        ok = [r for r in rs if r["ok"]]
        row = {"cap": cap, "arm": arm, "kind": rs[0]["kind"], "runs": len(rs), "ok": len(ok),
               "tok_s_each": [round(r["tok_s"], 3) for r in ok]}
        for k in ("tok_s", "mib_per_token", "experts_per_token", "hit_pct", "mgmt_s", "compute_s", "stall_s",
                  "peak_cgroup_mib", "disk_read_mib", "others_cpu_pct"):
            row[k] = median_of([r.get(k) for r in ok])
        mib = row["mib_per_token"]
        rate = min(cap, bw) if cap and bw else cap or bw  # the device's rate: a cap above it reads no faster
        row["io_bound"] = rate / mib if rate and mib else None
        row["compute_bound"] = cb
        row["compute_share"] = median_of([r.get("compute_share") for r in ok])
        lower = min([x for x in (row["io_bound"], cb) if x], default=None)
        row["share_of_lower_bound"] = row["tok_s"] / lower if lower and row["tok_s"] else None
        rows.append(row)
    return rows


def ab_ratios(recs: list[dict], arms: list[Arm]) -> list[dict]:
    """Every other arm's tok/s over the first bmoe arm's, per round and cap (the same-run comparison)."""
    base = arms[0].name
    out = []
    for r in recs:
        if r["kind"] == "compute-bound" or r["arm"] == base or not r["ok"]:
            continue
        b = next((x for x in recs if x["arm"] == base and x["cap"] == r["cap"] and x["round"] == r["round"]
                  and x["kind"] != "compute-bound" and x["ok"]), None)
        if b:
            out.append({"cap": r["cap"], "arm": r["arm"], "round": r["round"], "ratio": r["tok_s"] / b["tok_s"]})
    return out


def report(a: argparse.Namespace, argv: list[str], arms: list[Arm], left: list[str], facts: dict, bw: dict,
           recs: list[dict], rows: list[dict], started: dict, ended: dict) -> str:
    cap_name = {0: "uncapped"}
    plain_text = next((r["text"] for r in recs if r["kind"] in ("plain", "compute-bound") and r.get("text")), None)
    lines = [
        "# Decode on a real model's shape: bmoe, the C++ original, plain llama.cpp", "",
        f"`python bench/real_shape.py {shlex.join(argv)}`", "",
        f"- model: `{a.model}` ({facts['file_bytes'] / 1e9:.2f} GB; experts {facts['expert_bytes'] / MiB:.0f} MiB, "
        f"other {facts['other_bytes'] / MiB:.0f} MiB; {facts['moe_layers']} MoE layers × {facts['n_expert']} experts, "
        f"one expert {facts['mean_expert_mib']:.3f} MiB on average)",
        f"- prompt {a.prompt!r}, {a.tokens} tokens, `-t {a.threads}`, {a.lanes} lanes, `--cache-mb {a.cache_mb}`, "
        + ("no memory limit" if a.no_limit else f"memory cgroup {a.mem_limit_mb} MiB per run")
        + ", the model file dropped from the page cache before each run",
        f"- caps: {', '.join(cap_name.get(c, f'{c} MiB/s') for c in a.caps)} (`{a.flash_limit} N -- CMD`); "
        f"{a.repeats} round(s), arms in this order each round: {', '.join(x.name for x in arms)}",
        f"- O_DIRECT random expert-slice reads, {a.lanes} threads: {cell(bw.get('before'), '.0f')} MiB/s before, "
        f"{cell(bw.get('after'), '.0f')} after (the uncapped I/O bound uses their mean)",
        "- others' CPU %: the CPU time the rest of the machine used during a run, as a share of all cores "
        "(/proc/stat's busy time less the run's own process tree's): what a run competed with",
        f"- load average (1 min) at start {started['load']:.2f}, at end {ended['load']:.2f}; "
        f"{started['time']} to {ended['time']}",
    ]
    for arm in arms:
        where = (f"`{arm.tree}` ({arm.python})" if arm.tree else f"`{a.original_bin}`")
        flags = f", flags `{shlex.join(arm.flags)}`" if arm.flags else ""
        lines.append(f"- arm `{arm.name}` ({arm.kind}): {where}{flags}")
    for why in left:
        lines.append(f"- left out: {why}")
    if a.wait_load is not None:
        waits = [r["waited_s"] for r in recs if r.get("waited_s") is not None]
        lines.append(f"- each run waited (at most {a.wait_max:g} s) for a 1-minute load average below {a.wait_load:g}: "
                     f"waits {min(waits, default=0):.0f}–{max(waits, default=0):.0f} s")
    if a.plain_repeats is not None:
        lines.append(f"- plain llama.cpp under the limit ran in the first {a.plain_repeats} round(s) only")
    if a.plain_tokens:
        lines.append(f"- plain llama.cpp under the limit decodes {a.plain_tokens} tokens (the others {a.tokens})")
    lines += ["", "## Medians", "",
              "hit %: each program's own (bmoe: decode lookups; the original: since load, its prefill's "
              "lookups included). experts/token = decode MiB/token ÷ the mean expert. stall: the wall time "
              "compute waited for reads (serial runs: the time blocked on reads). I/O bound = the device's rate "
              "(the measured rate, or the cap when it is lower) ÷ MiB/token; compute bound = plain llama.cpp, file "
              "warm, no limit; compute ÷ plain = the run's compute s/token over its round's compute bound's "
              "s/token (plain llama.cpp's whole token).", "",
              "| cap | arm | ok/runs | tok/s (each) | MiB/token | experts/token | hit % | mgmt s/tok | compute s/tok "
              "| stall s/tok | I/O bound | compute bound | share of lower bound | compute ÷ plain | cgroup peak MiB "
              "| others' CPU % |",
              "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        each = ", ".join(f"{x:.2f}" for x in r["tok_s_each"])
        lines.append(
            f"| {cap_name.get(r['cap'], r['cap'])} | {r['arm']} | {r['ok']}/{r['runs']} "
            f"| **{cell(r['tok_s'])}** ({each}) "
            f"| {cell(r['mib_per_token'], '.1f')} | {cell(r['experts_per_token'], '.1f')}"
            f" | {cell(r['hit_pct'], '.1f')} "
            f"| {cell(r['mgmt_s'], '.4f')} | {cell(r['compute_s'], '.4f')} | {cell(r['stall_s'], '.4f')}"
            f" | {cell(r['io_bound'])} "
            f"| {cell(r['compute_bound'])} | {cell(r['share_of_lower_bound'])} | {cell(r['compute_share'])} "
            f"| {cell(r['peak_cgroup_mib'], '.0f')} | {cell(r['others_cpu_pct'], '.0f')} |")
    ratios = ab_ratios(recs, arms)
    if ratios:
        lines += ["", f"## Same-run ratios: tok/s ÷ `{arms[0].name}`'s in the same round and cap", "",
                  "| cap | arm | per round | median |", "|---|---|---|---:|"]
        seen = []
        for x in ratios:
            if (x["cap"], x["arm"]) in seen:
                continue
            seen.append((x["cap"], x["arm"]))
            rs = [y["ratio"] for y in ratios if y["cap"] == x["cap"] and y["arm"] == x["arm"]]
            lines.append(f"| {cap_name.get(x['cap'], x['cap'])} | {x['arm']} | {', '.join(f'{v:.2f}' for v in rs)} "
                         f"| {statistics.median(rs):.2f} |")
    lines += ["", "## Every run, in order", "",
              "| # | arm | cap | round | exit | tok/s | MiB/token | hit % | mgmt | compute | stall | compute bound "
              "| compute ÷ plain | text = plain's | load 1m | others' CPU % | elapsed s |",
              "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in recs:
        text = r.get("text")
        same = "–" if plain_text is None or text is None or a.replay_routes else (
            "yes" if plain_text.startswith(text) or text.startswith(plain_text) else "**no**")
        name = r["arm"] + (" (compute bound: warm, no limit)" if r["kind"] == "compute-bound" else "")
        lines.append(f"| {r['index']} | {name} | {cap_name.get(r['cap'], r['cap'])} | {r['round']} | {r['exit']} "
                     f"| {cell(r.get('tok_s'))} | {cell(r.get('mib_per_token'), '.1f')}"
                     f" | {cell(r.get('hit_pct'), '.1f')} "
                     f"| {cell(r.get('mgmt_s'), '.4f')} | {cell(r.get('compute_s'), '.4f')}"
                     f" | {cell(r.get('stall_s'), '.4f')} "
                     f"| {cell(r.get('compute_bound_tok_s'))} | {cell(r.get('compute_share'))} | {same} "
                     f"| {r['loadavg_1m']:.2f} | {cell(r.get('others_cpu_pct'), '.0f')} | {r['elapsed_s']:.0f} |")
    failed = [r for r in recs if not r["ok"]]
    if failed:
        lines += ["", "## Failed runs", ""]
        for r in failed:
            lines += [f"- run {r['index']} ({r['arm']}, cap {r['cap']}): exit {r['exit']}", "", "```",
                      r.get("stderr_tail", ""), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    arms, left = arms_of(a)
    runs = a.out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    cg_h = None
    if not a.no_limit:
        cg_h = bench_sys.find_cgroup()
        if cg_h is None:
            print("real_shape: error: no memory cgroup hierarchy here; pass --no-limit", file=sys.stderr)
            return 1
        bench_sys.probe_cgroup(cg_h)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(130))
    expert_mib, facts = mean_expert_mib(a.model)
    started = {"load": os.getloadavg()[0], "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    bw = {"before": bandwidth(a, "before")} if 0 in a.caps else {}
    recs: list[dict] = []
    index = 0
    plain_rounds = a.repeats if a.plain_repeats is None else min(a.repeats, a.plain_repeats)
    total = (a.repeats * (len(a.caps) * sum(x.kind != "plain" for x in arms) + (0 if a.no_compute_bound else 1))
             + plain_rounds * len(a.caps) * sum(x.kind == "plain" for x in arms))
    compute_arm = Arm("plain", "plain", [], tree=a.bmoe[0].tree, python=a.bmoe[0].python)
    try:
        for rnd in range(1, a.repeats + 1):
            plan = [(arm, cap, False) for cap in a.caps for arm in arms
                    if arm.kind != "plain" or a.plain_repeats is None or rnd <= a.plain_repeats]
            if not a.no_compute_bound:
                plan.append((compute_arm, 0, True))
            for arm, cap, warm in plan:
                index += 1
                waited = wait_for_load(a)
                print(f"real_shape: run {index}/{total}: round {rnd}, {arm.name}"
                      + (" (compute bound, warm)" if warm else f", cap {cap or 'none'}"), file=sys.stderr)
                r = run_one(a, arm, cap, rnd, index, cg_h, runs, expert_mib, warm)
                r["waited_s"] = waited
                recs.append(r)
                print(f"real_shape:   exit {r['exit']}, load {r['loadavg_1m']:.2f}, tok/s {cell(r.get('tok_s'))}, "
                      f"MiB/token {cell(r.get('mib_per_token'), '.1f')}, hit {cell(r.get('hit_pct'), '.1f')} %, "
                      f"{r['elapsed_s']:.0f} s", file=sys.stderr)
                (a.out / "results.json").write_text(json.dumps({"runs": recs}, indent=1))
    finally:
        if 0 in a.caps:
            bw["after"] = bandwidth(a, "after")
        ended = {"load": os.getloadavg()[0], "time": time.strftime("%Y-%m-%d %H:%M:%S")}
        rate = median_of(list(bw.values()))
        rows = summarize(recs, rate)
        (a.out / "results.json").write_text(json.dumps(
            {"argv": argv, "model": facts, "bandwidth_mib_s": bw, "left_out": left, "summary": rows, "runs": recs,
             "arms": [vars(x) | {"tree": str(x.tree)} for x in arms]}, indent=1, default=str))
        (a.out / "report.md").write_text(report(a, argv, arms, left, facts, bw, recs, rows, started, ended))
    print(f"real_shape: wrote {a.out / 'report.md'}", file=sys.stderr)
    return 0 if all(r["ok"] for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
