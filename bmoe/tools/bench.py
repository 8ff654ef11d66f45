"""`bmoe-bench`: the one way performance numbers in this project are produced.

`bmoe-bench run` starts `bmoe-cli` once per (round, configuration), alternating the
configurations round-robin (c1 c2 c3 c1 c2 c3 ...) so drift on a shared machine hits all of
them alike, starts every run with the model file out of the page cache, optionally under a
memory limit (cgroup, else a balloon), and reports medians and spread next to the I/O-bound
limit computed from the measured O_DIRECT bandwidth of the model file.

Outputs (in --out DIR): results.json (one record per run), report.md, tok_s.png (when
matplotlib is installed) and runs/ with each run's stdout, stderr and per-token CSV.

This module is the command line. The parts: bench_config (configurations and their order),
bench_run (the runs), bench_numbers (what they measured), bench_report (the outputs),
bench_machine (what they ran on), bench_io and bench_sys (reads and memory limits).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from bmoe.base import nonneg_int, positive_float, positive_int
from bmoe.replay import ReplayBudget
from bmoe.tools import bench_config, bench_numbers, bench_quality, bench_report, bench_run, bench_sys

EXIT_ERROR = 1
EXIT_SIGINT = 130

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

BENCH_EXAMPLES = """\
commands:
  run        benchmark bmoe-cli configurations against each other and plain llama.cpp
  quality    what lossy settings cost on your model and text: KL, top-1 agreement, perplexity, speed
  routes     what a routing trace (bmoe-cli --route-trace) says: reuse, router recall, LRU curve
  policies   replay routing traces through every cache policy and Belady's bound

