#!/bin/bash
# Issue 13's acceptance runs on the 64-expert demo model under a 2500 MiB memory limit, 4 lanes, -t 2:
#   decode: 64 tokens of the issue's prompt at --cache-mb 1300 and 1900, overlap and serial, and
#           1900 with --spec-gate; mmap (plain llama.cpp) beside them
#   ttft:   -n 1 on ~400- and ~2000-token prompts (bench/prompts/): time to first token, prefill tok/s,
#           load, bmoe's own load
#   resident: every expert cached (no limit), s/token against mmap (issue 2's hook overhead)
# Usage: bash bench/issue13_accept.sh OUT_DIR [decode|ttft|resident ...]   (default: all three)
# Each part is one `bmoe-bench run` into OUT_DIR/<part>[-<prompt>]; about 15, 15 and 5 minutes.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/demo64.sh"
OUT=${1:?usage: issue13_accept.sh OUT_DIR [decode|ttft|resident ...]}
shift
PARTS=${*:-decode ttft resident}
BENCH=("$PY" -m bmoe.tools.bench run -m "$MODEL")
LIMIT=(--mem-limit-mb 2500 --common '-t 2')
for part in $PARTS; do
  case $part in
    decode)
      "${BENCH[@]}" "${LIMIT[@]}" -n 64 --repeats 3 \
        -p "Write a story about a dragon who learns to bake bread." \
        --config c1300='--cache-mb 1300 --io-threads 4' \
        --config c1300-serial='--cache-mb 1300 --io-threads 4 --no-overlap' \
        --config c1900='--cache-mb 1900 --io-threads 4' \
        --config c1900-serial='--cache-mb 1900 --io-threads 4 --no-overlap' \
        --config c1900-spec='--cache-mb 1900 --io-threads 4 --spec-gate' \
        --out "$OUT/decode" ;;
    ttft)
      for n in 400 2000; do
        "${BENCH[@]}" --mem-limit-mb 2500 --common '-t 2 -c 4096' -n 1 --repeats 3 \
          -f "$REPO/bench/prompts/prefill_$n.txt" \
          --config c1300='--cache-mb 1300 --io-threads 4' \
          --config c1900='--cache-mb 1900 --io-threads 4' \
          --out "$OUT/ttft-$n"
      done ;;
    resident)
      "${BENCH[@]}" -n 64 --repeats 3 --common '-t 2' \
        -p "Write a story about a dragon who learns to bake bread." \
        --config resident='--cache-mb 6000 --io-threads 2 --preload' \
        --out "$OUT/resident" ;;
    *) echo "unknown part $part (decode, ttft, resident)" >&2; exit 2 ;;
  esac
done
