#!/bin/bash
# How fast does bmoe decode a model that does not fit in memory, against plain llama.cpp (mmap)?
# The 64-expert demo model (built when missing; 5.5 GB) under a 2500 MiB memory limit, 4 lanes, -t 2,
# 64 tokens of "Write a story about a dragon who learns to bake bread.", page cache dropped per run:
#   decode:   --cache-mb 1300 and 1900, each with --overlap (the default) and --no-overlap (serial),
#             and 1900 with --spec-gate; mmap beside them (~20 min: mmap runs at 0.3 tok/s)
#   resident: every expert cached (no limit, --preload) against mmap: what the hook costs when
#             nothing has to be read (~5 min)
# Usage: bash bench/decode_limit.sh OUT_DIR [decode|resident ...]   (default: both)
# Each part is one `bmoe-bench run` into OUT_DIR/<part>. Needs a quiet machine.
# Time to first token on the same workload: bench/ttft.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/demo64.sh"  # REPO, PY, MODEL (built when missing)
OUT=${1:?usage: decode_limit.sh OUT_DIR [decode|resident ...]}
shift
PARTS=${*:-decode resident}
BENCH=("$PY" -m bmoe.tools.bench run -m "$MODEL")
PROMPT="Write a story about a dragon who learns to bake bread."
for part in $PARTS; do
  case $part in
    decode)
      "${BENCH[@]}" --mem-limit-mb 2500 --common '-t 2' -n 64 --repeats 3 -p "$PROMPT" \
        --config c1300='--cache-mb 1300 --io-threads 4' \
        --config c1300-serial='--cache-mb 1300 --io-threads 4 --no-overlap' \
        --config c1900='--cache-mb 1900 --io-threads 4' \
        --config c1900-serial='--cache-mb 1900 --io-threads 4 --no-overlap' \
        --config c1900-spec='--cache-mb 1900 --io-threads 4 --spec-gate' \
        --out "$OUT/decode" ;;
    resident)
      "${BENCH[@]}" -n 64 --repeats 3 --common '-t 2' -p "$PROMPT" \
        --config resident='--cache-mb 6000 --io-threads 2 --preload' \
        --out "$OUT/resident" ;;
    *) echo "unknown part $part (decode, resident)" >&2; exit 2 ;;
  esac
done
