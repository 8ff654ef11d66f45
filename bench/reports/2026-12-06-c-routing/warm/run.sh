#!/bin/bash
M=/work/models/qwen3-30b-a3b-like-q4_k_m.gguf
for r in 1 2 3 4 5; do
  for arm in new main; do
    if [ $arm = new ]; then T=/work/main; else T=/work/bmoe-main; fi
    (cd $T && .venv/bin/python -m bmoe.cli -m $M -p 'Write a story about a dragon who learns to bake bread.' -t 2 -n 32 --io-threads 4 --cache-mb 2000 --no-warm-start --csv ./$arm-$r.csv > /dev/null 2>&1)
    echo "$arm r$r $(tail -1 ./$arm-$r.csv | tr ' ' '\n' | grep -E 'tok/s|compute_s|stall_s|mgmt_s' | tr '\n' ' ')"
  done
done
