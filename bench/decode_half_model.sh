#!/usr/bin/env bash
# How fast does bmoe decode when only about half the model fits in memory, against plain llama.cpp
# (mmap), and what does streaming cost when every expert is resident? On a synthetic MoE (or yours):
#
#   (a) writes a ≥4 GB synthetic qwen3moe model (q8_0) if it is missing;
#   (b) limited: bmoe-bench under a memory limit of about half the model: mmap vs bmoe with a cache
#       budget that fits the limit, with 2 and 4 I/O lanes;
#   (c) resident: bmoe-bench with no limit and every expert resident: the hook's overhead, bmoe ÷ mmap
#       s/token (the first tokens, which fill the cache, are left out with --skip-tokens).
#
# Both reports go to OUT/{limited,resident}/. Takes a long time (load of a 4.5 GB file per run, cold);
# run it on a quiet machine. Every knob is an environment variable:
#
#   MODEL=path        model to use (default bench/models/synth-4g.gguf, written when missing)
#   SIZE_GB=4.5       size of the synthetic model written when MODEL is missing
#   LIMIT_MB=...      memory limit for (b) (default: half the model file)
#   OVERHEAD_MB=640   what (b) keeps free inside the limit besides the non-expert weights and one
#                     layer's experts: Python + llama.cpp + KV cache + I/O lanes + page-cache slack
#   CACHE_MB=...      cache budget for (b) (default: LIMIT_MB - non-expert - one layer - OVERHEAD_MB)
#   N=32 N2=64        tokens per run in (b) / (c);   SKIP2=8: tokens (c) leaves out
#   REPEATS=3 WARMUP=1 THREADS=$(nproc) CTX=512
#   OUT=dir           reports directory (default bench/reports/<date>-decode-half-model)
#   ONLY=limited|resident   run just one part;   EXTRA='...' more bmoe-bench flags for both
#
# Quick check that it starts: MODEL=small.gguf N=4 N2=4 SKIP2=0 REPEATS=1 WARMUP=0 EXTRA='--bw-mb 16' $0
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}
MODEL=${MODEL:-$REPO/bench/models/synth-4g.gguf}
SIZE_GB=${SIZE_GB:-4.5}
N=${N:-32}
N2=${N2:-64}
SKIP2=${SKIP2:-8}
REPEATS=${REPEATS:-3}
WARMUP=${WARMUP:-1}
THREADS=${THREADS:-$(nproc)}
CTX=${CTX:-512}
OVERHEAD_MB=${OVERHEAD_MB:-640}
OUT=${OUT:-$REPO/bench/reports/$(date +%Y-%m-%d)-decode-half-model}
ONLY=${ONLY:-}
EXTRA=${EXTRA:-}
TIMEOUT=${TIMEOUT:-3600}
PROMPT=${PROMPT:-"Write a long and detailed story about a lighthouse keeper who finds a map in a bottle, \
the storm that follows, the village that doubts him, and the voyage he finally makes across the cold \
northern sea to the island drawn on the map, describing the ship, the crew and the weather."}

if [[ ! -f $MODEL ]]; then
    echo "decode_half_model: writing a ${SIZE_GB} GB synthetic model to $MODEL (once) ..." >&2
    mkdir -p "$(dirname "$MODEL")"
    # realistic shape (24 layers, 64 experts, top-8); --size-gb picks the expert width
    "$PY" -m bmoe.tools.synth --arch qwen3moe --layers 24 --experts 64 --top-k 8 --embd 1024 \
        --size-gb "$SIZE_GB" --quant q8_0 -o "$MODEL"
fi

# Sizes from the GGUF: file, expert tensors, other tensors, one layer's routed experts (top-k slices).
read -r SIZE_MIB EXPERT_MIB OTHER_MIB LAYER_MIB < <("$PY" - "$MODEL" <<'PY'
import sys, gguf
from bmoe.tools import bench_io
from bmoe.base.model_files import shard_paths
from pathlib import Path
paths = shard_paths(Path(sys.argv[1]))
ts = bench_io.expert_tensors(paths)
expert, total = bench_io.tensor_bytes(paths)
r = gguf.GGUFReader(paths[0])
arch = bytes(r.get_field("general.architecture").parts[-1]).decode()
f = r.get_field(f"{arch}.expert_used_count")
top_k = int(f.parts[-1][0]) if f else 8
layers = {t.name.split(".")[1] for t in ts}
layer = sum(t.slice_bytes for t in ts) / max(len(layers), 1) * top_k
M = 1 << 20
print(int(sum(p.stat().st_size for p in paths) / M), int(expert / M) + 1, int((total - expert) / M) + 1,
      int(layer / M) + 1)
PY
)
LIMIT_MB=${LIMIT_MB:-$((SIZE_MIB / 2))}
CACHE_MB=${CACHE_MB:-$((LIMIT_MB - OTHER_MIB - LAYER_MIB - OVERHEAD_MB))}
RESIDENT_MB=$((EXPERT_MIB + 64))
echo "decode_half_model: model ${SIZE_MIB} MiB (experts ${EXPERT_MIB}, other ${OTHER_MIB}, one layer's routed experts ${LAYER_MIB});" \
     "limit ${LIMIT_MB} MiB, cache budget ${CACHE_MB} MiB; resident run --cache-mb ${RESIDENT_MB}" >&2
if (( CACHE_MB < LAYER_MIB )); then
    echo "decode_half_model: error: a ${LIMIT_MB} MiB limit leaves no room for a cache (${CACHE_MB} MiB < one layer's" \
         "${LAYER_MIB} MiB); raise LIMIT_MB or lower OVERHEAD_MB" >&2
    exit 1
fi

mkdir -p "$OUT"
COMMON="-t $THREADS -c $CTX"
# shellcheck disable=SC2086  # EXTRA is a list of flags
if [[ -z $ONLY || $ONLY == limited ]]; then
    "$PY" -m bmoe.tools.bench run -m "$MODEL" -p "$PROMPT" -n "$N" --repeats "$REPEATS" --warmup "$WARMUP" \
        --common "$COMMON" --mem-limit-mb "$LIMIT_MB" --timeout "$TIMEOUT" \
        --config "stream-io2=--cache-mb $CACHE_MB --io-threads 2" \
        --config "stream-io4=--cache-mb $CACHE_MB --io-threads 4" \
        --out "$OUT/limited" $EXTRA
fi
# shellcheck disable=SC2086
if [[ -z $ONLY || $ONLY == resident ]]; then
    "$PY" -m bmoe.tools.bench run -m "$MODEL" -p "$PROMPT" -n "$N2" --skip-tokens "$SKIP2" --repeats "$REPEATS" \
        --warmup "$WARMUP" --common "$COMMON" --timeout "$TIMEOUT" \
        --config "resident=--cache-mb $RESIDENT_MB --io-threads 2 --preload" \
        --out "$OUT/resident" $EXTRA
fi
echo "decode_half_model: reports in $OUT/limited/report.md and $OUT/resident/report.md" >&2
