"""`bmoe-cli`: generate text from a MoE GGUF while streaming its experts from flash."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from pathlib import Path
from typing import Any, Callable

from bmoe import profile, seam, telemetry
from bmoe.argtypes import number, percent, positive_int
from bmoe.cache_policy import DEFAULT_POLICY, POLICIES
from bmoe.coordinator import DEFAULT_FLOOR_MB, SPEC_PRECISION_PCT, ConfigError, Engine, Result, Settings, TokenStat
from bmoe.lanes import LaneError
from bmoe.llama import SamplerSettings
from bmoe.model_files import ModelError

EXAMPLES = """\
examples:
  bmoe-cli                                   # built-in demo model and prompt
  bmoe-cli -m model.gguf -p "Why is the sky blue?" -n 128 --cache-mb 2000 --io-threads 4
  bmoe-cli -m model.gguf -f prompt.txt --chat --cache-mb 0
  bmoe-cli -m model.gguf -p "Hello" --cache-mb 1500 --cache-policy lru   # the classic LRU cache
  bmoe-cli -m model.gguf -p "Hello" --no-stream     # plain llama.cpp, the reference output
  bmoe-cli -m model.gguf -p "Hello" --progress --csv run.csv --profile   # telemetry for apps and benchmarks
"""

DEFAULT_PROMPT = "Once upon a time"
DEMO_PROMPT = "What is the capital of France, and what is it famous for?"
EXIT_ERROR = 1
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


def _cache_mb(text: str) -> float | None:
    if text == "auto":
        return None
    return number(text, float, "a number of MiB or 'auto'", lambda v: not v < 0,
                   "must be 0 (no cache), a positive number of MiB, or 'auto'")


def _mib(text: str) -> float:
    """argparse type for --cache-floor-mb and --cache-ceil-mb: a MiB count, 0 or more."""
    return number(text, float, "a number of MiB", lambda v: v >= 0 and v != float("inf"),
                   "must be a number of MiB, 0 or more")


def _cache_policy(text: str) -> str:
    if text not in POLICIES:
        raise argparse.ArgumentTypeError(f"unknown cache policy {text!r}; choose one of {', '.join(POLICIES)}")
    return text


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="bmoe-cli", epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a Mixture-of-Experts GGUF larger than RAM: routed experts are read from "
                    "flash into a bounded shared-memory cache; output equals plain llama.cpp.")
    ap.add_argument("-m", "--model", help="GGUF model (first shard of a split model); default: the demo model")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    src.add_argument("-f", "--file", help="read the prompt from this file")
    ap.add_argument("-n", "--n-predict", type=positive_int, default=64, help="tokens to generate (default 64)")
    ap.add_argument("-t", "--threads", type=positive_int, default=None, help="compute threads (default: all cores)")
    ap.add_argument("-c", "--ctx-size", type=positive_int, default=2048, help="context size in tokens (default 2048)")
    ap.add_argument("--cache-mb", type=_cache_mb, default=None,
                    help="expert cache budget in MiB; 0 = no cache (re-read every token); 'auto' (default) "
                         "= available memory minus --cache-floor-mb, at most --cache-ceil-mb; a budget below "
                         "one token's working set is refused (auto falls back to no cache) unless --force")
    ap.add_argument("--cache-policy", type=_cache_policy, default=DEFAULT_POLICY, metavar="NAME",
                    help=f"which experts the cache gives up first: {', '.join(POLICIES)} "
                         f"(default {DEFAULT_POLICY}; compare them on a trace with `bmoe-bench policies`)")
    ap.add_argument("--cache-floor-mb", type=_mib, default=None,
                    help=f"memory left to the system by --cache-mb auto (default {DEFAULT_FLOOR_MB:g})")
    ap.add_argument("--cache-ceil-mb", type=_mib, default=None,
                    help="the most --cache-mb auto may take (default: no cap)")
    ap.add_argument("--force", action="store_true",
                    help="run with a cache budget below one token's working set (it thrashes: every token "
                         "re-reads experts it just evicted)")
    ap.add_argument("--io-threads", type=positive_int, default=2, help="I/O lane processes (default 2)")
    ap.add_argument("--lane-timeout", type=float, default=30.0,
                    help="seconds an I/O lane may leave a read unanswered before it is replaced (default 30)")
    ap.add_argument("--shm", choices=("auto", "posix", "memfd"), default="auto",
                    help="cache segment: POSIX shared memory (/dev/shm) or an anonymous memfd; auto picks "
                         "memfd when /dev/shm is missing (default auto)")
    ap.add_argument("--no-odirect", action="store_true", help="buffered reads + FADV_DONTNEED instead of O_DIRECT")
    ap.add_argument("--preload", action="store_true",
                    help="read every expert into the cache at start (when the budget holds them all)")
    ap.add_argument("--no-stream", action="store_true", help="plain llama.cpp (mmap), no expert streaming")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                    help="read asynchronously: wait for gate/up slices at the routing node and for down slices "
                         "only before the down matmul; speculative reads run during compute (default: on "
                         "when streaming; --no-overlap waits for every read at the routing node)")
    ap.add_argument("--prefetch", type=positive_int, default=0, metavar="K",
                    help="after a layer routes, read ahead the experts the previous token routed at the next "
                         "K layers (needs a cache; off by default: a third of its reads are used, it measured "
                         "3-13%% slower)")
    ap.add_argument("--spec-gate", action=argparse.BooleanOptionalAction, default=False,
                    help="predict the next layer's experts from this layer's router input in a separate "
                         "process and read them ahead (needs a cache and F32/F16 routers; off by default: it "
                         "measured 4-5%% faster with a cache of a third of the experts, 4-5%% slower with a sixth)")
    ap.add_argument("--spec-warmup", type=positive_int, default=512, metavar="N",
                    help="predictions scored before the recall governor may switch --spec-gate off (default 512)")
    ap.add_argument("--spec-recall-min", type=percent, default=75.0, metavar="P",
                    help="switch --spec-gate off for the run when its recall is below P%% after the warm-up; "
                         "0 = never (default 75)")
    ap.add_argument("--spec-precision", type=percent, default=SPEC_PRECISION_PCT, metavar="P",
                    help="read a predicted expert ahead only when predictions as sure as this one came true "
                         "at least P%% of the time (measured per band of router probability as the run goes; "
                         f"0 = read every prediction; default {SPEC_PRECISION_PCT:g})")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the model's own chat template")
    ap.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=40, help="top-k when sampling (default 40)")
    ap.add_argument("--top-p", type=float, default=0.95, help="top-p when sampling (default 0.95)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    ap.add_argument("--progress", action="store_true",
                    help="machine-readable BMOE_LOAD/BMOE_PROGRESS lines per token, then the answer and perf banners")
    ap.add_argument("--csv", metavar="PATH", help="also write one CSV row per token (and PATH.procs.csv with --profile)")
    ap.add_argument("--profile", action="store_true",
                    help="at the end, a table of every process of the run (CPU, peak RSS, shared, reads) on stderr")
    ap.add_argument("--route-trace", metavar="PATH",
                    help="write each decode token's routed experts per layer (JSON lines) and the router "
                         "inputs (PATH.hidden.npy), for `bmoe-bench routes`")
    ap.add_argument("--verbose", action="store_true", help="show llama.cpp's own log on stderr")
    ap.add_argument("--session", action="store_true",
                    help="keep the model loaded and serve JSON requests from stdin, one per line, "
                         "answering with BMOE_* lines on stdout (see the telemetry contract's Session mode)")
    return ap


def check_flags(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Combinations argparse cannot see (exit code 2 like any other bad flag); then --overlap, left
    to its default, is settled: on when streaming."""
    ahead = [f for f, on in (("--prefetch", a.prefetch), ("--spec-gate", a.spec_gate)) if on]
    if a.no_stream and (ahead or a.overlap):
        ap.error(f"{' and '.join(ahead + (['--overlap'] if a.overlap else []))} stream experts; "
                 "drop them or drop --no-stream")
    sizing = [f for f, v in (("--cache-floor-mb", a.cache_floor_mb), ("--cache-ceil-mb", a.cache_ceil_mb))
              if v is not None]
    if sizing and a.cache_mb is not None:
        ap.error(f"{' and '.join(sizing)} size --cache-mb auto, and --cache-mb {a.cache_mb:g} is fixed; "
                 f"drop {' and '.join(sizing)} or use --cache-mb auto")
    if sizing and a.no_stream:
        ap.error(f"{' and '.join(sizing)} size the expert cache, and --no-stream has none; drop one of them")
    if a.cache_ceil_mb == 0:
        ap.error("--cache-ceil-mb 0 leaves --cache-mb auto no room; for no cache say --cache-mb 0")
    if ahead and a.cache_mb == 0:
        ap.error(f"{' and '.join(ahead)} read experts ahead into the cache, and --cache-mb 0 has none; "
                 "give it a budget (--cache-mb N or auto)")
    if a.overlap is None:
        a.overlap = not a.no_stream


