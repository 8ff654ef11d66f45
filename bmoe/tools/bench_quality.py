"""`bmoe-bench quality`: what a lossy setting costs, measured on the user's own model and text.

The lossless reference (bmoe streaming with the common flags alone, byte-identical to plain
llama.cpp) and each `--config NAME='FLAGS'` score the same text, teacher-forced token by token
through the decode path (bmoe.tools.bench_quality_run), one process per (round, configuration),
round-robin, each from a cold page cache under the memory limit, as `bmoe-bench run` runs them
(bmoe.tools.bench_run). Per configuration: the KL divergence of each next-token distribution from
the reference's (mean, p99, max), top-1 agreement and perplexity, defined as `llama-perplexity
--kl-divergence` defines them; how many tokens greedy generations from a few prompts keep
identical to the reference's before the first difference; and from the same runs tok/s, MiB read
per token, cache hit % and what the lossy modes did (drops, substitutions, weight changed).

The reference is first run once, unmeasured, to write its log-probabilities (phase `reference`:
writing them costs time a scored run does not spend, so its speed would not compare); its measured
runs are then scored against that one like every configuration: KL 0 and 100 % agreement, or the
harness (or the decode) is not deterministic, which the report says.

Outputs in --out: results.json, report.md, quality.png (tok/s against mean KL), the text scored,
and runs/ (each run's output, CSV and scores, and the reference's log-probabilities).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import statistics
from pathlib import Path

import numpy as np

from bmoe.base import nonneg_int, positive_int
from bmoe.tools import bench_config, bench_numbers, bench_report, bench_run
from bmoe.tools.bench_config import Config
from bmoe.tools.quality_text import PROMPTS, TEXT

REFERENCE = "lossless"
QUALITY_CHART = "quality.png"
ENTRY = "bmoe.tools.bench_quality_run"

QUALITY_EXAMPLES = """\
examples:
  # the price of each lossy mode on the demo model, under a 2500 MiB limit
  bmoe-bench quality -m model.gguf --mem-limit-mb 2500 --common '--cache-mb 1300 --io-threads 4 -t 2' \\
      --config k6='--experts-per-token 6' --config cold10='--drop-cold 0.1' --config cr20='--cache-routing 0.2'

  # your own text, fewer tokens, one round
  bmoe-bench quality -m model.gguf -f my-text.txt -n 256 --repeats 1 --config k4='--experts-per-token 4'

