#!/bin/bash
# OpenMP's spin between graph pieces, A/B on the streaming Qwen3-30B-A3B shape: interleaved rounds of
# bmoe-cli with GOMP_SPINCOUNT unset (libgomp's default) and set low. Usage: run.sh MODEL OUT_DIR
M=${1:-/work/models/qwen3-30b-a3b-like-q4_k_m.gguf}
OUT=${2:-.}
for r in 1 2 3 4 5 6; do
  for arm in default 3000 10000 300; do
    if [ $arm = default ]; then unset GOMP_SPINCOUNT; else export GOMP_SPINCOUNT=$arm; fi
    python -m bmoe.cli -m "$M" -p 'Write a story about a dragon who learns to bake bread.' -t 2 -n 32 \
      --io-threads 4 --cache-mb 2000 --no-warm-start --csv "$OUT/t$arm-$r.csv" > /dev/null 2>&1
    echo "$arm r$r $(tail -1 "$OUT/t$arm-$r.csv" | tr ' ' '\n' | grep -E 'tok/s|compute_s|stall_s' | tr '\n' ' ')"
  done
done
