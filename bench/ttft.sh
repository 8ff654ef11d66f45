#!/bin/bash
# How long until the first token, against plain llama.cpp (mmap)? Time to first token = load + prefill
# (bmoe-bench's "Time to first token" table) on the ~400- and ~2000-token prompts in bench/prompts/,
# -n 1 -c 4096, the 64-expert demo model (built when missing) under a 2500 MiB memory limit, 4 lanes,
# -t 2, --cache-mb 1300 and 1900, page cache dropped before every run (~15 min). Needs a quiet machine.
# Usage: bash bench/ttft.sh OUT_DIR [400|2000 ...]   (default: both; one `bmoe-bench run` into OUT_DIR/ttft-<n>)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/demo64.sh"  # REPO, PY, MODEL (built when missing)
OUT=${1:?usage: ttft.sh OUT_DIR [400|2000 ...]}
shift
for n in ${*:-400 2000}; do
  "$PY" -m bmoe.tools.bench run -m "$MODEL" --mem-limit-mb 2500 --common '-t 2 -c 4096' -n 1 --repeats 3 \
    -f "$REPO/bench/prompts/prefill_$n.txt" \
    --config c1300='--cache-mb 1300 --io-threads 4' \
    --config c1900='--cache-mb 1900 --io-threads 4' \
    --out "$OUT/ttft-$n"
done
