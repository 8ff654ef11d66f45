#!/bin/bash
# Time to first token of a ~2000-token prompt on the Qwen3-30B-A3B shape: plain llama.cpp (file in the page
# cache, no limit) against bmoe streaming under a 4000 MiB memory cgroup (cgroup v1 here) from a cold file,
# uncapped and at flash-limit 700; time to first token = load_s + prefill_s of bmoe-cli's summary.
# Usage: run.sh MODEL OUT_DIR [ROUNDS]
set -u
M=${1:-/work/models/qwen3-30b-a3b-like-q4_k_m.gguf}; OUT=${2:-.}; ROUNDS=${3:-2}
PY=${PY:-python}
# the first 4290 characters of bench/prompts/prefill_2000.txt: ~2000 tokens in the synthetic shapes' vocabulary
P="$OUT/prompt.txt"
head -c 4290 "$(dirname "$0")/../../prompts/prefill_2000.txt" > "$P"
CG=/sys/fs/cgroup/memory$(grep ':memory:' /proc/self/cgroup | cut -d: -f3)/bmoe-ttft
mkdir -p "$CG" && echo $((4000 << 20)) > "$CG/memory.limit_in_bytes"
common=(-m "$M" -f "$P" -c 4096 -n 8 -t 2)
drop() { $PY -c "from bmoe.tools.bench_sys import drop_file_cache; drop_file_cache(['$M'])"; }
for r in $(seq "$ROUNDS"); do
  cat "$M" > /dev/null
  $PY -m bmoe.cli "${common[@]}" --no-stream --csv "$OUT/plain-$r.csv" > "$OUT/plain-$r.out" 2>/dev/null
  for cap in 0 700; do
    drop
    pre=(); [ $cap != 0 ] && pre=(/work/shared/tools/flash-limit $cap --)
    sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' x "$CG" "${pre[@]}" $PY -m bmoe.cli "${common[@]}" \
      --io-threads 4 --cache-mb 2000 --no-warm-start --csv "$OUT/bmoe-cap$cap-$r.csv" > "$OUT/bmoe-cap$cap-$r.out" 2>/dev/null
  done
  for f in plain-$r bmoe-cap0-$r bmoe-cap700-$r; do
    echo "$f $(tail -1 "$OUT/$f.csv" | tr ' ' '\n' | grep -E '^(prefill_tokens|prefill_s|load_s)=' | tr '\n' ' ')"
  done
done
rmdir "$CG" 2>/dev/null
