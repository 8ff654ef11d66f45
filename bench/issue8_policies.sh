#!/usr/bin/env bash
# Issue 8, end to end: LRU vs the default cache policy (next-use) on the 64-expert demo model
# (5.2 GiB) under a memory limit of about half of it, at the same cache budget, in one bmoe-bench run.
# Acceptance: the default reads ≥20 % fewer MiB per token than LRU and is faster in tok/s.
#
# Run it on a quiet machine (each run reads GBs from flash; about 2 min per run, 8 runs by default).
#   MODEL=path (default bench/models/demo64.gguf, written by bmoe-demo when missing)
#   LIMIT_MB=2600   memory limit (cgroup, else a balloon), about half the model
#   CACHE_MB=1290   cache budget for both policies: 25 % of the 5164 MiB of experts, where the
#                   trace replay (bench/issue8_traces.sh) shows the largest difference
#   POLICY=next-use  the policy compared with lru (the default)
#   N=64 REPEATS=3 WARMUP=0 THREADS=1 SKIP=0 OUT=dir   EXTRA='...' more bmoe-bench flags
# Each policy runs twice: serial without speculative reads (the policy alone decides what is read)
# and with bmoe-cli's default levers (--overlap --spec-gate), the configuration users run.
# Quick check that it starts: N=2 REPEATS=1 WARMUP=0 EXTRA='--no-bandwidth' $0
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}
MODEL=${MODEL:-$REPO/bench/models/demo64.gguf}
LIMIT_MB=${LIMIT_MB:-2600}
CACHE_MB=${CACHE_MB:-1290}
POLICY=${POLICY:-next-use}
N=${N:-64}
REPEATS=${REPEATS:-3}
WARMUP=${WARMUP:-0}
THREADS=${THREADS:-1}
SKIP=${SKIP:-0}
EXTRA=${EXTRA:-}
OUT=${OUT:-$REPO/bench/reports/$(date +%Y-%m-%d)-issue8/limited}
if [[ ! -f $MODEL ]]; then
  mkdir -p "$(dirname "$MODEL")"
  "$PY" -m bmoe.demo --experts 64 --top-k 8 -o "$MODEL"
fi
# shellcheck disable=SC2086  # EXTRA is a list of flags
"$PY" -m bmoe.bench run -m "$MODEL" -p "Write a story about a lighthouse keeper who finds a message in a bottle." \
    -n "$N" --repeats "$REPEATS" --warmup "$WARMUP" --skip-tokens "$SKIP" --no-baseline \
    --common "-t $THREADS -c 512 --chat --io-threads 2" --mem-limit-mb "$LIMIT_MB" \
    --config "lru-serial=--cache-policy lru --cache-mb $CACHE_MB --no-overlap --no-spec-gate" \
    --config "$POLICY-serial=--cache-policy $POLICY --cache-mb $CACHE_MB --no-overlap --no-spec-gate" \
    --config "lru=--cache-policy lru --cache-mb $CACHE_MB" \
    --config "$POLICY=--cache-policy $POLICY --cache-mb $CACHE_MB" \
    --out "$OUT" $EXTRA
echo "issue8: report in $OUT/report.md" >&2
