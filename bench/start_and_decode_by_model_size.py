"""How do start-up, time to first token and decode grow with the model's size under one memory limit?

For each model (the 64-expert demo and bmoe-synth qwen3moe files of the sizes asked for, built one
at a time and deleted after they are measured), under a fresh cgroup of `--mem-limit-mb` (2500 MiB
by default) and with the model dropped from the page cache before every process:

1. llama.cpp's load alone, in a process of its own: wall time and the bytes it read from storage
   (`/proc/self/io` read_bytes across `llama_model_load_from_file`), as bmoe loads it (the file
   mapped without reading it, `bmoe.seam.no_populate`) and as plain llama.cpp loads it (`--plain-load`);
2. a `bmoe-cli --session` (auto budget unless `--cache-mb`; an empty `--usage-dir`, so a cold start whose
   usage profile is written there at exit, and its size recorded): the time from launch
   to `BMOE_READY`, the bytes every process had read by then, every process's RSS, the shared memory
   and the cgroup's page cache at that point; then one generation of the prompt (`-f`, by default
   bench/prompts/prefill_400.txt) with `-n` tokens: time to first token (`load_s + prefill_s`, as
   bmoe-bench defines it, and from launch), decode tok/s and MiB read per decode token, and the peaks
   of the same memory figures while it ran (sampled every 0.1 s), the cgroup's peak and OOM kills;
3. with `--cache-mb auto`, a second session right after the first, the page cache left as that run
   left it (a warm start): launch to READY and the auto budget it chose, against the cold one's;
4. for models up to `--mmap-up-to-gb`, the same session with `--no-stream` (plain llama.cpp's mmap),
   for time to first token.

Rounds (`--rounds`) alternate the models' runs where the models coexist (the demo); a synthetic model
is built, measured `--rounds` times and deleted before the next is built. Writes results.json,
report.md and charts (load and TTFT against model GB, tok/s and MiB/token against GB) to --out.

    python bench/start_and_decode_by_model_size.py --out bench/reports/$(date +%F)-scale \\
        --sizes 10 20 40 --models-dir /work/scale-models --rounds 2

Needs root for the cgroup (cgroup v1 or v2 with the memory controller).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bmoe.base.units import MiB  # noqa: E402
from bmoe.shm_cache import segments_of  # noqa: E402
from bmoe.tools.bench_machine import machine_info  # noqa: E402
from bmoe.tools.bench_sys import Cgroup, drop_file_cache, find_cgroup, remove_all_cgroups  # noqa: E402

DEMO = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bmoe" / "smollm2-135m-moe-e64-k8-r2.gguf"
SHAPE = dict(arch="qwen3moe", layers=48, experts=128, top_k=8, embd=896)  # 250 MiB of dense weights


def say(msg: str) -> None:
    print(f"scale: {msg}", file=sys.stderr, flush=True)


# ---- llama.cpp's load alone (run in its own process: --probe-load) ---------------------------------

def probe_load(model: str, mode: str) -> dict:
    """Load the model in llama.cpp as bmoe does (mode 'map') or as llama.cpp does ('plain')."""
    import contextlib

    import llama_cpp

    from bmoe import seam
    from bmoe.seam.llama import init_backend, load_model

    def read_bytes() -> int:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))

    init_backend()
    r0, t0 = read_bytes(), time.perf_counter()
    with seam.no_populate() if mode == "map" else contextlib.nullcontext() as why:
        m = load_model(model)
    out = {"mode": mode, "s": time.perf_counter() - t0, "read_bytes": read_bytes() - r0, "fallback": why}
    llama_cpp.llama_model_free(m)
    return out


def llama_load(cg_parent, limit: int, model: Path, mode: str) -> dict:
    drop_file_cache([model])
    with Cgroup(cg_parent, f"bmoe-bench-scale-{os.getpid()}-probe", limit) as cg:
        r = subprocess.run(cg.wrap([sys.executable, __file__, "--probe-load", str(model), mode]),
                           capture_output=True, text=True, cwd=REPO)
    if r.returncode != 0:
        return {"mode": mode, "error": r.stderr[-800:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---- memory of a run -------------------------------------------------------------------------------

def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("RssAnon", "RssFile", "RssShmem"):
                    out[k] = int(v.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def _read_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration, ValueError):
        return 0


def _role(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    if b"bmoe.workers.io_lane" in cmd:
        return f"io_lane {cmd[cmd.index(b'bmoe.workers.io_lane') + 1].decode()}"
    if b"bmoe.workers.spec_gate" in cmd:
        return "spec_gate"
    return "coordinator"


def _cgroup_stat(cg: Cgroup) -> dict[str, int]:
    out = {}
    try:
        for line in (cg.path / "memory.stat").read_text().splitlines():
            k, _, v = line.partition(" ")
            if v.strip().isdigit():
                out[k] = int(v)
    except OSError:
        pass
    if cg.h.version == 1:
        return {"page_cache": out.get("cache", 0) - out.get("shmem", 0), "shmem": out.get("shmem", 0),
                "anon": out.get("rss", 0), "mapped_file": out.get("mapped_file", 0)}
    return {"page_cache": out.get("file", 0) - out.get("shmem", 0), "shmem": out.get("shmem", 0),
            "anon": out.get("anon", 0), "mapped_file": out.get("file_mapped", 0)}


class Snapshot:
    """Per process (by role) RSS anon/file/shmem and bytes read; the bmoe segments' blocks; the cgroup's stat."""

    def __init__(self, root: int, cg: Cgroup) -> None:
        import psutil

        try:
            pids = [root] + [c.pid for c in psutil.Process(root).children(recursive=True)]
        except psutil.Error:
            pids = [root]
        self.procs = {}
        for pid in pids:
            st = _status(pid)
            if st:
                self.procs[_role(pid)] = {"rss_anon": st.get("RssAnon", 0), "rss_file": st.get("RssFile", 0),
                                          "rss_shmem": st.get("RssShmem", 0), "read_bytes": _read_bytes(pid)}
        self.shm = sum(p.stat().st_blocks * 512 for p in segments_of(root))
        self.cgroup = _cgroup_stat(cg)

    def as_dict(self) -> dict:
        return {"procs": self.procs, "shm": self.shm, "cgroup": self.cgroup}


class Peaks:
    """Samples Snapshots every `interval` s and keeps each figure's peak."""

    def __init__(self, root: int, cg: Cgroup, interval: float = 0.1) -> None:
        self.root, self.cg, self.interval = root, cg, interval
        self.peak: dict = {"procs": {}, "shm": 0, "cgroup": {}}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            s = Snapshot(self.root, self.cg)
            for role, d in s.procs.items():
                p = self.peak["procs"].setdefault(role, {})
                for k, v in d.items():
                    p[k] = max(p.get(k, 0), v)
            self.peak["shm"] = max(self.peak["shm"], s.shm)
            for k, v in s.cgroup.items():
                self.peak["cgroup"][k] = max(self.peak["cgroup"].get(k, 0), v)
            self._stop.wait(self.interval)

    def stop(self) -> dict:
        self._stop.set()
        self._t.join()
        return self.peak