def floor_mb(a: argparse.Namespace) -> float:
    """--cache-floor-mb, or its default (the flag defaults to None so a conflict can be seen)."""
    return DEFAULT_FLOOR_MB if a.cache_floor_mb is None else a.cache_floor_mb


def notice(msg: str) -> None:
    """One line for the user on stderr, in the form both modes share."""
    print(f"bmoe: {msg}", file=sys.stderr, flush=True)


def _read_prompt(a: argparse.Namespace) -> str:
    if a.file:
        try:
            return Path(a.file).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read prompt file {a.file}: {e.strerror}; check the -f path") from e
    return a.prompt if a.prompt is not None else DEFAULT_PROMPT


def _on_signal(signum: int, _frame: object) -> None:
    seam.deliver(KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(EXIT_SIGTERM))


def token_line(st: TokenStat, step: int, steps: int, hit_pct: float, overlap: bool) -> telemetry.TokenLine:
    return telemetry.TokenLine(step=step, steps=steps, wall_ms=st.wall_ns / 1e6, io_ms=st.io_ns / 1e6,
                               mgmt_ms=st.mgmt_ns / 1e6, stall_ms=st.stall_ns / 1e6,
                               read_bytes=st.read_bytes, cache_hit_pct=hit_pct, overlap=overlap)


