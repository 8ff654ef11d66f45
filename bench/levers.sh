#!/usr/bin/env bash
# Which of --overlap, --prefetch and --spec-gate hide flash latency? On the 64-expert demo model
# (5.2 GiB of experts) under a memory limit of about half the model, at two cache budgets, in one
# bmoe-bench run:
# serial, --overlap, --overlap --prefetch 1, --overlap --spec-gate, --overlap --prefetch 1 --spec-gate,
# plus llama.cpp mmap and a fully resident run (no limit) whose s/token is the compute cost in each
# configuration's overlap limit, 1 / max(compute s/token, MiB per token ÷ O_DIRECT bandwidth).
#
# Run it on a quiet machine: about 25 runs of 30-120 s each. Knobs (environment variables):
#   MODEL=path (default the demo model in the user cache, built by bmoe-demo when missing)
#   LIMIT_MB=2700   memory limit (cgroup, else a balloon)      SMALL_MB=900 LARGE_MB=1800  budgets
#   N=24 REPEATS=2 WARMUP=0 THREADS=1 LANES=3 (--io-threads)   EXTRA='...' more bmoe-bench flags
#   OUT=dir (default bench/reports/<date>-levers)
# One compute thread by default: llama.cpp's spinning thread pool slows down many times over when
# the I/O lanes or another process take a core, which would drown the levers' effect in noise.
# Quick check that it starts: N=2 REPEATS=1 EXTRA='--no-bandwidth' $0
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/demo64.sh"  # REPO, PY, MODEL (built when missing)
LIMIT_MB=${LIMIT_MB:-2700}
SMALL_MB=${SMALL_MB:-900}
LARGE_MB=${LARGE_MB:-1800}
N=${N:-24}
REPEATS=${REPEATS:-2}
WARMUP=${WARMUP:-0}
THREADS=${THREADS:-1}
LANES=${LANES:-3}
EXTRA=${EXTRA:-}
OUT=${OUT:-$REPO/bench/reports/$(date +%Y-%m-%d)-levers}
configs=()
for mb in "$SMALL_MB" "$LARGE_MB"; do
  c="--cache-mb $mb"
  # every lever spelled out: bmoe-cli's defaults follow this benchmark (--overlap on, --prefetch and --spec-gate off)
  configs+=(--config "serial-$mb=$c --no-overlap --no-spec-gate"
            --config "overlap-$mb=$c --overlap --no-spec-gate"
            --config "overlap-p1-$mb=$c --overlap --prefetch 1 --no-spec-gate"
            --config "overlap-spec-$mb=$c --overlap --spec-gate"
            --config "overlap-p1-spec-$mb=$c --overlap --prefetch 1 --spec-gate")
done
# shellcheck disable=SC2086  # EXTRA is a list of flags
"$PY" -m bmoe.tools.bench run -m "$MODEL" -p "Write a story about a lighthouse keeper who finds a message in a bottle." \
    -n "$N" --repeats "$REPEATS" --warmup "$WARMUP" \
    --common "-t $THREADS -c 512 --chat --io-threads $LANES" --bw-threads 1,2,3,4 --mem-limit-mb "$LIMIT_MB" \
    "${configs[@]}" --config "resident=--cache-mb 6000 --preload" --compute-ref resident \
    --out "$OUT" $EXTRA
echo "levers: report in $OUT/report.md" >&2