# ---- one session -----------------------------------------------------------------------------------

def session(cg_parent, limit: int, model: Path, flags: list[str], prompt: str, n_predict: int,
            tmp: Path) -> dict:
    """Launch `bmoe-cli --session` in a fresh cgroup on a cold page cache; READY, one generation, close."""
    from bmoe.edges.session_client import SessionClient, SessionError

    drop_file_cache([model])
    rec: dict = {"flags": flags}
    with Cgroup(cg_parent, f"bmoe-bench-scale-{os.getpid()}-run", limit) as cg:
        t0 = time.perf_counter()
        try:
            s = SessionClient(["-m", str(model), *flags], python=cg.python(tmp), cwd=str(REPO))
        except SessionError as e:
            return {**rec, "error": str(e)[-1500:]}
        try:
            rec["ready_s"] = time.perf_counter() - t0
            rec["ready"] = s.ready
            rec["at_ready"] = Snapshot(s.proc.pid, cg).as_dict()
            peaks = Peaks(s.proc.pid, cg)
            t1 = time.perf_counter()
            first = None
            read_mb: list[float] = []
            split: list[dict] = []
            for tag, ev in s.generate(1, prompt, timeout=3600, n_predict=n_predict):
                if tag == "PROGRESS":
                    first = first or time.perf_counter()
                    read_mb.append(ev["read_mb"])
                    split.append({k: ev[k] for k in ("wall_ms", "io_ms", "stall_ms", "compute_ms")})
                elif tag == "ERROR":
                    rec["error"] = ev.get("msg")
                elif tag == "DONE":
                    rec["done"] = {k: v for k, v in ev.items() if k != "text"}
            rec["first_token_after_request_s"] = (first - t1) if first else None
            rec["peak"] = peaks.stop()
            rec["read_mb_per_token"] = read_mb
            rec["token_split_ms"] = split
            rec["at_end"] = Snapshot(s.proc.pid, cg).as_dict()
        finally:
            rec["exit"] = s.close()
            rec["stderr_tail"] = s.stderr[-1500:]
            rec["start_budget_mib"] = start_budget(s.stderr)
            rec["cgroup_peak"] = cg.peak_bytes()
            rec["oom_kills"] = cg.oom_kills()
    done = rec.get("done")
    if done:
        rec["ttft_s"] = done["load_s"] + done["prefill_s"]
        rec["ttft_from_launch_s"] = rec["ready_s"] + rec["first_token_after_request_s"]
        rec["decode_tok_s"] = done["tok_s"]
        rec["mib_per_token"] = statistics.mean(read_mb) * 1e6 / MiB if read_mb else None
        for k in ("wall_ms", "io_ms", "stall_ms", "compute_ms"):
            rec[f"mean_{k}"] = statistics.mean(t[k] for t in split) if split else None
    return rec


