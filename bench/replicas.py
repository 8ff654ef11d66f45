"""Do two bmoe-server replicas behind HAProxy serve a team: with the disk as the bound, at least 1.7x one
replica's tokens/s; every conversation's prompt cache hit on its own replica (against no affinity); and
nothing lost but the streams that were running when a replica is SIGKILLed?

Starts, on loopback ports: a store the replicas share (a Redis server of the run's own, or an SQLite file),
2 `bmoe-server` replicas on the 64-expert demo model, each under `flash-limit CAP` (its own read cap, as if each
had its own disk: the disk, not the 2 cores, is the bound), in its own memory cgroup (bmoe.tools.bench_sys),
`-t 1`, its own `--cache-mb`, `--parallel` = the clients (a KV sequence for each conversation it may hold) and
`--batching turns` (one request decodes at a time: the comparison is of replicas, not of batches); and HAProxy
with deploy/haproxy.cfg as the repository has it (BMOE_MAXCONN = --parallel; an admin socket added, to take a
replica out). Clients, each on its own thread with the official `openai` client, hold agent-like conversations:
a system prompt with tools shared by all, a task, then turns of tool output, every turn the whole history so far,
streamed (`stream_options.include_usage`: each turn's cached prompt tokens). Phases, in one run, the same
workload in each (other words, the same sizes):

  a  one replica alone (r2 in maintenance), conversations keyed by `prompt_cache_key`: aggregate tokens/s
  b  both replicas, keyed (affinity): tokens/s (b / a: the acceptance is >= 1.7) and cached prompt tokens
  c  both replicas, no key (each turn to the least busy replica): cached prompt tokens against b
  d  as b (but client 0 sends no key, so r2 surely gets work), and r2 SIGKILLed once it streams: streams
     cut (and what the client raised), requests HAProxy retried on r1 (its counters), requests lost, what
     r1 answered after the kill; a client whose stream was cut sends its turn again, as an agent would

    python bench/replicas.py --out bench/reports/$(date +%F)-replicas     # the measurement (quiet machine, ~1 h)
    python bench/replicas.py --quick --out /tmp/replicas                  # a smoke run: about 2 minutes
    python bench/replicas.py --phases b,c --cap-mib 120 --out DIR         # affinity against none only

Progress goes to stderr; DIR/README.md is the report, DIR/results.json every number, DIR/requests.csv every
request, DIR/logs/ the replicas', HAProxy's and the store's output. Needs root (flash-limit, cgroups), HAProxy
(apt-get install haproxy) and, for the Redis store, redis-server and the `redis` client.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import openai
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bmoe.base.units import MiB  # noqa: E402
from bmoe.demo import build as demo_build  # noqa: E402
from bmoe.shm_cache import segments_of  # noqa: E402
from bmoe.tools import bench_io, bench_machine, bench_sys  # noqa: E402
from bmoe.tools.bench_report import cell  # noqa: E402

CONFIG = REPO / "deploy" / "haproxy.cfg"
FLASH_LIMIT = Path("/work/shared/tools/flash-limit")
NAMES = ("r1", "r2")
PHASES = {"a": "one replica alone, keyed", "b": "two replicas, keyed (affinity)",
          "c": "two replicas, no key (least busy)", "d": "two replicas, keyed, r2 SIGKILLed mid-run"}
SYSTEM = ("You are a coding agent working in a repository. Think briefly, then answer with one short step. "
          "Tools: read_file(path) returns a file's text; list_dir(path) lists a folder; run_tests(pattern) runs "
          "the tests whose names match; search(text) finds a text in the tree; write_file(path, text) replaces a "
          "file. Call one tool per step, say why, and stop when the task is done. Keep every answer short.")
WORDS = ("parser cache lane budget router replica stream token request header socket buffer queue config flag "
         "schema window ledger policy expert layer prompt answer module folder report metric signal worker").split()


def note(msg: str) -> None:
    print(f"replicas: {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(check, what: str, timeout: float = 900, every: float = 0.1) -> None:
    """Poll `check()` until it is true; a SystemExit naming `what` past `timeout` seconds."""
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise SystemExit(f"replicas: {what} did not happen within {timeout:.0f} s")
        time.sleep(every)


# ---- the conversations -------------------------------------------------------------------------


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def opening(rng: random.Random) -> list[dict[str, str]]:
    """A conversation's first messages: the shared system prompt and a task of its own."""
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Task: fix the failing test about the {_words(rng, 3)}. The error says "
                                        f"{_words(rng, 20)}."}]


def tool_output(rng: random.Random, turn: int) -> dict[str, str]:
    """What the agent's tool gave back after a turn: a user message of the same size every turn."""
    return {"role": "user", "content": f"Tool result {turn} (read_file src/{rng.choice(WORDS)}.py): {_words(rng, 40)}"}


@dataclass
class Asked:
    """One request and what became of it: ok, cut (the stream broke after its answer began), failed (no answer
    began), or resent (the same turn again after a cut)."""

    phase: str
    client: int
    conversation: int
    turn: int
    key: str | None
    start_s: float
    replica: str = ""
    outcome: str = "failed"
    first_s: float | None = None  # to the first text
    end_s: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    chunks: int = 0
    error: str = ""
    resent: bool = False
    text: str = field(default="", repr=False)


