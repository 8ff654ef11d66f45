"""Does a long prompt survive a restart? Time to first token after a restart, with and without
--prompt-cache, on the 64-expert demo model under a memory limit.

Each round, three processes in turn, each in a fresh cgroup of --mem-limit-mb and with the model's
and the cache's pages dropped first: `plain` (no prompt cache), `keep` (an empty cache folder: it
prefills and keeps the system prompt) and `restart` (a new process on that folder: it loads the
prefix instead of prefilling it). Each loads the model with bmoe.load and answers one chat, a
~2000-token system prompt and a short question; TTFT is the generation's prefill_s (from its
start to its first token: cache lookup, load and the tail's prefill included), the answer must be
byte-identical across all three. After the rounds, a truncated cache file must be ignored with a
notice (same answer), and the folder must stay within --prompt-cache-mb.

    .venv/bin/python bench/prompt_cache_restart.py --out bench/reports/DATE-prompt-cache [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
QUESTION = "In one sentence: what is the first rule above?"


def child(a: argparse.Namespace) -> int:
    """One process: load, answer one chat, print what it measured as JSON."""
    import bmoe

    notes: list[str] = []
    system = (REPO / "bench" / "prompts" / "prefill_2000.txt").read_text()
    kw = dict(n_ctx=4096, threads=2, io_threads=4, cache_mb=a.cache_mb, notice=notes.append)
    if a.dir:
        kw.update(prompt_cache=a.dir, prompt_cache_mb=a.cache_bound)
    t0 = time.perf_counter()
    with bmoe.load(a.model, **kw) as m:
        load_s = time.perf_counter() - t0
        text = m.chat([{"role": "system", "content": system}, {"role": "user", "content": QUESTION}],
                      max_tokens=a.n)
        s = m.stats.last
    print(json.dumps({"ttft_s": s.prefill_s, "prefill_tokens": s.prefill_tokens, "prompt_tokens": s.prompt_tokens,
                      "load_s": load_s, "text": text, "notes": notes}))
    return 0


def run(a: argparse.Namespace, label: str, folder: str | None, cg_parent: object) -> dict:
    from bmoe.tools import bench_sys

    paths = [Path(a.model), *(Path(folder).glob("*.kv") if folder else [])]
    bench_sys.drop_file_cache(paths)
    cmd = [sys.executable, __file__, "--child", "--model", a.model, "--cache-mb", str(a.cache_mb), "-n", str(a.n),
           "--cache-bound", str(a.prompt_cache_mb), *(["--dir", folder] if folder else [])]
    with bench_sys.Cgroup(cg_parent, f"bmoe-issue23-{label}-{time.monotonic_ns()}", int(a.mem_limit_mb * 2**20)) as cg:
        r = subprocess.run(cg.wrap(cmd), capture_output=True, text=True, timeout=3600)
        peak = cg.peak_bytes()
    if r.returncode != 0:
        raise SystemExit(f"{label} failed ({r.returncode}): {r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out.update(label=label, peak_cgroup_mib=peak / 2**20 if peak else None)
    print(f"{label}: ttft {out['ttft_s']:.2f} s, prefilled {out['prefill_tokens']}/{out['prompt_tokens']} tokens, "
          f"load {out['load_s']:.1f} s", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(Path.home() / ".cache/bmoe/smollm2-135m-moe-e64-k8-r2.gguf"))
    ap.add_argument("--mem-limit-mb", type=float, default=2500)
    ap.add_argument("--cache-mb", type=float, default=1300, help="the expert cache (default 1300)")
    ap.add_argument("--prompt-cache-mb", type=float, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=16, help="tokens of each answer (default 16)")
    ap.add_argument("--out", default=None, help="folder for results.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache-bound", type=float, default=512, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a)
    from bmoe.tools import bench_sys

    h = bench_sys.find_cgroup()
    if h is None:
        raise SystemExit("no memory cgroup here; this bench needs one for --mem-limit-mb")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bmoe-issue23-") as tmp:
        for rnd in range(a.rounds):
            folder = str(Path(tmp) / f"round{rnd}")
            rows.append([run(a, "plain", None, h), run(a, "keep", folder, h), run(a, "restart", folder, h)])
        texts = {r["text"] for row in rows for r in row}
        ratio = [row[2]["ttft_s"] / row[0]["ttft_s"] for row in rows]
        kv = sorted(Path(tmp, "round0").glob("*.kv"))
        folder_mib = sum(p.stat().st_size for p in kv) / 2**20
        with open(kv[0], "r+b") as f:  # a truncated file: ignored with a notice, the answer unchanged
            f.truncate(kv[0].stat().st_size // 3)
        cut = run(a, "truncated", str(Path(tmp, "round0")), h)
    summary = {
        "ttft_plain_s": statistics.median(r[0]["ttft_s"] for r in rows),
        "ttft_keep_s": statistics.median(r[1]["ttft_s"] for r in rows),
        "ttft_restart_s": statistics.median(r[2]["ttft_s"] for r in rows),
        "ratio_restart_over_plain": ratio, "ratio_median": statistics.median(ratio),
        "answers_identical": len(texts) == 1 and cut["text"] in texts,
        "truncated_notice": [n for n in cut["notes"] if "prompt cache" in n],
        "folder_mib": folder_mib, "bound_mib": a.prompt_cache_mb, "within_bound": folder_mib <= a.prompt_cache_mb,
        "prompt_tokens": rows[0][0]["prompt_tokens"], "restart_prefill_tokens": rows[0][2]["prefill_tokens"],
        "mem_limit_mb": a.mem_limit_mb, "cache_mb": a.cache_mb, "rounds": rows, "truncated": cut,
    }
    text = json.dumps(summary, indent=1)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "results.json").write_text(text)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("rounds", "truncated")}, indent=1))
    ok = summary["ratio_median"] <= 0.15 and summary["answers_identical"] and summary["within_bound"] \
        and summary["truncated_notice"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
