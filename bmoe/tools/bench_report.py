"""`bmoe-bench run`'s outputs: results.json, report.md, the tok/s chart and the summary table.

They only render what bench_run recorded and bench_numbers computed; nothing here measures.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

RESULTS = "results.json"
REPORT = "report.md"
SPEED_CHART = "tok_s.png"


def cell(x: float | None, fmt: str = ".2f", none: str = "–") -> str:
    """A table cell: the number in `fmt`, or `none` when it is missing."""
    return none if x is None else format(x, fmt)


def write_results(path: Path, meta: dict, records: list[dict], summary: list[dict] | None) -> None:
    """Replace results.json whole (write, then rename): an interrupted benchmark leaves a readable file."""
    doc = dict(meta, runs=records, summary=summary)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    tmp.replace(path)


def write_summary(out: Path, runs: list[dict], lines: list[str], summary: object = None) -> None:
    """A bench script's files: runs.json (every run), summary.json (when there is one), summary.md (`lines`,
    also printed)."""
    (out / "runs.json").write_text(json.dumps(runs, indent=1))
    if summary is not None:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def render_report(meta: dict, records: list[dict], summary: list[dict], chart: str | None) -> str:
    """report.md: the setting first (machine, model, limit, bandwidth), so no number is read without it."""
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
          f"- Python {m['python']}, llama-cpp-python {m['llama-cpp-python']}, bmoe {m['bmoe']}"
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
            L.append(f"| {t} | {cell(b, '.1f')} | {cell(a, '.1f')} | {cell(bw['used'][t], '.1f')} |")
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
          "token: the tok/s if reads were the only cost. Lanes busy % (with --overlap) = the lanes' "
          "busy time per token ÷ (lanes × s/token): below 100 % the flash idled part of each token, "
          "whatever the bandwidth probe says. Peak memory = RSS of the run's process tree "
          "(anonymous pages summed, file pages of its largest process) + its shared-memory cache segment, "
          f"sampled every {meta.get('sample_interval', 0.1):g} s, the largest over runs"
          + ("; cgroup peak = the cgroup's peak charge (includes page cache)."
             if (lim.get("method") or "").startswith("cgroup") else "."), "",
          "| config | flags | ok/runs | tok/s (median) | spread | s/token median | s/token p95 | MiB/token "
          "| steady MiB/token | hit % | stall s/token | lanes busy % | I/O-bound tok/s | peak MiB "
          "| cgroup peak MiB | tok/s vs mmap | s/token ÷ mmap |",
          "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    spec_rows = [s for s in summary if s["spec_mib_per_token"] is not None or s["spec_recall_pct"] is not None]
    limits = [s for s in summary if s["overlap_limit_tok_s"] is not None]
    first = [s for s in summary if s["ttft_s_median"] is not None]
    for s in summary:
        spread = "–" if s["tok_s_min"] is None else f"{s['tok_s_min']:.2f}–{s['tok_s_max']:.2f}"
        if s["tok_s_q1"] is not None:
            spread += f" (IQR {s['tok_s_q1']:.2f}–{s['tok_s_q3']:.2f})"
        iob = cell(s["io_bound_tok_s"])
        if s["io_bound_tok_s"] is not None:
            iob += f" ({s['bw_threads']} thr)"
        where = f" (from `{s['checkout']}`)" if s.get("checkout") else ""
        L.append(f"| {s['config']} | `{shlex.join(s['flags']) or ' '}`{where} | {s['ok_runs']}/{s['runs']} | "
                 f"{cell(s['tok_s_median'])} | {spread} | {cell(s['s_per_token_median'], '.4f')} | "
                 f"{cell(s['s_per_token_p95'], '.4f')} | {cell(s['mib_per_token'])} | "
                 f"{cell(s['steady_mib_per_token'])} | {cell(s['cache_hit_pct'], '.1f')} | "
                 f"{cell(s['stall_s_per_token'], '.4f')} | {cell(s['lanes_busy_pct'], '.0f')} | {iob} | "
                 f"{cell(s['peak_mem_mib'], '.0f')} | "
                 f"{cell(s['peak_cgroup_mib'], '.0f')} | "
                 f"{'–' if s['speedup_vs_mmap'] is None else format(s['speedup_vs_mmap'], '.2f') + '×'} | "
                 f"{cell(s['s_per_token_vs_mmap'], '.3f')} |")
    L.append("")
    if first:
        L += ["### Time to first token", "",
              "From each run's CSV `# summary` (medians over runs): TTFT = load + prefill, the time from the "
              "start of the model load to the first token's logits (Python's start-up before the load is not "
              "in it); load = llama.cpp's model load and context plus bmoe's start-up (warm-up capture, slab, "
              "I/O lanes, cache sizing), bmoe load = the part that is not llama.cpp's; prefill tok/s = prompt "
              "tokens ÷ prefill s. The load reads the model file from wherever the page cache before each run "
              "left it (see Memory limit above).", "",
              "| config | prompt tokens | TTFT s | TTFT ÷ mmap | prefill s | prefill tok/s | load s | bmoe load s |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for s in first:
            L.append(f"| {s['config']} | {cell(s['prefill_tokens'], '.0f')} | {cell(s['ttft_s_median'], '.3f')} | "
                     f"{cell(s['ttft_vs_mmap'], '.3f')} | {cell(s['prefill_s_median'], '.3f')} | "
                     f"{cell(s['prefill_tok_s_median'], '.1f')} | {cell(s['load_s_median'], '.3f')} | "
                     f"{cell(s['bmoe_load_s_median'], '.3f')} |")
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
            L.append(f"| {s['config']} | {cell(s['tok_s_median'])} | {cell(ref_s['tok_s_median'])} | "
                     f"{cell(s['io_bound_tok_s'])} | {cell(s['overlap_limit_tok_s'])}"
                     f" | {cell(s['pct_of_limit'], '.1f')} |")
        L.append("")
    if spec_rows:
        L += ["### Speculative reads", "",
              "Speculative MiB/token = flash read ahead of demand (temporal prefetch and spec-gate), a part of "
              "MiB/token; useful % = experts read ahead that a later routing used; recall % = the spec-gate's "
              "predicted experts that the layer then routed.", "",
              "| config | speculative MiB/token | useful % | spec-gate recall % | governor fired |",
              "|---|---:|---:|---:|---:|"]
        for s in spec_rows:
            L.append(f"| {s['config']} | {cell(s['spec_mib_per_token'])} | {cell(s['useful_pct'], '.1f')} | "
                     f"{cell(s['spec_recall_pct'], '.1f')} | {s['spec_disabled_runs']}/{s['ok_runs']} |")
        L.append("")
    if chart:
        L += [f"![tok/s per configuration]({chart})", ""]
    elif meta.get("chart_note"):
        L += [f"_{meta['chart_note']}_", ""]
    L += ["## Runs", "", "In the order they ran (logs in `runs/`).", "",
          "| # | phase | round | config | exit | tok/s | TTFT s | s/token p95 | MiB/token | hit % | peak MiB | "
          "load 1m | s |", "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        L.append(f"| {r['index']} | {r['phase']} | {r['round']} | {r['config']} | {r['exit_status']} | "
                 f"{cell(r['tok_s'])} | {cell(r['ttft_s'], '.3f')} | {cell(r['s_per_token_p95'], '.4f')} | "
                 f"{cell(r['mib_per_token'])} | "
                 f"{cell(r['cache_hit_pct'], '.1f')} | {cell(r.get('peak_mem_mib'), '.0f')} | "
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


NO_MATPLOTLIB = "chart skipped: matplotlib is not installed (pip install 'bmoe[bench]')"


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or None when matplotlib is not installed
    (charts are optional: the bench extra brings it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_speed_chart(path: Path, summary: list[dict]) -> str | None:
    """A bar chart of median tok/s (min–max whiskers); returns a notice when skipped."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
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


def print_summary(summary: list[dict]) -> None:
    """The results table on stdout, for a look before opening report.md."""
    print(f"{'config':<16} {'tok/s':>8} {'min–max':>15} {'s/tok':>8} {'MiB/tok':>9} {'hit%':>6} "
          f"{'I/O-bound':>10} {'peak MiB':>9} {'vs mmap':>8} {'TTFT s':>7} {'TTFT÷mmap':>9}")
    for s in summary:
        spread = "–" if s["tok_s_min"] is None else f"{s['tok_s_min']:.2f}–{s['tok_s_max']:.2f}"
        print(f"{s['config']:<16} {cell(s['tok_s_median']):>8} {spread:>15} {cell(s['s_per_token_median'], '.4f'):>8} "
              f"{cell(s['mib_per_token']):>9} "
              f"{cell(s['cache_hit_pct'], '.1f'):>6} {cell(s['io_bound_tok_s']):>10} "
              f" {cell(s['peak_mem_mib'], '.0f'):>9} "
              f"{cell(s['speedup_vs_mmap']):>8} {cell(s['ttft_s_median'], '.3f'):>7} "
              f"{cell(s['ttft_vs_mmap'], '.3f'):>9}")