def start_budget(stderr: str) -> float | None:
    """The budget `--cache-mb auto` chose at start, from its notice (MiB)."""
    m = re.search(r"cache budget ([\d.]+) MiB \(auto", stderr)
    return float(m.group(1)) if m else None


def warm_ready(cg_parent, limit: int, model: Path, flags: list[str], tmp: Path) -> dict:
    """A session started right after another, the model left in the page cache (charged to the cgroup
    that read it, now gone): launch to READY and the auto budget, then close."""
    from bmoe.edges.session_client import SessionClient, SessionError

    with Cgroup(cg_parent, f"bmoe-bench-scale-{os.getpid()}-warm", limit) as cg:
        t0 = time.perf_counter()
        try:
            s = SessionClient(["-m", str(model), *flags], python=cg.python(tmp), cwd=str(REPO))
        except SessionError as e:
            return {"error": str(e)[-1500:]}
        ready = time.perf_counter() - t0
        s.close()
        return {"ready_s": ready, "budget_mib": start_budget(s.stderr)}


# ---- models ----------------------------------------------------------------------------------------

def model_facts(path: Path) -> dict:
    from bmoe.base.model_files import read_model_files
    from bmoe.memory.dense import file_spans

    f = read_model_files(path)
    return {"path": str(path), "bytes": sum(f.sizes), "dense_bytes": sum(n for _, _, n in file_spans(f)),
            "expert_bytes": f.expert_bytes, "tensors": len(f.extents), "arch": f.arch,
            "n_expert": f.n_expert, "top_k": f.n_expert_used,
            "layers": len({n.split(".")[1] for n in f.extents if n.startswith("blk.")})}


def build(size_gb: float, models_dir: Path) -> Path:
    from bmoe.tools.synth import write_model

    path = models_dir / f"scale-qwen3moe-{size_gb:g}gb.gguf"
    if not path.exists():
        say(f"building {path.name} ({SHAPE})")
        t0 = time.perf_counter()
        write_model(path, size_gb=size_gb, **SHAPE)
        say(f"built {path.name} in {time.perf_counter() - t0:.0f} s")
    return path


