"""What do concurrent requests get from bmoe-server? 1, 2, 4 and 8 clients, each sending one request
with its own prompt, against the same requests served one after another.

For each batching mode a fresh `bmoe-server --parallel 8 --batching MODE` is started (in a fresh
memory cgroup when --mem-limit-mb is given); it answers a short warm-up request per prompt, then the requests one
after another (the sequential baseline, which is the same for every mode: one at a time), then
each level of concurrency. Requests are streamed with the official `openai` client; a request's
time to first token is to its first text chunk, its latency to its last chunk. MiB read per
generated token, stall and hit rate come from each response's `bmoe` telemetry (a batched step's
reads are shared among its tokens). Answers are compared with the same prompt's sequential answer
(greedy): how often a request served concurrently answers differently from alone.

    python bench/serve_concurrency.py -m demo64.gguf --preload --out a.md                       # regime (a)
    python bench/serve_concurrency.py -m demo64.gguf --cache-mb 1300 --mem-limit-mb 2500 --out b.md  # (b)

Progress goes to stderr, the Markdown report to --out (and stdout).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

PROMPTS = [
    "Write a story about a dragon who learns to bake bread.",
    "Explain how a steam engine works, step by step.",
    "What were the main causes of the French Revolution?",
    "Describe a walk through a forest in autumn.",
    "Write a letter to a friend about moving to a new city.",
    "How do bees make honey, and why do they need so much of it?",
    "Tell me about the history of the printing press.",
    "Write a short poem about the sea at night.",
]


def note(msg: str) -> None:
    print(f"serve_concurrency: {msg}", file=sys.stderr, flush=True)


@dataclass
class Answer:
    prompt: int
    text: str
    ttft_s: float
    latency_s: float
    tokens: int
    read_mib: float
    stall_s: float
    hit_pct: float


class Server:
    def __init__(self, args: list[str], limit_mb: float | None, name: str) -> None:
        cmd = [sys.executable, "-m", "bmoe.server", "--port", "0", *args]
        self.cgroup = None
        if limit_mb:
            from bmoe.tools import bench_sys

            h = bench_sys.find_cgroup()
            if h is None:
                raise SystemExit("--mem-limit-mb needs a cgroup hierarchy with the memory controller")
            self.cgroup = bench_sys.Cgroup(h, f"{bench_sys.CGROUP_PREFIX}{os.getpid()}-{name}", int(limit_mb * 2**20))
            cmd = self.cgroup.wrap(cmd)
        from bmoe.tools import bench_sys

        started = bench_sys.ServerProcess(cmd)
        self.proc, self.url, self.lines = started.proc, started.url, started.lines
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=3600)

    def ask(self, i: int, n: int) -> Answer:
        t0 = time.perf_counter()
        first = None
        parts: list[str] = []
        stream = self.client.completions.create(model="x", prompt=PROMPTS[i], max_tokens=n, stream=True)
        stats = None
        for chunk in stream:
            text = chunk.choices[0].text if chunk.choices else ""
            if text and first is None:
                first = time.perf_counter() - t0
            parts.append(text)
            extra = getattr(chunk, "model_extra", None) or {}
            if extra.get("bmoe") and "completion_tokens" in extra["bmoe"]:
                stats = extra["bmoe"]
        latency = time.perf_counter() - t0
        s = stats or {}
        tokens = int(s.get("completion_tokens", 0))
        return Answer(i, "".join(parts), first if first is not None else latency, latency, tokens,
                      float(s.get("read_mib", 0.0)), float(s.get("stall_s_per_token", 0.0)) * tokens,
                      float(s.get("cache_hit_pct", -1.0)))

    def steps(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics").text
        out = {}
        for m in re.finditer(r'^bmoe_decode_steps\{mode="(\w+)"\} (\S+)$', text, re.M):
            out[m.group(1)] = float(m.group(2))
        return out

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)
        if self.cgroup is not None:
            self.cgroup.remove()


def concurrent(server: Server, clients: int, n: int) -> tuple[float, list[Answer]]:
    out: list[Answer | None] = [None] * clients
    go = threading.Barrier(clients)

    def one(i: int) -> None:
        go.wait()
        out[i] = server.ask(i, n)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, [a for a in out if a is not None]


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, round(q * (len(v) - 1)))]


def row(label: str, wall: float, answers: list[Answer], base_wall: float | None, alone: dict[int, str],
        steps: str) -> str:
    tokens = sum(a.tokens for a in answers)
    hit = [(a.hit_pct, a.tokens) for a in answers if a.hit_pct >= 0 and a.tokens]
    differ = sum(a.text != alone.get(a.prompt, a.text) for a in answers)
    ratio = f"{base_wall / wall:.2f}" if base_wall else "–"
    return (f"| {label} | {tokens / wall:.2f} | {ratio} | {sum(a.read_mib for a in answers) / max(1, tokens):.1f} | "
            f"{sum(a.stall_s for a in answers) / max(1, tokens):.3f} | "
            f"{(sum(h * t for h, t in hit) / sum(t for _, t in hit) if hit else float('nan')):.1f} | "
            f"{pct([a.latency_s for a in answers], .5):.1f} / {pct([a.latency_s for a in answers], .95):.1f} | "
            f"{pct([a.ttft_s for a in answers], .5):.2f} / {pct([a.ttft_s for a in answers], .95):.2f} | "
            f"{differ}/{len(answers)} | {steps} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--modes", default="batch,turns,auto")
    ap.add_argument("-n", "--tokens", type=int, default=64)
    ap.add_argument("--cache-mb", default=None)
    ap.add_argument("--preload", action="store_true")
    ap.add_argument("--mem-limit-mb", type=float, default=None)
    ap.add_argument("--io-threads", default="4")
    ap.add_argument("-t", "--threads", default="2")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    levels = [int(c) for c in a.clients.split(",")]
    most = max(levels)
    if most > len(PROMPTS):
        raise SystemExit(f"at most {len(PROMPTS)} clients (one prompt each)")
    flags = ["-m", a.model, "--parallel", str(most), "--queue", str(most), "--io-threads", a.io_threads,
             "-t", a.threads, "-c", "1024"]
    if a.cache_mb:
        flags += ["--cache-mb", a.cache_mb]
    if a.preload:
        flags += ["--preload"]
    lines = [f"`{' '.join(['bmoe-server', *flags])} --batching MODE`"
             + (f" in a {a.mem_limit_mb:g} MiB memory cgroup" if a.mem_limit_mb else "") + f"; {a.tokens} tokens "
             "per request; a level of C clients sends the first C prompts at once.", "",
             "| run | aggregate tok/s | × one after another | MiB / gen token | stall s / gen token | hit % | "
             "latency p50 / p95 s | TTFT p50 / p95 s | answers ≠ alone | steps batch / turns |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode in a.modes.split(","):
        note(f"starting bmoe-server --batching {mode}")
        server = Server([*flags, "--batching", mode], a.mem_limit_mb, mode)
        try:
            for i in range(most):  # warm-up: each prompt once, a few tokens (first touches of the model's pages)
                server.ask(i, 4)
            for n, c in enumerate(levels):
                pair: dict[str, tuple[float, list[Answer], str]] = {}
                # the same c requests one after another, and at once; which goes first alternates
                for how in (("alone", "together") if n % 2 == 0 else ("together", "alone")):
                    if how == "alone" and c == 1:
                        continue
                    note(f"{mode}: {c} clients, {how}")
                    before = server.steps()
                    if how == "alone":
                        got = [server.ask(i, a.tokens) for i in range(c)]
                        wall = sum(x.latency_s for x in got)
                    else:
                        wall, got = concurrent(server, c, a.tokens)
                    after = server.steps()
                    pair[how] = wall, got, "/".join(f"{after.get(k, 0) - before.get(k, 0):.0f}"
                                                    for k in ("batch", "turns"))
                base = pair.get("alone", pair["together"])
                alone = {x.prompt: x.text for x in base[1]}
                if c > 1:
                    lines.append(row(f"{mode}, {c} one after another", base[0], base[1], None, alone, "–"))
                wall, got, steps = pair["together"]
                lines.append(row(f"**{mode}, {c} at once**", wall, got, base[0] if c > 1 else None, alone, steps))
        finally:
            server.stop()
    report = "\n".join(lines) + "\n"
    if a.out:
        a.out.write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
