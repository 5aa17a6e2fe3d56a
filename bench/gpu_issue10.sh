#!/usr/bin/env bash
# The layer-attention measurements issue 10 needs, for a lent GPU session (device tool `run`).
# Each stage fits one device call (<= 10 min); results go under $OUT (default bench/results/gpu).
#
#   bash bench/gpu_issue10.sh setup        # editable install without deps (the machine has torch/triton)
#   bash bench/gpu_issue10.sh tests        # op + module tests on the GPU (bf16 included), log to $OUT
#   bash bench/gpu_issue10.sh quick        # BERT-base bf16 N=4096: all six providers, the headline
#   bash bench/gpu_issue10.sh sweep bert-base bf16   # one shape x dtype of the N sweep (eager, compile-max, fused)
#   bash bench/gpu_issue10.sh memory       # BERT-base bf16 N=4096, fused only, three backward group budgets
#   bash bench/gpu_issue10.sh profile      # torch.profiler table of one fused forward + backward
#   bash bench/gpu_issue10.sh probe        # the open 16-bit fault: neighbouring shapes, one process each
#   bash bench/gpu_issue10.sh session      # one call: headline, tests, N sweep, profile (time-boxed)
#   bash bench/gpu_issue10.sh rerun        # shorter: headline without torch.compile, bf16 sweep, profile, tests
#   bash bench/gpu_issue10.sh next-a       # tests + full headline, one tarball back; next-b: the bf16/fp16 N sweep + profile
#   bash bench/gpu_issue10.sh rowscale-ab  # the value kernels' ROWSCALE forms against the others, fused only, one tarball
#   bash bench/gpu_issue10.sh setup && bash bench/gpu_issue10.sh host-probe   # event/host/CUDA-graph times + cProfile, the new GPU tests, then the kernel tests from the 31st on, one tarball (one call, <= 8 min)
#
# Then: copy $OUT/*.json into bench/results/, set mhmla_fast/dispatch.py AUTO_KERNELS["cuda"] from
# the runs' auto_evidence (the inference and full rows against the shipped rule), and quote the
# files in README.md. MHMLA_BENCH_COMMIT names the
# commit (the device's copy of the tree has no .git).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
unset TRITON_INTERPRET
stage=${1:?stage: setup, tests, quick, sweep SHAPE DTYPE or profile}
[ "$stage" = setup ] || source bench/gpu_env.sh
case "$stage" in
  setup)
    pip install -q --no-deps --no-build-isolation --no-index -e . ;;
  tests)
    # unbuffered, so that a run cut by a stage's timeout still leaves its lines in the log
    MHMLA_TRITON_CONFIGS=fixed python -u -m pytest -q -rs --durations=10 \
      tests/test_layer_attention.py tests/test_layer_attention_module.py \
      2>&1 | tee "$OUT/tests_gpu.log" ;;  # (the compile gate runs in CI, on the CPU)
  quick)
    python bench/benchmark_layer_attention.py --quick --out "$OUT/" 2>&1 | tee "$OUT/quick.log" ;;
  sweep)
    shape=${2:?shape}; dtype=${3:?dtype}
    python bench/benchmark_layer_attention.py --shapes "$shape" --dtypes "$dtype" \
      --providers eager compile-max fused --modes forward backward full inference \
      --out "$OUT/" 2>&1 | tee "$OUT/sweep_${shape}_${dtype}.log" ;;
  memory)  # the speed/memory trade-off of the backward's layer groups (2^23: 1 layer at BERT-base)
    for budget in 8388608 16777216 33554432 67108864; do
      python bench/benchmark_layer_attention.py --quick --providers eager fused --modes full \
        --bwd-group-elements $budget --out "$OUT/" 2>&1 | tee -a "$OUT/memory.log"
    done ;;
  profile)
    python - <<'PY' 2>&1 | tee "$OUT/profile_fused_bert_base_bf16.txt"
