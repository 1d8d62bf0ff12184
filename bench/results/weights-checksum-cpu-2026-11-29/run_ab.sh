#!/bin/bash
# interleaved A/B of python -m pipeline.bench weights: old (a3eaf45, sum32) vs new (sum64)
for r in 0 1 2; do
  for v in old new; do
    if [ $v = old ]; then d=/work/wt-old; else d=/work/main; fi
    echo "== $v repeat $r $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    (cd $d && timeout 600 /work/main/.venv/bin/python -m pipeline.bench weights --models smollm2-135m --modes staged --kinds full --updates 6 --out /work/ab/weights-$v-$r.json 2>&1 | tail -8)
  done
done
