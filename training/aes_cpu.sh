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
# 3. the shipped scorer (since 2026-12-07): the stack of four ridges (on [CLS] vectors, token
#    means and surface features) as one linear map per prompt, fold-0 train, each ridge's alpha
#    by fold-0 dev, NNLS weights and cutpoints on out-of-fold predictions (the single ridge
#    shipped before it: without --ridge-stack; the MHMLA scorer before that: --export-shipped)
mhmla-train aes --export-ridge runs/aes-ridge/aes-minilm-ridge-stack --ridge-stack \
  --threads "$THREADS"
# 4. its fold-0 dev and test QWK through the real encoder (not the cache)
for split in dev test; do
  mhmla-eval aes --model runs/aes-ridge/aes-minilm-ridge-stack --fold 0 --split "$split" \
    --no-cache --threads "$THREADS" --json "runs/aes-ridge/eval-fold0-$split-encoder.json"
done
# then: cp -r runs/aes-ridge/aes-minilm-ridge-stack mhmla_fast/models/ and, on a CPU with bf16
# instructions (AVX-512 bf16 or AMX), measure its checked bf16 scorer's margins: python
# bench/openvino_bf16_score_cpu.py --threads 2 --write-margins mhmla_fast/models/aes-minilm-ridge-stack
# (until then backend auto scores it with ONNX Runtime fp32 on every CPU)
# 5. seed variance of the head models: seeds 1 and 2 (ridge and TF-IDF are deterministic),
#    then the summary -> bench/results/aes_cpu-frozen-encoder-seeds.json (about 40 minutes)
for s in 1 2; do
  mhmla-train aes --out "runs/aes-cpu-seed$s" --seed "$s" --threads "$THREADS" \
    --models mhmla-cls,mhmla-reg,last-cls,avgl-cls,last-reg,avgl-reg,mhmla-joint-cls,mhmla-joint-reg \
    --results "bench/results/aes_cpu-frozen-encoder-seed$s.json"
done
python bench/aes_seed_summary.py bench/results/aes_cpu-frozen-encoder.json \
  bench/results/aes_cpu-frozen-encoder-seed1.json bench/results/aes_cpu-frozen-encoder-seed2.json