def measure(name: str, path: Path, a: argparse.Namespace, cg_parent, prompt: str, tmp: Path) -> dict:
    limit = a.mem_limit_mb * MiB
    flags = ["-t", str(a.threads), "-c", str(a.ctx), "--io-threads", str(a.io_threads), "--cache-mb", a.cache_mb]
    facts = model_facts(path)
    out = {"name": name, "model": facts, "rounds": []}
    gb = facts["bytes"] / 1e9
    for r in range(a.rounds):
        rnd: dict = {"round": r + 1}
        say(f"{name} round {r + 1}: llama.cpp load (mapped, not read)")
        rnd["llama_load_map"] = llama_load(cg_parent, limit, path, "map")
        if a.plain_load:
            say(f"{name} round {r + 1}: llama.cpp load (plain: reads the file)")
            rnd["llama_load_plain"] = llama_load(cg_parent, limit, path, "plain")
        say(f"{name} round {r + 1}: bmoe session")
        usage = tmp / f"usage-{name}-{r}"  # empty: a cold start; the run's profile is written there at exit
        rnd["bmoe"] = session(cg_parent, limit, path, [*flags, "--usage-dir", str(usage)], prompt, a.n_predict, tmp)
        b = rnd["bmoe"]
        b["usage_profile_bytes"] = sum(p.stat().st_size for p in usage.glob("*.json")) if usage.is_dir() else None
        shutil.rmtree(usage, ignore_errors=True)
        if a.cache_mb == "auto":
            say(f"{name} round {r + 1}: warm start (page cache left as the last run left it)")
            rnd["warm"] = warm_ready(cg_parent, limit, path, [*flags, "--no-warm-start"], tmp)
        say(f"  READY {b.get('ready_s', 0):.2f} s, TTFT {b.get('ttft_s') or 0:.2f} s, "
            f"{b.get('decode_tok_s') or 0:.2f} tok/s, {b.get('mib_per_token') or 0:.0f} MiB/token, "
            f"exit {b.get('exit')}, OOM {b.get('oom_kills')}"
            + (f", error {b['error'][:300]}" if b.get("error") else ""))
        if gb <= a.mmap_up_to_gb:
            say(f"{name} round {r + 1}: plain llama.cpp (mmap) session")
            rnd["mmap"] = session(cg_parent, limit, path, ["-t", str(a.threads), "-c", str(a.ctx), "--no-stream"],
                                  prompt, a.n_predict, tmp)
            m = rnd["mmap"]
            say(f"  mmap TTFT {m.get('ttft_s') or 0:.2f} s, {m.get('decode_tok_s') or 0:.2f} tok/s")
        out["rounds"].append(rnd)
    return out


# ---- report ----------------------------------------------------------------------------------------

def _med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _mib(x: float | None) -> str:
    return "–" if x is None else f"{x / MiB:.0f}"


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "–" if x is None else format(x, fmt)


def summarize(m: dict) -> dict:
    rs = m["rounds"]
    b = [r["bmoe"] for r in rs]
    s = {
        "name": m["name"], "gb": m["model"]["bytes"] / 1e9, "dense_mib": m["model"]["dense_bytes"] / MiB,
        "tensors": m["model"]["tensors"],
        "llama_load_map_s": _med([r["llama_load_map"].get("s") for r in rs]),
        "llama_load_map_read": _med([r["llama_load_map"].get("read_bytes") for r in rs]),
        "llama_load_plain_s": _med([r.get("llama_load_plain", {}).get("s") for r in rs]),
        "llama_load_plain_read": _med([r.get("llama_load_plain", {}).get("read_bytes") for r in rs]),
        "ready_s": _med([x.get("ready_s") for x in b]),
        "load_s": _med([x.get("ready", {}).get("load_s") for x in b]),
        "read_at_ready": _med([sum(p["read_bytes"] for p in x["at_ready"]["procs"].values())
                               for x in b if "at_ready" in x]),
        "ttft_s": _med([x.get("ttft_s") for x in b]),
        "ttft_from_launch_s": _med([x.get("ttft_from_launch_s") for x in b]),
        "prefill_s": _med([x.get("done", {}).get("prefill_s") for x in b]),
        "tok_s": _med([x.get("decode_tok_s") for x in b]),
        "mib_per_token": _med([x.get("mib_per_token") for x in b]),
        "hit_pct": _med([x.get("done", {}).get("cache_hit_pct") for x in b]),
        "stall_s": _med([(x.get("mean_stall_ms") or 0) / 1e3 for x in b if x.get("mean_stall_ms") is not None]),
        "compute_s": _med([(x.get("mean_compute_ms") or 0) / 1e3 for x in b if x.get("mean_compute_ms") is not None]),
        "lanes_io_s": _med([(x.get("mean_io_ms") or 0) / 1e3 for x in b if x.get("mean_io_ms") is not None]),
        "budget_mib": _med([x.get("start_budget_mib") for x in b]),
        "warm_budget_mib": _med([r.get("warm", {}).get("budget_mib") for r in rs]),
        "warm_ready_s": _med([r.get("warm", {}).get("ready_s") for r in rs]),
        "cgroup_peak": max((x.get("cgroup_peak") or 0 for x in b), default=None),
        "oom_kills": sum(x.get("oom_kills") or 0 for x in b),
        "exits": [x.get("exit") for x in b],
        "mmap_ttft_s": _med([r.get("mmap", {}).get("ttft_s") for r in rs]),
        "profile_bytes": max((x.get("usage_profile_bytes") or 0 for x in b), default=None),
    }
    s["ttft_vs_mmap"] = s["ttft_s"] / s["mmap_ttft_s"] if s["ttft_s"] and s["mmap_ttft_s"] else None
    return s


