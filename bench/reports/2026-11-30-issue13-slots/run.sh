#!/bin/bash
# usage: run.sh TREE MB TAG  -> one cold run of the reference workload in a 2500 MiB cgroup (/tmp/incg.sh), output in /tmp/ab/TAG.out/.err
TREE=$1; MB=$2; TAG=$3
sync; echo 1 > /proc/sys/vm/drop_caches
cd $TREE && PYTHONPATH=$TREE /tmp/incg.sh 2500 /work/main/.venv/bin/python -m bmoe.cli -m /work/models/demo64.gguf \
  --cache-mb $MB --io-threads 4 -t 2 -n 32 -p "Write a story about a dragon who learns to bake bread." --profile \
  > /tmp/ab/$TAG.out 2> /tmp/ab/$TAG.err
echo "rc=$?" >> /tmp/ab/$TAG.err
