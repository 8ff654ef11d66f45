"""What the runs measured: one run's numbers from its output, and each configuration's medians,
spread and limits.

bmoe-cli's output is read with bmoe.base.telemetry, the one parser of the telemetry contract; this
module only does arithmetic on what it returns.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from bmoe.base import MiB, telemetry
from bmoe.tools.bench_config import BASELINE_NAME, Config, io_threads_of, overlap_of

RUN_KEYS = ("tokens", "tok_s", "s_per_token", "s_per_token_median", "s_per_token_p95", "p95_source",
            "steady_mib_per_token", "mib_read", "mib_per_token", "stall_s_per_token", "cache_hit_pct",
            "cache_resident_mib", "spec_mib_per_token", "useful_pct", "spec_recall_pct", "spec_disabled",
            "prefill_tokens", "prefill_s", "prefill_tok_s", "load_s", "bmoe_load_s", "ttft_s", "io_s_per_token",
            "drafted", "accepted", "draft_extra_mib")


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile (numpy's default method)."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _float(x: float | None) -> float | None:
    return None if x is None else float(x)


def run_numbers(stdout: str, csv_text: str | None = None, skip_tokens: int = 0, stderr: str = "") -> dict:
    """Numbers from one `bmoe-cli` run: its summary lines and, when given, its per-token CSV.

    Keys: RUN_KEYS (None when absent); p95_source is 'csv' or 'summary'. The CSV-based numbers
    (median, p95, steady MiB/token) leave out the first `skip_tokens` tokens when more tokens than
    that exist. The time to first token and its parts come from the CSV's `# summary` (None for a
    bmoe-cli too old to write them): ttft_s = load_s + prefill_s (the first token is sampled from
    the prefill's logits), bmoe_load_s = load_s − llama.cpp's own load.
    """
    out: dict = dict.fromkeys(RUN_KEYS)
    summary = telemetry.parse_run_summary(stdout, stderr)
    gen = summary.get("generation")
    if gen:
        s_tok = float(gen["s_per_token"])
        out.update(tokens=gen["tokens"], s_per_token=s_tok, tok_s=float(gen["tok_s"]),
                   s_per_token_median=s_tok, s_per_token_p95=s_tok, p95_source="summary",
                   drafted=gen["drafted"], accepted=gen["accepted"], draft_extra_mib=_float(gen["draft_extra_mib"]))
    stream = summary.get("moe-stream")
    if stream:
        out.update(mib_read=float(stream["read_mib"]), mib_per_token=float(stream["mib_per_token"]),
                   stall_s_per_token=_float(stream["stall_s_per_token"]),
                   io_s_per_token=float(stream["io_s_per_token"]))
    cache = summary.get("moe-cache")
    if cache:
        out.update(cache_hit_pct=float(cache["hit_pct"]), cache_resident_mib=float(cache["resident_mib"]))
    pre = summary.get("moe-prefetch")
    if pre and out["tokens"]:
        out.update(spec_mib_per_token=float(pre["speculative_mib"]) / out["tokens"],
                   useful_pct=100.0 * pre["useful"] / pre["prefetched"] if pre["prefetched"] else None)
    spec = summary.get("moe-spec-gate")
    if spec:
        out.update(spec_recall_pct=float(spec["recall_pct"]), spec_disabled=spec["disabled_below_pct"] is not None)
    if csv_text:
        rows, csv_sum = telemetry.read_csv(csv_text)
        out.update(_first_token(csv_sum))
        rows = [r for r in rows if "wall_ms" in r]
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


def _first_token(csv_sum: dict[str, float]) -> dict:
    """What the first token waited for, from a `# summary` line's keys (those present)."""
    out: dict = {}
    n, prefill, load, llama_load = (csv_sum.get(k) for k in ("prefill_tokens", "prefill_s", "load_s", "llama_load_s"))
    if prefill is not None:
        out["prefill_s"] = prefill
        if n is not None:
            out["prefill_tokens"] = int(n)
            if prefill > 0:
                out["prefill_tok_s"] = n / prefill
    if load is not None:
        out["load_s"] = load
        if prefill is not None:
            out["ttft_s"] = load + prefill
        if llama_load is not None:
            out["bmoe_load_s"] = load - llama_load
    return out


def median_of(xs: list) -> float | None:
    """The median of the values that are there (None left out); None when none is."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def bandwidth_for(bw: dict[int, float], threads: int) -> tuple[int, float] | None:
    """The measured (thread count, MiB/s) closest to `threads` (ties: fewer threads)."""
    if not bw:
        return None
    k = min(bw, key=lambda t: (abs(t - threads), t))
    return k, bw[k]


def summarize(configs: list[Config], records: list[dict], bw: dict[int, float],
              compute_ref: str | None = None, common: Sequence[str] = ()) -> list[dict]:
    """Per-configuration medians; with `compute_ref` (a run with every expert resident) also each
    streaming configuration's overlap limit, 1 / max(compute s/token, MiB per token ÷ bandwidth)."""
    out: list[dict[str, Any]] = []
    for c in configs:
        runs = [r for r in records if r["config"] == c.name and r["phase"] == "measure"]
        ok = [r for r in runs if r["ok"]]
        tps = [r["tok_s"] for r in ok]
        s: dict[str, Any] = {"config": c.name, "flags": c.flags, "checkout": str(c.checkout) if c.checkout else None,
             "runs": len(runs), "ok_runs": len(ok),
             "tok_s_median": median_of(tps), "tok_s_min": min(tps) if tps else None,
             "tok_s_max": max(tps) if tps else None,
             "tok_s_q1": percentile(tps, 25) if len(tps) >= 4 else None,
             "tok_s_q3": percentile(tps, 75) if len(tps) >= 4 else None,
             "s_per_token_median": median_of([r["s_per_token_median"] for r in ok]),
             "s_per_token_p95": median_of([r["s_per_token_p95"] for r in ok]),
             "mib_per_token": median_of([r["mib_per_token"] for r in ok]),
             "steady_mib_per_token": median_of([r["steady_mib_per_token"] for r in ok]),
             "cache_hit_pct": median_of([r["cache_hit_pct"] for r in ok]),
             "stall_s_per_token": median_of([r["stall_s_per_token"] for r in ok]),
             "peak_mem_mib": max((r["peak_mem_mib"] for r in runs if r.get("peak_mem_mib") is not None),
                                 default=None),
             "peak_cgroup_mib": max((r["peak_cgroup_mib"] for r in runs
                                     if r.get("peak_cgroup_mib") is not None), default=None),
             "spec_mib_per_token": median_of([r.get("spec_mib_per_token") for r in ok]),
             "useful_pct": median_of([r.get("useful_pct") for r in ok]),
             "spec_recall_pct": median_of([r.get("spec_recall_pct") for r in ok]),
             "spec_disabled_runs": sum(1 for r in ok if r.get("spec_disabled")),
             "prefill_tokens": median_of([r.get("prefill_tokens") for r in ok]),
             "ttft_s_median": median_of([r.get("ttft_s") for r in ok]),
             "prefill_s_median": median_of([r.get("prefill_s") for r in ok]),
             "prefill_tok_s_median": median_of([r.get("prefill_tok_s") for r in ok]),
             "load_s_median": median_of([r.get("load_s") for r in ok]),
             "bmoe_load_s_median": median_of([r.get("bmoe_load_s") for r in ok]),
             "io_threads": None, "lanes_busy_pct": None,
             "bw_threads": None, "bw_mib_s": None, "io_bound_tok_s": None,
             "overlap_limit_tok_s": None, "pct_of_limit": None,
             "speedup_vs_mmap": None, "s_per_token_vs_mmap": None, "ttft_vs_mmap": None}
        if "--no-stream" not in c.flags:
            s["io_threads"] = io_threads_of([*common, *c.flags])  # a configuration's flag wins
            if overlap_of([*common, *c.flags]):  # flash I/O is then the lanes' busy time
                s["lanes_busy_pct"] = median_of([100.0 * r["io_s_per_token"] / (s["io_threads"] * r["s_per_token"])
                                            for r in ok if r.get("io_s_per_token") is not None
                                            and r.get("s_per_token")])
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
    if base and base["ttft_s_median"]:
        for s in out:
            if s["ttft_s_median"] is not None:
                s["ttft_vs_mmap"] = s["ttft_s_median"] / base["ttft_s_median"]
    return out