def render(meta: dict, models: list[dict]) -> str:
    sums = [summarize(m) for m in models]
    L = [f"# Start-up, time to first token and decode by model size under {meta['limit_mib']} MiB", "",
         f"`{meta['command']}`", "",
         f"Machine: {meta['machine'].get('cpu', '?')}, {meta['machine'].get('cores', '?')} cores, "
         f"{meta['machine'].get('ram_mib', '?')} MiB, kernel {meta['machine'].get('kernel', '?')}; 1-minute load "
         f"average {meta['load_start']:.1f} at start, {meta['load_end']:.1f} at end; "
         f"bmoe {meta['machine'].get('bmoe_git', '?')}.",
         f"Each run: a fresh cgroup of {meta['limit_mib']} MiB, the model dropped from the page cache first; "
         f"`bmoe-cli --session {' '.join(meta['flags'])}`; prompt {meta['prompt']} ({meta['prompt_words']} words), "
         f"{meta['n_predict']} tokens; medians of {meta['rounds']} round(s).", "",
         "## Models", "",
         "| model | GB | layers | experts | top-k | tensors | dense MiB | expert GB |",
         "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for m in models:
        f = m["model"]
        L.append(f"| {m['name']} | {f['bytes'] / 1e9:.1f} | {f['layers']} | {f['n_expert']} | {f['top_k']} | "
                 f"{f['tensors']} | {f['dense_bytes'] / MiB:.0f} | {f['expert_bytes'] / 1e9:.1f} |")
    L += ["", "## Start", "",
          "llama.cpp load = `llama_model_load_from_file` alone in a process of its own (bmoe's way: mapped, "
          "not read; plain: llama.cpp's own, which reads every byte), with the MiB it read from storage. "
          "READY = launch of `bmoe-cli --session` to `BMOE_READY` (Python start-up included); load_s = "
          "`BMOE_READY.load_s`; read at READY = bytes every process of the run had read by then.", "",
          "| model | GB | llama.cpp load s (bmoe) | MiB read | ≤ dense + 2 %? | llama.cpp load s (plain) | MiB read | "
          "READY s | load_s | MiB read at READY | auto budget MiB, cold | warm | warm READY s |",
          "|---|---:|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s, m in zip(sums, models):
        bound = m["model"]["dense_bytes"] + 0.02 * m["model"]["bytes"]
        ok = "yes" if s["llama_load_map_read"] is not None and s["llama_load_map_read"] <= bound else "no"
        L.append(f"| {s['name']} | {s['gb']:.1f} | {_f(s['llama_load_map_s'])} | "
                 f"{_mib(s['llama_load_map_read'])} | {ok} | "
                 f"{_f(s['llama_load_plain_s'])} | {_mib(s['llama_load_plain_read'])} | {_f(s['ready_s'])} | "
                 f"{_f(s['load_s'])} | {_mib(s['read_at_ready'])} | {_f(s['budget_mib'], '.0f')} | "
                 f"{_f(s['warm_budget_mib'], '.0f')} | {_f(s['warm_ready_s'])} |")
    L += ["", "## First token and decode", "",
          "TTFT = `load_s + prefill_s` (bmoe-bench's definition); from launch = launch to the first token's "
          "`BMOE_PROGRESS`. MiB/token = mean `read_mb` of the decode tokens; per decode token (means), the wall time "
          "compute waited for reads (stall), the compute residual, and the lanes' summed busy time (I/O, "
          "overlapping compute). Hit % −1: no cache (the budget went below one token's working set).", "",
          "| model | GB | TTFT s | from launch s | prefill s | mmap TTFT s | ÷ mmap | decode tok/s | MiB/token | "
          "stall s/tok | compute s/tok | lanes I/O s/tok | hit % | cgroup peak MiB | OOM kills | exit "
          "| usage profile KB |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for s in sums:
        L.append(f"| {s['name']} | {s['gb']:.1f} | {_f(s['ttft_s'])} | {_f(s['ttft_from_launch_s'])} | "
                 f"{_f(s['prefill_s'])} | {_f(s['mmap_ttft_s'])} | {_f(s['ttft_vs_mmap'])} | {_f(s['tok_s'])} | "
                 f"{_f(s['mib_per_token'], '.0f')} | {_f(s['stall_s'])} | {_f(s['compute_s'])} | "
                 f"{_f(s['lanes_io_s'])} | "
                 f"{_f(s['hit_pct'], '.1f')} | {_mib(s['cgroup_peak'])} | "
                 f"{s['oom_kills']} | {s['exits']} | {_f((s['profile_bytes'] or 0) / 1024, '.0f')} |")
    L += ["", "## Memory", "",
          "Per process: peak RSS (anonymous + file; shared memory apart), MiB. shm = the bmoe segment's allocated "
          "blocks; page cache = the cgroup's file pages (`cache` − `shmem`), at READY and at its peak.", ""]
    roles = sorted({role for m in models for r in m["rounds"] for role in r["bmoe"].get("peak", {}).get("procs", {})})
    L.append("| model | " + " | ".join(roles) + " | shm at READY | shm peak | page cache at READY | page cache peak | "
             "cgroup peak |")
    L.append("|---|" + "---:|" * (len(roles) + 5))
    for m in models:
        b = m["rounds"][-1]["bmoe"]
        pk, rd = b.get("peak", {}), b.get("at_ready", {})
        cells = [_mib((pk.get("procs", {}).get(role, {}).get("rss_anon", 0)
                       + pk.get("procs", {}).get(role, {}).get("rss_file", 0))
                      if role in pk.get("procs", {}) else None) for role in roles]
        L.append(f"| {m['name']} | " + " | ".join(cells) + f" | {_mib(rd.get('shm'))} | {_mib(pk.get('shm'))} | "
                 f"{_mib(rd.get('cgroup', {}).get('page_cache'))} | {_mib(pk.get('cgroup', {}).get('page_cache'))} | "
                 f"{_mib(b.get('cgroup_peak'))} |")
    L += ["", "Charts: `start.png` (llama.cpp load, READY and TTFT against model GB), `decode.png` "
          "(tok/s and MiB/token against GB).", ""]
    return "\n".join(L)


def charts(out: Path, models: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("charts skipped: matplotlib is not installed (pip install 'bmoe[bench]')")
        return
    sums = sorted((summarize(m) for m in models), key=lambda s: s["gb"])
    gb = [s["gb"] for s in sums]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("llama_load_map_s", "llama.cpp load (bmoe: mapped)"),
                       ("llama_load_plain_s", "llama.cpp load (plain)"),
                       ("ready_s", "launch → BMOE_READY")):
        ys = [s[key] for s in sums]
        if any(y is not None for y in ys):
            ax[0].plot(gb, ys, "o-", label=label)
    ax[0].set(xlabel="model GB", ylabel="s", title="start")
    ax[0].legend(fontsize=8)
    for key, label in (("ttft_s", "bmoe TTFT"), ("mmap_ttft_s", "mmap TTFT")):
        pts = [(s["gb"], s[key]) for s in sums if s[key] is not None]
        if pts:
            ax[1].plot(*zip(*pts), "o-", label=label)
    ax[1].set(xlabel="model GB", ylabel="s", title="time to first token")
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "start.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].plot(gb, [s["tok_s"] for s in sums], "o-")
    ax[0].set(xlabel="model GB", ylabel="tok/s", title="decode tok/s")
    pts = [(s["mib_per_token"], 1 / s["tok_s"], s["stall_s"], s["name"])
           for s in sums if s["tok_s"] and s["mib_per_token"] is not None]
    ax[1].plot([p[0] for p in pts], [p[1] for p in pts], "o", label="s/token")
    ax[1].plot([p[0] for p in pts], [p[2] for p in pts], "s", label="of it waiting for reads (stall)")
    for x, y, _, name in pts:
        ax[1].annotate(name, (x, y), fontsize=7)
    ax[1].set(xlabel="MiB read per token", ylabel="s/token", title="decode cost against bytes per token")
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "decode.png", dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="*", default=[10, 20, 40], help="synthetic model sizes in GB")
    ap.add_argument("--no-demo", action="store_true", help="leave the 64-expert demo model out")
    ap.add_argument("--demo", type=Path, default=DEMO,
                    help="the 64-expert demo model's path; pass a copy no other process maps, or a 'cold' start "
                         "finds the pages those processes keep mapped (POSIX_FADV_DONTNEED cannot drop them)")
    ap.add_argument("--models-dir", type=Path, default=Path("/work/scale-models"),
                    help="where synthetic models are built (each deleted after it is measured)")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic models")
    ap.add_argument("--mem-limit-mb", type=int, default=2500)
    ap.add_argument("--cache-mb", default="auto")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx", type=int, default=4096)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("-f", "--prompt-file", type=Path, default=REPO / "bench" / "prompts" / "prefill_400.txt")
    ap.add_argument("-n", "--n-predict", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--plain-load", action=argparse.BooleanOptionalAction, default=True,
                    help="also time llama.cpp's own (reading) load")
    ap.add_argument("--mmap-up-to-gb", type=float, default=6.0,
                    help="run plain llama.cpp (--no-stream) for models up to this size (default 6: the demo)")
    ap.add_argument("--out", type=Path, required=True)
    if len(sys.argv) == 4 and sys.argv[1] == "--probe-load":  # (the child process of `llama_load`)
        print(json.dumps(probe_load(sys.argv[2], sys.argv[3])))
        return 0
    a = ap.parse_args()
    cg_parent = find_cgroup()
    if cg_parent is None:
        ap.error("no memory cgroup here (run as root where cgroup v1 or v2 has the memory controller)")
    a.out.mkdir(parents=True, exist_ok=True)
    tmp = a.out / ".tmp"
    tmp.mkdir(exist_ok=True)
    prompt = a.prompt_file.read_text()
    meta = {"command": " ".join(["python bench/start_and_decode_by_model_size.py", *sys.argv[1:]]),
            "machine": machine_info(DEMO if DEMO.exists() else REPO), "limit_mib": a.mem_limit_mb,
            "flags": ["-t", str(a.threads), "-c", str(a.ctx), "--io-threads", str(a.io_threads),
                      "--cache-mb", a.cache_mb, "--usage-dir", "(empty)"],
            "prompt": a.prompt_file.name, "prompt_words": len(prompt.split()), "n_predict": a.n_predict,
            "rounds": a.rounds, "load_start": os.getloadavg()[0]}
    models: list[dict] = []
    try:
        if not a.no_demo:
            models.append(measure("demo64", a.demo, a, cg_parent, prompt, tmp))
        a.models_dir.mkdir(parents=True, exist_ok=True)
        for gb in a.sizes:
            path = build(gb, a.models_dir)
            try:
                models.append(measure(f"synth-{gb:g}gb", path, a, cg_parent, prompt, tmp))
            finally:
                if not a.keep:
                    path.unlink(missing_ok=True)
            (a.out / "results.json").write_text(json.dumps({"meta": meta, "models": models}, indent=1))
    finally:
        remove_all_cgroups()
        meta["load_end"] = os.getloadavg()[0]
        (a.out / "results.json").write_text(json.dumps({"meta": meta, "models": models}, indent=1))
        shutil.rmtree(tmp, ignore_errors=True)
    (a.out / "report.md").write_text(render(meta, models))
    charts(a.out, models)
    say(f"wrote {a.out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
