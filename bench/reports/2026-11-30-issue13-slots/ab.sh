#!/bin/bash
# alternate A/B from the worktree root: main (`git archive c913620` in /tmp/ab-main) vs slots, rounds x {1300,1900}
mkdir -p /tmp/ab
for r in ${ROUNDS:-1 2 3}; do
  for mb in 1300 1900; do
    if [ $((r % 2)) = 1 ]; then order="main slots"; else order="slots main"; fi
    for t in $order; do
      tree=${MAIN_TREE:-/tmp/ab-main}; [ $t = slots ] && tree=${SLOTS_TREE:-/work/wt-slots}
      tag=$t-$mb-r$r
      echo "== $tag $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /tmp/ab/ab.log
      bench/reports/2026-11-30-issue13-slots/run.sh $tree $mb $tag
      grep -h "generation:\|moe-stream:\|moe-cache:\|rc=.*peak" /tmp/ab/$tag.out /tmp/ab/$tag.err >> /tmp/ab/ab.log
    done
  done
done
echo DONE >> /tmp/ab/ab.log
