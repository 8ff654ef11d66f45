"""Does bmoe-server stay whole through a long day of mixed traffic with faults arriving in it?

Starts a real `bmoe-server` (the 16-expert demo model unless -m; `--parallel 2 --queue 8 --batching
turns --spec-gate`, a prompt cache and a usage-profile folder each on a small tmpfs, the whole
server in a memory cgroup) and drives it for --minutes with a seeded mix of clients: chat and
completions, streamed and not, forced tool calls, json_schema, short and long prompts, a shared
system prompt (the prompt cache), clients that disconnect mid-stream or give up on a whole answer,
and bursts past the queue. Faults come on a schedule after a calm first sixth of the run:

    stop-gate      SIGSTOP the spec-gate for a while, then SIGCONT (it is dropped for not answering)
    kill-lane      SIGKILL one I/O lane (it is replaced)
    squeeze        the cgroup's memory limit lowered by a third, then raised back
    disk-full      the prompt cache's filesystem filled to the last byte, then emptied again
    usage-ro       the usage-profile folder made read-only, until shutdown (the profile is saved at exit)

Every few seconds it samples each server process's RSS, descriptors and threads, bmoe's shared
memory, the cache budget (/metrics) and /health's latency; a greedy probe (temperature 0, the same
chat every time) runs before, during and after each fault and must answer byte-identically
(`--batching turns` decodes each sequence alone, so a probe's answer does not depend on who else is
decoding). At the end the server gets SIGTERM and must leave no process and no shared memory behind.

    python bench/soak.py --minutes 30 --out bench/reports/DATE-soak          # the benchmark
    python bench/soak.py --seconds 10 --out /tmp/soak                          # the suite's smoke

The report (DIR/report.md, charts beside it) has the request ledger (sent = answered + refused with
a reason + disconnected by the client; failed must be 0), latency percentiles per kind, each
resource's drift (its level after the last fault against the level at the end of the calm start),
the faults and probes, and a verdict line per acceptance check. Exit status 0 when every check holds.
Progress goes to stderr. Faults this machine cannot stage (no root for tmpfs, no writable memory
cgroup) are skipped and the report says why.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bmoe.demo import build as demo_build  # noqa: E402
from bmoe.shm_cache import segments_of  # noqa: E402
from bmoe.tools import bench_sys  # noqa: E402

DEMO16 = demo_build.default_path()  # the 16-expert demo, where bmoe keeps it (honours $XDG_CACHE_HOME)
TEMPLATE = REPO / "tests" / "data" / "templates" / "chatml-tools.jinja"  # the demo's own has no tools
LONG_S = 600  # runs at least this long judge the drift of RSS (shorter ones end inside the warm-up)
FAULTS = ("stop-gate", "kill-lane", "squeeze", "disk-full", "usage-ro")
SYSTEM = ("You are a careful assistant for a shipping company. Answer in short sentences, name the port and "
          "the day, and never promise a delivery time you cannot keep. ") * 6  # shared: the prompt cache keeps it
WORDS = ("river stone king winter market lantern harbour garden letter bridge forest candle engine mountain clock "
         "painter sailor village storm silver").split()
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "port", "schema": {
    "type": "object", "properties": {"port": {"type": "string", "maxLength": 12}, "day": {"type": "integer"}},
    "required": ["port", "day"], "additionalProperties": False}}}
PROBE = {"messages": [{"role": "user", "content": "Name three rivers and one thing about each."}],
         "max_tokens": 16, "temperature": 0, "bmoe": {"lossless": True}}


def note(msg: str) -> None:
    print(f"soak: {msg}", file=sys.stderr, flush=True)


# ---- the ledger -------------------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str
    start: float  # seconds since the run began
    seconds: float
    outcome: str  # answered, refused, disconnected (by the client, on purpose), failed
    status: int | None
    reason: str = ""


@dataclass
class Ledger:
    rows: list[Outcome] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, row: Outcome) -> None:
        with self.lock:
            self.rows.append(row)

    def count(self, outcome: str) -> int:
        return sum(r.outcome == outcome for r in self.rows)


def _reason(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])[:120]
    except (ValueError, KeyError, TypeError):
        return r.text[:120]


# ---- the clients ------------------------------------------------------------------------------------


class Traffic:
    """Seeded client threads sending the mix, plus a burst past the queue now and then."""

    KINDS = ("chat", "chat-stream", "completion", "completion-stream", "tools", "json-schema", "long-prompt",
             "shared-system", "disconnect-mid-stream", "give-up")

    def __init__(self, url: str, seed: int, clients: int, max_tokens: int, t0: float, ledger: Ledger,
                 stop: threading.Event) -> None:
        self.url, self.seed, self.clients, self.max_tokens, self.t0 = url, seed, clients, max_tokens, t0
        self.ledger, self.stop = ledger, stop
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> None:
        for t in self.threads:
            t.join()

    def _client(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        with httpx.Client(base_url=self.url, timeout=httpx.Timeout(600, connect=10)) as h:
            while not self.stop.is_set():
                kind = rng.choice(self.KINDS)
                self.send(h, kind, rng)
                if rng.random() < 0.05:
                    self.burst(rng)

    def burst(self, rng: random.Random) -> None:
        """More requests at once than the server queues: some must be refused with 429, none lost."""
        n = 12
        kinds = [rng.choice(("chat", "completion")) for _ in range(n)]
        seeds = [rng.randrange(1 << 30) for _ in range(n)]

        def one(k: str, s: int) -> None:
            with httpx.Client(base_url=self.url, timeout=httpx.Timeout(600, connect=10)) as h:
                self.send(h, k, random.Random(s), burst=True)

        ts = [threading.Thread(target=one, args=(k, s), daemon=True) for k, s in zip(kinds, seeds)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    def body(self, kind: str, rng: random.Random) -> tuple[str, dict]:
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        n = rng.randint(4, self.max_tokens)
        if kind.startswith("completion"):
            return "/v1/completions", {"prompt": f"A story about {words}:", "max_tokens": n,
                                       "temperature": rng.choice((0, 0.8)), "seed": rng.randrange(1000)}
        msgs = [{"role": "user", "content": f"Tell me about {words}."}]
        body: dict = {"messages": msgs, "max_tokens": n, "temperature": rng.choice((0, 0.8)),
                      "seed": rng.randrange(1000)}
        if kind == "tools":
            body.update(tools=[TOOL], tool_choice="required", max_tokens=2 * self.max_tokens)
        elif kind == "json-schema":
            body.update(response_format=SCHEMA, max_tokens=2 * self.max_tokens)
        elif kind == "long-prompt":
            msgs[0]["content"] = " ".join(rng.choice(WORDS) for _ in range(900)) + " Summarise."
        elif kind == "shared-system":
            body["messages"] = [{"role": "system", "content": SYSTEM}, *msgs]
        return "/v1/chat/completions", body

    def send(self, h: httpx.Client, kind: str, rng: random.Random, burst: bool = False) -> None:
        path, body = self.body(kind, rng)
        streamed = kind.endswith("stream") or kind == "disconnect-mid-stream"
        body["stream"] = streamed
        label = f"burst-{kind}" if burst else kind
        t = time.monotonic()
        try:
            if kind == "give-up":  # the client stops waiting for a whole answer
                try:
                    r = h.post(path, json={**body, "max_tokens": 5 * self.max_tokens},
                               timeout=httpx.Timeout(rng.uniform(0.3, 2.0)))
                except httpx.TimeoutException:
                    self.ledger.add(Outcome(label, t - self.t0, time.monotonic() - t, "disconnected", None))
                    return
            elif streamed:
                with h.stream("POST", path, json=body) as r:
                    if r.status_code == 200:
                        cut = rng.randint(2, 6) if kind == "disconnect-mid-stream" else None
                        chunks, done = 0, False
                        for line in r.iter_lines():
                            chunks += line.startswith("data: {")
                            if "error" in line and line.startswith("data: {") and '"error"' in line:
                                raise RuntimeError(f"an error inside the stream: {line[:160]}")
                            if line == "data: [DONE]":
                                done = True
                            if cut is not None and chunks >= cut:
                                break
                        if cut is not None and not done:
                            self.ledger.add(Outcome(label, t - self.t0, time.monotonic() - t, "disconnected", 200))
                            return
                        if not done:
                            raise RuntimeError("the stream ended without [DONE]")
                    else:
                        r.read()
            else:
                r = h.post(path, json=body)
            self.classify(label, t, r)
        except Exception as e:  # noqa: BLE001 - every failure is the ledger's to count
            self.ledger.add(Outcome(label, t - self.t0, time.monotonic() - t, "failed", None,
                                    f"{type(e).__name__}: {e}"[:160]))

    def classify(self, label: str, t: float, r: httpx.Response) -> None:
        took = time.monotonic() - t
        if r.status_code == 200:
            self.ledger.add(Outcome(label, t - self.t0, took, "answered", 200))
        elif r.status_code in (429, 503) or 400 <= r.status_code < 500:
            self.ledger.add(Outcome(label, t - self.t0, took, "refused", r.status_code, _reason(r)))
        else:
            self.ledger.add(Outcome(label, t - self.t0, took, "failed", r.status_code, _reason(r)))


# ---- the server and what it is made of ---------------------------------------------------------------


@dataclass
class Stage:
    """What the faults work on: tmpfs folders, the cgroup, the server."""

    root: Path
    cache_dir: Path
    usage_dir: Path
    mounted: list[Path] = field(default_factory=list)
    cgroup: bench_sys.Cgroup | None = None
    why_not: dict[str, str] = field(default_factory=dict)  # fault → why it cannot be staged here

    @classmethod
    def make(cls, limit_mb: int) -> Stage:
        root = Path(tempfile.mkdtemp(prefix="bmoe-soak-"))
        s = cls(root, root / "prompt-cache", root / "usage")
        for d, size in ((s.cache_dir, "96m"), (s.usage_dir, "8m")):
            d.mkdir()
            if os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)],
                                                    capture_output=True).returncode == 0:
                s.mounted.append(d)
        if s.cache_dir not in s.mounted:
            s.why_not["disk-full"] = "no tmpfs for the prompt cache (mount needs root)"
        if s.usage_dir not in s.mounted:
            s.why_not["usage-ro"] = "no tmpfs for the usage folder (root ignores permission bits; mount needs root)"
        h = bench_sys.find_cgroup()
        try:
            if h is None:
                raise bench_sys.LimitError("no memory cgroup hierarchy")
            s.cgroup = bench_sys.Cgroup(h, f"{bench_sys.CGROUP_PREFIX}{os.getpid()}-soak", limit_mb << 20)
        except bench_sys.LimitError as e:
            s.why_not["squeeze"] = f"no writable memory cgroup ({e})"
        return s

    def remove(self) -> None:
        for d in self.mounted:
            subprocess.run(["umount", str(d)], capture_output=True)
        if self.cgroup is not None:
            self.cgroup.remove()
        subprocess.run(["rm", "-rf", str(self.root)], capture_output=True)


class Server(bench_sys.ServerProcess):
    def __init__(self, model: Path, stage: Stage, args: list[str]) -> None:
        cmd = [sys.executable, "-m", "bmoe.server", "-m", str(model), "--port", "0", "--parallel", "2",
               "--queue", "8", "--batching", "turns", "--spec-gate", "--prompt-cache", str(stage.cache_dir),
               "--prompt-cache-mb", "64", "--usage-dir", str(stage.usage_dir), "--chat-template-file",
               str(TEMPLATE), "-t", "2", "--io-threads", "2", *args]
        super().__init__(stage.cgroup.wrap(cmd) if stage.cgroup is not None else cmd, cwd=REPO, new_session=True,
                         wait_s=900)

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def worker(self, module: str) -> psutil.Process | None:
        for p in self.tree()[1:]:
            try:
                if module in " ".join(p.cmdline()):
                    return p
            except psutil.Error:
                continue
        return None

    def segments(self) -> list[Path]:
        return segments_of(self.proc.pid)


# ---- samples ----------------------------------------------------------------------------------------


@dataclass
class Sample:
    t: float
    rss_mib: float  # the server's own process, shared memory aside
    tree_rss_mib: float  # every process of the tree, shared memory aside
    shm_mib: float
    fds: int
    threads: int
    budget_mib: float
    health_s: float
    processes: int


def sample(server: Server, t0: float) -> Sample:
    procs = server.tree()
    rss = tree = 0.0
    fds = threads = 0
    for i, p in enumerate(procs):
        try:
            kb = bench_sys.status_kb(p.pid)
            r = (kb.get("RssAnon", 0) + kb.get("RssFile", 0)) / 1024  # shared memory aside: the slab counts once
            tree += r
            rss = r if i == 0 else rss
            fds += p.num_fds()
            threads += p.num_threads()
        except (psutil.Error, OSError):
            continue
    shm = bench_sys.shm_bytes({server.proc.pid}) / 2**20
    t = time.monotonic()
    try:
        httpx.get(server.url + "/health", timeout=30).raise_for_status()
        health = time.monotonic() - t
    except httpx.HTTPError:
        health = float("inf")
    budget = float("nan")
    try:
        m = re.search(r"^bmoe_cache_budget_bytes (\S+)$", httpx.get(server.url + "/metrics", timeout=30).text, re.M)
        budget = float(m.group(1)) / 2**20 if m else budget
    except httpx.HTTPError:
        pass
    return Sample(t - t0, rss, tree, shm, fds, threads, budget, health, len(procs))


def sample_every(server: Server, t0: float, every: float, out: Run, stop: threading.Event) -> None:
    """The sampler's thread: a sample every `every` seconds while the traffic runs."""
    while not stop.is_set():
        s = sample(server, t0)
        out.samples.append(s)
        note(f"{s.t:7.1f} s  rss {s.rss_mib:.0f} MiB (tree {s.tree_rss_mib:.0f}), shm {s.shm_mib:.0f} MiB, "
             f"fds {s.fds}, health {s.health_s * 1000:.0f} ms, {len(out.ledger.rows)} requests")
        stop.wait(every)