The reference ('lossless': the common flags alone) runs once first, unmeasured, to write its
log-probabilities, then first in every round like a configuration; the text's first
--context tokens are the prompt, the next -n tokens are scored one decode step each.
"""


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    q = sub.add_parser(
        "quality", epilog=QUALITY_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
        help="what lossy settings cost: KL, top-1 agreement, perplexity and speed against the lossless reference",
        description="Score a text teacher-forced through the decode path with the lossless reference and each "
                    "configuration (round-robin, cold page cache, optional memory limit): KL divergence, top-1 "
                    "agreement and perplexity as llama-perplexity --kl-divergence defines them, greedy generations "
                    "kept identical, and tok/s, MiB/token and hit %; write report.md, results.json and a chart of "
                    "speed against KL.")
    q.add_argument("-m", "--model", required=True, help="GGUF model (first shard of a split model)")
    q.add_argument("-f", "--file", dest="text", default=None,
                   help="the text to score (UTF-8; default: bmoe's own, bmoe/tools/quality_text.py)")
    q.add_argument("--context", type=positive_int, default=128,
                   help="tokens of the text prefilled before scoring starts (default 128)")
    q.add_argument("-n", "--n-predict", type=positive_int, default=512,
                   help="tokens scored, one decode step each (default 512)")
    q.add_argument("--gen-tokens", type=nonneg_int, default=48,
                   help="tokens of each greedy generation from the built-in prompts (default 48; 0 = none)")
    bench_config.add_plan_options(q, warmup=0, everyone="the reference")
    return q


# ---- the runs ----------------------------------------------------------------------------------------


def cmd_quality(a: argparse.Namespace, argv: list[str]) -> int:
    """Run the plan (bmoe-bench run's machinery, another entry point), then score and report."""
    if any(c.name == REFERENCE for c in a.config):
        raise bench_run.BenchError(f"configuration name {REFERENCE!r} is the built-in reference; choose another")
    text = TEXT if a.text is None else _read_text(a.text)
    # bmoe-bench run's options this command fixes: no prompt, the reference as the first configuration,
    # no baseline, no bandwidth probe, no compute reference
    a.prompt, a.file, a.no_baseline, a.compute_ref, a.skip_tokens = None, None, True, None, 0
    a.no_bandwidth, a.bw_mb, a.bw_threads = True, 0, []
    a.config = [Config(REFERENCE, []), *a.config]
    b = bench_run.prepare(a, argv)
    b.plan.insert(0, ("reference", 0, b.configs[0]))  # writes the log-probabilities; not measured
    text_path, ref_path = b.out / "text.txt", b.env.runs_dir / "reference"
    text_path.write_text(text, encoding="utf-8")
    shutil.rmtree(ref_path, ignore_errors=True)  # this benchmark's reference is its own first run
    b.env.entry = ENTRY
    prompts = list(PROMPTS) if a.gen_tokens else []
    b.env.prompt_args = ["--text", str(text_path), "--context", str(a.context), "--reference", str(ref_path),
                         "--gen-prompts", json.dumps(prompts), "--gen-tokens", str(a.gen_tokens)]
    b.meta.update(prompt_desc=("bmoe's own text (bmoe/tools/quality_text.py)" if a.text is None else f"`{a.text}`"),
                  context=a.context, gen_tokens=a.gen_tokens, prompts=prompts)
    bench_run.run_bench(b, a)
    speed = bench_numbers.summarize(b.configs, b.records, {}, None, a.common)
    rows = score(b.configs, b.records, b.env.runs_dir, speed)
    chart_note = write_quality_chart(b.out / QUALITY_CHART, rows)
    if chart_note:
        bench_run.say(chart_note)
    results, report = b.out / bench_report.RESULTS, b.out / bench_report.REPORT
    bench_report.write_results(results, b.meta, b.records, rows)
    report.write_text(render(b.meta, b.records, rows, None if chart_note else QUALITY_CHART))
    print_rows(rows)
    bench_run.say(f"wrote {report} and {results}")
    if b.interrupted:
        return 130
    return 0 if all(r["ok"] for r in b.records) else 1


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise bench_run.BenchError(f"cannot read the text {path}: {e}; give a UTF-8 text file") from None


# ---- the scores --------------------------------------------------------------------------------------


def scores_of(run: dict) -> dict:
    """One run's quality numbers from its per-token scores (llama-perplexity's definitions)."""
    kl = np.array(run["kl"], dtype=np.float64)
    nll = np.array(run["nll"], dtype=np.float64)
    return {"kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max()),
            "top1_pct": 100.0 * float(np.mean(run["same_top"])), "ppl": float(math.exp(nll.mean())),
            "scored": len(kl)}


def same_prefix(a: list[int], b: list[int]) -> int:
    """Tokens two generations share before their first difference."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _load(runs_dir: Path, rec: dict) -> dict | None:
    if not rec.get("csv_file"):
        return None
    path = runs_dir / (rec["csv_file"] + ".quality.json")
    return json.loads(path.read_text()) if path.exists() else None


def score(configs: list[Config], records: list[dict], runs_dir: Path, speed: list[dict]) -> list[dict]:
    """Per configuration: the speed medians (bench_numbers) with the quality medians over its measured runs."""
    runs = {r["index"]: _load(runs_dir, r) for r in records if r["ok"]}
    ref = next((q for q in runs.values() if q and q["reference"]), None)
    ref_gen = [g["ids"] for g in ref["generations"]] if ref else []
    base = next((s for s in speed if s["config"] == REFERENCE), None)
    out = []
    for c, sp in zip(configs, speed):
        qs = [q for r in records if r["config"] == c.name and r["phase"] == "measure"
              and (q := runs.get(r["index"])) is not None]
        compared = [q for q in qs if not q["reference"]]
        per = [scores_of(q) for q in compared]
        row = dict(sp, scored_runs=len(per))
        for k in ("kl_mean", "kl_p99", "kl_max", "top1_pct", "ppl"):
            row[k] = statistics.median(p[k] for p in per) if per else None
        row["ppl_all"] = statistics.median(scores_of(q)["ppl"] for q in qs) if qs else None
        keeps = [[same_prefix(g["ids"], want) for g, want in zip(q["generations"], ref_gen)] for q in compared]
        row["greedy_same_mean"] = statistics.median(statistics.mean(k) for k in keeps) if keeps and keeps[0] else None
        row["greedy_same_min"] = min(min(k) for k in keeps) if keeps and keeps[0] else None
        lossy = [q["stats"] for q in qs]
        for k in ("dropped_per_token", "substituted_per_token", "weight_changed_pct", "experts_per_token"):
            row[k] = statistics.median(s[k] for s in lossy) if lossy else None
        row["speedup"] = (sp["tok_s_median"] / base["tok_s_median"]
                          if base and base["tok_s_median"] and sp["tok_s_median"] else None)
        out.append(row)
    return out


# ---- the outputs -------------------------------------------------------------------------------------


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "–" if x is None else format(x, fmt)


def render(meta: dict, records: list[dict], rows: list[dict], chart: str | None) -> str:
    m, mo, lim = meta["machine"], meta["model"], meta["memory_limit"]
    n = meta["n_predict"]
    L = ["# bmoe-bench quality report", ""]
    if meta.get("interrupted"):
        L += ["**Interrupted**: partial results.", ""]
    L += ["## Command", "", "```", meta["command"], "```", "",
          f"Started {meta['started']}, finished {meta.get('finished', '?')}; {m['cores']} cores ({m['cpu']}), "
          f"{m['ram_mib']} MiB RAM; load average at start "
          f"{' / '.join(f'{x:.2f}' for x in m['loadavg_at_start'])}"
          + (f", at end {' / '.join(f'{x:.2f}' for x in m['loadavg_at_end'])}" if m.get("loadavg_at_end") else "")
          + f"; bmoe {m['bmoe']}" + (f" (git {m['bmoe_git']})" if m.get("bmoe_git") else "") + ".", "",
          f"Model `{Path(mo['path']).name}` ({mo['size_mib']:.0f} MiB, experts {mo['expert_mib']:.0f} MiB). "
          f"Memory limit: {lim['description']}. Page cache before each run: {meta['drop_desc']}. "
          f"Common flags: `{shlex.join(meta['common_flags'])}`.", "",
          f"Text: {meta['prompt_desc']}; its first {meta['context']} tokens are the prompt, the next {n} are "
          "scored, each decoded in its own step with the text's token (teacher forcing through bmoe's decode "
          "path). Definitions as `llama-perplexity --kl-divergence`: KL = Σ p_ref · (ln p_ref − ln p) over the "
          "reference's tokens with ln p_ref > −16, per scored token (mean, 99th percentile with linear "
          "interpolation, max); top-1 % = tokens whose most likely next token is the reference's; PPL = exp(mean "
          "−ln p(text token)). Greedy = tokens a greedy generation of "
          f"{meta['gen_tokens']} tokens from each of {len(meta['prompts'])} prompts keeps identical to the "
          "reference's before the first difference (median over runs of the mean over prompts; min over all). "
          f"Speed from the same runs' forced decode: medians over {meta['repeats']} round(s), configurations "
          "round-robin; × = tok/s over the reference's. Dropped / substituted = experts per token (over every "
          "layer); weight changed = mean share of a layer's routing weight not computed as the router chose "
          "(the --experts-per-token cut included).", "",
          "| config | flags | tok/s | spread | × | MiB/token | hit % | mean KL | p99 KL | max KL | top-1 % | PPL "
          "| greedy same (mean / min) | dropped/tok | substituted/tok | weight changed % |",
          "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        spread = "–" if r["tok_s_min"] is None else f"{r['tok_s_min']:.2f}–{r['tok_s_max']:.2f}"
        greedy = "–" if r["greedy_same_mean"] is None else f"{r['greedy_same_mean']:.1f} / {r['greedy_same_min']}"
        ppl = r["ppl"] if r["ppl"] is not None else r["ppl_all"]
        L.append(f"| {r['config']} | `{shlex.join(r['flags']) or ' '}` | {_f(r['tok_s_median'])} | {spread} | "
                 f"{_f(r['speedup'])} | {_f(r['mib_per_token'])} | {_f(r['cache_hit_pct'], '.1f')} | "
                 f"{_f(r['kl_mean'], '.5f')} | {_f(r['kl_p99'], '.4f')} | {_f(r['kl_max'], '.4f')} | "
                 f"{_f(r['top1_pct'], '.1f')} | {_f(ppl, '.3f')} | {greedy} | {_f(r['dropped_per_token'])} | "
                 f"{_f(r['substituted_per_token'])} | {_f(r['weight_changed_pct'])} |")
    L.append("")
    ref = next((r for r in rows if r["config"] == REFERENCE), None)
    if ref is not None:
        if ref["scored_runs"]:
            ok = ref["kl_max"] == 0 and ref["top1_pct"] == 100.0
            L += [f"The reference's measured runs against its unmeasured first: max KL {ref['kl_max']:g}, top-1 "
                  f"{ref['top1_pct']:.1f} % over {ref['scored_runs']} run(s): "
                  + ("the decode is deterministic and the harness scores a lossless run as lossless." if ok else
                     "**not zero: the harness or the decode is not deterministic; the other rows cannot be "
                     "trusted.**"), ""]
        else:
            L += ["No measured run of the reference was scored: the harness was not checked on its own "
                  "repeat.", ""]
    if chart:
        L += [f"![tok/s against mean KL]({chart})", ""]
    L += ["## Runs", "", "| # | phase | round | config | exit | tok/s | MiB/token | hit % | load 1m | s |",
          "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        L.append(f"| {r['index']} | {r['phase']} | {r['round']} | {r['config']} | {r['exit_status']} | "
                 f"{_f(r['tok_s'])} | {_f(r['mib_per_token'])} | {_f(r['cache_hit_pct'], '.1f')} | "
                 f"{r['loadavg_1m']:.2f} | {r['elapsed_s']:.1f} |")
    L.append("")
    failed = [r for r in records if not r["ok"]]
    for r in failed:
        L += [f"Run {r['index']} ({r['config']}) failed (exit {r['exit_status']}):", "", "```",
              r.get("stderr_tail", ""), "```", ""]
    return "\n".join(L)


def write_quality_chart(path: Path, rows: list[dict]) -> str | None:
    """tok/s (median, min–max) against mean KL, one labelled point per configuration; None when written."""
    plt = bench_report.pyplot()
    if plt is None:
        return bench_report.NO_MATPLOTLIB
    pts = [r for r in rows if r["tok_s_median"] is not None and (r["kl_mean"] is not None or r["config"] == REFERENCE)]
    if not pts:
        return "chart skipped: no scored runs"
    fig, ax = plt.subplots(figsize=(7.0, 4.5))
    for r in pts:
        kl = r["kl_mean"] or 0.0
        err = [[r["tok_s_median"] - r["tok_s_min"]], [r["tok_s_max"] - r["tok_s_median"]]]
        ref = r["config"] == REFERENCE
        ax.errorbar([kl], [r["tok_s_median"]], yerr=err, fmt="s" if ref else "o", capsize=3,
                    color="#cc3311" if ref else "#4477aa")
        ax.annotate(r["config"], (kl, r["tok_s_median"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    low = min([r["kl_mean"] for r in pts if r["kl_mean"]] or [1e-3])
    ax.set_xscale("symlog", linthresh=low / 2)
    ax.set_xlim(left=0)
    ax.set_xlabel("mean KL divergence from the lossless reference (nats per token; symlog)")
    ax.set_ylabel("tok/s (median, min–max)")
    ax.set_title("bmoe-bench quality: speed against the price of each setting")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def print_rows(rows: list[dict]) -> None:
    print(f"{'config':<16} {'tok/s':>7} {'×':>5} {'MiB/tok':>8} {'hit%':>6} {'mean KL':>9} {'p99 KL':>8} "
          f"{'top1%':>6} {'PPL':>8} {'greedy':>7}")
    for r in rows:
        print(f"{r['config']:<16} {_f(r['tok_s_median']):>7} {_f(r['speedup']):>5} {_f(r['mib_per_token']):>8} "
              f"{_f(r['cache_hit_pct'], '.1f'):>6} {_f(r['kl_mean'], '.5f'):>9} {_f(r['kl_p99'], '.4f'):>8} "
              f"{_f(r['top1_pct'], '.1f'):>6} {_f(r['ppl'] if r['ppl'] is not None else r['ppl_all'], '.3f'):>8} "
              f"{_f(r['greedy_same_mean'], '.1f'):>7}")
