#!/usr/bin/env bash
# GED systems of the paper's Table 2 on all-MiniLM-L6-v2, trained identically, then scored.
# Usage: training/ged_table2.sh [EPOCHS] [SEED] [HEADS...]
# CPU: about 8-10 minutes per epoch per system with 2 free cores (here the three systems ran
# side by side, one thread each). Checkpoints make every run resumable: rerun to continue.
set -euo pipefail
epochs=${1:-5}
seed=${2:-0}
shift $(( $# > 2 ? 2 : $# )) || true
heads=("${@:-mhmla last avgl}")
for head in ${heads[@]}; do
  run=runs/ged-minilm-$head
  [ "$seed" != 0 ] && run=$run-seed$seed
  mhmla-train ged --out "$run" --head "$head" --heads 12 --epochs "$epochs" \
    --freeze-word-embeddings --seed "$seed" --threads 1 &
done
wait
for head in ${heads[@]}; do
  run=runs/ged-minilm-$head
  [ "$seed" != 0 ] && run=$run-seed$seed
  mhmla-eval ged-suite --model "$run/best" --out "bench/results/ged_minilm_${head}_seed${seed}.json"
done
