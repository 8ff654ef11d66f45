"""`bmoe-cli`'s flags: the parser, its defaults (read from bmoe.settings), and flags → Settings."""

from __future__ import annotations

import argparse
from dataclasses import replace

from bmoe.argtypes import number, percent, positive_int
from bmoe.cache_policy import POLICIES
from bmoe.console import notice
from bmoe.settings import (CacheSettings, ConfigError, SamplerSettings, Settings, SpecSettings, StreamSettings,
                           validate)

EXAMPLES = """\
examples:
  bmoe-cli                                   # built-in demo model and prompt
  bmoe-cli -m model.gguf -p "Why is the sky blue?" -n 128 --cache-mb 2000 --io-threads 4
  bmoe-cli -m model.gguf -f prompt.txt --chat --cache-mb 0
  bmoe-cli -m model.gguf -p "Hello" --cache-mb 1500 --cache-policy lru   # the classic LRU cache
  bmoe-cli -m model.gguf -p "Hello" --no-stream     # plain llama.cpp, the reference output
  bmoe-cli -m model.gguf -p "Hello" --progress --csv run.csv --profile   # telemetry for apps and benchmarks
  bmoe-cli --session -m model.gguf --cache-mb 2000  # serve JSON-lines requests on stdin
  bmoe-cli -m model.gguf -p "Hello" --usage-dir ~/bmoe-usage   # keep usage profiles (warm starts) there
"""

DEFAULT_PROMPT = "Once upon a time"
N_PREDICT = 64


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
    ap.add_argument("-n", "--n-predict", type=positive_int, default=N_PREDICT,
                    help=f"tokens to generate (default {N_PREDICT})")
    ap.add_argument("-t", "--threads", type=positive_int, default=None, help="compute threads (default: all cores)")
    ap.add_argument("-c", "--ctx-size", type=positive_int, default=Settings.n_ctx,
                    help=f"context size in tokens (default {Settings.n_ctx})")
    ap.add_argument("--parallel", type=positive_int, default=Settings.parallel, metavar="N",
                    help="KV sequences, each of -c tokens: up to N requests may decode together in one batch "
                         f"(bmoe-server's concurrent requests, bmoe.Model.batch; default {Settings.parallel})")
    ap.add_argument("--cache-mb", type=_cache_mb, default=None,
                    help="expert cache budget in MiB; 0 = no cache (re-read every token); 'auto' (default) "
                         "= the least room any memory limit leaves (the cgroup's, the machine's, an rlimit's) "
                         "minus --cache-floor-mb, at most --cache-ceil-mb, following free memory while it runs; "
                         "a budget below one token's working set is refused (auto falls back to no cache) "
                         "unless --force")
    ap.add_argument("--cache-policy", type=_cache_policy, default=CacheSettings.policy, metavar="NAME",
                    help=f"which experts the cache gives up first: {', '.join(POLICIES)} "
                         f"(default {CacheSettings.policy}; compare them on a trace with `bmoe-bench policies`)")
    ap.add_argument("--cache-floor-mb", type=_mib, default=None,
                    help=f"memory --cache-mb auto (and --adapt) leaves free under every limit (default "
                         f"{CacheSettings.FLOOR_MB:g}, at most a quarter of a cgroup's limit)")
    ap.add_argument("--cache-ceil-mb", type=_mib, default=None,
                    help="the most --cache-mb auto may take (default: no cap)")
    ap.add_argument("--adapt", action="store_true",
                    help="let a fixed --cache-mb follow free memory too: shrink (giving pages back) when the "
                         "cgroup or machine runs short of --cache-floor-mb, grow back up to N when it frees "
                         "(--cache-mb auto always does)")
    ap.add_argument("--force", action="store_true",
                    help="run with a cache budget below one token's working set (it thrashes: every token "
                         "re-reads experts it just evicted)")
    ap.add_argument("--io-threads", type=positive_int, default=StreamSettings.io_threads,
                    help=f"I/O lane processes (default {StreamSettings.io_threads})")
    ap.add_argument("--lane-timeout", type=float, default=StreamSettings.lane_timeout,
                    help=f"seconds an I/O lane may leave a read unanswered before it is replaced "
                         f"(default {StreamSettings.lane_timeout:g})")
    ap.add_argument("--shm", choices=("auto", "posix", "memfd"), default=StreamSettings.shm_backend,
                    help="cache segment: POSIX shared memory (/dev/shm) or an anonymous memfd; auto picks "
                         f"memfd when /dev/shm is missing (default {StreamSettings.shm_backend})")
    ap.add_argument("--no-odirect", action="store_true", help="buffered reads + FADV_DONTNEED instead of O_DIRECT")
    ap.add_argument("--usage-dir", metavar="DIR", default=CacheSettings.usage_dir,
                    help="where each model's usage profile (how often each expert was routed) is kept: saved at "
                         "exit, used at the next start to fill the cache in the background, most used first "
                         "(default: $BMOE_USAGE_DIR, else $XDG_CACHE_HOME/bmoe/usage, i.e. ~/.cache/bmoe/usage)")
    ap.add_argument("--no-warm-start", action="store_true",
                    help="neither use nor save a usage profile: every start begins with an empty cache")
    ap.add_argument("--preload", action="store_true",
                    help="read every expert into the cache at start (when the budget holds them all)")
    ap.add_argument("--no-stream", action="store_true", help="plain llama.cpp (mmap), no expert streaming")
    ap.add_argument("--pin-dense", action="store_true",
                    help="lock the dense (non-expert) weights in memory (mlock), so a tight memory limit cannot "
                         "evict them and fault them back in every token; they count against the budget")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                    help="read asynchronously: wait for gate/up slices at the routing node and for down slices "
                         "only before the down matmul; speculative reads run during compute (default: on "
                         "when streaming; --no-overlap waits for every read at the routing node)")
    ap.add_argument("--prefetch", type=positive_int, default=SpecSettings.prefetch, metavar="K",
                    help="after a layer routes, read ahead the experts the previous token routed at the next "
                         "K layers (needs a cache; off by default: a third of its reads are used, it measured "
                         "3-13%% slower)")
    ap.add_argument("--spec-gate", action=argparse.BooleanOptionalAction, default=SpecSettings.gate,
                    help="predict the next layer's experts from this layer's router input in a separate "
                         "process and read them ahead (needs a cache and F32/F16 routers; off by default: it "
                         "measured 4-5%% faster with a cache of a third of the experts, 4-5%% slower with a sixth)")
    ap.add_argument("--spec-warmup", type=positive_int, default=SpecSettings.warmup, metavar="N",
                    help=f"predictions scored before the recall governor may switch --spec-gate off "
                         f"(default {SpecSettings.warmup})")
    ap.add_argument("--spec-recall-min", type=percent, default=SpecSettings.recall_min, metavar="P",
                    help="switch --spec-gate off for the run when its recall is below P%% after the warm-up; "
                         f"0 = never (default {SpecSettings.recall_min:g})")
    ap.add_argument("--spec-precision", type=percent, default=SpecSettings.precision, metavar="P",
                    help="read a predicted expert ahead only when predictions as sure as this one came true "
                         "at least P%% of the time (measured per band of router probability as the run goes; "
                         f"0 = read every prediction; default {SpecSettings.precision:g})")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the model's own chat template")
    ap.add_argument("--temp", type=float, default=SamplerSettings.temp, help=f"temperature; 0 = greedy (default {SamplerSettings.temp:g})")
    ap.add_argument("--top-k", type=int, default=SamplerSettings.top_k, help=f"top-k when sampling (default {SamplerSettings.top_k})")
    ap.add_argument("--top-p", type=float, default=SamplerSettings.top_p, help=f"top-p when sampling (default {SamplerSettings.top_p:g})")
    ap.add_argument("--seed", type=int, default=SamplerSettings.seed, help=f"sampling seed (default {SamplerSettings.seed})")
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