class Clients:
    """`n` client threads, each holding `conversations` conversations of `turns` turns in phase `phase`."""

    def __init__(self, url: str, phase: str, a: argparse.Namespace, keyed: bool, t0: float) -> None:
        self.url, self.phase, self.a, self.keyed, self.t0 = url, phase, a, keyed, t0
        self.asked: list[Asked] = []
        self.lock = threading.Lock()
        self.streaming: dict[str, threading.Event] = {n: threading.Event() for n in NAMES}  # a text chunk came
        self.pool = ThreadPoolExecutor(a.clients, thread_name_prefix=f"client-{phase}")
        self.futures: list[Future] = []

    def run(self) -> None:
        self.futures = [self.pool.submit(self._client, i) for i in range(self.a.clients)]

    def running(self) -> bool:
        return not all(f.done() for f in self.futures)

    def join(self) -> None:
        for f in self.futures:
            f.result()  # a client's own failure (not a request's: those are recorded) ends the benchmark
        self.pool.shutdown()

    def _client(self, i: int) -> None:
        client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=3600)
        for conv in range(self.a.conversations):
            rng = random.Random(f"{self.a.seed}-{self.phase}-{i}-{conv}")
            # phase d: client 0 sends no key (the least busy replica), so r2 surely has work to be killed in
            keyed = self.keyed and not (self.phase == "d" and i == 0)
            key = f"{self.phase}-client{i}-conversation{conv}" if keyed else None
            messages = opening(rng)
            for turn in range(self.a.turns):
                got = self.ask(client, messages, i, conv, turn, key)
                if got.outcome == "cut":  # an agent sends its turn again
                    got = self.ask(client, messages, i, conv, turn, key, resent=True)
                if got.outcome != "ok":
                    break  # the conversation cannot go on without its answer
                messages = [*messages, {"role": "assistant", "content": got.text}, tool_output(rng, turn)]

    def ask(self, client: openai.OpenAI, messages: list[dict[str, str]], i: int, conv: int, turn: int,
            key: str | None, resent: bool = False) -> Asked:
        """One streamed turn, recorded whatever happens to it."""
        rec = Asked(self.phase, i, conv, turn, key, time.monotonic() - self.t0, resent=resent)
        with self.lock:
            self.asked.append(rec)
        extra = {"prompt_cache_key": key} if key else {}
        parts: list[str] = []
        try:
            with client.chat.completions.with_streaming_response.create(
                    model="bmoe", messages=messages, max_tokens=self.a.tokens, temperature=0, stream=True,
                    stream_options={"include_usage": True}, **extra) as raw:
                rec.replica = raw.headers.get("x-bmoe-replica", "?")
                rec.outcome = "cut"  # from here on, an error breaks an answer that has begun
                for chunk in raw.parse():
                    rec.chunks += 1
                    if chunk.choices and chunk.choices[0].delta.content:
                        if rec.first_s is None:
                            rec.first_s = time.monotonic() - self.t0
                            if rec.replica in self.streaming:
                                self.streaming[rec.replica].set()
                        parts.append(chunk.choices[0].delta.content)
                    if chunk.usage is not None:
                        rec.completion_tokens = chunk.usage.completion_tokens
                        rec.prompt_tokens = chunk.usage.prompt_tokens
                        details = chunk.usage.prompt_tokens_details
                        rec.cached_tokens = (details.cached_tokens or 0) if details else 0
            rec.outcome = "ok" if rec.completion_tokens else "cut"
            if rec.outcome == "cut":
                rec.error = "the stream ended without its usage chunk"
        except (openai.APIError, httpx.HTTPError) as e:
            rec.error = _described(e)
        rec.end_s = time.monotonic() - self.t0
        rec.text = "".join(parts)
        return rec


def _described(e: BaseException) -> str:
    """An exception as the client met it: its class and message, and what it was raised from."""
    said = f"{type(e).__module__}.{type(e).__name__}: {e}"
    if e.__cause__ is not None:
        said += f" (from {type(e.__cause__).__module__}.{type(e.__cause__).__name__}: {e.__cause__})"
    return said[:400]


# ---- the deployment ------------------------------------------------------------------------------


class Store:
    """The replicas' shared --response-store: a Redis server of this run's own, or an SQLite file."""

    def __init__(self, kind: str, folder: Path, port: int, log: Path) -> None:
        self.proc: subprocess.Popen | None = None
        if kind == "sqlite":
            self.url = f"sqlite:{folder / 'responses.db'}"
            return
        import redis

        self.url = f"redis://127.0.0.1:{port}/0"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([str(shutil.which("redis-server")), "--port", str(port), "--bind", "127.0.0.1",
                                          "--save", "", "--appendonly", "no", "--dir", str(folder)],
                                         stdout=out, stderr=out)

        def up() -> bool:
            try:
                return bool(redis.Redis.from_url(self.url).ping())
            except redis.ConnectionError:
                assert self.proc is not None and self.proc.poll() is None, f"redis-server ended: {log.read_text()}"
                return False

        wait_for(up, "redis-server answering", 60)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(30)