# ---- faults -----------------------------------------------------------------------------------------


@dataclass
class Fault:
    name: str
    start: float
    end: float
    detail: str = ""


def schedule(total: float, names: list[str]) -> list[tuple[str, float, float]]:
    """(fault, start, end) in seconds: a calm first sixth, then the faults one after another, each for
    a share of the middle of the run, then calm again for the last third (usage-ro lasts to the end)."""
    first, last = total / 6, total * 2 / 3
    step = (last - first) / max(len(names), 1)
    out = []
    for i, name in enumerate(names):
        start = first + i * step
        out.append((name, start, total if name == "usage-ro" else start + step * 0.6))
    return out


class Faults:
    def __init__(self, server: Server, stage: Stage, limit_mb: int) -> None:
        self.server, self.stage, self.limit_mb = server, stage, limit_mb
        self.stopped: psutil.Process | None = None
        self.filler = stage.cache_dir / "soak-filler"
        self.squeezing = threading.Event()  # set: the squeeze is over
        self.reached = limit_mb << 20  # the lowest limit the squeeze got to
        self.lowest: list[int] = []  # each squeeze's

    def begin(self, name: str) -> str:
        if name == "kill-lane":
            lane = self.server.worker("bmoe.workers.io_lane")
            if lane is None:
                return "no lane found"
            lane.send_signal(signal.SIGKILL)
            return f"SIGKILL lane pid {lane.pid}"
        if name == "stop-gate":
            gate = self.server.worker("bmoe.workers.spec_gate")
            if gate is None:
                return "no spec-gate running (it may have been dropped already)"
            gate.send_signal(signal.SIGSTOP)
            self.stopped = gate
            return f"SIGSTOP spec-gate pid {gate.pid}"
        if name == "squeeze":
            self.squeezing.clear()
            threading.Thread(target=self._squeeze, daemon=True).start()
            return f"memory limit {self.limit_mb} → {self.limit_mb * 2 // 3} MiB, stepped down"
        if name == "disk-full":
            with open(self.filler, "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * (1 << 20))
                        f.flush()
                except OSError:
                    pass
            return f"prompt-cache filesystem full ({self.filler.stat().st_size >> 20} MiB of filler)"
        if name == "usage-ro":
            subprocess.run(["mount", "-o", "remount,ro", str(self.stage.usage_dir)], check=True)
            return "usage folder remounted read-only"
        raise ValueError(name)

    def _squeeze(self) -> None:
        """Lower the limit to two thirds. cgroup v1 refuses a limit below what it cannot reclaim
        (EBUSY: shared memory without swap), so the limit goes down in steps to just above the charge,
        and bmoe, seeing less room, gives cache pages back, until the target holds or the fault ends."""
        cg = self.stage.cgroup
        assert cg is not None
        target = (self.limit_mb * 2 // 3) << 20
        while not self.squeezing.is_set():
            try:
                cg.set_limit(target)
                self.reached = target
                return
            except OSError:
                used = cg.usage_bytes() or target
                step = max(target, used + (64 << 20))
                if step < cg.limit_bytes:
                    try:
                        cg.set_limit(step)
                    except OSError:
                        pass
                self.reached = cg.limit_bytes
            self.squeezing.wait(1.0)

    def end(self, name: str) -> None:
        if name == "stop-gate" and self.stopped is not None:
            try:
                self.stopped.send_signal(signal.SIGCONT)
            except psutil.Error:
                pass
        elif name == "squeeze":
            assert self.stage.cgroup is not None
            self.squeezing.set()
            self.lowest.append(self.reached)
            self.stage.cgroup.set_limit(self.limit_mb << 20)
        elif name == "disk-full":
            self.filler.unlink(missing_ok=True)
        elif name == "usage-ro":
            subprocess.run(["mount", "-o", "remount,rw", str(self.stage.usage_dir)], capture_output=True)


class Prober:
    """The greedy probe, asked for on a thread of its own so that a probe waiting in the queue never
    holds up the fault schedule: `ask(label)` queues one, `join` waits for every one asked."""

    def __init__(self, url: str, t0: float, out: list[tuple[float, str, str]]) -> None:
        self.url, self.t0, self.out = url, t0, out
        self.asked: queue.Queue[tuple[float, str] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def ask(self, label: str) -> None:
        self.asked.put((time.monotonic() - self.t0, label))

    def join(self) -> None:
        self.asked.put(None)
        self.thread.join()

    def _loop(self) -> None:
        with httpx.Client(timeout=900) as h:
            while (item := self.asked.get()) is not None:
                t, label = item
                try:
                    r = h.post(self.url + "/v1/chat/completions", json=PROBE)
                    r.raise_for_status()
                    answer = str(r.json()["choices"][0]["message"]["content"])
                except httpx.HTTPError as e:
                    answer = f"(no answer: {type(e).__name__}: {e})"
                self.out.append((t, label, answer))


def server_counts(url: str) -> dict[str, float]:
    """The server's own ledger (/metrics): answers by route and status, generations by how they ended."""
    text = httpx.get(url + "/metrics", timeout=60).text
    out = {}
    for m in re.finditer(r'^bmoe_requests_total\{route="([^"]+)",status="(\d+)"\} (\S+)$', text, re.M):
        out[f"{m.group(1)} {m.group(2)}"] = float(m.group(3))
    for m in re.finditer(r'^bmoe_generations_total\{finish_reason="(\w+)"\} (\S+)$', text, re.M):
        out[f"generations {m.group(1)}"] = float(m.group(2))
    return out


# ---- the run ----------------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


@dataclass
class Run:
    args: argparse.Namespace
    ledger: Ledger = field(default_factory=Ledger)
    samples: list[Sample] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    probes: list[tuple[float, str, str]] = field(default_factory=list)  # (t, when, answer)
    exit_code: int | None = None
    leftover_segments: list[str] = field(default_factory=list)
    leftover_processes: list[int] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    stderr_tail: list[str] = field(default_factory=list)
    server_counts: dict[str, float] = field(default_factory=dict)  # /metrics: answers by route and status, ends


def run(a: argparse.Namespace) -> Run:
    total = a.seconds if a.seconds else a.minutes * 60
    out = Run(a)
    stage = Stage.make(a.limit_mb)
    server: Server | None = None
    stop = threading.Event()
    try:
        server = Server(a.model, stage, a.server_args.split())
        note(f"serving at {server.url}; {total:.0f} s of traffic, seed {a.seed}")
        t0 = time.monotonic()
        prober = Prober(server.url, t0, out.probes)
        prober.ask("start")
        faults = Faults(server, stage, a.limit_mb)
        wanted = [f for f in (a.faults.split(",") if a.faults else FAULTS) if f]
        out.skipped = {f: stage.why_not[f] for f in wanted if f in stage.why_not}
        plan = schedule(total, [f for f in wanted if f not in out.skipped])
        traffic = Traffic(server.url, a.seed, a.clients, a.max_tokens, t0, out.ledger, stop)
        traffic.start()
        active: dict[str, Fault] = {}
        sampler = threading.Thread(target=sample_every, args=(server, t0, a.sample_s, out, stop), daemon=True)
        sampler.start()
        while (now := time.monotonic() - t0) < total:
            for name, start, end in plan:
                if name not in active and start <= now and not any(f.name == name for f in out.faults):
                    try:
                        detail = faults.begin(name)
                    except OSError as e:
                        detail = f"could not be staged: {e}"
                    f = Fault(name, now, end, detail)
                    active[name] = f
                    out.faults.append(f)
                    note(f"{now:7.1f} s  fault {name}: {f.detail}")
                    prober.ask(f"during {name}")
                if name in active and end <= now and name != "usage-ro":
                    faults.end(name)
                    f = active.pop(name)
                    f.end = now
                    if name == "squeeze":
                        f.detail += f"; the lowest it held: {faults.lowest[-1] >> 20} MiB"
                    note(f"{now:7.1f} s  fault {name} over")
                    prober.ask(f"after {name}")
            stop.wait(0.2)
        stop.set()
        traffic.join()
        sampler.join()
        prober.ask("end")
        prober.join()
        out.server_counts = server_counts(server.url)
        out.samples.append(sample(server, t0))
    finally:
        stop.set()
        if server is not None:
            pid = server.proc.pid
            server.proc.send_signal(signal.SIGTERM)
            try:
                out.exit_code = server.proc.wait(120)
            except subprocess.TimeoutExpired:
                bench_sys.kill_group(server.proc)
                out.exit_code = None
            out.stderr_tail = server.lines[-15:]
            _, alive = psutil.wait_procs([p for p in psutil.process_iter() if _from(p, pid)], timeout=30)
            out.leftover_processes = [p.pid for p in alive]
            out.leftover_segments = [p.name for p in server.segments()]
        stage.remove()
    return out


def _from(p: psutil.Process, root: int) -> bool:
    """A process the server started that outlived it (its session id is the server's pid)."""
    try:
        return os.getsid(p.pid) == root and p.pid != root
    except (OSError, psutil.Error):
        return False


# ---- the report -------------------------------------------------------------------------------------


def checks(r: Run, total: float) -> list[tuple[str, bool, str]]:
    rows, samples = r.ledger.rows, r.samples
    calm = [s for s in samples if s.t <= total / 6] or samples[:1]
    last_end = max((f.end for f in r.faults if f.name != "usage-ro"), default=total / 6)
    after = [s for s in samples if s.t >= last_end] or samples[-1:]
    base, late = calm[-1].rss_mib, statistics.median(s.rss_mib for s in after)
    health = [s.health_s for s in samples]
    answers = {a for _, _, a in r.probes}
    refused_without_reason = [x for x in rows if x.outcome == "refused" and not x.reason]
    return [
        ("no crash: the server answered /health throughout and ended on SIGTERM as it should (exit 143)",
         all(h != float("inf") for h in health) and r.exit_code == 143, f"exit {r.exit_code}"),
        ("no request lost: each ended answered, refused with a reason, or disconnected by its client",
         r.ledger.count("failed") == 0 and not refused_without_reason,
         f"{len(rows)} sent = {r.ledger.count('answered')} answered + {r.ledger.count('refused')} refused + "
         f"{r.ledger.count('disconnected')} disconnected + {r.ledger.count('failed')} failed"),
        ("no shared memory or process left after shutdown", not r.leftover_segments and not r.leftover_processes,
         f"segments {r.leftover_segments}, processes {r.leftover_processes}"),
        ("the server's RSS (shared memory aside) after the last fault within 10 % of its level after the calm start",
         abs(late - base) <= 0.10 * base or total < LONG_S,
         f"{base:.0f} → {late:.0f} MiB ({(late - base) / base * 100:+.1f} %)"
         + (" — not judged: a run under 10 minutes is still warming up" if total < LONG_S else "")),
        ("/health p99 under 1 s", pct(health, 99) < 1.0, f"p99 {pct(health, 99) * 1000:.0f} ms, "
                                                        f"max {max(health) * 1000:.0f} ms over {len(health)} samples"),
        ("greedy probe answers byte-identical before, during and after every fault",
         len(answers) == 1 and len(r.probes) == 2 + sum(2 if f.name != "usage-ro" else 1 for f in r.faults),
         f"{len(r.probes)} probes for {len(r.faults)} faults, {len(answers)} distinct answer(s)"),
    ]


def charts(r: Run, out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    t = [s.t / 60 for s in r.samples]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    axes[0].plot(t, [s.rss_mib for s in r.samples], label="server RSS")
    axes[0].plot(t, [s.tree_rss_mib for s in r.samples], label="tree RSS (lanes, spec-gate)")
    axes[0].plot(t, [s.shm_mib for s in r.samples], label="bmoe shared memory")
    axes[0].plot(t, [s.budget_mib for s in r.samples], label="cache budget", linestyle="--")
    axes[0].set_ylabel("MiB")
    axes[1].plot(t, [s.fds for s in r.samples], label="open descriptors")
    axes[1].plot(t, [s.threads for s in r.samples], label="threads")
    axes[2].plot(t, [s.health_s * 1000 for s in r.samples], label="/health latency")
    axes[2].set_ylabel("ms")
    axes[2].set_xlabel("minutes")
    for ax in axes:
        for f in r.faults:
            ax.axvspan(f.start / 60, f.end / 60, alpha=0.12, color="red")
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle("bmoe-server soak: resources over time (faults shaded)")
    fig.tight_layout()
    fig.savefig(out / "resources.png", dpi=90)
    plt.close(fig)
    return ["resources.png"]


def report(r: Run, out: Path) -> tuple[str, bool]:
    a = r.args
    total = a.seconds if a.seconds else a.minutes * 60
    out.mkdir(parents=True, exist_ok=True)
    results = checks(r, total)
    ok = all(passed for _, passed, _ in results)
    lines = [f"# bmoe-server soak, {total / 60:.1f} minutes", "",
             f"`python bench/soak.py {' '.join(sys.argv[1:])}` — model {a.model.name}, seed {a.seed}, "
             f"{a.clients} clients, memory limit {a.limit_mb} MiB, {len(r.samples)} samples every {a.sample_s} s.", "",
             "## Verdict", "", "| check | holds | measured |", "|---|---|---|"]
    lines += [f"| {name} | {'yes' if passed else '**no**'} | {what} |" for name, passed, what in results]
    lines += ["", "## Ledger", "", "| kind | sent | answered | refused | disconnected | failed | p50 s | p90 s | "
              "p99 s | max s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    kinds = sorted({x.kind for x in r.ledger.rows})
    for k in kinds:
        rows = [x for x in r.ledger.rows if x.kind == k]
        done = [x.seconds for x in rows if x.outcome == "answered"]
        c = {o: sum(x.outcome == o for x in rows) for o in ("answered", "refused", "disconnected", "failed")}
        lines.append(f"| {k} | {len(rows)} | {c['answered']} | {c['refused']} | {c['disconnected']} | {c['failed']} | "
                     f"{pct(done, 50):.2f} | {pct(done, 90):.2f} | {pct(done, 99):.2f} | "
                     f"{max(done, default=float('nan')):.2f} |")
    reasons: dict[str, int] = {}
    for x in r.ledger.rows:
        if x.outcome in ("refused", "failed"):
            key = f"{x.outcome} {x.status}: {x.reason}"
            reasons[key] = reasons.get(key, 0) + 1
    if reasons:
        lines += ["", "Refusals and failures by reason:", ""]
        lines += [f"- {n} × {why}" for why, n in sorted(reasons.items(), key=lambda kv: -kv[1])]
    if r.server_counts:
        lines += ["", "The server's own count (/metrics before shutdown; a client's disconnect shows as a 499 for a "
                  "whole answer it gave up on, or a cancelled generation for a stream it left):", "",
                  "| what | count |", "|---|---:|"]
        lines += [f"| {k} | {v:.0f} |" for k, v in sorted(r.server_counts.items())]
    lines += ["", "## Faults", "", "| fault | from s | to s | what |", "|---|---:|---:|---|"]
    lines += [f"| {f.name} | {f.start:.0f} | {f.end:.0f} | {f.detail} |" for f in r.faults]
    lines += [f"| {name} | — | — | skipped: {why} |" for name, why in r.skipped.items()]
    lines += ["", "## Probes (greedy, the same chat each time)", "", "| asked at s | when | answer |", "|---:|---|---|"]
    lines += [f"| {t:.0f} | {when} | {json.dumps(ans)[:80]} |" for t, when, ans in sorted(r.probes)]
    if r.samples:
        first, last = r.samples[0], r.samples[-1]
        lines += ["", "## Resources (first sample → last before shutdown)", "",
                  "| measure | first | last | max |", "|---|---:|---:|---:|"]
        for label, get in (("server RSS MiB", lambda s: s.rss_mib), ("tree RSS MiB", lambda s: s.tree_rss_mib),
                           ("shared memory MiB", lambda s: s.shm_mib), ("descriptors", lambda s: s.fds),
                           ("threads", lambda s: s.threads), ("processes", lambda s: s.processes),
                           ("cache budget MiB", lambda s: s.budget_mib)):
            lines.append(f"| {label} | {get(first):.0f} | {get(last):.0f} | {max(get(s) for s in r.samples):.0f} |")
    for png in charts(r, out):
        lines += ["", f"![{png}]({png})"]
    lines += ["", "## The server's last lines", "", "```", *[x.rstrip() for x in r.stderr_tail], "```", ""]
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    (out / "ledger.json").write_text(json.dumps([vars(x) for x in r.ledger.rows], indent=0))
    return text, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, default=DEMO16)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--seconds", type=float, default=0, help="the run's length in seconds (overrides --minutes)")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=40, help="the most a request asks for (a tool call or a "
                    "schema twice that); the probe asks for 16")
    ap.add_argument("--limit-mb", type=int, default=3000, help="the cgroup's memory limit (squeeze lowers it a third)")
    ap.add_argument("--faults", default="", help=f"comma-separated, of {', '.join(FAULTS)} (default: all)")
    ap.add_argument("--sample-s", type=float, default=3.0)
    ap.add_argument("--server-args", default="", help="more bmoe-server flags")
    ap.add_argument("--out", type=Path, required=True, help="folder for report.md, ledger.json and the charts")
    a = ap.parse_args()
    if not a.model.exists():
        raise SystemExit(f"soak: no model at {a.model} (build the demo with bmoe-demo, or pass -m)")
    text, ok = report(run(a), a.out)
    print(text)
    note(f"report in {a.out / 'report.md'}: {'every check holds' if ok else 'a check FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
