#!/bin/bash
for round in 1 2 3; do
for tree in wt main; do
  for th in default 1; do
    cd /work/$tree
    if [ $th = default ]; then unset AMP_ZOO_CONV_THREADS; else export AMP_ZOO_CONV_THREADS=1; fi
    out=$(.venv/bin/python train.py recipe=lenet_o2 trainer.max_steps=625 trainer.eval_every=0 logger.progress_bar=false hydra.run.dir=/tmp/bb_${tree}_${th}_$round 2>&1 | grep -E "epoch [2-5]/5" | grep -o "[0-9,]* samples/s" | tr -d , | awk '{s+=$1} END {printf "%.0f", s/NR}')
    echo "round $round tree=$tree threads=$th: $out samples/s (epochs 2-5 mean)"
  done
done
done