class Replica:
    """One bmoe-server under its own read cap and memory cgroup; `pid` is the server's own process."""

    def __init__(self, name: str, port: int, a: argparse.Namespace, store: str, logs: Path,
                 cg_h: bench_sys.CgroupHierarchy | None) -> None:
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = [sys.executable, "-m", "bmoe.server", "-m", str(a.model), "--port", str(port), "--replica-id", name,
                    "--response-store", store, "-t", "1", "-c", str(a.ctx), "--cache-mb", str(a.cache_mb),
                    "--parallel", str(a.parallel), "--batching", a.batching, "--io-threads", str(a.io_threads),
                    "--no-warm-start", "--drain-seconds", "0", *shlex.split(a.server_args)]
        argv = self.cmd
        self.cgroup = None
        if cg_h is not None:
            self.cgroup = bench_sys.Cgroup(cg_h, f"{bench_sys.CGROUP_PREFIX}replicas-{os.getpid()}-{name}",
                                           a.mem_limit_mb * MiB)
            argv = self.cgroup.wrap(argv)
        if a.cap_mib:
            argv = [str(a.flash_limit), str(a.cap_mib), "--file", str(a.model), "--", *argv]
        self.argv = argv
        started = bench_sys.ServerProcess(argv, cwd=REPO, new_session=True, wait_s=900)
        self.proc, self.lines = started.proc, started.lines
        tree = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        self.pid = next(p.pid for p in tree if p.cmdline()[:3] == [sys.executable, "-m", "bmoe.server"])
        self.io = bench_sys.TreeSampler(self.pid)
        self.killed = False
        (logs / f"{name}.cmd").write_text(shlex.join(argv) + "\n")

    def cgroups(self) -> dict[str, str]:
        """The server's blkio (flash-limit's) and memory cgroups, as /proc says them: the proof both hold."""
        lines = [line.split(":", 2) for line in Path(f"/proc/{self.pid}/cgroup").read_text().splitlines()]
        return {ctrls or "unified": path for _, ctrls, path in lines if ctrls in ("blkio", "memory", "")}

    def metrics(self) -> dict[str, float]:
        """/metrics, each series summed over its labels."""
        out: dict[str, float] = {}
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.split("{")[0].split(" ")[0], line.rsplit(" ", 1)[1]
                out[name] = out.get(name, 0.0) + float(value)
        return out

    def cpu_s(self) -> float:
        """CPU seconds of the server and its workers so far."""
        total = 0.0
        try:
            root = psutil.Process(self.pid)
            for p in [root, *root.children(recursive=True)]:
                t = p.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
        return total

    def kill(self) -> None:
        """SIGKILL the server process alone, as the kernel's OOM killer would (its lanes end on their own)."""
        os.kill(self.pid, signal.SIGKILL)
        self.killed = True

    def stop(self) -> None:
        if self.proc.poll() is None and not self.killed:
            try:
                os.kill(self.pid, signal.SIGTERM)
                self.proc.wait(120)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        bench_sys.kill_group(self.proc)
        for seg in segments_of(self.pid):  # a SIGKILLed server leaves its shared memory behind
            seg.unlink(missing_ok=True)
        if self.cgroup is not None:
            self.cgroup.remove()


def admin_config(text: str, sock: Path) -> str:
    """deploy/haproxy.cfg with an admin socket in its global section (phase a puts r2 in maintenance); the rest is
    the file as the repository has it."""
    head, sep, rest = text.partition("\nglobal\n")
    if not sep:
        raise SystemExit(f"replicas: {CONFIG} has no global section")
    return f"{head}{sep}    stats socket {sock} mode 600 level admin\n{rest}"


class Router:
    """HAProxy with the repository's config (and an admin socket) in front of the replicas."""

    def __init__(self, ports: dict[str, int], listen: int, stats: int, maxconn: int, folder: Path,
                 log: Path) -> None:
        self.sock = folder / "haproxy.sock"
        cfg = folder / "haproxy.cfg"
        cfg.write_text(admin_config(CONFIG.read_text(), self.sock))
        env = {**os.environ, "BMOE_LISTEN": f"127.0.0.1:{listen}", "BMOE_STATS": f"127.0.0.1:{stats}",
               "BMOE_MAXCONN": str(maxconn), **{f"BMOE_{n.upper()}": f"127.0.0.1:{p}" for n, p in ports.items()}}
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([str(shutil.which("haproxy")), "-db", "-f", str(cfg)], env=env, stdout=out,
                                         stderr=out)
        self.url = f"http://127.0.0.1:{listen}"
        wait_for(self.sock.exists, "HAProxy's admin socket", 30)

    def command(self, cmd: str) -> str:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.sock))
            s.sendall(cmd.encode() + b"\n")
            chunks = []
            while data := s.recv(65536):
                chunks.append(data)
        return b"".join(chunks).decode()

    def stats(self) -> dict[str, dict[str, str]]:
        """`show stat` of the replicas backend, by server name (and BACKEND)."""
        rows = csv.DictReader(io.StringIO(self.command("show stat").lstrip("# ")))
        return {r["svname"]: r for r in rows if r["pxname"] == "replicas"}

    def until(self, want: dict[str, str], timeout: float = 900) -> None:
        def seen() -> bool:
            assert self.proc.poll() is None, self.log.read_text()
            got = self.stats()
            return all(got.get(n, {}).get("status") == s for n, s in want.items())

        wait_for(seen, f"HAProxy seeing {want}", timeout)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


# ---- the machine -------------------------------------------------------------------------------


