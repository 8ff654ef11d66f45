#!/usr/bin/env bash
# Issue 8: 150-token routing traces of the 64-expert demo model for three kinds of prompt (story,
# factual Q&A, code), then `bmoe-bench policies` on them (LRU, Belady's bound, every candidate).
#   MODEL=path (default bench/models/demo64.gguf, written by bmoe-demo when missing)
#   OUT=dir (default bench/reports/<date>-issue8)  N=150  BUDGETS=10,25,50,75  ONLY=traces|policies
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/demo64.sh"  # REPO, PY, MODEL (built when missing)
OUT=${OUT:-$REPO/bench/reports/$(date +%Y-%m-%d)-issue8}
N=${N:-150}
BUDGETS=${BUDGETS:-10,25,50,75}
ONLY=${ONLY:-}
declare -A PROMPTS=(
  [story]="Write a story about a lighthouse keeper who finds a message in a bottle."
  [factual]="Explain how the human heart pumps blood through the body, step by step."
  [code]="Write a Python function that checks whether a string is a palindrome, and explain it."
)
mkdir -p "$OUT/traces"
if [[ -z $ONLY || $ONLY == traces ]]; then
  for name in story factual code; do
    echo "issue8: tracing $name ($N tokens) ..." >&2
    "$PY" -m bmoe.cli -m "$MODEL" --chat -p "${PROMPTS[$name]}" -n "$N" --cache-mb 2000 -t 1 \
        --route-trace "$OUT/traces/$name.jsonl" > "$OUT/traces/$name.out"
  done
fi
if [[ -z $ONLY || $ONLY == policies ]]; then
  "$PY" -m bmoe.tools.bench policies "$OUT/traces/story.jsonl" "$OUT/traces/factual.jsonl" "$OUT/traces/code.jsonl" \
      -m "$MODEL" --budgets "$BUDGETS" --out "$OUT/policies-table.md"
fi