def settings_from_args(a: argparse.Namespace, model: str) -> Settings:
    """The flags as Settings, for `model` (the demo model's path when no -m was given)."""
    return Settings(
        model=model, n_ctx=a.ctx_size, threads=a.threads or 0, verbose=a.verbose, route_trace=a.route_trace,
        pin_dense=a.pin_dense, parallel=a.parallel,
        cache=CacheSettings(mb=a.cache_mb, floor_mb=a.cache_floor_mb, ceil_mb=a.cache_ceil_mb, force=a.force,
                            policy=a.cache_policy, preload=a.preload, adapt=a.adapt,
                            warm_start=not a.no_warm_start, usage_dir=a.usage_dir),
        streaming=StreamSettings(enabled=not a.no_stream, io_threads=a.io_threads, odirect=not a.no_odirect,
                                 lane_timeout=a.lane_timeout, shm_backend=a.shm,
                                 overlap=StreamSettings.overlap if a.overlap is None else a.overlap),
        speculation=SpecSettings(prefetch=a.prefetch, gate=a.spec_gate, warmup=a.spec_warmup,
                                 recall_min=a.spec_recall_min, precision=a.spec_precision),
        sampler=SamplerSettings(temp=a.temp, top_k=a.top_k, top_p=a.top_p, seed=a.seed))


def check(ap: argparse.ArgumentParser, a: argparse.Namespace) -> Settings:
    """The flags' Settings, validated; a contradiction is a usage error (exit 2). The model is
    not looked at yet (no -m: the demo model, built later if missing)."""
    if a.no_stream and a.overlap:
        ap.error("--overlap streams experts; drop it or drop --no-stream")
    try:
        s = settings_from_args(a, a.model or "")
        validate(s)
    except ConfigError as e:
        ap.error(str(e))
    return s


def resolve_model(a: argparse.Namespace, s: Settings) -> Settings:
    """With no -m: the demo model (built on first use) and, unless the cache was sized, its budget."""
    if a.model is not None:
        return s
    from bmoe.tools.demo import default_model

    path, demo_cache_mb = default_model(progress=notice)
    cache = s.cache
    if cache.mb is None and cache.floor_mb is None and cache.ceil_mb is None:
        cache = replace(cache, mb=demo_cache_mb)
    return replace(s, model=str(path), cache=cache)
