#!/usr/bin/env bash
# Issue 3: 150-token routing traces of the 64-expert demo model for three kinds of prompt, and what
# `bmoe-bench routes` says of each (previous-token reuse, next-layer router recall, LRU curve).
#   MODEL=path (default bench/models/demo64.gguf, written by bmoe-demo when missing)  OUT=dir  N=150
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/demo64.sh"  # REPO, PY, MODEL (built when missing)
OUT=${OUT:-$REPO/bench/reports/$(date +%Y-%m-%d)-issue3/traces}
N=${N:-150}
mkdir -p "$OUT"
declare -A PROMPTS=(
  [story]="Write a story about a lighthouse keeper who finds a message in a bottle."
  [factual]="Explain how the human heart pumps blood through the body, step by step."
  [code]="Write a Python function that checks whether a string is a palindrome, and explain it."
)
for name in story factual code; do
  echo "issue3: tracing $name ($N tokens) ..." >&2
  "$PY" -m bmoe.cli -m "$MODEL" --chat -p "${PROMPTS[$name]}" -n "$N" --cache-mb 2000 \
      --route-trace "$OUT/$name.jsonl" > "$OUT/$name.out"
  "$PY" -m bmoe.tools.bench routes "$OUT/$name.jsonl" -m "$MODEL" | tee "$OUT/$name.routes.txt"
done
