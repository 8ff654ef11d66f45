"""`bmoe-bench`: the one way performance numbers in this project are produced.

`bmoe-bench run` starts `bmoe-cli` once per (round, configuration), alternating the
configurations round-robin (c1 c2 c3 c1 c2 c3 ...) so drift on a shared machine hits all of
them alike, starts every run with the model file out of the page cache, optionally under a
memory limit (cgroup, else a balloon), and reports medians and spread next to the I/O-bound
limit computed from the measured O_DIRECT bandwidth of the model file.

Outputs (in --out DIR): results.json (one record per run), report.md, tok_s.png (when
matplotlib is installed) and runs/ with each run's stdout, stderr and per-token CSV.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bmoe.tools import bench_io, bench_sys
from bmoe.argtypes import nonneg_int, positive_float, positive_int
from bmoe.units import MiB

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_SIGINT = 130
BASELINE_NAME = "mmap"
BASELINE_FLAGS = ["--no-stream"]
DEFAULT_CLI_IO_THREADS = 2  # bmoe-cli's --io-threads default, used when it cannot be read
# bmoe-cli options the benchmark sets itself; a configuration may not override them.
CONTROLLED = {"-m", "--model", "-p", "--prompt", "-f", "--file", "-n", "--n-predict", "--csv"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")

RUN_EXAMPLES = """\
examples:
  # streaming with no cache and with a 1 GiB cache, against plain llama.cpp (mmap)
  bmoe-bench run -m model.gguf -p "Why is the sky blue?" -n 32 \\
      --config nocache='--cache-mb 0' --config c1g='--cache-mb 1024 --io-threads 4'

  # the same under a 2 GiB memory limit (cgroup, else a balloon), 5 measured rounds
  bmoe-bench run -m model.gguf -n 32 --mem-limit-mb 2048 --repeats 5 \\
      --config c1g='--cache-mb 1024' --out bench/reports/my-run

  # flags for every configuration (baseline included), no baseline, quick
  bmoe-bench run -m model.gguf -n 8 --common '-t 2 -c 512' --no-baseline \\
      --config a='--cache-mb 0' --config b='--cache-mb 64' --warmup 0 --repeats 1

Configurations run round-robin (warm-up rounds first, not counted); each run starts with the
model file dropped from the page cache. The baseline configuration 'mmap' = '--no-stream'
(plain llama.cpp) is always included unless --no-baseline.
"""

EXAMPLES = """\
commands:
  run        benchmark bmoe-cli configurations against each other and plain llama.cpp
  routes     what a routing trace (bmoe-cli --route-trace) says: reuse, router recall, LRU curve
  policies   replay routing traces through every cache policy and Belady's bound

examples:
  bmoe-bench run -m model.gguf -n 32 --config c0='--cache-mb 0' --config c1g='--cache-mb 1024'
  bmoe-bench run --help
  bmoe-cli -m model.gguf -n 150 --route-trace story.jsonl && bmoe-bench routes story.jsonl
  bmoe-bench policies story.jsonl code.jsonl --budgets 10,25,50,75
"""

POLICIES_EXAMPLES = """\
examples:
  bmoe-cli -m model.gguf --chat -p "Write a story" -n 150 --cache-mb 2000 --route-trace story.jsonl
  bmoe-bench policies story.jsonl                       # budgets 10,25,50,75% of the expert bytes
  bmoe-bench policies story.jsonl code.jsonl --budgets 25,50 -m model.gguf --out policies.md