import torch
from torch.profiler import ProfilerActivity, profile
from mhmla_fast import layer_attention
L, N, H, K, J = 12, 4096, 768, 768, 12
g = torch.Generator(device="cuda").manual_seed(0)
def r(*s, scale=1.0):
    return (torch.randn(*s, device="cuda", generator=g) * scale).bfloat16().requires_grad_()
ts = [r(L, N, H), r(L, H, H, scale=H**-0.5), r(L, H, scale=0.02), r(L, H, K, scale=H**-0.5),
      r(L, K, scale=0.02), r(L, K, J, scale=K**-0.5), r(L, J, scale=0.02)]
dc = torch.randn(N, H, device="cuda", generator=g).bfloat16()
for backend in ("torch", "triton"):
    for _ in range(3):  # compile + autotune outside the profile
        torch.autograd.grad(layer_attention(*ts, J, backend=backend), ts, dc)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            torch.autograd.grad(layer_attention(*ts, J, backend=backend), ts, dc)
        torch.cuda.synchronize()
    print(f"=== backend={backend}: 5 x (forward + backward), {torch.cuda.get_device_name()}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
PY
    ;;
  first)  # (run 'setup' first) one device call, most telling first, each step time-boxed so the logs come back
    python -c "import setuptools, pip; print('setuptools', setuptools.__version__, 'pip', pip.__version__)"
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/nvidia_smi.txt"
    TRITON_PRINT_AUTOTUNING=1 timeout 150 python bench/benchmark_layer_attention.py --quick \
      --providers eager fused cublas --out "$OUT/first_quick.json" 2>&1 | tee "$OUT/first_quick.log" || true
    TRITON_PRINT_AUTOTUNING=1 timeout 120 python bench/benchmark_layer_attention.py --shapes minilm \
      --dtypes bf16 --n 4096 --providers eager fused cublas --out "$OUT/first_minilm.json" \
      2>&1 | tee "$OUT/first_minilm.log" || true
    timeout 90 bash "$0" profile || true
    timeout 170 bash "$0" tests || true ;;
  second)  # one device call: the N sweep (eager vs fused) at both shapes and dtypes, then the
    # headline with every provider (compile-max autotunes for minutes)
    for shape in bert-base minilm; do for dtype in bf16 fp16; do
      timeout 140 python bench/benchmark_layer_attention.py --shapes $shape --dtypes $dtype \
        --n 1024 4096 16384 --providers eager fused --modes full inference forward \
        --out "$OUT/sweep_${shape}_${dtype}.json" > "$OUT/sweep_${shape}_${dtype}.log" 2>&1 || true
      grep -A24 "^auto's evidence" "$OUT/sweep_${shape}_${dtype}.log" || tail -5 "$OUT/sweep_${shape}_${dtype}.log"
    done; done
    timeout 330 python bench/benchmark_layer_attention.py --quick --modes inference forward full \
      --out "$OUT/headline.json" > "$OUT/headline.log" 2>&1 || true
    sed -n '/^speedup/,$p' "$OUT/headline.log" | head -40 ;;
  session)  # (run 'setup' first) one device call for the whole issue-10 picture, most telling
    # first, each step time-boxed so that what finished comes back: the headline with every
    # provider, the GPU kernel tests, the N sweep (eager, fused, auto) at both shapes and
    # 16-bit dtypes, and a profile of the fused forward + backward
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/nvidia_smi.txt"
    TRITON_PRINT_AUTOTUNING=1 timeout 170 python bench/benchmark_layer_attention.py --quick \
      --modes inference forward full --out "$OUT/headline.json" > "$OUT/headline.log" 2>&1 || true
    sed -n '/^speedup/,$p' "$OUT/headline.log" | head -40
    timeout 80 bash "$0" tests > /dev/null 2>&1 || true
    tail -3 "$OUT/tests_gpu.log" || true
    for shape in bert-base minilm; do for dtype in bf16 fp16; do
      TRITON_PRINT_AUTOTUNING=1 timeout 40 python bench/benchmark_layer_attention.py --shapes $shape \
        --dtypes $dtype --n 1024 4096 16384 --providers eager fused auto --modes full inference forward \
        --out "$OUT/sweep_${shape}_${dtype}.json" > "$OUT/sweep_${shape}_${dtype}.log" 2>&1 || true
      grep -A24 "^auto's evidence" "$OUT/sweep_${shape}_${dtype}.log" || tail -5 "$OUT/sweep_${shape}_${dtype}.log"
    done; done
    timeout 45 bash "$0" profile > /dev/null 2>&1 || true ;;
  rerun)  # (run 'setup' first) a shorter call after a kernel change: headline without the
    # torch.compile providers (their autotuning takes minutes), the bf16 N sweep at both
    # shapes, the profile, then the GPU kernel tests
    TRITON_PRINT_AUTOTUNING=1 timeout 70 python bench/benchmark_layer_attention.py --quick \
      --providers eager fused auto cublas --modes forward full --out "$OUT/headline.json" \
      > "$OUT/headline.log" 2>&1 || true
    sed -n '/^speedup/,/^  \* headline/p' "$OUT/headline.log" | head -12
    for shape in bert-base minilm; do
      TRITON_PRINT_AUTOTUNING=1 timeout 80 python bench/benchmark_layer_attention.py --shapes $shape \
        --dtypes bf16 --n 1024 4096 16384 --providers eager fused --modes full inference forward \
        --out "$OUT/sweep_${shape}_bf16.json" > "$OUT/sweep_${shape}_bf16.log" 2>&1 || true
      grep -A24 "^auto's evidence" "$OUT/sweep_${shape}_bf16.log" || tail -3 "$OUT/sweep_${shape}_bf16.log"
    done
    timeout 40 bash "$0" profile > /dev/null 2>&1 || true
    timeout 60 bash "$0" tests > /dev/null 2>&1 || true
    grep -E "passed|failed|^FAILED" "$OUT/tests_gpu.log" | tail -8 || true ;;
  next-a|next-b)  # (run 'setup' first) two calls of about 5 minutes, each returning one
    # tarball (a device call returns at most 8 files): a = the GPU kernel tests and the
    # headline with every provider; b = the N sweep (eager, fused, auto) at both shapes in
    # bf16 and fp16, and the profile
    raw="$OUT/raw_$stage"; mkdir -p "$raw"
    if [ "$stage" = next-a ]; then
      nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$raw/nvidia_smi.txt"
      OUT="$raw" timeout 150 bash "$0" tests > /dev/null 2>&1 || true
      grep -E "passed|failed|^FAILED|^ERROR" "$raw/tests_gpu.log" | tail -12 || true
      TRITON_PRINT_AUTOTUNING=1 timeout 170 python bench/benchmark_layer_attention.py --quick \
        --modes inference forward full --out "$raw/headline.json" > "$raw/headline.log" 2>&1 || true
      sed -n '/^speedup/,/^  \* headline/p' "$raw/headline.log" | head -14
    else
      for shape in bert-base minilm; do for dtype in bf16 fp16; do
        TRITON_PRINT_AUTOTUNING=1 timeout 90 python bench/benchmark_layer_attention.py --shapes $shape \
          --dtypes $dtype --n 1024 4096 16384 --providers eager fused auto --modes full inference forward \
          --out "$raw/sweep_${shape}_${dtype}.json" > "$raw/sweep_${shape}_${dtype}.log" 2>&1 || true
        grep -E "^$shape +$dtype .*(eager|fused|auto) +full" "$raw/sweep_${shape}_${dtype}.log" || true
      done; done
      OUT="$raw" timeout 40 bash "$0" profile > /dev/null 2>&1 || true
    fi
    tar czf "$OUT/$stage.tgz" -C "$raw" . && rm -rf "$raw" ;;
  rowscale-ab)  # (run 'setup' first) one call of about 4 minutes: the fused op at both shapes,
    # bf16, N = 1024 and 4096, autotuned over the value kernels' ROWSCALE forms only, over the
    # others only, and over both (what users get); the autotuner's picks are in the logs
    raw="$OUT/raw_$stage"; mkdir -p "$raw"
    for choice in rowscale no-rowscale both; do
      env_choice=$choice; [ "$choice" = both ] && env_choice=
      for shape in bert-base minilm; do
        MHMLA_TRITON_CONFIGS=$env_choice TRITON_PRINT_AUTOTUNING=1 timeout 75 python \
          bench/benchmark_layer_attention.py --shapes $shape --dtypes bf16 --n 1024 4096 \
          --providers fused --modes forward full --out "$raw/${choice}_${shape}.json" \
          > "$raw/${choice}_${shape}.log" 2>&1 || true
        grep -E "^$shape +bf16 .*fused +(forward|full)" "$raw/${choice}_${shape}.log" | sed "s/^/$choice /" || true
      done
    done
    tar czf "$OUT/$stage.tgz" -C "$raw" . && rm -rf "$raw" ;;
  host-probe)  # (after 'setup', in the same call) at most 7.5 minutes, one tarball:
    # bench/layer_attention_graph_probe.py first (a cProfile of the fused call, then eager and
    # fused forward + backward: event time, host time and CUDA-graph replay time, the fused
    # rows with direct and with JIT launches; autotuning at BERT-base takes about a minute of
    # it), then the new GPU tests, then the GPU kernel tests from the 31st on (the 'tests'
    # stage reached only 31 in 150 s: each new shape compiles for seconds)
    raw="$OUT/raw_$stage"; mkdir -p "$raw"
    timeout 240 python bench/layer_attention_graph_probe.py --out "$raw" > "$raw/graph_probe.log" 2>&1 || true
    grep -E "fwd|cProfile of" "$raw/graph_probe.log" || tail -5 "$raw/graph_probe.log"
    files="tests/test_layer_attention.py tests/test_layer_attention_module.py"
    # first the tests of 2026-11-27's changes (CUDA-graph replays with dropout, the seed read
    # on the device, the inference forward), then the rest from the 31st on
    new="cuda_graph_replays or read_the_dropout_seed or inference_skips"
    mapfile -t rest < <(python -m pytest --collect-only -q $files -k "not ($new)" 2>/dev/null \
      | grep '::' | sed -n '31,$p')
    MHMLA_TRITON_CONFIGS=fixed timeout 90 python -u -m pytest -q -rfs \
      tests/test_layer_attention.py -k "$new" > "$raw/tests_gpu_new.log" 2>&1 || true
    grep -E "passed|failed|^FAILED|^ERROR" "$raw/tests_gpu_new.log" | tail -5 || true
    MHMLA_TRITON_CONFIGS=fixed timeout 120 python -u -m pytest -q -rfs "${rest[@]}" \
      > "$raw/tests_gpu_from31.log" 2>&1 || true
    grep -E "passed|failed|^FAILED|^ERROR" "$raw/tests_gpu_from31.log" | tail -12 || true
    tar czf "$OUT/$stage.tgz" -C "$raw" . && rm -rf "$raw" ;;
  probe)  # the open 16-bit fault (13 70 120 72 3 in fp16): neighbouring shapes, one process each
    export CUDA_LAUNCH_BLOCKING=1 MHMLA_TRITON_CONFIGS=fixed
    for s in "13 70 120 72 3" "2 70 120 72 3" "13 64 120 72 3" "13 70 128 72 3" "13 70 120 80 3" \
             "13 70 120 72 4" "2 64 120 72 3" "2 70 120 64 3" "2 70 96 72 3"; do
      for dt in float16 bfloat16; do
        timeout 60 python bench/layer_attention_probe.py $s $dt 2>&1 | tail -1
      done
    done | tee "$OUT/probe_16bit_fault.txt"
    # the fault shape with one and two pipeline stages, and 8 warps: software pipelining or not
    for opt in "--stages 1" "--stages 2" "--warps 8"; do
      for dt in float16 bfloat16; do
        timeout 60 python bench/layer_attention_probe.py 13 70 120 72 3 $dt $opt 2>&1 | tail -1
      done
    done | tee -a "$OUT/probe_16bit_fault.txt" ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
