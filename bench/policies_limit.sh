#!/usr/bin/env bash
# Does the default cache policy (next-use) beat LRU end to end? On the 64-expert demo model (5.2 GiB)
# under a memory limit of about half of it, at the same cache budgets, in one bmoe-bench run: MiB read
# per token and tok/s of each policy. (The replay of recorded traces through every policy: traces.sh.)
#
# Run it on a quiet machine (each run reads GBs from flash; 30-60 s per run, 24 runs by default).
#   MODEL=path (default the demo model in the user cache, written by bmoe-demo when missing)
#   LIMIT_MB=2700   memory limit (cgroup, else a balloon), about half the model
#   CACHE_MB="1290 2000"  cache budgets, each run by both policies: 25 % and 39 % of the 5164 MiB
#                   of experts (the largest budget that leaves room under the limit)
#   POLICY=next-use  the policy compared with lru (the default)
#   N=64 REPEATS=3 WARMUP=0 THREADS=1 SKIP=0   EXTRA='...' more bmoe-bench flags
#   OUT=dir (default bench/reports/<date>-policies-limit)
# Each policy runs serial and with --overlap (bmoe-cli's default), both without speculative
# reads, so the policy alone decides what is read.
# Quick check that it starts: N=2 REPEATS=1 WARMUP=0 EXTRA='--no-bandwidth' $0
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/demo64.sh"  # REPO, PY, MODEL (built when missing)
LIMIT_MB=${LIMIT_MB:-2700}
CACHE_MB=${CACHE_MB:-1290 2000}
POLICY=${POLICY:-next-use}
N=${N:-64}
REPEATS=${REPEATS:-3}
WARMUP=${WARMUP:-0}
THREADS=${THREADS:-1}
SKIP=${SKIP:-0}
EXTRA=${EXTRA:-}
OUT=${OUT:-$REPO/bench/reports/$(date +%Y-%m-%d)-policies-limit}
# shellcheck disable=SC2086  # EXTRA is a list of flags
configs=()
for mb in $CACHE_MB; do
  # every lever spelled out, so a change of bmoe-cli's defaults does not change what is measured
  configs+=(--config "lru-serial-$mb=--cache-policy lru --cache-mb $mb --no-overlap --no-spec-gate"
            --config "$POLICY-serial-$mb=--cache-policy $POLICY --cache-mb $mb --no-overlap --no-spec-gate"
            --config "lru-overlap-$mb=--cache-policy lru --cache-mb $mb --overlap --no-spec-gate"
            --config "$POLICY-overlap-$mb=--cache-policy $POLICY --cache-mb $mb --overlap --no-spec-gate")
done
# shellcheck disable=SC2086  # EXTRA is a list of flags
"$PY" -m bmoe.tools.bench run -m "$MODEL" -p "Write a story about a lighthouse keeper who finds a message in a bottle." \
    -n "$N" --repeats "$REPEATS" --warmup "$WARMUP" --skip-tokens "$SKIP" --no-baseline \
    --common "-t $THREADS -c 512 --chat --io-threads 2" --mem-limit-mb "$LIMIT_MB" \
    "${configs[@]}" --out "$OUT" $EXTRA
echo "policies_limit: report in $OUT/report.md" >&2