def summary(engine: Engine, res: Result, lines: list[telemetry.TokenLine]) -> list[str]:
    st = engine.streamer
    totals = telemetry.RunTotals.of(lines, overlap=engine.settings.overlap)
    out = [telemetry.generation_line(totals)]
    if st:
        out.append(telemetry.stream_line(totals))
    if engine.cache_active:
        out.append(telemetry.cache_line(res.hit_pct(), engine.resident_bytes()))
    if st and engine.settings.prefetch:
        sp = res.speculation
        out.append(telemetry.prefetch_line(sp.bytes, sp.useful, sp.prefetched))
    if st and st.spec is not None:
        out.append(telemetry.spec_gate_line(st.spec.recall_pct, st.spec.disabled_below))
    return out


def workers(engine: Engine) -> list[tuple[str, int]]:
    if not engine.streamer:
        return []
    return [(f"io_lane {lane.index}", lane.pid) for lane in engine.streamer.pool.lanes]


# Settings fields whose flag has another name or form; every other field is taken from the flag of
# the same name. tests/test_session.py checks every field is covered.
SETTINGS_FROM_FLAGS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "model": lambda a: a.model,
    "n_ctx": lambda a: a.ctx_size,
    "threads": lambda a: a.threads or 0,
    "stream": lambda a: not a.no_stream,
    "odirect": lambda a: not a.no_odirect,
    "shm_backend": lambda a: a.shm,
    "cache_floor_mb": floor_mb,
    "sampler": lambda a: SamplerSettings(temp=a.temp, top_k=a.top_k, top_p=a.top_p, seed=a.seed),
}


