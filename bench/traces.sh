#!/usr/bin/env bash
# How predictable is routing, and what would each cache policy do with it? Records 150-token
# `--route-trace` files of the 64-expert demo model (built when missing) for three kinds of prompt
# (story, factual Q&A, code), then:
#   routes:   `bmoe-bench routes` on each (previous-token reuse, next-layer router recall, LRU curve)
#             into OUT/traces/NAME.routes.txt;
#   policies: `bmoe-bench policies` on all three (every cache policy, LRU and Belady's bound, replayed)
#             into OUT/policies-table.md.
# Knobs: MODEL=path  OUT=dir (default bench/reports/<date>-traces)  N=150  BUDGETS=10,25,50,75
#        ONLY=traces|routes|policies (one step; routes and policies read the traces already in OUT)
# The traces behind the committed policy figures are in bench/reports/2026-11-29-issue8/traces/.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/demo64.sh"  # REPO, PY, MODEL (built when missing)
OUT=${OUT:-$REPO/bench/reports/$(date +%Y-%m-%d)-traces}
N=${N:-150}
BUDGETS=${BUDGETS:-10,25,50,75}
ONLY=${ONLY:-}
NAMES=(story factual code)
declare -A PROMPTS=(
  [story]="Write a story about a lighthouse keeper who finds a message in a bottle."
  [factual]="Explain how the human heart pumps blood through the body, step by step."
  [code]="Write a Python function that checks whether a string is a palindrome, and explain it."
)
mkdir -p "$OUT/traces"
if [[ -z $ONLY || $ONLY == traces ]]; then
  for name in "${NAMES[@]}"; do
    echo "traces: tracing $name ($N tokens) ..." >&2
    "$PY" -m bmoe.cli -m "$MODEL" --chat -p "${PROMPTS[$name]}" -n "$N" --cache-mb 2000 -t 1 \
        --route-trace "$OUT/traces/$name.jsonl" > "$OUT/traces/$name.out"
  done
fi
if [[ -z $ONLY || $ONLY == routes ]]; then
  for name in "${NAMES[@]}"; do
    "$PY" -m bmoe.tools.bench routes "$OUT/traces/$name.jsonl" -m "$MODEL" | tee "$OUT/traces/$name.routes.txt"
  done
fi
if [[ -z $ONLY || $ONLY == policies ]]; then
  TRACES=()
  for name in "${NAMES[@]}"; do TRACES+=("$OUT/traces/$name.jsonl"); done
  "$PY" -m bmoe.tools.bench policies "${TRACES[@]}" -m "$MODEL" --budgets "$BUDGETS" --out "$OUT/policies-table.md"
fi