examples:
  bmoe-bench run -m model.gguf -n 32 --config c0='--cache-mb 0' --config c1g='--cache-mb 1024'
  bmoe-bench run --help
  bmoe-bench quality -m model.gguf --config k6='--experts-per-token 6' --config cold='--drop-cold 0.1'
  bmoe-cli -m model.gguf -n 150 --route-trace story.jsonl && bmoe-bench routes story.jsonl
  bmoe-bench policies story.jsonl code.jsonl --budgets 10,25,50,75
  bmoe-bench policies ../shared/traces/*.csv --budgets 1300MiB,1900MiB,4000MiB,10,25   # no model file
"""

POLICIES_EXAMPLES = """\
examples:
  bmoe-cli -m model.gguf --chat -p "Write a story" -n 150 --cache-mb 2000 --route-trace story.jsonl
  bmoe-bench policies story.jsonl                       # budgets 10,25,50,75% of the expert bytes
  bmoe-bench policies story.jsonl code.jsonl --budgets 25,50 -m model.gguf --out policies.md
  bmoe-bench policies gemma.route.csv --budgets 1300MiB,1900MiB,10   # route_trace v1: no model file
  bmoe-bench policies gemma.route.csv --budgets 1300MiB --guesses 0.2,0.3,0.5   # and how well --guess would do
  bmoe-cli -m model.gguf -p "Hello" -n 64 --route-trace hello.csv    # bmoe writes route_trace v1 too

Traces are bmoe's JSON lines (bmoe-cli --route-trace PATH.jsonl) or route_trace v1 CSV (the format
of the C++ project bmoe descends from; bmoe-cli --route-trace PATH.csv writes it). A v1 header
gives the model's shape and each layer's expert bytes, so it replays without the model file; its
prompt rows warm the cache before decode is counted.

Each policy runs in the live ExpertCache with no memory behind it, so its hit rate is what
bmoe-cli --cache-policy NAME gets on the same routing. 'belady' is the offline optimum (it knows
the future) and 'next-token-oracle' is next-use told the next token's routing (a bound for any
next-token predictor); both only exist here. 'predict' is told the temporal and spec-gate predictions the
trace allows (spec-gate needs the trace's .hidden.npy).
"""


def _thread_list(text: str) -> list[int]:
    try:
        xs = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected thread counts like 1,2,4") from None
    if not xs or xs[0] < 1:
        raise argparse.ArgumentTypeError("thread counts must be 1 or more")
    return xs


def _budget_list(text: str) -> list[ReplayBudget]:
    try:
        xs = [ReplayBudget.parse(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected percentages like 10,25 or sizes like 1300MiB") from None
    if not xs or any(b.pct is not None and not 0 < b.pct <= 100 for b in xs) or any(
            b.mib is not None and b.mib <= 0 for b in xs):
        raise argparse.ArgumentTypeError(f"{text!r}: a budget is a percentage from 1 to 100 or a positive size "
                                         f"in MiB (1300MiB)")
    return xs


def _fraction_list(text: str) -> list[float]:
    try:
        xs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        xs = []
    if not xs or not all(0 < x < 1 for x in xs):
        raise argparse.ArgumentTypeError(f"{text!r}: expected fractions between 0 and 1 like 0.05,0.1,0.2")
    return xs


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="bmoe-bench", epilog=BENCH_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Benchmark bmoe: the one way performance numbers in this project are produced.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    r = sub.add_parser(
        "run", epilog=RUN_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
        help="benchmark bmoe-cli configurations (alternating, medians) against plain llama.cpp",
        description="Run bmoe-cli with each configuration, alternating round-robin, each run starting "
                    "with a cold page cache and optionally under a memory limit; write results.json, "
                    "report.md and a chart.")
    bench_quality.add_parser(sub)
    rt = sub.add_parser("routes", help="previous-token reuse, next-layer router recall and the LRU hit-rate "
                                       "curve of a routing trace",
                        description="Read a trace written by bmoe-cli --route-trace and print previous-token "
                                    "expert reuse, next-layer router recall (the next layer's router applied "
                                    "to this layer's router input) and LRU hit rates at budgets of "
                                    "10/25/50/75%% of the expert bytes.")
    rt.add_argument("trace", help="trace file from bmoe-cli --route-trace, or route_trace v1 CSV")
    rt.add_argument("-m", "--model", help="the model the trace came from (default: the path in the trace)")
    po = sub.add_parser("policies", epilog=POLICIES_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
                        help="replay routing traces through every cache policy and Belady's bound",
                        description="Replay traces written by bmoe-cli --route-trace through LRU, Belady's MIN, "
                                    "a next-token oracle and every candidate cache policy; print hit rate and "
                                    "MiB read per token for each policy and budget, and the distance to LRU and "
                                    "to Belady.")
    po.add_argument("traces", nargs="+", metavar="TRACE",
                    help="trace files from bmoe-cli --route-trace, or route_trace v1 CSV")
    po.add_argument("--budgets", type=_budget_list, default=_budget_list("10,25,50,75"), metavar="LIST",
                    help="cache budgets: %% of all expert bytes (25) or MiB (1300MiB); default 10,25,50,75")
    po.add_argument("-m", "--model", help="the model the traces came from (default: the path in each trace)")
    po.add_argument("--out", metavar="PATH", help="also write the table (markdown) to PATH")
    po.add_argument("--drop-cold", type=_fraction_list, default=[], metavar="LIST",
                    help="also price --drop-cold F on the traces' router weights (needs weights: route_trace v1 "
                         "or --route-trace PATH.csv): reads saved against router weight dropped, e.g. 0.05,0.1,0.2")
    po.add_argument("--guesses", type=_fraction_list, default=[], metavar="LIST",
                    help="also score bmoe-cli --guess at these thresholds on the traces (default policy): the "
                         "next layer's misses the routing seen so far guesses, and the bytes it guesses in vain, "
                         "e.g. 0.2,0.3,0.5")
    po.add_argument("--no-prefill", action="store_true",
                    help="start decode from an empty cache; by default the trace's prompt (or, for a trace "
                         "without prompt rows, a pass that routes every expert of every layer) comes first")
    r.add_argument("-m", "--model", required=True, help="GGUF model (first shard of a split model)")
    src = r.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="prompt text (default: bmoe-cli's)")
    src.add_argument("-f", "--file", help="read the prompt from this file")
    r.add_argument("-n", "--n-predict", type=positive_int, default=32, help="tokens per run (default 32)")
    bench_config.add_plan_options(r, warmup=1, everyone="baseline")
    r.add_argument("--no-baseline", action="store_true",
                   help=f"leave out the built-in baseline "
                        f"{bench_config.BASELINE_NAME}='{shlex.join(bench_config.BASELINE_FLAGS)}'")
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
    return ap


def cmd_run(a: argparse.Namespace, argv: list[str]) -> int:
    """`bmoe-bench run`: check, run the plan, then write results.json, report.md and the chart."""
    b = bench_run.prepare(a, argv)
    bench_run.run_bench(b, a)
    summary = bench_numbers.summarize(b.configs, b.records, b.bandwidth, a.compute_ref, a.common)
    chart_note = bench_report.write_speed_chart(b.out / bench_report.SPEED_CHART, summary)
    if chart_note:
        bench_run.say(chart_note)
        b.meta["chart_note"] = chart_note
    results_path, report_path = b.out / bench_report.RESULTS, b.out / bench_report.REPORT
    bench_report.write_results(results_path, b.meta, b.records, summary)
    report_path.write_text(bench_report.render_report(b.meta, b.records, summary,
                                                      None if chart_note else bench_report.SPEED_CHART))
    bench_report.print_summary(summary)
    bench_run.say(f"wrote {report_path} and {results_path}")
    if b.interrupted:
        return EXIT_SIGINT
    return 0 if all(r["ok"] for r in b.records) else EXIT_ERROR


def cmd_routes(a: argparse.Namespace) -> int:
    """`bmoe-bench routes`: what one routing trace says (bmoe.replay.stats)."""
    from bmoe.replay import stats as route_stats

    try:
        print(route_stats.report(a.trace, a.model))
    except (OSError, ValueError, KeyError) as e:
        raise bench_run.BenchError(f"cannot read trace {a.trace}: {e}") from e
    return 0


def cmd_policies(a: argparse.Namespace) -> int:
    """`bmoe-bench policies`: every cache policy replayed on the traces (bmoe.replay.policies)."""
    from bmoe.replay import policies as policy_sim

    try:
        rows = policy_sim.simulate(a.traces, a.budgets, a.model, progress=bench_run.say, prefill=not a.no_prefill)
    except (OSError, ValueError, KeyError) as e:
        raise bench_run.BenchError(f"cannot replay the traces: {e}") from e
    text = policy_sim.policy_table(rows)
    if a.drop_cold:
        from bmoe.replay import lossy_prices

        try:
            prices = lossy_prices.prices(a.traces, a.budgets, a.drop_cold, a.model)
        except (OSError, ValueError, KeyError) as e:
            raise bench_run.BenchError(f"cannot price --drop-cold on the traces: {e}") from e
        text += "\n## --drop-cold on these routes (default policy)\n\n" + lossy_prices.price_table(prices) + "\n"
    if a.guesses:
        from bmoe.replay import guesses

        try:
            rows_g = [r for path in a.traces for b in a.budgets
                      for r in guesses.score_guesses(path, b, tuple(a.guesses), a.model)]
        except (OSError, ValueError, KeyError) as e:
            raise bench_run.BenchError(f"cannot score --guess on the traces: {e}") from e
        text += "\n## --guess on these routes (default policy)\n\n" + guesses.guess_table(rows_g) + "\n"
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
        if a.command == "quality":
            return bench_quality.cmd_quality(a, argv)
        if a.command == "routes":
            return cmd_routes(a)
        if a.command == "policies":
            return cmd_policies(a)
        raise bench_run.BenchError(f"unknown command {a.command}")
    except bench_run.BenchError as e:
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