def settings_from_args(a: argparse.Namespace) -> Settings:
    """The Settings of a one-shot run or a session: the flags, and the demo model with its budget
    when no -m is given."""
    if a.model is None:
        from bmoe.tools.demo import default_model

        path, demo_cache_mb = default_model(progress=notice)
        a.model = str(path)
        if a.cache_mb is None and a.cache_floor_mb is None and a.cache_ceil_mb is None:
            a.cache_mb = demo_cache_mb
    kw = {}
    for f in dataclasses.fields(Settings):
        if f.name in SETTINGS_FROM_FLAGS:
            kw[f.name] = SETTINGS_FROM_FLAGS[f.name](a)
        elif hasattr(a, f.name):
            kw[f.name] = getattr(a, f.name)
    return Settings(**kw)


def run(a: argparse.Namespace) -> int:
    if a.model is None and a.prompt is None and a.file is None:
        a.prompt, a.chat = DEMO_PROMPT, True
    settings = settings_from_args(a)
    prompt = _read_prompt(a)
    csv_file = open(a.csv, "w", buffering=1) if a.csv else None
    engine = Engine(settings, notice=notice)
    try:
        tokens = engine.prompt_tokens(prompt, a.chat)
        out = sys.stdout
        lines: list[telemetry.TokenLine] = []
        text = ""
        if csv_file:
            csv_file.write(telemetry.csv_header() + "\n")

        hits = lookups = 0

        def on_token(i: int, piece: str, stat: TokenStat) -> None:
            nonlocal text, hits, lookups
            text += piece
            hits, lookups = hits + stat.hits, lookups + stat.lookups
            hit_pct = (100.0 * hits / lookups if lookups else 0.0) if engine.cache_active else -1.0
            line = token_line(stat, i + 1, a.n_predict, hit_pct, a.overlap)
            lines.append(line)
            if a.progress:
                out.write("".join(x + "\n" for x in telemetry.token_lines(line, text)))
            else:
                out.write(piece)
            out.flush()
            if csv_file:
                csv_file.write(telemetry.csv_row(line) + "\n")

        res = engine.generate(tokens, a.n_predict, on_token)
        engine.files.check_unchanged("the answer above may not be the model's; run again")
        if a.progress:
            out.write(f"{telemetry.ANSWER_BANNER}\n{res.text}\n{telemetry.PERF_BANNER}\n")
        else:
            out.write(res.text[len(text):] + "\n")
        for line in summary(engine, res, lines):
            out.write(line + "\n")
        out.flush()
        st = engine.streamer
        if st and st.spec is not None and not a.prefetch:  # the contract's moe-prefetch line is --prefetch's
            sp = res.speculation
            notice(telemetry.prefetch_line(sp.bytes, sp.useful, sp.prefetched))
        if csv_file:
            csv_file.write(telemetry.csv_summary(telemetry.RunTotals.of(lines, overlap=a.overlap),
                                                 res.hit_pct() if engine.cache_active else -1.0) + "\n")
        if a.profile:
            rows = profile.collect(workers(engine))
            print(profile.table(rows, engine.resident_bytes()), file=sys.stderr)
            if a.csv:
                Path(a.csv + ".procs.csv").write_text(profile.csv_text(rows, engine.resident_bytes()))
    finally:
        engine.close()
        if csv_file:
            csv_file.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    check_flags(ap, a)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    if a.session:
        from bmoe import session

        return session.serve(a)
    try:
        return run(a)
    except (ModelError, ConfigError, LaneError, OSError) as e:
        print(f"bmoe-cli: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("bmoe-cli: interrupted", file=sys.stderr)
        return EXIT_SIGINT


if __name__ == "__main__":
    sys.exit(main())
