"""`bmoe-bench run`'s runs: checks before the first one, the memory limit, one `bmoe-cli` process
measured, and the plan run in order between two bandwidth measurements.

`prepare` finds every mistake it can before a run starts (a bad flag should cost seconds, not an
hour of runs); `run` runs the plan, rewriting results.json after every run so that Ctrl-C, SIGTERM
or a crash leave what was measured.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bmoe.base import MiB
from bmoe.edges import flags
from bmoe.streaming import Trace
from bmoe.tools import bench_io, bench_machine, bench_report, bench_sys
from bmoe.tools.bench_config import BASELINE_FLAGS, BASELINE_NAME, Config, schedule
from bmoe.tools.bench_numbers import run_numbers


class BenchError(Exception):
    """A problem the user can fix; the message says how."""


class Interrupted(Exception):
    """SIGTERM: stop the current run and write the partial results, as Ctrl-C does."""


def say(msg: str) -> None:
    """Progress and warnings go to stderr: stdout holds only the summary table."""
    print(f"bmoe-bench: {msg}", file=sys.stderr, flush=True)


def check_cli_flags(configs: list[Config], common: list[str]) -> None:
    """Reject flags bmoe-cli would reject, alone or together, before any run starts."""
    for c in configs:
        p = flags.build_parser()
        p.exit_on_error = False
        try:
            s = flags.settings_from(p, p.parse_args(["-m", "x.gguf", *common, *c.flags]))
        except argparse.ArgumentError as e:
            raise BenchError(f"configuration {c.name!r}: bmoe-cli rejects its flags: {e}") from None
        except SystemExit:
            raise BenchError(f"configuration {c.name!r}: bmoe-cli rejects its flags {c.text!r}") from None
        if s.replay_routes:  # every run would fail at its start
            try:
                Trace.read(s.replay_routes)
            except (OSError, ValueError) as e:
                raise BenchError(f"configuration {c.name!r}: --replay-routes {s.replay_routes}: "
                                 f"{getattr(e, 'strerror', None) or e}") from None


# ---- the memory limit --------------------------------------------------------------------------

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
        assert self.hierarchy is not None  # a cgroup method comes with its hierarchy
        return (f"{self.mb:g} MiB via {self.method}: a fresh cgroup per run under "
                f"{self.hierarchy.parent} (memory limit = {self.bytes} bytes, swap not allowed), the "
                "run's process joins it before exec; peak = the cgroup's own peak usage counter")


def setup_limit(a: argparse.Namespace) -> Limit:
    """--mem-limit-mb by --limit-method: a cgroup when one can be made and joined (a probe tries),
    else (auto) a balloon, with a notice saying why."""
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
            assert h is not None  # why names a missing hierarchy
            lim.method, lim.hierarchy = f"cgroup-v{h.version}", h
            return lim
        if a.limit_method == "cgroup":
            raise BenchError(f"cannot apply the memory limit with a cgroup: {why}")
        say(f"cgroup not usable ({why}); falling back to a balloon process")
        lim.notes = f"cgroup not usable: {why}"
    lim.method = "balloon"
    avail = bench_sys.available_bytes() / MiB
    say(f"balloon: about {avail - a.mem_limit_mb:.0f} MiB of the machine's {avail:.0f} MiB available "
           "will be held during each run (this squeezes every process on the machine, not just bmoe)")
    return lim


# ---- one run -----------------------------------------------------------------------------------

def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


@dataclass
class RunEnv:
    """What every run of a benchmark shares."""

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
    entry: str = "bmoe.cli"  # the module each run starts (bmoe-bench quality's: bmoe.tools.bench_quality_run)
    # the source trees (None: this one) whose bmoe-cli has --no-warm-start: their runs start cold
    # unless a configuration says otherwise (trees from before it have no warm start to turn off)
    warm_start_trees: frozenset[Path | None] = frozenset()


def _run_env(checkout: Path | None) -> dict[str, str]:
    """The environment of one run. A checkout's bmoe-cli starts in its tree, so `-m` finds it there;
    its workers start without the cwd on sys.path (bmoe.workers.command), so PYTHONPATH names the
    tree for them too: every process of the run is the checkout's code."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if checkout is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(checkout), env.get("PYTHONPATH")]))
    return env


