"""Python cost of one fused-kernel launch, measured without a GPU (the CUDA driver mocked).

    python bench/triton_launch_host_cpu.py      # table + bench/results/triton_launch_host_cpu.json

The H100 runs of issue 10 found the fused forward + backward bound by its host (1.85 ms of CPU
per call against 1.07 ms of kernels). This measures the Python part of its Triton launches on
any CPU: the driver is replaced by a stand-in that reports an sm_90 target, the kernel
(fwd_scores at BERT-base shape, bf16) is compiled for real, and only the final C launcher and
the binary load are no-ops. Three ways to launch it, in microseconds per launch (the minimum
over 5 rounds of the mean over 300 launches, one CPU thread):

    jit         the fixed config through Triton's JIT (``kernel[grid](...)``): argument
                binding and specialisation, cache key, launch
    fixed       the fixed config through ``_launch`` (MHMLA_TRITON_CONFIGS=fixed): the compiled
                kernel launched directly (``_run``), as every launch after a key's first
    autotuner   ``_tuned(name)[grid](...)``, the autotuner's dispatch on a cached key (what
                ``_launch`` did for every launch before it kept the picks)
    picks       ``_launch`` autotuned: the autotuner's pick for the key reused, and the
                compiled kernel launched directly

A torch op of negligible work (``torch.empty``) is timed for scale. The C launcher's own cost
(unpacking the arguments, cuLaunchKernel) is not counted.

Then the whole op as users call it, ``torch.autograd.grad`` of ``layer_attention`` for all
inputs, fused (``backend="triton"``, its 5 launches through the mocked driver) and eager
(``backend="torch"``), on tiny fp32 CPU tensors (L = 2, N = 16, H = K = 32, J = 4) whose
arithmetic is negligible: microseconds per forward + backward, the minimum over 15 rounds of
100 calls, fused and eager rounds interleaved; and the forward alone on inputs that need no
gradient (inference: ``*_forward`` rows).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import timeit
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _mock_driver(launch_candidates: bool = False) -> None:
    """A driver that reports an sm_90 target on device 0, stream 0; compiled kernels whose
    launch and binary load do nothing; autotuning that times nothing (every candidate 1 ms).
    With ``launch_candidates`` the autotuner keeps its own per-candidate path (so the
    launchers' ``_autotune_bench`` and its ``_precompile`` run) and its timing launches each
    candidate once, compiling it if need be."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime import driver
    from triton.runtime.autotuner import Autotuner

    class Driver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(Driver())
    CompiledKernel.run = property(lambda self: (lambda *args: None))
    CompiledKernel._init_handles = lambda self: None
    if launch_candidates:
        import triton.testing

        triton.testing.do_bench = lambda fn, warmup, rep, quantiles: (fn(), [1.0, 1.0, 1.0])[1]
    else:
        Autotuner._bench = lambda self, *args, config, **kwargs: [1.0, 1.0, 1.0]


def measure(launches: int = 300, rounds: int = 5) -> dict:
    os.environ.pop("TRITON_INTERPRET", None)  # compile for sm_90, not the interpreter
    import torch
    import triton.language as tl

    _mock_driver()
    import mhmla_fast.kernels.layer_attention as kernels

    kernels._check_launchable = lambda t: None  # CPU tensors stand in for the device's

    L, N, H, K, J = 12, 4096, 768, 768, 12
    dt = torch.bfloat16
    hidden = torch.empty((L, N, H), dtype=dt)
    w_k, b_k = torch.empty((L, H, K), dtype=dt), torch.empty((L, K), dtype=dt)
    w_a, b_a = torch.empty((L, K, J), dtype=dt), torch.empty((L, J), dtype=dt)
    scores = torch.empty((L, N, J), dtype=torch.float32)
    seed = torch.zeros((), dtype=torch.int64)
    args = (hidden, w_k, b_k, w_a, b_a, scores, N, H, K, J, seed, 0.0, 1.0)
    kwargs = dict(DROP_K=False, N_BUCKET=kernels._n_bucket(N),
                  BLOCK_J=kernels._shape_constexprs(H, J)["BLOCK_J"], PREC="tf32", ACC=tl.float32)

    def grid(meta):
        return (kernels._cdiv(N, meta["BLOCK_N"]), L)

    def launch():
        kernels._launch("fwd_scores", grid, *args, **kwargs)

    tiles, warps, stages = kernels._FIXED["fwd_scores"]

    def jit():
        kernels._KERNELS["fwd_scores"][grid(tiles)](*args, **kwargs, **tiles, num_warps=warps,
                                                    num_stages=stages)

    def autotuner():
        kernels._tuned("fwd_scores")[grid](*args, **kwargs)

    def us(fn) -> float:
        fn()  # compiles on first use
        return round(min(timeit.repeat(fn, number=launches, repeat=rounds)) / launches * 1e6, 2)

    from mhmla_fast import layer_attention

    def op(backend, grad=True):
        Ls, Ns, Hs, Ks, Js = 2, 16, 32, 32, 4
        g = torch.Generator().manual_seed(0)
        ts = [torch.randn(s, generator=g).requires_grad_(grad) for s in
              ((Ls, Ns, Hs), (Ls, Hs, Hs), (Ls, Hs), (Ls, Hs, Ks), (Ls, Ks), (Ls, Ks, Js), (Ls, Js))]
        dc = torch.randn(Ns, Hs, generator=g)
        if not grad:  # inference: the forward alone, no input requiring a gradient
            return lambda: layer_attention(*ts, Js, backend=backend)
        return lambda: torch.autograd.grad(layer_attention(*ts, Js, backend=backend), ts, dc)

    previous = os.environ.get("MHMLA_TRITON_CONFIGS")
    try:
        os.environ["MHMLA_TRITON_CONFIGS"] = "fixed"
        fixed = us(launch)
        os.environ["MHMLA_TRITON_CONFIGS"] = ""
        rows = {"jit": us(jit), "fixed": fixed, "autotuner": us(autotuner), "picks": us(launch),
                "torch.empty": us(lambda: torch.empty((L, N, J)))}
        # the op: fused and eager rounds interleaved, the minimum of each over 15 rounds of
        # 100 calls (on a shared machine a burst of load then hits both, not one)
        calls = {"fused_forward_backward": op("triton"), "eager_forward_backward": op("torch"),
                 "fused_forward": op("triton", False), "eager_forward": op("torch", False)}
        best = {name: float("inf") for name in calls}
        for fn in calls.values():
            fn()
        for _ in range(15):
            for name, fn in calls.items():
                best[name] = min(best[name], timeit.timeit(fn, number=100) / 100 * 1e6)
        rows.update({name: round(v, 2) for name, v in best.items()})
    finally:
        if previous is None:
            os.environ.pop("MHMLA_TRITON_CONFIGS", None)
        else:
            os.environ["MHMLA_TRITON_CONFIGS"] = previous
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path,
                        default=REPO_ROOT / "bench" / "results" / "triton_launch_host_cpu.json")
    args = parser.parse_args()
    import torch
    import triton

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from benchmark_layer_attention import git_commit

    rows = measure()
    for name, value in rows.items():
        print(f"{name:22s} {value:7.2f} us")
    header = {"device": f"cpu ({platform.machine()}, 1 thread), CUDA driver mocked",
              "torch": torch.__version__, "triton": triton.__version__, "commit": git_commit(),
              "load_1min": os.getloadavg()[0], "command": "python bench/triton_launch_host_cpu.py",
              "kernel": "fwd_scores, BERT-base shape, bf16",
              "op_shape": "L=2, N=16, H=K=32, J=4, fp32",
              "unit": "us per launch (per call of the op: *_forward_backward, *_forward rows)"}
    args.out.write_text(json.dumps({"benchmark": "triton_launch_host_cpu", "header": header,
                                    "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
