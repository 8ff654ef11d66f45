#!/usr/bin/env bash
# Issue 3: the 64-expert demo model (5.5 GB) under a memory limit of about half of it:
# plain llama.cpp mmap vs bmoe serial streaming at two cache sizes, with the I/O-bound limit.
#   MODEL=path (default bench/models/demo64.gguf)  LIMIT_MB=2600  CACHES="900 1800"  N=32
#   REPEATS=2 WARMUP=1 THREADS=$(nproc) OUT=dir
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/demo64.sh"  # REPO, PY, MODEL (built when missing)
LIMIT_MB=${LIMIT_MB:-2600}
CACHES=${CACHES:-"900 1800"}
N=${N:-32}
REPEATS=${REPEATS:-2}
WARMUP=${WARMUP:-1}
THREADS=${THREADS:-$(nproc)}
OUT=${OUT:-$REPO/bench/reports/$(date +%Y-%m-%d)-issue3/limited}
configs=()
for c in $CACHES; do configs+=(--config "serial-${c}=--cache-mb $c --io-threads 2"); done
"$PY" -m bmoe.tools.bench run -m "$MODEL" -p "Write a story about a lighthouse keeper who finds a message in a bottle." \
    -n "$N" --repeats "$REPEATS" --warmup "$WARMUP" --common "-t $THREADS -c 512 --chat" \
    --mem-limit-mb "$LIMIT_MB" "${configs[@]}" --out "$OUT"