def run_one(env: RunEnv, index: int, phase: str, rnd: int, cfg: Config) -> dict:
    """One bmoe-cli process from a cold page cache, under the limit, its memory sampled: its record."""
    stem = f"{index:03d}-{cfg.name}-{phase}{rnd}"
    csv_path = env.runs_dir / f"{stem}.csv" if env.csv else None
    out_path, err_path = env.runs_dir / f"{stem}.out", env.runs_dir / f"{stem}.err"
    cmd = [sys.executable, "-m", env.entry, "-m", str(env.model), *env.prompt_args,
           "-n", str(env.n_predict), *env.common, *cfg.flags]
    if csv_path:
        cmd += ["--csv", str(csv_path)]
    if cfg.checkout in env.warm_start_trees and not {"--usage-dir", "--no-warm-start"} & set(env.common + cfg.flags):
        cmd.append("--no-warm-start")  # an earlier run's usage profile would fill the cache: not a cold start
    rec: dict = {"index": index, "phase": phase, "round": rnd,
                 "repeat": rnd if phase == "measure" else None,
                 "config": cfg.name, "flags": cfg.flags, "cmd": cmd,
                 "checkout": str(cfg.checkout) if cfg.checkout else None}

    if env.drop != "none":
        bench_sys.drop_file_cache(env.shards)
        if env.drop == "all" and env.drop_all_ok is not False:
            env.drop_all_ok = bench_sys.drop_all_caches()
            if not env.drop_all_ok:
                say("/proc/sys/vm/drop_caches is not writable: only the model file is dropped "
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
            assert limit.hierarchy is not None  # a cgroup method comes with its hierarchy
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
            proc = subprocess.Popen(argv, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, cwd=cfg.checkout,
                                    start_new_session=True, env=_run_env(cfg.checkout))
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
    rec.update(run_numbers(stdout, csv_text, env.skip_tokens, err_path.read_text(errors="replace")))
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


# ---- the benchmark -----------------------------------------------------------------------------

def measure_bandwidth(a: argparse.Namespace, shards: list[Path], tensors: list[bench_io.ExpertSpan],
                      when: str, seed: int) -> tuple[dict[int, float], str]:
    """O_DIRECT MiB/s at each --bw-threads count (and the read mode used), for the I/O-bound limits."""
    res, mode = {}, "?"
    for t in a.bw_threads:
        b = bench_io.measure(shards, tensors, a.bw_mb, t, seed=seed + t)
        res[t], mode = b.mib_s, b.mode
        say(f"O_DIRECT bandwidth ({when}), {t} thread(s): {b.mib_s:.1f} MiB/s "
               f"({b.requests} reads, {b.bytes / MiB:.0f} MiB in {b.seconds:.2f} s, {b.mode})")
    return res, mode


@dataclass
class Bench:
    """A checked `bmoe-bench run`: what runs, in which order, and its record so far."""

    configs: list[Config]
    plan: list[tuple[str, int, Config]]
    env: RunEnv
    tensors: list[bench_io.ExpertSpan]
    out: Path
    meta: dict
    records: list[dict] = field(default_factory=list)
    bandwidth: dict[int, float] = field(default_factory=dict)  # MiB/s by threads: mean of before and after
    interrupted: bool = False


def _model(path: str) -> tuple[Path, list[Path]]:
    model = Path(path).expanduser()
    if not model.is_file():
        raise BenchError(f"model file {model} does not exist; check the -m path")
    try:
        from bmoe.base import ModelError, shard_paths

        shards = shard_paths(model.resolve())
    except ModelError as e:
        raise BenchError(str(e)) from None
    return model.resolve(), shards


def _prompt_args(a: argparse.Namespace) -> list[str]:
    if a.prompt is not None:
        return ["-p", a.prompt]
    if a.file is not None:
        pf = Path(a.file).expanduser()
        if not pf.is_file():
            raise BenchError(f"prompt file {pf} does not exist; check the -f path")
        return ["-f", str(pf.resolve())]
    return []


def _configs(a: argparse.Namespace) -> list[Config]:
    configs: list[Config] = [] if a.no_baseline else [Config(BASELINE_NAME, list(BASELINE_FLAGS))]
    for c in a.config:
        if any(c.name == x.name for x in configs):
            hint = " (the built-in baseline; use --no-baseline to redefine it)" if c.name == BASELINE_NAME else ""
            raise BenchError(f"configuration name {c.name!r} is used twice{hint}")
        configs.append(c)
    if not configs:
        raise BenchError("nothing to run: give at least one --config NAME='FLAGS' (or drop --no-baseline)")
    check_cli_flags(configs, a.common)
    for name, where in a.checkout:
        match = [c for c in configs if c.name == name]
        if not match:
            raise BenchError(f"--checkout {name}={where}: no configuration is named {name!r}")
        match[0].checkout = where
    if a.compute_ref and not any(c.name == a.compute_ref for c in configs):
        raise BenchError(f"--compute-ref {a.compute_ref!r} names no configuration; give it as --config "
                         f"{a.compute_ref}='--cache-mb <all experts> --preload'")
    return configs


def prepare(a: argparse.Namespace, argv: list[str]) -> Bench:
    """Check the model, prompt, configurations and flags, make the output directory and set up the
    memory limit: everything that can fail before the first run."""
    model, shards = _model(a.model)
    prompt_args = _prompt_args(a)
    configs = _configs(a)
    try:
        tensors = bench_io.expert_tensors(shards)
    except (ValueError, OSError) as e:
        raise BenchError(f"cannot read {model} as GGUF ({e})") from None

    def cli_help(tree: Path | None) -> str:
        return subprocess.run([sys.executable, "-m", "bmoe.cli", "--help"], capture_output=True, text=True,
                              timeout=120, cwd=tree).stdout

    helptext = cli_help(None)
    warm_start_trees = frozenset(t for t in {c.checkout for c in configs}
                                 if "--no-warm-start" in (helptext if t is None else cli_help(t)))
    csv_ok = "--csv" in helptext
    if not csv_ok:
        say("bmoe-cli has no --csv: s/token median and p95 fall back to each run's summary line"
               + ("; --skip-tokens has no effect" if a.skip_tokens else ""))
    if a.skip_tokens >= a.n_predict:
        raise BenchError(f"--skip-tokens {a.skip_tokens} leaves none of the {a.n_predict} tokens; lower it "
                         "or raise -n")

    started = _dt.datetime.now()
    out = Path(a.out) if a.out else Path("bench/reports") / started.strftime("%Y-%m-%d-%H%M%S")
    out = out.absolute()  # a --checkout run starts in its own tree: every path it is given must hold there
    runs_dir = out / "runs"
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BenchError(f"cannot create the output directory {out}: {e.strerror}") from None

    limit = setup_limit(a)
    drop_desc = {"all": "model file dropped (POSIX_FADV_DONTNEED) and /proc/sys/vm/drop_caches = 1",
                 "file": "model file dropped (POSIX_FADV_DONTNEED)", "none": "not dropped"}[a.drop_caches]
    meta: dict = {
        "command": shlex.join(["bmoe-bench", *argv]), "cwd": os.getcwd(),
        "started": started.isoformat(timespec="seconds"),
        "machine": bench_machine.machine_info(model), "model": bench_machine.model_info(model, shards, tensors),
        "prompt_desc": ("`" + a.prompt + "`") if a.prompt is not None else
                       (f"file `{a.file}`" if a.file else "bmoe-cli's default"),
        "n_predict": a.n_predict, "skip_tokens": a.skip_tokens, "repeats": a.repeats, "warmup": a.warmup, "csv": csv_ok,
        "common_flags": a.common,
        "configs": [{"name": c.name, "flags": c.flags, "checkout": str(c.checkout) if c.checkout else None}
                    for c in configs],
        "memory_limit": {"mb": limit.mb, "method": limit.method, "description": limit.describe(),
                         "notes": limit.notes,
                         "cgroup_parent": str(limit.hierarchy.parent) if limit.hierarchy else None},
        "drop_caches": a.drop_caches, "drop_desc": drop_desc, "sample_interval": a.sample_interval,
        "compute_ref": a.compute_ref,
        "bandwidth": {},
    }
    env = RunEnv(model=model, shards=shards, prompt_args=prompt_args, n_predict=a.n_predict,
                 common=a.common, csv=csv_ok, runs_dir=runs_dir, limit=limit, drop=a.drop_caches,
                 timeout=a.timeout, interval=a.sample_interval, skip_tokens=a.skip_tokens,
                 unlimited=(a.compute_ref,) if a.compute_ref else (), warm_start_trees=warm_start_trees)
    return Bench(configs, schedule(configs, a.warmup, a.repeats), env, tensors, out, meta)


def _outcome(rec: dict) -> str:
    if rec["ok"]:
        msg = f"{rec['tok_s']:.2f} tok/s"
        if rec["mib_per_token"] is not None:
            msg += f", {rec['mib_per_token']:.2f} MiB/token"
        if rec["cache_hit_pct"] is not None:
            msg += f", {rec['cache_hit_pct']:.1f}% hit"
        if rec["ttft_s"] is not None:
            msg += f", TTFT {rec['ttft_s']:.3f} s"
    else:
        msg = f"FAILED (exit {rec['exit_status']}" + (", OOM-killed" if rec.get("oom_kills") else "") + ")"
    if rec.get("peak_mem_mib") is not None:
        msg += f", peak {rec['peak_mem_mib']:.0f} MiB"
    return msg


def run_bench(b: Bench, a: argparse.Namespace) -> None:
    """Bandwidth, every run of the plan with a progress line before and after, bandwidth again.

    Ctrl-C or SIGTERM stop the current run (its whole process group) and set b.interrupted; the
    records so far stay in b.records and results.json.
    """
    shards, tensors, meta = b.env.shards, b.tensors, b.meta
    results_path = b.out / bench_report.RESULTS
    bw_before: dict[int, float] = {}
    bw_after: dict[int, float] = {}
    bw_mode = "?"
    if a.no_bandwidth:
        meta["bandwidth"] = {"skipped": "--no-bandwidth"}
    elif not tensors:
        meta["bandwidth"] = {"skipped": "the model has no expert tensors"}
    else:
        bw_before, bw_mode = measure_bandwidth(a, shards, tensors, "before", seed=1)

    t_start = time.monotonic()

    def on_term(_sig: int, _frame: object) -> None:
        raise Interrupted()

    old_term = signal.signal(signal.SIGTERM, on_term)
    # Ctrl-C must reach us even when a shell started us in the background with SIGINT ignored.
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for i, (phase, rnd, cfg) in enumerate(b.plan):
            rounds = a.warmup if phase == "warmup" else a.repeats
            el = time.monotonic() - t_start
            print(f"bmoe-bench: [{i + 1}/{len(b.plan)}] {phase} round {rnd + 1}/{rounds}, config {cfg.name} "
                  f"({cfg.text or 'no flags'}), elapsed {el // 60:.0f}:{el % 60:04.1f} ...",
                  file=sys.stderr, flush=True)
            rec = run_one(b.env, i, phase, rnd, cfg)
            b.records.append(rec)
            print(f"bmoe-bench:     {_outcome(rec)} in {rec['elapsed_s']:.1f} s", file=sys.stderr, flush=True)
            if not rec["ok"] and rec.get("stderr_tail"):
                for ln in rec["stderr_tail"].splitlines()[-3:]:
                    print(f"bmoe-bench:     | {ln}", file=sys.stderr)
            bench_report.write_results(results_path, meta, b.records, None)
        if bw_before:
            bw_after, _ = measure_bandwidth(a, shards, tensors, "after", seed=101)
    except (KeyboardInterrupt, Interrupted):
        b.interrupted = True
        say("interrupted: the current run was stopped; writing partial results")
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
        bench_sys.remove_all_cgroups()

    b.bandwidth = {t: statistics.mean([x for x in (bw_before.get(t), bw_after.get(t)) if x is not None])
                   for t in bw_before}
    if bw_before:
        mean_req = statistics.mean(t.request(min(1, t.n_expert - 1))[1] for t in tensors) / 1024
        meta["bandwidth"] = {"mb": a.bw_mb, "mode": bw_mode, "mean_request_kib": mean_req,
                             "before": bw_before, "after": bw_after, "used": b.bandwidth}
    meta["machine"]["loadavg_at_end"] = list(os.getloadavg())
    if a.drop_caches == "all" and b.env.drop_all_ok is False:
        meta["drop_desc"] = ("model file dropped (POSIX_FADV_DONTNEED); /proc/sys/vm/drop_caches was not "
                             "writable, so other files stayed cached")
    meta["finished"] = _dt.datetime.now().isoformat(timespec="seconds")
    meta["interrupted"] = b.interrupted
