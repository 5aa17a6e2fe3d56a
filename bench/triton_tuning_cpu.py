"""How long the first tuning of the fused inference forward takes on a fresh machine, its
candidates compiled one by one (as Triton's autotuner does) or in a pool of threads (as the
launchers do since 2026-11-27), measured without a GPU.

    python bench/triton_tuning_cpu.py                    # table + bench/results/triton_tuning_cpu.json

Each figure is one process with an empty Triton cache (``TRITON_CACHE_DIR`` a new folder), the
CUDA driver mocked to an sm_90 target (``triton_launch_host_cpu._mock_driver``): the kernels
compile for real, for the H100, and the autotuner's timing of each candidate is replaced by a
single no-op launch, so what is timed is the compiles. Shape: MiniLM (L = 6, H = K = 384,
J = 12), N = 4096 tokens, bf16, no dropout, the forward's two kernels (fwd_scores and
fwd_values). Modes alternate over ``--rounds``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

REPO_ROOT = Path(__file__).resolve().parents[1]

_ONE = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from triton_launch_host_cpu import _mock_driver
_mock_driver(launch_candidates=True)
import torch
import mhmla_fast.kernels.layer_attention as K
K._check_launchable = lambda t: None
if sys.argv[2] == "serial":
    K._precompile = lambda *args: None
L, N, H, Kd, J = 6, 4096, 384, 384, 12
ts = [torch.empty(s, dtype=torch.bfloat16) for s in
      [(L, N, H), (L, H, H), (L, H), (L, H, Kd), (L, Kd), (L, Kd, J), (L, J)]]
t = time.perf_counter()
K.layer_attention_fwd(*ts, J, (0.0, 0.0, 0.0), 0)
configs = sum(len(K.layer_attention_configs(k, H, J)) for k in ("fwd_scores", "fwd_values"))
print(time.perf_counter() - t, configs)
"""


def one(mode: str) -> tuple[float, int]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MHMLA_TRITON_CONFIGS")}
    with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
        env["TRITON_CACHE_DIR"] = cache
        res = subprocess.run([sys.executable, "-c", _ONE, str(REPO_ROOT / "bench"), mode],
                             env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-2000:])
    seconds, configs = res.stdout.split()
    return float(seconds), int(configs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "triton_tuning_cpu.json")
    args = parser.parse_args()
    import torch
    import triton

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from benchmark_layer_attention import git_commit

    runs: dict[str, list[float]] = {"serial": [], "pool": []}
    configs = None
    for _ in range(args.rounds):
        for mode in runs:
            seconds, configs = one(mode)
            runs[mode].append(round(seconds, 2))
            print(f"{mode:6s} {seconds:6.2f} s", flush=True)
    rows = {mode: {"seconds": times, "median_s": median(times)} for mode, times in runs.items()}
    speedup = rows["serial"]["median_s"] / rows["pool"]["median_s"]
    print(f"{configs} candidate configs; median serial {rows['serial']['median_s']:.2f} s, "
          f"pool {rows['pool']['median_s']:.2f} s: {speedup:.2f}x on {os.cpu_count()} CPUs")
    header = {"device": f"cpu ({platform.machine()}, {os.cpu_count()} logical CPUs), CUDA driver "
                        "mocked (sm_90 target)", "torch": torch.__version__,
              "triton": triton.__version__, "commit": git_commit(),
              "load_1min": os.getloadavg()[0], "command": "python bench/triton_tuning_cpu.py",
              "what": "first call of the fused inference forward, empty Triton cache: the "
                      "autotuner's candidates compiled (timings replaced by one no-op launch)",
              "shape": "MiniLM L=6, H=K=384, J=12, N=4096, bf16, no dropout"}
    args.out.write_text(json.dumps({"benchmark": "triton_tuning_cpu", "header": header,
                                    "candidate_configs": configs, "rows": rows,
                                    "pool_speedup": round(speedup, 2)}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
