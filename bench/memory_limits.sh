#!/usr/bin/env bash
# Does bmoe stay alive, correct and fast under memory limits, including one squeezed mid-run? Each case
# is a bench/memory_squeeze.py run on the 64-expert demo model (built when missing), -t 2
# --io-threads 4, cold page cache; its report checks exit 0, no OOM kill and the --no-stream text:
#   adversary/      default flags under 3000 MiB, a 900 MiB balloon in the cgroup from token 10 to 40, 5 runs
#   limit-2500, limit-2000, limit-1500/   default flags under each limit, no balloon, 2 runs each
#   dense-fixed1300, dense-pin, dense-fixed1300-adapt-pin/   what a tight limit does to the dense weights (1500 MiB)
# Knobs: MODEL=path RUNS=5 OUT=dir. About 20 minutes.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/demo64.sh"  # REPO, PY, MODEL (built when missing)
RUNS=${RUNS:-5}
OUT=${OUT:-$REPO/bench/reports/$(date +%Y-%m-%d)-memory-limits}
A=("$PY" "$REPO/bench/memory_squeeze.py" -m "$MODEL")
"${A[@]}" --runs "$RUNS" --limit-mb 3000 --balloon-mb 900 --out "$OUT/adversary"
for mb in 2500 2000 1500; do
  "${A[@]}" --runs 2 --limit-mb "$mb" --balloon-mb 0 --out "$OUT/limit-$mb"
done
"${A[@]}" --runs 1 --limit-mb 1500 --balloon-mb 0 --flags "-t 2 --io-threads 4 --cache-mb 1300" --out "$OUT/dense-fixed1300"
"${A[@]}" --runs 1 --limit-mb 1500 --balloon-mb 0 --flags "-t 2 --io-threads 4 --pin-dense" --out "$OUT/dense-pin"
"${A[@]}" --runs 1 --limit-mb 1500 --balloon-mb 0 --flags "-t 2 --io-threads 4 --cache-mb 1300 --adapt --pin-dense" --out "$OUT/dense-fixed1300-adapt-pin"
echo "memory_limits: reports in $OUT/*/report.md" >&2