Each policy runs in the live ExpertCache with no memory behind it, so its hit rate is what
bmoe-cli --cache-policy NAME gets on the same routing. 'belady' is the offline optimum (it knows
the future) and 'next-token-oracle' is next-use told the next token's routing (a bound for any
next-token predictor); both only exist here. 'predict' is told the temporal and spec-gate predictions the
trace allows (spec-gate needs the trace's .hidden.npy).
"""


class BenchError(Exception):
    """A problem the user can fix; the message says how."""


class Interrupted(Exception):
    pass


# ---- configurations ----------------------------------------------------------------------------

@dataclass
class Config:
    name: str
    flags: list[str]

    @property
    def text(self) -> str:
        return shlex.join(self.flags)


def parse_config(text: str) -> Config:
    """`NAME=FLAGS` (FLAGS split like a shell would) -> Config."""
    name, eq, flags = text.partition("=")
    name = name.strip()
    if not eq or not name:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAME='FLAGS', e.g. --config c1g='--cache-mb 1024 --io-threads 4'")
    if not _NAME.match(name):
        raise argparse.ArgumentTypeError(
            f"{name!r}: a configuration name is letters, digits and _.+- (it names files)")
    try:
        argv = shlex.split(flags)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: cannot split the flags ({e})") from None
    for f in argv:
        if f.split("=", 1)[0] in CONTROLLED:
            raise argparse.ArgumentTypeError(
                f"{text!r}: {f.split('=', 1)[0]} is set by bmoe-bench itself (-m/-p/-f/-n/--csv); "
                "pass it to bmoe-bench instead")
    return Config(name, argv)


def check_cli_flags(configs: list[Config], common: list[str]) -> None:
    """Reject flags bmoe-cli would reject, before any run starts (best effort)."""
    try:
        from bmoe.cli import build_parser
    except Exception:  # noqa: BLE001 - the CLI is optional for this check
        return
    for c in configs:
        p = build_parser()
        p.exit_on_error = False
        try:
            p.parse_args(["-m", "x.gguf", *common, *c.flags])
        except argparse.ArgumentError as e:
            raise BenchError(f"configuration {c.name!r}: bmoe-cli rejects its flags: {e}") from None
        except SystemExit:
            raise BenchError(f"configuration {c.name!r}: bmoe-cli rejects its flags {c.text!r}") from None


def io_threads_of(flags: list[str]) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--io-threads", type=int, default=None)
    try:
        ns, _ = p.parse_known_args(flags)
    except SystemExit:
        ns = argparse.Namespace(io_threads=None)
    if ns.io_threads:
        return ns.io_threads
    try:
        from bmoe.cli import build_parser

        return int(build_parser().get_default("io_threads") or DEFAULT_CLI_IO_THREADS)
    except Exception:  # noqa: BLE001
        return DEFAULT_CLI_IO_THREADS


def schedule(configs: list[Config], warmup: int, repeats: int) -> list[tuple[str, int, Config]]:
    """(phase, round, config) in run order: rounds of every configuration, round-robin."""
    out = []
    for phase, rounds in (("warmup", warmup), ("measure", repeats)):
        for r in range(rounds):
            out.extend((phase, r, c) for c in configs)
    return out


# ---- parsing bmoe-cli output (one function: to be replaced by bmoe.telemetry's parser) ----------

_NUM = r"(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|nan|inf)"
_GEN = re.compile(rf"^generation: (\d+) tokens, {_NUM} s/token \({_NUM} tok/s\)\s*$", re.M)
_STREAM = re.compile(rf"^moe-stream: read {_NUM} MiB \({_NUM} MiB/token\), decode .*?"
                     rf"(?: stall_s/tok={_NUM})?\s*$", re.M)
_CACHE = re.compile(rf"^moe-cache: {_NUM}% hit, resident {_NUM} MiB\s*$", re.M)
# on stdout with --prefetch; bmoe-cli puts the same numbers on stderr (as a notice) for --spec-gate alone
_PREFETCH = re.compile(rf"^(?:bmoe: )?moe-prefetch: {_NUM} MiB speculative, (\d+)/(\d+) experts useful", re.M)
_SPEC = re.compile(rf"^moe-spec-gate: {_NUM}% router prediction recall( \(auto-disabled)?", re.M)


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile (numpy's default method)."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def parse_run(stdout: str, csv_text: str | None = None, skip_tokens: int = 0, stderr: str = "") -> dict:
    """Numbers from one `bmoe-cli` run: its summary lines and, when given, its per-token CSV.

    Keys (None when absent): tokens, tok_s, s_per_token, s_per_token_median, s_per_token_p95,
    p95_source ('csv' or 'summary'), steady_mib_per_token, mib_read, mib_per_token,
    stall_s_per_token, cache_hit_pct, cache_resident_mib, spec_mib_per_token, useful_pct,
    spec_recall_pct, spec_disabled. The CSV-based numbers (median, p95,
    steady MiB/token) leave out the first `skip_tokens` tokens when more tokens than that exist.
    """
    out: dict = dict.fromkeys(("tokens", "tok_s", "s_per_token", "s_per_token_median", "s_per_token_p95",
                               "p95_source", "steady_mib_per_token", "mib_read", "mib_per_token",
                               "stall_s_per_token", "cache_hit_pct", "cache_resident_mib",
                               "spec_mib_per_token", "useful_pct", "spec_recall_pct", "spec_disabled"))
    gen = _GEN.findall(stdout)
    if gen:  # the last one: an answer text cannot fake the real summary, which comes after it
        n, s_tok, tok_s = gen[-1]
        out.update(tokens=int(n), s_per_token=float(s_tok), tok_s=float(tok_s))
        out.update(s_per_token_median=float(s_tok), s_per_token_p95=float(s_tok), p95_source="summary")
    stream = _STREAM.findall(stdout)
    if stream:
        mib, per_tok, stall = stream[-1]
        out.update(mib_read=float(mib), mib_per_token=float(per_tok),
                   stall_s_per_token=float(stall) if stall else None)
    cache = _CACHE.findall(stdout)
    if cache:
        out.update(cache_hit_pct=float(cache[-1][0]), cache_resident_mib=float(cache[-1][1]))
    pre = _PREFETCH.findall(stdout) or _PREFETCH.findall(stderr)
    if pre and out["tokens"]:
        mib, useful, prefetched = pre[-1]
        out.update(spec_mib_per_token=float(mib) / out["tokens"],
                   useful_pct=100.0 * int(useful) / int(prefetched) if int(prefetched) else None)
    spec = _SPEC.findall(stdout)
    if spec:
        out.update(spec_recall_pct=float(spec[-1][0]), spec_disabled=bool(spec[-1][1]))
    if csv_text:
        lines = [ln for ln in csv_text.splitlines() if ln.strip() and not ln.startswith("#")]
        if len(lines) >= 2:
            header = [h.strip() for h in lines[0].split(",")]
            rows = []
            for ln in lines[1:]:
                row = {}
                for k, v in zip(header, ln.split(",")):
                    try:
                        row[k] = float(v)
                    except ValueError:
                        pass
                if "wall_ms" in row:
                    rows.append(row)
            total = sum(r["wall_ms"] for r in rows) / 1e3
            if rows and total > 0:  # more digits than the summary line's
                out.update(tok_s=len(rows) / total, s_per_token=total / len(rows))
            if len(rows) > skip_tokens:
                rows = rows[skip_tokens:]
            if rows:
                walls = [r["wall_ms"] / 1e3 for r in rows]
                out.update(s_per_token_median=statistics.median(walls),
                           s_per_token_p95=percentile(walls, 95), p95_source="csv")
                if stream and all("read_bytes" in r for r in rows):
                    out["steady_mib_per_token"] = statistics.mean(r["read_bytes"] for r in rows) / MiB
    return out


# ---- one run -----------------------------------------------------------------------------------

@dataclass
class Limit:
    """How the memory limit is applied (method None = no limit)."""

    mb: float | None = None
    method: str | None = None  # "cgroup-v1", "cgroup-v2", "balloon"
    hierarchy: bench_sys.CgroupHierarchy | None = None
    notes: str = ""

    @property
    def bytes(self) -> int:
        return int((self.mb or 0) * MiB)

    def describe(self) -> str:
        if self.mb is None:
            return "none"
        if self.method == "balloon":
            return (f"{self.mb:g} MiB via a balloon process holding touched anonymous memory so that about "
                    f"{self.mb:g} MiB stay available on the whole machine (sized again before each run)")
        return (f"{self.mb:g} MiB via {self.method}: a fresh cgroup per run under "
                f"{self.hierarchy.parent} (memory limit = {self.bytes} bytes, swap not allowed), the "
                "run's process joins it before exec; peak = the cgroup's own peak usage counter")


def _notice(msg: str) -> None:
    print(f"bmoe-bench: {msg}", file=sys.stderr, flush=True)


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


@dataclass
class RunEnv:
    model: Path
    shards: list[Path]
    prompt_args: list[str]
    n_predict: int
    common: list[str]
    csv: bool
    runs_dir: Path
    limit: Limit
    drop: str  # "all", "file", "none"
    timeout: float
    interval: float
    skip_tokens: int = 0
    drop_all_ok: bool | None = None
    unlimited: tuple[str, ...] = ()  # configurations run without the memory limit (--compute-ref)


def run_one(env: RunEnv, index: int, phase: str, rnd: int, cfg: Config) -> dict:
    stem = f"{index:03d}-{cfg.name}-{phase}{rnd}"
    csv_path = env.runs_dir / f"{stem}.csv" if env.csv else None
    out_path, err_path = env.runs_dir / f"{stem}.out", env.runs_dir / f"{stem}.err"
    cmd = [sys.executable, "-m", "bmoe.cli", "-m", str(env.model), *env.prompt_args,
           "-n", str(env.n_predict), *env.common, *cfg.flags]
    if csv_path:
        cmd += ["--csv", str(csv_path)]
    rec: dict = {"index": index, "phase": phase, "round": rnd,
                 "repeat": rnd if phase == "measure" else None,
                 "config": cfg.name, "flags": cfg.flags, "cmd": cmd}

    if env.drop != "none":
        bench_sys.drop_file_cache(env.shards)
        if env.drop == "all" and env.drop_all_ok is not False:
            env.drop_all_ok = bench_sys.drop_all_caches()
            if not env.drop_all_ok:
                _notice("/proc/sys/vm/drop_caches is not writable: only the model file is dropped "
                        "from the page cache before each run")
    rec["loadavg_1m"] = os.getloadavg()[0]

    cgroup = balloon = None
    proc = sampler = None
    peak_cg = oom = None
    limit = Limit() if cfg.name in env.unlimited else env.limit
    rec["limited"] = limit.method is not None
    t0 = time.monotonic()
    try:
        if limit.method in ("cgroup-v1", "cgroup-v2"):
            cgroup = bench_sys.Cgroup(limit.hierarchy, f"{bench_sys.CGROUP_PREFIX}{os.getpid()}-{index}",
                                      limit.bytes)
            argv = cgroup.wrap(cmd)
        else:
            argv = cmd
            if limit.method == "balloon":
                size = bench_sys.available_bytes() - limit.bytes
                rec["balloon_mib"] = round(max(size, 0) / MiB, 1)
                if size > 64 * MiB:
                    balloon = bench_sys.Balloon(size)
        t0 = time.monotonic()
        with open(out_path, "w") as fo, open(err_path, "w") as fe:
            proc = subprocess.Popen(argv, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
            sampler = bench_sys.TreeSampler(proc.pid, env.interval).start()
            try:
                rc = proc.wait(timeout=env.timeout or None)
            except subprocess.TimeoutExpired:
                bench_sys.kill_group(proc)
                rc = proc.returncode
                rec["timed_out"] = True
    finally:
        elapsed = time.monotonic() - t0
        if sampler:
            sampler.stop()
        if proc is not None and proc.poll() is None:
            bench_sys.kill_group(proc)
        if cgroup:
            peak_cg, oom = cgroup.peak_bytes(), cgroup.oom_kills()
            cgroup.remove()
        if balloon:
            balloon.close()

    stdout = out_path.read_text(errors="replace")
    csv_text = csv_path.read_text(errors="replace") if csv_path and csv_path.exists() else None
    rec.update(parse_run(stdout, csv_text, env.skip_tokens, err_path.read_text(errors="replace")))
    rec.update(exit_status=rc, elapsed_s=round(elapsed, 3),
               peak_mem_mib=round(sampler.peak_total / MiB, 1) if sampler.samples else None,
               peak_rss_mib=round(sampler.peak_rss / MiB, 1) if sampler.samples else None,
               peak_shm_mib=round(sampler.peak_shm / MiB, 1) if sampler.samples else None,
               peak_cgroup_mib=round(peak_cg / MiB, 1) if peak_cg is not None else None,
               oom_kills=oom, proc_read_mib=round(sampler.read_bytes / MiB, 1),
               stdout_file=out_path.name, stderr_file=err_path.name,
               csv_file=csv_path.name if csv_path and csv_path.exists() else None)
    rec["ok"] = rc == 0 and rec["tok_s"] is not None
    if not rec["ok"]:
        tail = _tail(err_path)
        if rc == 0 and rec["tok_s"] is None:
            tail = (tail + "\n" if tail else "") + "(bmoe-bench: no 'generation:' line in stdout)"
        rec["stderr_tail"] = tail
    return rec


# ---- aggregation -------------------------------------------------------------------------------

def _med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def bandwidth_for(bw: dict[int, float], threads: int) -> tuple[int, float] | None:
    """The measured (thread count, MiB/s) closest to `threads` (ties: fewer threads)."""
    if not bw:
        return None
    k = min(bw, key=lambda t: (abs(t - threads), t))
    return k, bw[k]


def summarize(configs: list[Config], records: list[dict], bw: dict[int, float],
              compute_ref: str | None = None, common: list[str] = ()) -> list[dict]:
    """Per-configuration medians; with `compute_ref` (a run with every expert resident) also each
    streaming configuration's overlap limit, 1 / max(compute s/token, MiB per token ÷ bandwidth)."""
    out = []
    for c in configs:
        runs = [r for r in records if r["config"] == c.name and r["phase"] == "measure"]
        ok = [r for r in runs if r["ok"]]
        tps = [r["tok_s"] for r in ok]
        s = {"config": c.name, "flags": c.flags, "runs": len(runs), "ok_runs": len(ok),
             "tok_s_median": _med(tps), "tok_s_min": min(tps) if tps else None,
             "tok_s_max": max(tps) if tps else None,
             "tok_s_q1": percentile(tps, 25) if len(tps) >= 4 else None,
             "tok_s_q3": percentile(tps, 75) if len(tps) >= 4 else None,
             "s_per_token_median": _med([r["s_per_token_median"] for r in ok]),
             "s_per_token_p95": _med([r["s_per_token_p95"] for r in ok]),
             "mib_per_token": _med([r["mib_per_token"] for r in ok]),
             "steady_mib_per_token": _med([r["steady_mib_per_token"] for r in ok]),
             "cache_hit_pct": _med([r["cache_hit_pct"] for r in ok]),
             "stall_s_per_token": _med([r["stall_s_per_token"] for r in ok]),
             "peak_mem_mib": max((r["peak_mem_mib"] for r in runs if r.get("peak_mem_mib") is not None),
                                 default=None),
             "peak_cgroup_mib": max((r["peak_cgroup_mib"] for r in runs
                                     if r.get("peak_cgroup_mib") is not None), default=None),
             "spec_mib_per_token": _med([r.get("spec_mib_per_token") for r in ok]),
             "useful_pct": _med([r.get("useful_pct") for r in ok]),
             "spec_recall_pct": _med([r.get("spec_recall_pct") for r in ok]),
             "spec_disabled_runs": sum(1 for r in ok if r.get("spec_disabled")),
             "io_threads": None, "bw_threads": None, "bw_mib_s": None, "io_bound_tok_s": None,
             "overlap_limit_tok_s": None, "pct_of_limit": None,
             "speedup_vs_mmap": None, "s_per_token_vs_mmap": None}
        if "--no-stream" not in c.flags:
            s["io_threads"] = io_threads_of([*common, *c.flags])  # a configuration's flag wins
            pick = bandwidth_for(bw, s["io_threads"])
            if pick:
                s["bw_threads"], s["bw_mib_s"] = pick
                if s["mib_per_token"]:
                    s["io_bound_tok_s"] = pick[1] / s["mib_per_token"]
        out.append(s)
    ref = next((s for s in out if s["config"] == compute_ref), None)
    if ref and ref["tok_s_median"]:
        compute_s = 1.0 / ref["tok_s_median"]
        for s in out:
            if s is ref or s["io_bound_tok_s"] is None or s["tok_s_median"] is None:
                continue
            s["overlap_limit_tok_s"] = 1.0 / max(compute_s, 1.0 / s["io_bound_tok_s"])
            s["pct_of_limit"] = 100.0 * s["tok_s_median"] / s["overlap_limit_tok_s"]
    base = next((s for s in out if s["config"] == BASELINE_NAME), None)
    if base and base["tok_s_median"]:
        for s in out:
            if s["tok_s_median"] is not None:
                s["speedup_vs_mmap"] = s["tok_s_median"] / base["tok_s_median"]
            if s["s_per_token_median"] is not None and base["s_per_token_median"]:
                s["s_per_token_vs_mmap"] = s["s_per_token_median"] / base["s_per_token_median"]
    return out


# ---- machine -----------------------------------------------------------------------------------

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001
        return None


def _git(repo: Path) -> str | None:
    try:
        rev = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _filesystem(path: Path) -> str:
    best = ("", "?", "?")
    try:
        real = str(path.resolve())
        for line in Path("/proc/self/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                best = (mnt, dev, fstype)
    except OSError:
        pass
    return f"{best[1]} ({best[2]}) mounted at {best[0] or '?'}"


def machine_info(model: Path) -> dict:
    import psutil

    vm = psutil.virtual_memory()
    return {"cores": os.cpu_count(), "cpu": _cpu_model(), "ram_mib": round(vm.total / MiB),
            "available_mib_at_start": round(vm.available / MiB), "kernel": platform.release(),
            "platform": platform.platform(), "python": platform.python_version(),
            "llama_cpp_python": _version("llama-cpp-python"), "bmoe": _version("bmoe"),
            "bmoe_git": _git(Path(__file__).resolve().parent.parent),
            "loadavg_at_start": list(os.getloadavg()), "model_filesystem": _filesystem(model),
            "hostname": platform.node()}


# ---- report ------------------------------------------------------------------------------------

def _f(x: float | None, fmt: str = ".2f", none: str = "–") -> str:
    return none if x is None else format(x, fmt)


def write_results(path: Path, meta: dict, records: list[dict], summary: list[dict] | None) -> None:
    doc = dict(meta, runs=records, summary=summary)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    tmp.replace(path)


def render_report(meta: dict, records: list[dict], summary: list[dict], chart: str | None) -> str:
    m, mo, lim, bw = meta["machine"], meta["model"], meta["memory_limit"], meta["bandwidth"]
    L = ["# bmoe-bench report", ""]
    if meta.get("interrupted"):
        L += ["**Interrupted**: partial results (the runs that finished before Ctrl-C / SIGTERM).", ""]
    L += ["## Command", "", "```", meta["command"], "```", "",
          f"Started {meta['started']}, finished {meta.get('finished', '?')}; working directory "
          f"`{meta['cwd']}`.", ""]
    L += ["## Machine", "",
          f"- cores: {m['cores']} ({m['cpu']})",
          f"- RAM: {m['ram_mib']} MiB ({m['available_mib_at_start']} MiB available at start)",
          f"- kernel: {m['kernel']} ({m['platform']})",
          f"- load average (1/5/15 min) at start: {' / '.join(f'{x:.2f}' for x in m['loadavg_at_start'])}"
          + (f"; at end: {' / '.join(f'{x:.2f}' for x in m['loadavg_at_end'])}" if m.get("loadavg_at_end") else ""),
          f"- Python {m['python']}, llama-cpp-python {m['llama_cpp_python']}, bmoe {m['bmoe']}"
          + (f" (git {m['bmoe_git']})" if m.get("bmoe_git") else ""),
          f"- model file system: {m['model_filesystem']}", ""]
    L += ["## Model", "",
          f"- path: `{mo['path']}`" + (f" ({len(mo['shards'])} shards)" if len(mo["shards"]) > 1 else ""),
          f"- size: {mo['size_mib']:.1f} MiB; expert tensors {mo['expert_mib']:.1f} MiB, "
          f"other tensors {mo['non_expert_mib']:.1f} MiB",
          f"- expert slice per tensor: {mo['slice_desc']}",
          f"- prompt: {meta['prompt_desc']}; {meta['n_predict']} tokens per run", ""]
    L += ["## Memory limit", "", f"- {lim['description']}"]
    if lim.get("notes"):
        L.append(f"- {lim['notes']}")
    L += [f"- page cache before each run: {meta['drop_desc']}", ""]
    L += ["## O_DIRECT read bandwidth", ""]
    if bw.get("skipped"):
        L += [f"Not measured ({bw['skipped']}).", ""]
    else:
        L += [f"Random expert-slice requests (4 KiB-aligned supersets, as the I/O lanes issue them), "
              f"{bw['mb']:g} MiB per measurement, mode {bw['mode']}; mean request "
              f"{bw['mean_request_kib']:.1f} KiB. Measured before and after the runs; the I/O-bound "
              "limits below use their mean.", "",
              "| threads | before MiB/s | after MiB/s | used MiB/s |", "|---:|---:|---:|---:|"]
        for t in sorted(bw["used"], key=int):
            b = bw["before"].get(t)
            a = bw["after"].get(t)
            L.append(f"| {t} | {_f(b, '.1f')} | {_f(a, '.1f')} | {_f(bw['used'][t], '.1f')} |")
        L.append("")
    reps = meta["repeats"]
    L += ["## Results", "",
          f"Medians over {reps} measured round(s) per configuration ({meta['warmup']} warm-up round(s) "
          "not counted), configurations alternating round-robin. Spread = min–max of tok/s"
          + (" (IQR shown when there are 4 or more runs)" if reps >= 4 else "") + ". s/token median and p95 "
          "come from the per-token CSV when bmoe-cli writes one "
          f"({'yes' if meta['csv'] else 'no: p95 = the run mean'}) and are medians over runs"
          + (f"; they leave out each run's first {meta['skip_tokens']} token(s) (--skip-tokens), as does "
             "'steady MiB/token'" if meta.get("skip_tokens") else "") + ". "
          "'s/token ÷ mmap' = s/token median over the baseline's (for a fully resident cache: the "
          "cost of the hook). "
          "I/O-bound limit = O_DIRECT bandwidth (at the configuration's --io-threads) ÷ MiB read per "
          "token: the tok/s if reads were the only cost. Peak memory = RSS of the run's process tree "
          "(anonymous pages summed, file pages of its largest process) + its shared-memory cache segment, "
          f"sampled every {meta.get('sample_interval', 0.1):g} s, the largest over runs"
          + ("; cgroup peak = the cgroup's peak charge (includes page cache)."
             if (lim.get("method") or "").startswith("cgroup") else "."), "",
          "| config | flags | ok/runs | tok/s (median) | spread | s/token median | s/token p95 | MiB/token "
          "| steady MiB/token | hit % | stall s/token | I/O-bound tok/s | peak MiB | cgroup peak MiB "
          "| tok/s vs mmap | s/token ÷ mmap |",
          "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    spec_rows = [s for s in summary if s["spec_mib_per_token"] is not None or s["spec_recall_pct"] is not None]
    limits = [s for s in summary if s["overlap_limit_tok_s"] is not None]
    for s in summary:
        spread = "–" if s["tok_s_min"] is None else f"{s['tok_s_min']:.2f}–{s['tok_s_max']:.2f}"
        if s["tok_s_q1"] is not None:
            spread += f" (IQR {s['tok_s_q1']:.2f}–{s['tok_s_q3']:.2f})"
        iob = _f(s["io_bound_tok_s"])
        if s["io_bound_tok_s"] is not None:
            iob += f" ({s['bw_threads']} thr)"
        L.append(f"| {s['config']} | `{shlex.join(s['flags']) or ' '}` | {s['ok_runs']}/{s['runs']} | "
                 f"{_f(s['tok_s_median'])} | {spread} | {_f(s['s_per_token_median'], '.4f')} | "
                 f"{_f(s['s_per_token_p95'], '.4f')} | {_f(s['mib_per_token'])} | "
                 f"{_f(s['steady_mib_per_token'])} | {_f(s['cache_hit_pct'], '.1f')} | "
                 f"{_f(s['stall_s_per_token'], '.4f')} | {iob} | {_f(s['peak_mem_mib'], '.0f')} | "
                 f"{_f(s['peak_cgroup_mib'], '.0f')} | "
                 f"{'–' if s['speedup_vs_mmap'] is None else format(s['speedup_vs_mmap'], '.2f') + '×'} | "
                 f"{_f(s['s_per_token_vs_mmap'], '.3f')} |")
    L.append("")
    if limits:
        ref = meta["compute_ref"]
        L += ["### Overlap limits", "",
              f"Overlap limit = 1 / max(compute s/token, MiB per token ÷ O_DIRECT bandwidth): the tok/s if reads "
              f"hid perfectly behind compute. Compute s/token is configuration `{ref}`'s (every expert resident, "
              "run without the memory limit); bandwidth is the measured one at the configuration's --io-threads.",
              "", "| config | tok/s (median) | compute-bound tok/s | I/O-bound tok/s | overlap limit tok/s | "
              "% of limit |", "|---|---:|---:|---:|---:|---:|"]
        ref_s = next(s for s in summary if s["config"] == ref)
        for s in limits:
            L.append(f"| {s['config']} | {_f(s['tok_s_median'])} | {_f(ref_s['tok_s_median'])} | "
                     f"{_f(s['io_bound_tok_s'])} | {_f(s['overlap_limit_tok_s'])} | {_f(s['pct_of_limit'], '.1f')} |")
        L.append("")
    if spec_rows:
        L += ["### Speculative reads", "",
              "Speculative MiB/token = flash read ahead of demand (temporal prefetch and spec-gate), a part of "
              "MiB/token; useful % = experts read ahead that a later routing used; recall % = the spec-gate's "
              "predicted experts that the layer then routed.", "",
              "| config | speculative MiB/token | useful % | spec-gate recall % | governor fired |",
              "|---|---:|---:|---:|---:|"]
        for s in spec_rows:
            L.append(f"| {s['config']} | {_f(s['spec_mib_per_token'])} | {_f(s['useful_pct'], '.1f')} | "
                     f"{_f(s['spec_recall_pct'], '.1f')} | {s['spec_disabled_runs']}/{s['ok_runs']} |")
        L.append("")
    if chart:
        L += [f"![tok/s per configuration]({chart})", ""]
    elif meta.get("chart_note"):
        L += [f"_{meta['chart_note']}_", ""]
    L += ["## Runs", "", "In the order they ran (logs in `runs/`).", "",
          "| # | phase | round | config | exit | tok/s | s/token p95 | MiB/token | hit % | peak MiB | "
          "load 1m | s |", "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        L.append(f"| {r['index']} | {r['phase']} | {r['round']} | {r['config']} | {r['exit_status']} | "
                 f"{_f(r['tok_s'])} | {_f(r['s_per_token_p95'], '.4f')} | {_f(r['mib_per_token'])} | "
                 f"{_f(r['cache_hit_pct'], '.1f')} | {_f(r.get('peak_mem_mib'), '.0f')} | "
                 f"{r['loadavg_1m']:.2f} | {r['elapsed_s']:.1f} |")
    L.append("")
    failed = [r for r in records if not r["ok"]]
    if failed:
        L += ["## Failures", ""]
        for r in failed:
            why = f"exit {r['exit_status']}"
            if r.get("oom_kills"):
                why += f", {r['oom_kills']} OOM kill(s) in its cgroup"
            if r.get("timed_out"):
                why += ", timed out"
            L += [f"Run {r['index']} ({r['config']}, {r['phase']} round {r['round']}): {why}", "", "```",
                  r.get("stderr_tail", ""), "```", ""]
    return "\n".join(L)


def write_chart(path: Path, summary: list[dict]) -> str | None:
    """A bar chart of median tok/s (min–max whiskers); returns a notice when skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "chart skipped: matplotlib is not installed (pip install 'bmoe[bench]')"
    rows = [s for s in summary if s["tok_s_median"] is not None]
    if not rows:
        return "chart skipped: no successful runs"
    names = [s["config"] for s in rows]
    med = [s["tok_s_median"] for s in rows]
    err = [[m - s["tok_s_min"] for m, s in zip(med, rows)], [s["tok_s_max"] - m for m, s in zip(med, rows)]]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(rows) + 2), 3.5))
    ax.bar(names, med, yerr=err, capsize=4, color="#4477aa")
    labelled = False
    for i, s in enumerate(rows):
        if s["io_bound_tok_s"]:
            ax.plot([i - 0.4, i + 0.4], [s["io_bound_tok_s"]] * 2, color="#cc3311", lw=1.5,
                    label=None if labelled else "I/O-bound limit")
            labelled = True
    ax.set_ylabel("tok/s (median, min–max)")
    ax.set_title("bmoe-bench: decode speed per configuration")
    if any(s["io_bound_tok_s"] for s in rows):
        top = max([s["tok_s_max"] for s in rows] + [s["io_bound_tok_s"] or 0 for s in rows])
        ax.set_ylim(0, top * 1.25)
        ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ---- the run command ---------------------------------------------------------------------------

def _thread_list(text: str) -> list[int]:
    try:
        xs = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected thread counts like 1,2,4") from None
    if not xs or xs[0] < 1:
        raise argparse.ArgumentTypeError("thread counts must be 1 or more")
    return xs


def _flags(text: str) -> list[str]:
    try:
        argv = shlex.split(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: cannot split the flags ({e})") from None
    bad = [f for f in argv if f.split("=", 1)[0] in CONTROLLED]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]} is set by bmoe-bench itself (-m/-p/-f/-n/--csv)")
    return argv


def _budget_list(text: str) -> list[int]:
    try:
        xs = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected percentages like 10,25,50,75") from None
    if not xs or xs[0] < 1 or xs[-1] > 100:
        raise argparse.ArgumentTypeError(f"{text!r}: budgets are percentages from 1 to 100")
    return xs


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="bmoe-bench", epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Benchmark bmoe: the one way performance numbers in this project are produced.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    r = sub.add_parser(
        "run", epilog=RUN_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
        help="benchmark bmoe-cli configurations (alternating, medians) against plain llama.cpp",
        description="Run bmoe-cli with each configuration, alternating round-robin, each run starting "
                    "with a cold page cache and optionally under a memory limit; write results.json, "
                    "report.md and a chart.")
    rt = sub.add_parser("routes", help="previous-token reuse, next-layer router recall and the LRU hit-rate "
                                       "curve of a routing trace",
                        description="Read a trace written by bmoe-cli --route-trace and print previous-token "
                                    "expert reuse, next-layer router recall (the next layer's router applied "
                                    "to this layer's router input) and LRU hit rates at budgets of "
                                    "10/25/50/75%% of the expert bytes.")
    rt.add_argument("trace", help="trace file from bmoe-cli --route-trace")
    rt.add_argument("-m", "--model", help="the model the trace came from (default: the path in the trace)")
    po = sub.add_parser("policies", epilog=POLICIES_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
                        help="replay routing traces through every cache policy and Belady's bound",
                        description="Replay traces written by bmoe-cli --route-trace through LRU, Belady's MIN, "
                                    "a next-token oracle and every candidate cache policy; print hit rate and MiB read per token "
                                    "for each policy and budget, and the distance to LRU and to Belady.")
    po.add_argument("traces", nargs="+", metavar="TRACE", help="trace files from bmoe-cli --route-trace")
    po.add_argument("--budgets", type=_budget_list, default=[10, 25, 50, 75], metavar="LIST",
                    help="cache budgets as %% of all expert bytes (default 10,25,50,75)")
    po.add_argument("-m", "--model", help="the model the traces came from (default: the path in each trace)")
    po.add_argument("--out", metavar="PATH", help="also write the table (markdown) to PATH")
    po.add_argument("--no-prefill", action="store_true",
                    help="start decode from an empty cache; by default a pass that routes every expert of "
                         "every layer comes first, as a prompt of a few dozen tokens does in a live run")
    r.add_argument("-m", "--model", required=True, help="GGUF model (first shard of a split model)")
    src = r.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="prompt text (default: bmoe-cli's)")
    src.add_argument("-f", "--file", help="read the prompt from this file")
    r.add_argument("-n", "--n-predict", type=positive_int, default=32, help="tokens per run (default 32)")
    r.add_argument("--config", action="append", type=parse_config, default=[], metavar="NAME='FLAGS'",
                   help="a configuration: a name and the bmoe-cli flags it runs with; repeat for more")
    r.add_argument("--no-baseline", action="store_true",
                   help=f"leave out the built-in baseline {BASELINE_NAME}='{shlex.join(BASELINE_FLAGS)}'")
    r.add_argument("--common", type=_flags, default=[], metavar="'FLAGS'",
                   help="bmoe-cli flags for every configuration, baseline included (e.g. '-t 2 -c 512')")
    r.add_argument("--repeats", type=positive_int, default=3, help="measured rounds (default 3)")
    r.add_argument("--warmup", type=nonneg_int, default=1, help="warm-up rounds, not counted (default 1)")
    r.add_argument("--mem-limit-mb", type=positive_float, default=None, metavar="M",
                   help="run each bmoe-cli process tree with only M MiB of memory (cgroup, else a balloon)")
    r.add_argument("--limit-method", choices=("auto", "cgroup", "balloon"), default="auto",
                   help="how --mem-limit-mb is applied: auto (default) = cgroup, falling back to a balloon")
    r.add_argument("--cgroup-parent", default=None, metavar="PATH",
                   help="cgroup (relative to the memory controller's root) under which per-run cgroups "
                        "are made; default: the cgroup bmoe-bench runs in, so the runs stay inside any "
                        "limit and accounting that applies to it ('/' = the top level)")
    r.add_argument("--drop-caches", choices=("all", "file", "none"), default="all",
                   help="before each run: 'all' (default) = drop the model file from the page cache and "
                        "echo 1 > /proc/sys/vm/drop_caches when writable; 'file' = the model file only")
    r.add_argument("--bw-mb", type=positive_float, default=256.0,
                   help="MiB read per O_DIRECT bandwidth measurement (default 256)")
    r.add_argument("--bw-threads", type=_thread_list, default=[1, 2, 4], metavar="LIST",
                   help="thread counts for the bandwidth measurement (default 1,2,4)")
    r.add_argument("--no-bandwidth", action="store_true", help="skip the O_DIRECT bandwidth measurement")
    r.add_argument("--compute-ref", default=None, metavar="NAME",
                   help="a configuration with every expert resident (e.g. --config resident='--cache-mb 9000 "
                        "--preload'); it runs without the memory limit, and its s/token is the compute cost "
                        "in each configuration's overlap limit, 1 / max(compute, MiB per token ÷ bandwidth)")
    r.add_argument("--skip-tokens", type=nonneg_int, default=0, metavar="K",
                   help="leave each run's first K tokens out of the per-token s/token median/p95 (cache "
                        "fill); needs bmoe-cli --csv (default 0)")
    r.add_argument("--timeout", type=float, default=0.0, metavar="S",
                   help="kill a run after S seconds (default: no limit)")
    r.add_argument("--sample-interval", type=positive_float, default=0.1, metavar="S",
                   help="memory sampling interval in seconds (default 0.1)")
    r.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (default bench/reports/<date-time>)")
    return ap


def _setup_limit(a: argparse.Namespace) -> Limit:
    if a.mem_limit_mb is None:
        return Limit()
    lim = Limit(mb=a.mem_limit_mb)
    if a.limit_method in ("auto", "cgroup"):
        h = bench_sys.find_cgroup(a.cgroup_parent)
        why = None
        if h is None:
            why = "no cgroup hierarchy with the memory controller is mounted"
        elif not h.parent.is_dir():
            why = f"{h.parent} does not exist"
        else:
            try:
                bench_sys.probe_cgroup(h)
            except bench_sys.LimitError as e:
                why = str(e)
        if why is None:
            lim.method, lim.hierarchy = f"cgroup-v{h.version}", h
            return lim
        if a.limit_method == "cgroup":
            raise BenchError(f"cannot apply the memory limit with a cgroup: {why}")
        _notice(f"cgroup not usable ({why}); falling back to a balloon process")
        lim.notes = f"cgroup not usable: {why}"
    lim.method = "balloon"
    avail = bench_sys.available_bytes() / MiB
    _notice(f"balloon: about {avail - a.mem_limit_mb:.0f} MiB of the machine's {avail:.0f} MiB available "
            "will be held during each run (this squeezes every process on the machine, not just bmoe)")
    return lim


def _model_info(model: Path, shards: list[Path], tensors: list[bench_io.ExpertTensor]) -> dict:
    expert, total = bench_io.tensor_bytes(shards)
    slices: dict[int, int] = {}
    for t in tensors:
        slices[t.slice_bytes] = slices.get(t.slice_bytes, 0) + 1
    desc = ", ".join(f"{b / 1024:.1f} KiB × {n} tensors" for b, n in sorted(slices.items())) or "no expert tensors"
    n_exp = sorted({t.n_expert for t in tensors})
    return {"path": str(model), "shards": [str(p) for p in shards],
            "size_mib": sum(p.stat().st_size for p in shards) / MiB, "expert_mib": expert / MiB,
            "non_expert_mib": (total - expert) / MiB, "n_expert": n_exp[0] if len(n_exp) == 1 else n_exp,
            "expert_tensors": len(tensors), "slice_desc": desc}


def _bandwidth(a: argparse.Namespace, shards: list[Path], tensors: list[bench_io.ExpertTensor],
               when: str, seed: int) -> tuple[dict[int, float], str]:
    res, mode = {}, "?"
    for t in a.bw_threads:
        b = bench_io.measure(shards, tensors, a.bw_mb, t, seed=seed + t)
        res[t], mode = b.mib_s, b.mode
        _notice(f"O_DIRECT bandwidth ({when}), {t} thread(s): {b.mib_s:.1f} MiB/s "
                f"({b.requests} reads, {b.bytes / MiB:.0f} MiB in {b.seconds:.2f} s, {b.mode})")
    return res, mode


def cmd_run(a: argparse.Namespace, argv: list[str]) -> int:
    model = Path(a.model).expanduser()
    if not model.is_file():
        raise BenchError(f"model file {model} does not exist; check the -m path")
    try:
        from bmoe.model_files import ModelError, shard_paths

        shards = shard_paths(model.resolve())
    except ModelError as e:
        raise BenchError(str(e)) from None
    model = model.resolve()
    prompt_args: list[str] = []
    if a.prompt is not None:
        prompt_args = ["-p", a.prompt]
    elif a.file is not None:
        pf = Path(a.file).expanduser()
        if not pf.is_file():
            raise BenchError(f"prompt file {pf} does not exist; check the -f path")
        prompt_args = ["-f", str(pf.resolve())]

    configs: list[Config] = [] if a.no_baseline else [Config(BASELINE_NAME, list(BASELINE_FLAGS))]
    for c in a.config:
        if any(c.name == x.name for x in configs):
            hint = " (the built-in baseline; use --no-baseline to redefine it)" if c.name == BASELINE_NAME else ""
            raise BenchError(f"configuration name {c.name!r} is used twice{hint}")
        configs.append(c)
    if not configs:
        raise BenchError("nothing to run: give at least one --config NAME='FLAGS' (or drop --no-baseline)")
    check_cli_flags(configs, a.common)
    if a.compute_ref and not any(c.name == a.compute_ref for c in configs):
        raise BenchError(f"--compute-ref {a.compute_ref!r} names no configuration; give it as --config "
                         f"{a.compute_ref}='--cache-mb <all experts> --preload'")

    try:
        tensors = bench_io.expert_tensors(shards)
    except (ValueError, OSError) as e:
        raise BenchError(f"cannot read {model} as GGUF ({e})") from None

    helptext = subprocess.run([sys.executable, "-m", "bmoe.cli", "--help"], capture_output=True, text=True,
                              timeout=120).stdout
    csv_ok = "--csv" in helptext
    if not csv_ok:
        _notice("bmoe-cli has no --csv: s/token median and p95 fall back to each run's summary line"
                + ("; --skip-tokens has no effect" if a.skip_tokens else ""))
    if a.skip_tokens >= a.n_predict:
        raise BenchError(f"--skip-tokens {a.skip_tokens} leaves none of the {a.n_predict} tokens; lower it "
                         "or raise -n")

    started = _dt.datetime.now()
    out = Path(a.out) if a.out else Path("bench/reports") / started.strftime("%Y-%m-%d-%H%M%S")
    runs_dir = out / "runs"
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BenchError(f"cannot create the output directory {out}: {e.strerror}") from None

    limit = _setup_limit(a)
    drop_desc = {"all": "model file dropped (POSIX_FADV_DONTNEED) and /proc/sys/vm/drop_caches = 1",
                 "file": "model file dropped (POSIX_FADV_DONTNEED)", "none": "not dropped"}[a.drop_caches]
    meta: dict = {
        "command": shlex.join(["bmoe-bench", *argv]), "cwd": os.getcwd(),
        "started": started.isoformat(timespec="seconds"),
        "machine": machine_info(model), "model": _model_info(model, shards, tensors),
        "prompt_desc": ("`" + a.prompt + "`") if a.prompt is not None else
                       (f"file `{a.file}`" if a.file else "bmoe-cli's default"),
        "n_predict": a.n_predict, "skip_tokens": a.skip_tokens, "repeats": a.repeats, "warmup": a.warmup, "csv": csv_ok,
        "common_flags": a.common,
        "configs": [{"name": c.name, "flags": c.flags} for c in configs],
        "memory_limit": {"mb": limit.mb, "method": limit.method, "description": limit.describe(),
                         "notes": limit.notes,
                         "cgroup_parent": str(limit.hierarchy.parent) if limit.hierarchy else None},
        "drop_caches": a.drop_caches, "drop_desc": drop_desc, "sample_interval": a.sample_interval,
        "compute_ref": a.compute_ref,
        "bandwidth": {},
    }
    results_path, report_path = out / "results.json", out / "report.md"
    records: list[dict] = []
    bw_before: dict[int, float] = {}
    bw_after: dict[int, float] = {}
    bw_mode = "?"
    if a.no_bandwidth:
        meta["bandwidth"] = {"skipped": "--no-bandwidth"}
    elif not tensors:
        meta["bandwidth"] = {"skipped": "the model has no expert tensors"}
    else:
        bw_before, bw_mode = _bandwidth(a, shards, tensors, "before", seed=1)

    env = RunEnv(model=model, shards=shards, prompt_args=prompt_args, n_predict=a.n_predict,
                 common=a.common, csv=csv_ok, runs_dir=runs_dir, limit=limit, drop=a.drop_caches,
                 timeout=a.timeout, interval=a.sample_interval, skip_tokens=a.skip_tokens,
                 unlimited=(a.compute_ref,) if a.compute_ref else ())
    plan = schedule(configs, a.warmup, a.repeats)
    t_start = time.monotonic()
    interrupted = False

    def on_term(_sig: int, _frame: object) -> None:
        raise Interrupted()

    old_term = signal.signal(signal.SIGTERM, on_term)
    # Ctrl-C must reach us even when a shell started us in the background with SIGINT ignored.
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for i, (phase, rnd, cfg) in enumerate(plan):
            rounds = a.warmup if phase == "warmup" else a.repeats
            el = time.monotonic() - t_start
            print(f"bmoe-bench: [{i + 1}/{len(plan)}] {phase} round {rnd + 1}/{rounds}, config {cfg.name} "
                  f"({cfg.text or 'no flags'}), elapsed {el // 60:.0f}:{el % 60:04.1f} ...",
                  file=sys.stderr, flush=True)
            rec = run_one(env, i, phase, rnd, cfg)
            records.append(rec)
            if rec["ok"]:
                msg = f"{rec['tok_s']:.2f} tok/s"
                if rec["mib_per_token"] is not None:
                    msg += f", {rec['mib_per_token']:.2f} MiB/token"
                if rec["cache_hit_pct"] is not None:
                    msg += f", {rec['cache_hit_pct']:.1f}% hit"
            else:
                msg = f"FAILED (exit {rec['exit_status']}" + (", OOM-killed" if rec.get("oom_kills") else "") + ")"
            if rec.get("peak_mem_mib") is not None:
                msg += f", peak {rec['peak_mem_mib']:.0f} MiB"
            print(f"bmoe-bench:     {msg} in {rec['elapsed_s']:.1f} s", file=sys.stderr, flush=True)
            if not rec["ok"] and rec.get("stderr_tail"):
                for ln in rec["stderr_tail"].splitlines()[-3:]:
                    print(f"bmoe-bench:     | {ln}", file=sys.stderr)
            write_results(results_path, meta, records, None)
        if bw_before:
            bw_after, _ = _bandwidth(a, shards, tensors, "after", seed=101)
    except (KeyboardInterrupt, Interrupted):
        interrupted = True
        _notice("interrupted: the current run was stopped; writing partial results")
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
        bench_sys.remove_all_cgroups()

    used = {t: statistics.mean([x for x in (bw_before.get(t), bw_after.get(t)) if x is not None])
            for t in bw_before}
    if bw_before:
        mean_req = statistics.mean(t.request(min(1, t.n_expert - 1))[1] for t in tensors) / 1024
        meta["bandwidth"] = {"mb": a.bw_mb, "mode": bw_mode, "mean_request_kib": mean_req,
                             "before": bw_before, "after": bw_after, "used": used}
    meta["machine"]["loadavg_at_end"] = list(os.getloadavg())
    if a.drop_caches == "all" and env.drop_all_ok is False:
        meta["drop_desc"] = ("model file dropped (POSIX_FADV_DONTNEED); /proc/sys/vm/drop_caches was not "
                             "writable, so other files stayed cached")
    meta["finished"] = _dt.datetime.now().isoformat(timespec="seconds")
    meta["interrupted"] = interrupted
    summary = summarize(configs, records, used, a.compute_ref, a.common)
    chart_note = write_chart(out / "tok_s.png", summary)
    if chart_note:
        _notice(chart_note)
        meta["chart_note"] = chart_note
    write_results(results_path, meta, records, summary)
    report_path.write_text(render_report(meta, records, summary, None if chart_note else "tok_s.png"))
    _print_summary(summary)
    _notice(f"wrote {report_path} and {results_path}")
    if interrupted:
        return EXIT_SIGINT
    return 0 if all(r["ok"] for r in records) else EXIT_ERROR


def _print_summary(summary: list[dict]) -> None:
    print(f"{'config':<16} {'tok/s':>8} {'min–max':>15} {'s/tok':>8} {'MiB/tok':>9} {'hit%':>6} "
          f"{'I/O-bound':>10} {'peak MiB':>9} {'vs mmap':>8}")
    for s in summary:
        spread = "–" if s["tok_s_min"] is None else f"{s['tok_s_min']:.2f}–{s['tok_s_max']:.2f}"
        print(f"{s['config']:<16} {_f(s['tok_s_median']):>8} {spread:>15} {_f(s['s_per_token_median'], '.4f'):>8} "
              f"{_f(s['mib_per_token']):>9} "
              f"{_f(s['cache_hit_pct'], '.1f'):>6} {_f(s['io_bound_tok_s']):>10} {_f(s['peak_mem_mib'], '.0f'):>9} "
              f"{_f(s['speedup_vs_mmap']):>8}")


def cmd_routes(a: argparse.Namespace) -> int:
    from bmoe.tools import route_stats

    try:
        print(route_stats.report(a.trace, a.model))
    except (OSError, ValueError, KeyError) as e:
        raise BenchError(f"cannot read trace {a.trace}: {e}") from e
    return 0


def cmd_policies(a: argparse.Namespace) -> int:
    from bmoe.tools import policy_sim

    try:
        rows = policy_sim.simulate(a.traces, a.budgets, a.model, progress=_notice, prefill=not a.no_prefill)
    except (OSError, ValueError, KeyError) as e:
        raise BenchError(f"cannot replay the traces: {e}") from e
    text = policy_sim.table(rows)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
    try:
        if a.command == "run":
            return cmd_run(a, argv)
        if a.command == "routes":
            return cmd_routes(a)
        if a.command == "policies":
            return cmd_policies(a)
        raise BenchError(f"unknown command {a.command}")
    except BenchError as e:
        print(f"bmoe-bench: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except bench_sys.LimitError as e:
        print(f"bmoe-bench: error: memory limit: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        bench_sys.remove_all_cgroups()
        print("bmoe-bench: interrupted", file=sys.stderr)
        return EXIT_SIGINT


if __name__ == "__main__":
    sys.exit(main())
