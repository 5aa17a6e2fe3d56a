#!/usr/bin/env bash
# The AES CPU frozen-encoder protocol on ASAP, end to end, and the shipped scorer.
# Resumable: every step reuses what an earlier (interrupted) run left under runs/.
# About 80 minutes on 2 cores: the two feature caches ~25 each (one encoder pass since
# 2026-11-28), the GED features of the error-feature models ~12, the units ~20.
set -euo pipefail
THREADS=${THREADS:-2}
# 1. per-layer [CLS] and token-mean vectors of every window of all 12,978 essays (two
#    caches, shards every 500 essays)
mhmla-train aes --cache-only --threads "$THREADS"
# 2. every (model, fold, prompt) unit, then all models together, the human rows and the
#    ensembles -> bench/results/aes_cpu-frozen-encoder.json
mhmla-train aes --out runs/aes-cpu --threads "$THREADS"
# 3. the shipped scorer: fold-0 train, objective and epoch chosen on fold-0 dev
mhmla-train aes --export-shipped runs/aes-shipped/aes-minilm-mhmla12 --threads "$THREADS"
# 4. its fold-0 test QWK through the real encoder (not the cache)
mhmla-eval aes --model runs/aes-shipped/aes-minilm-mhmla12 --fold 0 --no-cache \
  --threads "$THREADS" --json runs/aes-shipped/eval-fold0-encoder.json
# then: cp -r runs/aes-shipped/aes-minilm-mhmla12 mhmla_fast/models/
# 5. seed variance of the head models: seeds 1 and 2 (ridge and TF-IDF are deterministic),
#    then the summary -> bench/results/aes_cpu-frozen-encoder-seeds.json (about 40 minutes)
for s in 1 2; do
  mhmla-train aes --out "runs/aes-cpu-seed$s" --seed "$s" --threads "$THREADS" \
    --models mhmla-cls,mhmla-reg,last-cls,avgl-cls,last-reg,avgl-reg,mhmla-joint-cls,mhmla-joint-reg \
    --results "bench/results/aes_cpu-frozen-encoder-seed$s.json"
done
python bench/aes_seed_summary.py bench/results/aes_cpu-frozen-encoder.json \
  bench/results/aes_cpu-frozen-encoder-seed1.json bench/results/aes_cpu-frozen-encoder-seed2.json