def check_flash_limit(a: argparse.Namespace) -> dict:
    """Whether flash-limit caps reads here (its exit 99 says it cannot, and why), and the rate an O_DIRECT read
    of the model gets under the cap (dd, about 2 s of reading)."""
    out: dict = {"tool": str(a.flash_limit), "cap_mib_s": a.cap_mib}
    if not a.cap_mib:
        return out | {"capped": False, "why": "--cap-mib 0: no cap"}
    if not a.flash_limit.exists():
        raise SystemExit(f"replicas: no flash-limit at {a.flash_limit} (pass --flash-limit PATH, or --cap-mib 0)")
    probe = subprocess.run([str(a.flash_limit), str(a.cap_mib), "--file", str(a.model), "--", "true"],
                           capture_output=True, text=True, timeout=60)
    out["probe_exit"] = probe.returncode
    if probe.returncode == 99:
        raise SystemExit(f"replicas: flash-limit cannot cap reads here (exit 99): {probe.stderr.strip()} "
                         "(pass --cap-mib 0 to run uncapped)")
    if probe.returncode != 0:
        raise SystemExit(f"replicas: flash-limit failed (exit {probe.returncode}): {probe.stderr.strip()}")
    blocks = max(1, 2 * a.cap_mib // 4)
    skip = random.Random(a.seed).randrange(max(1, a.model.stat().st_size // (4 * MiB) - blocks))
    t0 = time.monotonic()
    dd = subprocess.run([str(a.flash_limit), str(a.cap_mib), "--file", str(a.model), "--", "dd", f"if={a.model}",
                         "of=/dev/null", "bs=4M", f"count={blocks}", f"skip={skip}", "iflag=direct"],
                        capture_output=True, text=True, timeout=600)
    seconds = time.monotonic() - t0
    out |= {"capped": dd.returncode == 0, "dd_mib": blocks * 4, "dd_s": round(seconds, 2),
            "measured_mib_s": round(blocks * 4 / seconds, 1) if dd.returncode == 0 else None}
    return out


def machine(a: argparse.Namespace) -> dict:
    facts = bench_machine.machine_info(a.model)
    bench_sys.drop_file_cache([a.model])
    tensors = bench_io.expert_tensors([a.model])
    bw = bench_io.measure([a.model], tensors, a.bw_mb, a.io_threads * 2, seed=a.seed)
    facts["disk_mib_s"] = round(bw.mib_s, 1)
    facts["disk_probe"] = (f"{bw.mode} random expert-slice reads of the model, {bw.threads} threads (two replicas' "
                           f"lanes), {bw.bytes / MiB:.0f} MiB, uncapped")
    return facts


def lanes_of(pid: int) -> list[int]:
    """The I/O lanes still running on the shared memory of server `pid` (a lane names its segment)."""
    mark = f"--shm bmoe-{os.geteuid()}-{pid}-"
    return [p.pid for p in psutil.process_iter(["cmdline"]) if mark in " ".join(p.info["cmdline"] or [])]


def busy_seconds() -> float:
    """CPU seconds the whole machine has been busy since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


# ---- a phase -------------------------------------------------------------------------------------


def snapshot(replicas: dict[str, Replica], router: Router) -> dict:
    """What the replicas, HAProxy and the machine have counted so far."""
    snap: dict = {"t": time.monotonic(), "busy_s": busy_seconds(), "haproxy": router.stats(), "replicas": {}}
    for name, r in replicas.items():
        if r.killed:
            continue
        r.io.sample()
        snap["replicas"][name] = {"metrics": r.metrics(), "cpu_s": r.cpu_s(), "read_bytes": r.io.read_bytes}
    return snap


def _delta(before: dict, after: dict, name: str) -> dict:
    b, e = before["replicas"].get(name), after["replicas"].get(name)
    if b is None or e is None:
        return {}
    m = e["metrics"]
    dm = {k: m.get(k, 0.0) - b["metrics"].get(k, 0.0) for k in
          ("bmoe_generated_tokens_total", "bmoe_prefill_tokens_total", "llamacpp:prompt_tokens_total",
           "llamacpp:prompt_tokens_cached_total", "bmoe_read_bytes_total", "bmoe_stall_seconds_total")}
    wall = after["t"] - before["t"]
    return {"generated": dm["bmoe_generated_tokens_total"], "prefilled": dm["bmoe_prefill_tokens_total"],
            "prompt_cached": dm["llamacpp:prompt_tokens_cached_total"],
            "expert_read_mib": dm["bmoe_read_bytes_total"] / MiB, "stall_s": dm["bmoe_stall_seconds_total"],
            "disk_read_mib": (e["read_bytes"] - b["read_bytes"]) / MiB,
            "disk_mib_s": (e["read_bytes"] - b["read_bytes"]) / MiB / wall if wall > 0 else None,
            "cpu_s": e["cpu_s"] - b["cpu_s"], "cpu_pct": 100 * (e["cpu_s"] - b["cpu_s"]) / wall if wall > 0 else None}


def haproxy_counts(before: dict, after: dict) -> dict:
    """HAProxy's own counters over a phase, per server and for the backend: retries, redispatches, errors."""
    out = {}
    for sv in (*NAMES, "BACKEND"):
        b, e = before["haproxy"].get(sv, {}), after["haproxy"].get(sv, {})
        out[sv] = {k: int(e.get(k) or 0) - int(b.get(k) or 0)
                   for k in ("stot", "wretr", "wredis", "econ", "eresp", "srv_abrt", "cli_abrt", "hrsp_5xx")}
        out[sv]["status_end"] = e.get("status", "")
    return out


def summarize(phase: str, asked: list[Asked], wall: float) -> dict:
    """A phase's numbers from its requests: tokens/s over the phase's wall time, cached prompt tokens, outcomes."""
    ok = [x for x in asked if x.outcome == "ok"]
    later = [x for x in ok if x.turn > 0]  # a conversation's later turns: what a prompt cache can hold
    gen = sum(x.completion_tokens for x in ok)
    firsts = [x.first_s - x.start_s for x in ok if x.first_s is not None]
    return {"phase": phase, "what": PHASES[phase], "wall_s": round(wall, 2), "requests": len(asked),
            "ok": len(ok), "cut": sum(x.outcome == "cut" for x in asked),
            "failed": sum(x.outcome == "failed" for x in asked), "resent": sum(x.resent for x in asked),
            "resent_ok": sum(x.resent and x.outcome == "ok" for x in asked),
            "generated_tokens": gen, "tok_s": gen / wall if wall > 0 else None,
            "prompt_tokens": sum(x.prompt_tokens for x in ok), "cached_tokens": sum(x.cached_tokens for x in ok),
            "later_turns_prompt_tokens": sum(x.prompt_tokens for x in later),
            "later_turns_cached_tokens": sum(x.cached_tokens for x in later),
            "later_turns_cached_pct": (100 * sum(x.cached_tokens for x in later) / sum(x.prompt_tokens for x in later)
                                       if later else None),
            "by_replica": {n: sum(x.replica == n for x in ok) for n in NAMES},
            "conversations_on_one_replica": _kept(ok),
            "first_text_s_median": statistics.median(firsts) if firsts else None}


def _kept(ok: list[Asked]) -> str:
    """How many conversations had every turn answered by one replica, of how many."""
    homes: dict[tuple[int, int], set[str]] = {}
    for x in ok:
        homes.setdefault((x.client, x.conversation), set()).add(x.replica)
    return f"{sum(len(h) == 1 for h in homes.values())}/{len(homes)}"


def run_phase(phase: str, a: argparse.Namespace, replicas: dict[str, Replica], router: Router, t0: float) -> dict:
    note(f"phase {phase}: {PHASES[phase]}")
    if phase == "a":
        router.command("set server replicas/r2 state maint")
        router.until({"r2": "MAINT"})
    else:
        router.command("set server replicas/r2 state ready")
        router.until(dict.fromkeys(NAMES, "UP"))
    before = snapshot(replicas, router)
    clients = Clients(router.url, phase, a, keyed=phase != "c", t0=t0)
    clients.run()
    killed_at = down_after = None
    if phase == "d":
        while not clients.streaming["r2"].wait(0.5):
            if not clients.running():
                raise SystemExit("replicas: phase d ended before r2 streamed anything: nothing to kill it in")
        killed_at = time.monotonic()
        replicas["r2"].kill()
        note(f"phase d: r2 SIGKILLed at {killed_at - t0:.1f} s (it was streaming)")
        router.until({"r2": "DOWN"}, 120)
        down_after = time.monotonic() - killed_at
    clients.join()
    after = snapshot(replicas, router)
    wall = after["t"] - before["t"]
    s = summarize(phase, clients.asked, wall)
    s["replicas"] = {n: _delta(before, after, n) for n in NAMES}
    s["haproxy"] = haproxy_counts(before, after)
    s["machine_busy_pct"] = 100 * (after["busy_s"] - before["busy_s"]) / (wall * (os.cpu_count() or 1))
    s["start_s"], s["end_s"] = before["t"] - t0, after["t"] - t0
    if killed_at is not None:
        k = killed_at - t0
        s["kill"] = {"at_s": round(k, 2), "haproxy_down_after_s": round(down_after or 0, 2),
                     "streams_cut": [asdict(x) | {"text": None} for x in clients.asked if x.outcome == "cut"],
                     "failed_without_answer": sum(x.outcome == "failed" for x in clients.asked),
                     "answered_by_r1_after_kill": sum(x.outcome == "ok" and x.replica == "r1" and x.start_s > k
                                                      for x in clients.asked),
                     "answered_by_r2_after_kill": sum(x.outcome == "ok" and x.replica == "r2" and x.start_s > k
                                                      for x in clients.asked),
                     "lanes_left": lanes_of(replicas["r2"].pid)}
    s["asked"] = clients.asked
    note(f"phase {phase}: {s['generated_tokens']} tokens in {wall:.0f} s = {cell(s['tok_s'])} tok/s; "
         f"{s['ok']} ok, {s['cut']} cut, {s['failed']} failed; later turns' prompt cached "
         f"{cell(s['later_turns_cached_pct'], '.0f')} %; by replica {s['by_replica']}")
    return s


def warm_up(a: argparse.Namespace, replicas: dict[str, Replica]) -> None:
    """One conversation of two turns on each replica at once (not measured): the caches fill."""
    def one(r: Replica) -> None:
        c = openai.OpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0, timeout=3600)
        rng = random.Random(f"warm-{r.name}")
        messages = opening(rng)
        for turn in range(2):
            got = c.chat.completions.create(model="bmoe", messages=messages, max_tokens=a.tokens, temperature=0)
            messages += [{"role": "assistant", "content": got.choices[0].message.content or ""}, tool_output(rng, turn)]

    with ThreadPoolExecutor(len(replicas)) as pool:
        list(pool.map(one, replicas.values()))


# ---- the report --------------------------------------------------------------------------------


def report(a: argparse.Namespace, argv: list[str], facts: dict, flash: dict, setup: dict, phases: list[dict]) -> str:
    by = {p["phase"]: p for p in phases}
    ratio = by["b"]["tok_s"] / by["a"]["tok_s"] if "a" in by and "b" in by and by["a"]["tok_s"] else None
    lines = ["# Two bmoe-server replicas behind HAProxy", "",
             f"`python bench/replicas.py {shlex.join(argv)}`", "",
             f"- machine: {facts['cpu']}, {facts['cores']} cores, {facts['ram_mib']} MiB RAM, kernel "
             f"{facts['kernel']}; load average at start {facts['loadavg_at_start'][0]:.2f}; bmoe {facts['bmoe_git']}",
             f"- disk: {facts['disk_mib_s']:.0f} MiB/s ({facts['disk_probe']}); model file on "
             f"{facts['model_filesystem']}",
             "- read cap per replica: " + (
                 f"`{flash['tool']} {a.cap_mib}` (its probe exit {flash['probe_exit']}: it caps here); an O_DIRECT "
                 f"read of {flash['dd_mib']} MiB of the model under it: {cell(flash['measured_mib_s'], '.1f')} MiB/s"
                 if flash.get("capped") else f"none ({flash.get('why', 'flash-limit did not cap')})"),
             f"- model: `{a.model}`; each replica `{shlex.join(setup['replica_cmd'])}`",
             f"- memory limit per replica: {setup['memory']}",
             f"- the replicas' cgroups (from /proc): {setup['cgroups']}",
             f"- store: `{setup['store']}`; HAProxy: `{CONFIG.relative_to(REPO)}` as the repository has it, "
             f"BMOE_MAXCONN={a.parallel}, an admin socket added (`set server replicas/r2 state maint` for phase a)",
             f"- workload per phase: {a.clients} clients × {a.conversations} conversation(s) × {a.turns} turns, "
             f"{a.tokens} tokens a turn (greedy), streamed with include_usage; every turn sends the whole history "
             "(a system prompt with tools shared by all, the task, each answer and a tool result of 40 words); "
             "each replica warmed with one 2-turn conversation first (not measured)",
             "- tok/s = generated tokens ÷ the phase's wall time (first request sent to last answer ended); "
             "cached % = the later turns' `usage.prompt_tokens_details.cached_tokens` ÷ their prompt tokens", ""]
    if ratio is not None:
        lines += [f"**Two replicas with affinity: {ratio:.2f}× one replica's tokens/s** (acceptance ≥ 1.7: "
                  f"{'holds' if ratio >= 1.7 else 'does not hold'}).", ""]
    if "b" in by and a.cap_mib:
        rates = [f"{n} read {cell(d['disk_mib_s'], '.0f')} MiB/s of its {a.cap_mib} MiB/s cap (its disk busy "
                 f"{cell(d['disk_mib_s'] and 100 * d['disk_mib_s'] / a.cap_mib, '.0f')} % of the phase) at "
                 f"{cell(d['cpu_pct'], '.0f')} % of a core" for n, d in by["b"]["replicas"].items() if d]
        busy = by["b"]["machine_busy_pct"]
        cores = (f"the machine's cores {busy:.0f} % busy: " + ("not the bound" if busy < 75 else "near their bound"))
        lines += [f"In phase b {'; '.join(rates)}; {cores}. A replica reads the experts the model's router asks "
                  "for when it asks, so its disk idles while it computes: at its cap it is busy less than the whole "
                  "phase even where nothing else bounds it.", ""]
    if a.quick:
        lines += ["**A `--quick` smoke run**: two caps of 1000 MiB/s pass the disk's own rate and the cores bound it; "
                  "its ratios mean nothing.", ""]
    if "b" in by and "c" in by:
        lines += [f"**Prompt tokens of later turns the KV held: {cell(by['b']['later_turns_cached_pct'], '.1f')} % "
                  f"with affinity, {cell(by['c']['later_turns_cached_pct'], '.1f')} % without.**", ""]
    lines += ["## Phases", "",
              "| phase | what | wall s | requests ok / cut / failed / resent | tokens | tok/s | first text s (median) "
              "| later turns cached % | answered by r1 / r2 | conversations on one replica | machine CPU % |",
              "|---|---|---:|---|---:|---:|---:|---:|---|---|---:|"]
    for p in phases:
        lines.append(f"| {p['phase']} | {p['what']} | {p['wall_s']:.0f} | {p['ok']} / {p['cut']} / {p['failed']} / "
                     f"{p['resent']} | {p['generated_tokens']} | **{cell(p['tok_s'])}** | "
                     f"{cell(p['first_text_s_median'], '.1f')} | {cell(p['later_turns_cached_pct'], '.1f')} | "
                     f"{p['by_replica']['r1']} / {p['by_replica']['r2']} | {p['conversations_on_one_replica']} | "
                     f"{p['machine_busy_pct']:.0f} |")
    lines += ["", "## Each replica per phase (its /metrics and its processes)", "",
              "expert MiB read while decoding: bmoe_read_bytes_total (a prefill's reads are not in it); disk MiB: "
              "what the replica's processes read from the block device (/proc/PID/io: prefills too), and its rate "
              "over the phase's wall time, against the cap; CPU %: of one core, the server and its lanes.", "",
              "| phase | replica | generated | prompt tokens prefilled | prompt tokens cached "
              "| expert MiB read decoding | disk MiB read | disk MiB/s | stall s | CPU % |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in phases:
        for n, d in p["replicas"].items():
            if d:
                lines.append(f"| {p['phase']} | {n} | {d['generated']:.0f} | {d['prefilled']:.0f} | "
                             f"{d['prompt_cached']:.0f} | {d['expert_read_mib']:.0f} | {d['disk_read_mib']:.0f} | "
                             f"{cell(d['disk_mib_s'], '.1f')} | {d['stall_s']:.1f} | {cell(d['cpu_pct'], '.0f')} |")
    lines += ["", "## HAProxy's counters per phase", "",
              "stot: requests sent to it; wretr: retries; wredis: redispatches to another replica; econ / eresp: "
              "connection and response errors; srv_abrt: answers the replica broke off.", "",
              "| phase | server | stot | wretr | wredis | econ | eresp | srv_abrt | 5xx | status at end |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for p in phases:
        for sv, c in p["haproxy"].items():
            lines.append(f"| {p['phase']} | {sv} | {c['stot']} | {c['wretr']} | {c['wredis']} | {c['econ']} | "
                         f"{c['eresp']} | {c['srv_abrt']} | {c['hrsp_5xx']} | {c['status_end']} |")
    if "d" in by and "kill" in by["d"]:
        d, k = by["d"], by["d"]["kill"]
        lines += ["", "## The SIGKILL (phase d)", "",
                  f"- r2's server process was SIGKILLed at {k['at_s']:.1f} s, as soon as it streamed its first text "
                  f"in the phase; HAProxy's check saw it DOWN {k['haproxy_down_after_s']:.1f} s later",
                  f"- streams cut: {len(k['streams_cut'])}; each client sent its turn again: {d['resent']} resent, "
                  f"{d['resent_ok']} answered",
                  f"- requests lost (failed before any answer began): {k['failed_without_answer']}",
                  f"- HAProxy retried {d['haproxy']['BACKEND']['wretr']} and redispatched "
                  f"{d['haproxy']['BACKEND']['wredis']} request(s) (backend counters)",
                  f"- answered after the kill: by r1 {k['answered_by_r1_after_kill']}, by r2 "
                  f"{k['answered_by_r2_after_kill']}",
                  f"- r2's I/O lanes still running after it: {k['lanes_left'] or 'none'}", "",
                  "What each cut client saw:", ""]
        lines += [f"- client {x['client']} turn {x['turn']} on {x['replica']}, after {x['chunks']} chunk(s): "
                  f"`{x['error']}`" for x in k["streams_cut"]] or ["- none"]
    return "\n".join(lines) + "\n"


def write_requests(path: Path, phases: list[dict]) -> None:
    rows = [asdict(x) for p in phases for x in p["asked"]]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[k for k in Asked.__dataclass_fields__ if k != "text"], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


# ---- the command line --------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for README.md, results.json, requests.csv, logs/")
    p.add_argument("-m", "--model", type=Path, default=None,
                   help="GGUF (default: the 64-expert demo model, built when missing)")
    p.add_argument("--phases", default="a,b,c,d", help="which of a,b,c,d to run, in that order (default all)")
    p.add_argument("--clients", type=int, default=4, help="client threads, each one conversation at a time (4)")
    p.add_argument("--conversations", type=int, default=3,
                   help="conversations each client holds per phase, one after another: each starts on the least "
                        "busy replica and keeps to it (3)")
    p.add_argument("--turns", type=int, default=3, help="turns of each conversation (3)")
    p.add_argument("--tokens", type=int, default=24, help="max_tokens of each turn (24)")
    p.add_argument("--cap-mib", type=int, default=20,
                   help="each replica's read cap, MiB/s; 0 = none (20: a replica on demo64 reads 25-30 MiB/s uncapped "
                        "at -t 1 on the 2-core VM, so 60 did not bind there, bench/reports/2026-12-06-replicas)")
    p.add_argument("--cache-mb", type=int, default=4800,
                   help="each replica's --cache-mb (4800 of the demo's 5164 MiB of experts: a turn's prefill, which "
                        "routes to nearly every expert, still reads the rest)")
    p.add_argument("--mem-limit-mb", type=int, default=None,
                   help="each replica's memory cgroup (default --cache-mb + 1200); 0 = none")
    p.add_argument("--parallel", type=int, default=None, help="each replica's --parallel and HAProxy's maxconn "
                   "(default --clients: every conversation keeps its KV sequence even on one replica)")
    p.add_argument("--batching", default="turns", choices=("turns", "batch", "auto"),
                   help="each replica's --batching (turns: one request decodes at a time)")
    p.add_argument("--ctx", type=int, default=2048, help="each replica's -c (2048)")
    p.add_argument("--io-threads", type=int, default=2, help="each replica's --io-threads (2)")
    p.add_argument("--server-args", default="", help="more bmoe-server flags for both replicas")
    p.add_argument("--store", choices=("auto", "redis", "sqlite"), default="auto",
                   help="the shared --response-store (auto: redis when redis-server and its client are there)")
    p.add_argument("--port-base", type=int, default=0,
                   help="PORT: the router, PORT+1 and PORT+2: r1 and r2, PORT+3: HAProxy's stats, PORT+4: Redis "
                        "(default: free ports)")
    p.add_argument("--flash-limit", type=Path, default=FLASH_LIMIT, help=f"the read cap tool ({FLASH_LIMIT})")
    p.add_argument("--bw-mb", type=float, default=256, help="MiB read to measure the disk's own rate (256)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--quick", action="store_true",
                   help="a smoke run of a few minutes: 2 clients, 2 turns, 8 tokens, cap 1000 MiB/s (two such "
                        "caps may pass the disk's own rate: the ratio means nothing), --cache-mb 3000")
    a = p.parse_args(argv)
    if a.quick:
        a.clients, a.conversations, a.turns, a.tokens, a.cap_mib, a.cache_mb, a.bw_mb = 2, 1, 2, 8, 1000, 3000, 64
    a.phases = [x for x in a.phases.split(",") if x]
    if not a.phases or any(x not in PHASES for x in a.phases) or a.phases != sorted(set(a.phases)):
        p.error(f"--phases: some of {','.join(PHASES)}, in that order (got {','.join(a.phases)})")
    for name in ("clients", "conversations", "turns", "tokens"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be at least 1")
    if a.cap_mib < 0 or a.cache_mb < 0:
        p.error("--cap-mib and --cache-mb are 0 or more")
    a.parallel = a.parallel or a.clients
    a.mem_limit_mb = a.cache_mb + 1200 if a.mem_limit_mb is None else a.mem_limit_mb
    if a.model is not None and not a.model.is_file():
        p.error(f"no model at {a.model}")
    if a.store == "auto":
        a.store = "redis" if shutil.which("redis-server") and _has_redis() else "sqlite"
    a.out = a.out.resolve()
    return a


def _has_redis() -> bool:
    try:
        import redis  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if shutil.which("haproxy") is None:
        raise SystemExit("replicas: HAProxy is not installed (apt-get install haproxy)")
    a.model = (a.model or demo_build.built_path(64, 8)).resolve()
    flash = check_flash_limit(a)
    note(f"flash-limit: {flash}")
    logs = a.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(130))
    base = a.port_base
    ports = ({"router": base, "r1": base + 1, "r2": base + 2, "stats": base + 3, "store": base + 4} if base else
             {k: free_port() for k in ("router", "r1", "r2", "stats", "store")})
    facts = machine(a)
    note(f"disk: {facts['disk_mib_s']:.0f} MiB/s uncapped; {facts['cores']} cores, {facts['cpu']}")
    cg_h = bench_sys.find_cgroup() if a.mem_limit_mb else None
    memory = "none (--mem-limit-mb 0)" if not a.mem_limit_mb else "none: no memory cgroup hierarchy here"
    if cg_h is not None:
        try:
            bench_sys.probe_cgroup(cg_h)
            memory = f"{a.mem_limit_mb} MiB, a cgroup v{cg_h.version} of its own (under {cg_h.parent})"
        except bench_sys.LimitError as e:  # the machine does not allow it: run without, and say why
            cg_h, memory = None, f"none: {e}"
    note(f"memory limit per replica: {memory}")
    folder = Path(tempfile.mkdtemp(prefix="bmoe-replicas-"))
    store = router = None
    replicas: dict[str, Replica] = {}
    phases: list[dict] = []
    t0 = time.monotonic()
    try:
        store = Store(a.store, folder, ports["store"], logs / "store.log")
        bench_sys.drop_file_cache([a.model])  # cold: the lanes read experts from the disk, under the caps
        for n in NAMES:
            note(f"starting {n} on port {ports[n]}")
            replicas[n] = Replica(n, ports[n], a, store.url, logs, cg_h)
        router = Router({n: ports[n] for n in NAMES}, ports["router"], ports["stats"], a.parallel, folder,
                        logs / "haproxy.log")
        router.until(dict.fromkeys(NAMES, "UP"))
        note("warming each replica's cache (one conversation each, not measured)")
        warm_up(a, replicas)
        setup = {"replica_cmd": replicas["r1"].cmd, "memory": memory, "store": store.url,
                 "cgroups": {n: r.cgroups() for n, r in replicas.items()}, "ports": ports}
        for phase in a.phases:
            phases.append(run_phase(phase, a, replicas, router, t0))
    finally:
        if router is not None:
            router.stop()
        for r in replicas.values():
            (logs / f"{r.name}.log").write_text("".join(r.lines))
            r.stop()
        if store is not None:
            store.stop()
        shutil.rmtree(folder, ignore_errors=True)
    write_requests(a.out / "requests.csv", phases)
    results = {"argv": argv, "machine": facts, "flash_limit": flash, "setup": setup,
               "phases": [{k: v for k, v in p.items() if k != "asked"} for p in phases]}
    (a.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (a.out / "README.md").write_text(report(a, argv, facts, flash, setup, phases))
    note(f"wrote {a.out / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
