"""Benchmark of ``mhmla_fast.layer_attention``: eager vs torch.compile vs the fused Triton kernels.

    python bench/benchmark_layer_attention.py                 # full sweep, writes bench/results/*.json
    python bench/benchmark_layer_attention.py --quick         # BERT-base, bf16, N = 4096 only
    python bench/benchmark_layer_attention.py --out DIR_OR_FILE.json --shapes minilm --dtypes fp16

Providers (all on the same random inputs; all but ``cublas`` checked against eager once before timing):
    eager        backend="torch" (the eager PyTorch reference)
    compile      torch.compile (default mode, static shapes) of a function calling backend="torch"
    compile-max  the same function under torch.compile(mode="max-autotune-no-cudagraphs")
    fused        backend="triton" (fused forward and backward kernels through autograd)
    auto         backend="auto" (what a user gets by default: the per-device rule of mhmla_fast.dispatch)
    cublas       the "cuBLAS line": torch.bmm of the two projections alone, v = h W_v and
                 z = h W_k for all L layers (no bias, ReLU, scores, softmax or sum); backward is
                 autograd through those two bmm. A floor for the counted GEMMs, not the head:
                 never compared numerically with eager.

Modes:
    forward    the forward as run in training (inputs require grad, autograd records)
    backward   only the backward: the graph is built once outside the timed region and
               ``torch.autograd.grad(c, inputs, dc, retain_graph=True)`` is timed; when a
               provider's graph cannot be replayed, the forward is rebuilt before every
               timed backward, outside the CUDA events (row field ``backward_timing``)
    full       forward + backward (gradients of hidden, all weights and biases)
    inference  the forward under ``torch.no_grad()`` (what auto decides for serving)

FLOP convention ("model FLOPs"; a GEMM [M x K] @ [K x N] is 2*M*N*K FLOPs):
    forward  = 2 * L * N * H * (H + K)   the two projections per layer, h W_v ([N,H]@[H,H])
                                         and h W_k ([N,H]@[H,K]); at BERT-base that is
                                         28.3 MFLOP per token
    backward = 2 * forward               dX and dW of each projection (4 GEMM-sized passes)
    full     = 3 * forward
    Not counted: the score GEMM k W_a (2*L*N*K*J, 0.8% of the forward at BERT-base), the
    softmax, the weighted sum, biases and ReLU, and any recomputation a backward does. So the
    TFLOP/s figures are a slight underestimate of the arithmetic actually done. The cuBLAS line
    runs exactly the counted GEMMs, so its TFLOP/s is what cuBLAS reaches on them.

Summaries written beside the rows: ``speedups`` (other provider's median / fused's, and the
same for auto), ``targets`` (the op issue's, PASS/FAIL/n-a), ``auto_evidence`` (eager or
fused for each decision ``auto`` makes, inference and training, and whether the shipped rule
picked the faster; schema 3; files of schema 2 have ``direction_winners``, read from the
forward and backward rows instead) and ``determinism`` (fused weight gradients bitwise equal
over two identical runs).

On a machine without a CUDA GPU this prints a message to stderr and exits 0, writing nothing.
See bench/README.md for every output field and the targets.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

NO_CUDA_MESSAGE = "no CUDA GPU found: the layer-attention benchmark needs one; nothing measured"

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT_DIR = REPO_ROOT / "bench" / "results"


@dataclass(frozen=True)
class Shape:
    """One head configuration: L layers, H hidden, K key width, J heads."""

    name: str
    L: int
    H: int
    K: int
    J: int


SHAPES = {
    "bert-base": Shape("bert-base", L=12, H=768, K=768, J=12),
    "minilm": Shape("minilm", L=6, H=384, K=384, J=12),
}
DTYPE_NAMES = ("bf16", "fp16")
N_SWEEP = (1024, 2048, 4096, 8192, 16384)  # tokens; 4096 = batch 32 x 128
PROVIDERS = ("eager", "compile", "compile-max", "fused", "auto", "cublas")
# What fused (and auto) are compared with in the summary: other median / their median.
BASELINES = ("eager", "compile", "compile-max", "cublas")
MODES = ("forward", "backward", "full", "inference")
QUANTILES = (0.5, 0.2, 0.8)  # median, 20th, 80th percentile
INPUT_NAMES = ("hidden", "w_v", "b_v", "w_k", "b_k", "w_a", "b_a")
WEIGHT_NAMES = INPUT_NAMES[1:]
PROJECTION_INPUTS = (0, 1, 3)  # the cuBLAS line differentiates hidden, w_v and w_k only
MATMUL_CEILING_SIZE = 8192
COPY_CEILING_BYTES = 1 << 30

CUBLAS_NOTE = ("reference line: torch.bmm of the two projections alone (h W_v and h W_k, no bias, ReLU, "
               "scores, softmax or sum), a different function from the head, so it is not compared "
               "with eager; its incoming gradient is dc repeated over the L layers")

FLOP_CONVENTION = (
    "model FLOPs, a GEMM [M x K] @ [K x N] = 2*M*N*K: forward = 2*L*N*H*(H+K) (the value and "
    "key projections); backward = 2 * forward (dX and dW of both projections); full = 3 * "
    "forward; inference = forward. Not counted: the score GEMM (2*L*N*K*J), softmax, weighted "
    "sum, biases, ReLU, and recomputation in the backward. The same count for every provider "
    "(the cuBLAS line runs exactly the counted GEMMs)."
)


@dataclass(frozen=True)
class Target:
    """One check: ``value <op> threshold`` on a field of a ``speedups`` entry of ``mode``."""

    mode: str
    metric: str
    op: str  # "<=", ">=" or ">"
    threshold: float

    def passed(self, value: float | None) -> bool | None:
        """True / False, or None when the value was not measured."""
        if value is None:
            return None
        return {"<=": value <= self.threshold, ">=": value >= self.threshold,
                ">": value > self.threshold}[self.op]

    def text(self) -> str:
        return f"{self.op} {self.threshold:.3g}"


# Targets from the op issue, stated for an H100 at BERT-base shape in bf16, N = 4096 (headline).
TARGET_SHAPE, TARGET_DTYPE, TARGET_HEADLINE_N = "bert-base", "bf16", 4096
HEADLINE_TARGETS = (
    Target("forward", "fused_ms", "<=", 0.20),
    Target("forward", "fused_vs_eager", ">=", 3.0),
    Target("forward", "fused_vs_compile_max", ">=", 1.65),
    Target("full", "fused_ms", "<=", 0.60),
    Target("full", "fused_vs_eager", ">=", 2.8),
    Target("full", "fused_vs_compile_max", ">=", 1.75),
    Target("full", "fused_mem_over_eager", "<=", 1.0 / 3.0),
)
# ... and at every measured N in [1024, 16384], both shapes, bf16 and fp16, forward and full:
# fused faster than eager and than compile-max.
SWEEP_SHAPES, SWEEP_DTYPES, SWEEP_N_RANGE = ("bert-base", "minilm"), ("bf16", "fp16"), (1024, 16384)
SWEEP_TARGETS = tuple(Target(mode, metric, ">", 1.0) for mode in ("forward", "full")
                      for metric in ("fused_vs_eager", "fused_vs_compile_max"))
TARGETS = {"headline": HEADLINE_TARGETS, "sweep": SWEEP_TARGETS}

# The auto policy's evidence: each decision backend="auto" makes, and the mode whose rows measure
# it (inference: the forward without a gradient; training: the fused pair against eager end to end).
AUTO_DECISIONS = {"inference": "inference", "training": "full"}


# ----------------------------------------------------------------------------------------------
# Counting: FLOPs and the fewest bytes
# ----------------------------------------------------------------------------------------------


def layer_attention_flops(L: int, N: int, H: int, K: int, mode: str = "forward") -> int:
    """Model FLOPs of one layer-attention call (see the module docstring for the convention).

    forward (and inference) = 2*L*N*H*(H+K); backward = 2x forward; full = 3x forward.
    """
    forward = 2 * L * N * H * (H + K)
    factor = {"forward": 1, "inference": 1, "backward": 2, "full": 3}
    if mode not in factor:
        raise ValueError(f"mode: expected one of {sorted(factor)}, got {mode!r}")
    return forward * factor[mode]


def layer_attention_min_bytes(L: int, N: int, H: int, K: int, J: int, elem_bytes: int, mode: str) -> int:
    """Fewest bytes a call must move through device memory (each input read once, each output
    written once): a lower bound, the second figure after TFLOP/s.

    forward: read hidden [L,N,H] and the parameters, write c [N,H]. backward: read hidden, the
    parameters, dc and c [N,H]; write dhidden [L,N,H] and the parameter gradients. full: both.
    """
    params = L * (H * H + H + H * K + K + K * J + J)
    fwd = L * N * H + params + N * H
    bwd = 2 * L * N * H + 2 * params + 2 * N * H
    per_mode = {"forward": fwd, "inference": fwd, "backward": bwd, "full": fwd + bwd}
    if mode not in per_mode:
        raise ValueError(f"mode: expected one of {sorted(per_mode)}, got {mode!r}")
    return per_mode[mode] * elem_bytes


def projection_min_bytes(L: int, N: int, H: int, K: int, elem_bytes: int, mode: str) -> int:
    """Fewest bytes of the cuBLAS line (the two projections alone), as for the head.

    forward: read hidden [L,N,H], w_v [L,H,H], w_k [L,H,K]; write v [L,N,H] and z [L,N,K].
    backward: read hidden, w_v, w_k, dv [L,N,H], dz [L,N,K]; write dhidden [L,N,H], dw_v, dw_k.
    full: both.
    """
    weights = L * H * (H + K)
    outputs = L * N * (H + K)
    fwd = L * N * H + weights + outputs
    bwd = L * N * H + weights + outputs + L * N * H + weights
    per_mode = {"forward": fwd, "inference": fwd, "backward": bwd, "full": fwd + bwd}
    if mode not in per_mode:
        raise ValueError(f"mode: expected one of {sorted(per_mode)}, got {mode!r}")
    return per_mode[mode] * elem_bytes


def quantiles(times: list[float], qs: tuple[float, ...] = QUANTILES) -> tuple[float, ...]:
    """Linear-interpolation quantiles (as numpy and ``triton.testing.do_bench`` compute them)."""
    if not times:
        raise ValueError("quantiles: no samples")
    s = sorted(times)
    out = []
    for q in qs:
        pos = q * (len(s) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(s) - 1)
        out.append(s[lo] + (s[hi] - s[lo]) * (pos - lo))
    return tuple(out)


# ----------------------------------------------------------------------------------------------
# Timing and memory on CUDA
# ----------------------------------------------------------------------------------------------


class CudaTimer:
    """Median and 20th/80th percentile in ms of CUDA events around each call, the L2 flushed
    and the GPU idle before every run (the flush, then a synchronisation); ``warmup_ms`` and
    ``rep_ms`` are the warm-up and measuring budgets in ms (as ``triton.testing.do_bench``'s).

    One harness for every provider. ``do_bench``, used for most of them before 2026-12-07, does
    not synchronise after its flush: a host-bound call issued its launches while the 256 MiB
    memset ran (about 0.09 ms on an H100) and was timed as its host time less that, a GPU-bound
    call as its GPU time, which favoured the fused op's host-bound rows (forward + backward at
    BERT-base N = 4096, every MiniLM row) over eager's by about the size of the recorded tie."""

    def __init__(self, warmup_ms: int = 25, rep_ms: int = 100):
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms

    def bench(self, fn: Callable[[], Any]) -> tuple[float, float, float]:
        return self.bench_with_setup(lambda: None, lambda _: fn())

    def bench_with_setup(self, setup: Callable[[], Any], fn: Callable[[Any], Any]) -> tuple[float, float, float]:
        """Time ``fn(setup())`` with CUDA events around ``fn`` only (``setup`` outside them: for
        a backward whose graph cannot be replayed, the forward runs there)."""
        import torch

        flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")

        def timed(n: int) -> list[float]:
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            for i in range(n):
                state = setup()
                flush.zero_()
                torch.cuda.synchronize()  # idle: the call is timed from its first launch
                starts[i].record()
                fn(state)
                ends[i].record()
                del state
            torch.cuda.synchronize()
            return [s.elapsed_time(e) for s, e in zip(starts, ends)]

        estimate = sum(timed(5)) / 5
        timed(max(1, int(self.warmup_ms / max(estimate, 1e-3))))
        times = timed(max(5, int(self.rep_ms / max(estimate, 1e-3))))
        return quantiles(times)  # type: ignore[return-value]


def cuda_peak_extra_bytes(call: Callable[[], Any]) -> int:
    """Peak memory one call allocates beyond what was allocated before it (inputs excluded):
    ``max_memory_allocated()`` after ``reset_peak_memory_stats()``, minus the allocation before."""
    import torch

    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del result
    return int(peak - before)


def measure_matmul_ceiling(timer: CudaTimer, dtype: Any, size: int = MATMUL_CEILING_SIZE) -> dict:
    """TFLOP/s of one large torch.matmul on random data (the matrix-unit ceiling of this run)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(1234)
    a = torch.randn(size, size, device="cuda", generator=g).to(dtype)
    b = torch.randn(size, size, device="cuda", generator=g).to(dtype)
    c = torch.empty(size, size, device="cuda", dtype=dtype)
    p50, p20, p80 = timer.bench(lambda: torch.matmul(a, b, out=c))
    del a, b, c
    torch.cuda.empty_cache()
    return {"tflops": 2 * size**3 / (p50 * 1e-3) / 1e12, "ms_p50": p50, "ms_p20": p20, "ms_p80": p80,
            "m_n_k": [size, size, size]}


def measure_copy_ceiling(timer: CudaTimer, nbytes: int = COPY_CEILING_BYTES) -> dict:
    """GB/s of a large device-to-device copy, counting bytes read plus bytes written."""
    import torch

    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    p50, _, _ = timer.bench(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return {"gbps": 2 * nbytes / (p50 * 1e-3) / 1e9, "ms_p50": p50, "bytes_copied": nbytes}


# ----------------------------------------------------------------------------------------------
# Providers, inputs, references
# ----------------------------------------------------------------------------------------------


@dataclass
class Provider:
    """One way of computing what is timed.

    ``fn(*inputs)`` takes the seven inputs (hidden, w_v, b_v, w_k, b_k, w_a, b_a) and returns
    c [N, H] (or, for the cuBLAS line, the tuple (v [L,N,H], z [L,N,K])). Backward modes
    differentiate ``inputs[i] for i in wrt`` with the incoming gradient
    ``incoming_grad(dc, inputs)`` (dc itself by default). ``compared``: checked against eager.
    """

    name: str
    fn: Callable[..., Any]
    wrt: tuple[int, ...] = tuple(range(len(INPUT_NAMES)))
    incoming_grad: Callable[[Any, tuple], Any] | None = None
    compared: bool = True

    @property
    def wrt_names(self) -> tuple[str, ...]:
        return tuple(INPUT_NAMES[i] for i in self.wrt)


def projection_incoming_grads(grad_out: Any, inputs: tuple) -> tuple[Any, Any]:
    """The cuBLAS line's incoming gradients, made once outside any timed region: dv [L, N, H]
    is dc [N, H] repeated over the L layers; dz [L, N, K] is the same tensor when K == H (the
    benchmark's shapes), else dc's columns repeated cyclically up to K."""
    L = inputs[0].shape[0]
    N, H = grad_out.shape
    K = inputs[3].shape[-1]
    dv = grad_out.unsqueeze(0).expand(L, N, H).contiguous()
    if K == H:
        return dv, dv
    cols = grad_out.repeat(1, -(-K // H))[:, :K]
    return dv, cols.unsqueeze(0).expand(L, N, K).contiguous()


def make_provider(name: str, op: Callable, num_heads: int, op_kwargs: dict) -> Provider:
    """The :class:`Provider` called ``name`` (a fresh torch.compile for "compile" and
    "compile-max", so that each (shape, dtype, N) gets its own static-shape graph)."""
    if name in ("eager", "fused", "auto"):
        backend = {"eager": "torch", "fused": "triton", "auto": "auto"}[name]
        return Provider(name, lambda *t: op(*t, num_heads, backend=backend, **op_kwargs))
    if name in ("compile", "compile-max"):
        import torch

        torch._dynamo.reset()  # one static-shape graph per (shape, dtype, N); no recompile limit hit

        def reference(*t):
            return op(*t, num_heads, backend="torch", **op_kwargs)

        kwargs = {"mode": "max-autotune-no-cudagraphs"} if name == "compile-max" else {}
        return Provider(name, torch.compile(reference, dynamic=False, **kwargs))
    if name == "cublas":
        import torch

        def projections(hidden, w_v, b_v, w_k, b_k, w_a, b_a):
            return torch.bmm(hidden, w_v), torch.bmm(hidden, w_k)

        return Provider(name, projections, wrt=PROJECTION_INPUTS, incoming_grad=projection_incoming_grads,
                        compared=False)
    raise ValueError(f"provider: expected one of {PROVIDERS}, got {name!r}")


def make_inputs(shape: Shape, n: int, dtype: Any, device: str, seed: int) -> tuple[tuple, Any]:
    """Random inputs (never zeros): hidden [L, N, H] ~ N(0, 1), weights ~ N(0, 1/fan_in),
    biases ~ N(0, 0.02^2); all leaves requiring grad. Also dc [N, H] ~ N(0, 1)."""
    import torch

    L, H, K, J = shape.L, shape.H, shape.K, shape.J
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*size: int, scale: float = 1.0):
        return (torch.randn(*size, device=device, generator=g) * scale).to(dtype).requires_grad_(True)

    inputs = (
        rnd(L, n, H),
        rnd(L, H, H, scale=H**-0.5), rnd(L, H, scale=0.02),
        rnd(L, H, K, scale=H**-0.5), rnd(L, K, scale=0.02),
        rnd(L, K, J, scale=K**-0.5), rnd(L, J, scale=0.02),
    )
    grad_out = torch.randn(n, H, device=device, generator=g).to(dtype)
    return inputs, grad_out


def _max_abs_diff(a: Any, b: Any) -> float:
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"shape {list(a.shape)} differs from the reference's {list(b.shape)}")
    return float((a.detach().double() - b.detach().double()).abs().max().item())


@dataclass
class References:
    """Eager outputs in the benchmark dtype and in float64 for one input set."""

    c: Any
    grads: tuple | None
    c64: Any = None
    grads64: tuple | None = None
    fp64_error: str | None = None


def compute_references(op: Callable, inputs: tuple, grad_out: Any, num_heads: int, need_grads: bool) -> References:
    import torch

    c = op(*inputs, num_heads, backend="torch")
    grads = torch.autograd.grad(c, inputs, grad_out) if need_grads else None
    refs = References(c=c.detach(), grads=grads)
    del c
    try:
        x64 = tuple(t.detach().double().requires_grad_(True) for t in inputs)
        c64 = op(*x64, num_heads, backend="torch")
        refs.grads64 = torch.autograd.grad(c64, x64, grad_out.double()) if need_grads else None
        refs.c64 = c64.detach()
    except Exception as e:  # noqa: BLE001 - a missing oracle must not stop the run
        refs.fp64_error = _error_text(e)
    return refs


def check_provider(fn: Callable, inputs: tuple, grad_out: Any, refs: References, need_grads: bool) -> dict:
    """Run the provider once (this is also its first warm-up) and compare with eager and fp64."""
    import torch

    out = fn(*inputs)
    res: dict[str, Any] = {
        "max_abs_diff": _max_abs_diff(out, refs.c),
        "max_abs_err_fp64": _max_abs_diff(out, refs.c64) if refs.c64 is not None else None,
        "grad_max_abs_diff": None,
        "grad_max_abs_err_fp64": None,
    }
    if need_grads:
        grads = torch.autograd.grad(out, inputs, grad_out)
        res["grad_max_abs_diff"] = {n: _max_abs_diff(g, r) for n, g, r in zip(INPUT_NAMES, grads, refs.grads)}
        if refs.grads64 is not None:
            res["grad_max_abs_err_fp64"] = {
                n: _max_abs_diff(g, r) for n, g, r in zip(INPUT_NAMES, grads, refs.grads64)
            }
    return res


def check_weight_grad_determinism(fn: Callable, inputs: tuple, grad_out: Any, seed: int) -> dict:
    """Two identical forward + backward runs (all seven inputs differentiated, as in training;
    the RNG reseeded with ``seed`` before each, so dropout masks repeat) must give bitwise-equal
    weight gradients (w_v, b_v, w_k, b_k, w_a, b_a), as a two-stage reduction does and atomics
    need not.

    Returns ``weight_grads_deterministic`` (bool) and ``weight_grads_max_abs_diff``
    ({weight name: max |g1 - g2|}, all 0.0 when deterministic)."""
    import torch

    runs = []
    for _ in range(2):
        torch.manual_seed(seed)
        runs.append(torch.autograd.grad(fn(*inputs), inputs, grad_out)[1:])
    equal = [torch.equal(a, b) for a, b in zip(*runs)]
    return {
        "weight_grads_deterministic": all(equal),
        "weight_grads_max_abs_diff": {n: (0.0 if same else _max_abs_diff(a, b))
                                      for n, same, a, b in zip(WEIGHT_NAMES, equal, *runs)},
    }


# ----------------------------------------------------------------------------------------------
# Measuring one (provider, mode)
# ----------------------------------------------------------------------------------------------


def _sync(device: str) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


HOST_REPS = 20


def host_ms(call: Callable[[], Any], device: str, reps: int = HOST_REPS) -> float:
    """Median host time of one call in ms: the device synchronised before each call, so the
    time is what Python, autograd and the launches cost the CPU to enqueue the call's work.
    A provider whose host time nears its device time (``ms_p50``) is bound by the host, and
    gains nothing from faster kernels until launches are fewer or captured in a CUDA graph."""
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        res = call()
        times.append((time.perf_counter() - t0) * 1e3)
        del res
    _sync(device)
    return quantiles(times, (0.5,))[0]


def _warm(call: Callable[[], Any], device: str, times: int = 2) -> None:
    for _ in range(times):
        res = call()
        del res
    _sync(device)


def _retain_graph_works(out: Any, wrt: tuple, grad_out: Any,
                        names: tuple[str, ...] = INPUT_NAMES) -> tuple[bool, str | None]:
    """Two backward calls on one graph must both run and agree (a graph that frees or
    overwrites what it saved would fail or drift here)."""
    import torch

    try:
        g1 = torch.autograd.grad(out, wrt, grad_out, retain_graph=True)
        g2 = torch.autograd.grad(out, wrt, grad_out, retain_graph=True)
    except RuntimeError as e:
        return False, _error_text(e)
    for name, a, b in zip(names, g1, g2):
        if not bool(torch.isfinite(b).all()):
            return False, f"second backward gave non-finite d{name}"
        scale = float(a.detach().double().abs().max().item())
        if _max_abs_diff(a, b) > 0.05 * scale + 1e-6:
            return False, f"second backward's d{name} differs from the first"
    return True, None


def measure_mode(mode: str, fn: Callable, inputs: tuple, grad_out: Any, *, device: str,
                 timer: Any, peak_probe: Callable | None, wrt: tuple | None = None,
                 wrt_names: tuple[str, ...] = INPUT_NAMES) -> dict:
    """Warm up, measure the peak extra memory of one call, then time. Backward modes
    differentiate ``wrt`` (default: all ``inputs``) with incoming gradient ``grad_out`` (a
    tensor, or a tuple matching a tuple of outputs). Returns ms p50/p20/p80,
    peak_extra_bytes (None without a probe) and, for backward, how it was timed."""
    import torch

    wrt = inputs if wrt is None else wrt
    res: dict[str, Any] = {"backward_timing": None, "backward_timing_note": None}
    if mode in ("forward", "inference", "full"):
        if mode == "forward":
            def call():
                return fn(*inputs)
        elif mode == "inference":
            def call():
                with torch.no_grad():
                    return fn(*inputs)
        else:
            def call():
                return torch.autograd.grad(fn(*inputs), wrt, grad_out)
        _warm(call, device)
        res["peak_extra_bytes"] = peak_probe(call) if peak_probe else None
        res["ms"] = timer.bench(call)
        res["host_ms"] = host_ms(call, device)
        return res
    if mode != "backward":
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    out = fn(*inputs)
    ok, why = _retain_graph_works(out, wrt, grad_out, wrt_names)
    if ok:
        def call():
            return torch.autograd.grad(out, wrt, grad_out, retain_graph=True)

        _warm(call, device)
        res["peak_extra_bytes"] = peak_probe(call) if peak_probe else None
        res["ms"] = timer.bench(call)
        res["host_ms"] = host_ms(call, device)
        res["backward_timing"] = "retain_graph"
        return res
    del out

    def setup():
        return fn(*inputs)

    def run(o):
        return torch.autograd.grad(o, wrt, grad_out)

    state = setup()
    res["peak_extra_bytes"] = peak_probe(lambda: run(state)) if peak_probe else None
    del state
    res["ms"] = timer.bench_with_setup(setup, run)
    res["host_ms"] = None  # the rebuilt forward would be timed with it
    res["backward_timing"] = "rebuild"
    res["backward_timing_note"] = f"retain_graph unusable: {why}"
    return res


# ----------------------------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------------------------


@dataclass
class BenchConfig:
    shapes: list[Shape]
    dtypes: list[str]
    ns: list[int]
    providers: list[str] = field(default_factory=lambda: list(PROVIDERS))
    modes: list[str] = field(default_factory=lambda: list(MODES))
    dropout: float = 0.0
    seed: int = 0


def _error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= 600 else text[:600] + " ..."


def _torch_dtype(name: str) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _free_memory(device: str) -> None:
    import torch

    gc.collect()
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()


def run_benchmark(cfg: BenchConfig, op: Callable, *, device: str, timer: Any, peak_probe: Callable | None,
                  ceiling_tflops: float | None, meta: dict, log: Callable[[str], None] = print) -> list[dict]:
    """Every (shape, dtype, N, provider, mode) row. ``op`` is ``mhmla_fast.layer_attention``;
    ``timer`` has ``bench(fn)`` and ``bench_with_setup(setup, fn)`` returning ms (p50, p20, p80);
    ``peak_probe(call)`` returns the call's peak extra bytes (or is None: not measured)."""
    rows: list[dict] = []
    need_grads = any(m in ("backward", "full") for m in cfg.modes)
    op_kwargs = {}
    if cfg.dropout > 0:
        op_kwargs = dict(dropout_h=cfg.dropout, dropout_k=cfg.dropout, dropout_p=cfg.dropout, training=True)
    for shape in cfg.shapes:
        for dtype_name in cfg.dtypes:
            dtype = _torch_dtype(dtype_name)
            for n in cfg.ns:
                base = {**meta, "shape": shape.name, "L": shape.L, "N": n, "H": shape.H, "K": shape.K,
                        "J": shape.J, "dtype": dtype_name, "dropout": cfg.dropout}
                tag = f"[{shape.name} {dtype_name} N={n}]"
                rows.extend(_run_group(cfg, op, shape, dtype, n, base, tag, op_kwargs, need_grads,
                                       device=device, timer=timer, peak_probe=peak_probe,
                                       ceiling_tflops=ceiling_tflops, log=log))
                _free_memory(device)
    return rows


def _row(base: dict, provider: str, mode: str, **fields: Any) -> dict:
    row = {**base, "provider": provider, "mode": mode,
           "ms_p50": None, "ms_p20": None, "ms_p80": None, "flops": None, "tflops": None,
           "ratio_to_matmul_ceiling": None, "min_bytes": None, "gbps": None, "peak_extra_mem_mb": None,
           "max_abs_diff": None, "max_abs_err_fp64": None,
           "grad_max_abs_diff": None, "grad_max_abs_err_fp64": None, "check_note": None,
           "host_ms_p50": None, "backward_timing": None, "backward_timing_note": None,
           "weight_grads_deterministic": None, "weight_grads_max_abs_diff": None, "determinism_note": None,
           "error": None}
    row.update(fields)
    return row


def _group_inputs(cfg: BenchConfig, op: Callable, shape: Shape, dtype: Any, n: int, need_grads: bool,
                  device: str) -> tuple[tuple, Any, References | None, str | None]:
    """Inputs, dc, the eager references (None with dropout) and the rows' check note."""
    inputs, grad_out = make_inputs(shape, n, dtype, device, cfg.seed + n)
    refs = compute_references(op, inputs, grad_out, shape.J, need_grads) if cfg.dropout == 0 else None
    check_note = None
    if refs is None:
        check_note = "skipped: dropout > 0 (masks differ between providers)"
    elif refs.fp64_error:
        check_note = f"no float64 oracle: {refs.fp64_error}"
    return inputs, grad_out, refs, check_note


def _build_and_check(cfg: BenchConfig, prov: Provider, inputs: tuple, grad_out: Any, refs: References | None,
                     need_grads: bool, device: str) -> tuple[dict, dict]:
    """Run the provider once (its first warm-up), compare it with eager where it is a version
    of the head, and for "fused" check that its weight gradients are deterministic. Returns
    the row fields of the comparison and of the determinism check."""
    if prov.compared and refs is not None:
        check = check_provider(prov.fn, inputs, grad_out, refs, need_grads)
    else:
        check = {"check_note": CUBLAS_NOTE} if not prov.compared else {}
        _warm(lambda: prov.fn(*inputs), device, times=1)
    det: dict[str, Any] = {}
    if prov.name == "fused":
        try:
            det = check_weight_grad_determinism(prov.fn, inputs, grad_out, cfg.seed)
            if cfg.dropout > 0:
                det["determinism_note"] = "dropout > 0: the RNG was reseeded before each run"
        except Exception as e:  # noqa: BLE001 - recorded, the timing goes on
            det = {"determinism_note": f"check failed: {_error_text(e)}"}
        _free_memory(device)
    return check, det


def _measured_row(base: dict, provider: Provider, mode: str, shape: Shape, n: int, elem_bytes: int, res: dict,
                  ceiling_tflops: float | None, **fields: Any) -> dict:
    p50, p20, p80 = res["ms"]
    flops = layer_attention_flops(shape.L, n, shape.H, shape.K, mode)
    tflops = flops / (p50 * 1e-3) / 1e12
    if provider.name == "cublas":
        nbytes = projection_min_bytes(shape.L, n, shape.H, shape.K, elem_bytes, mode)
    else:
        nbytes = layer_attention_min_bytes(shape.L, n, shape.H, shape.K, shape.J, elem_bytes, mode)
    peak = res["peak_extra_bytes"]
    return _row(
        base, provider.name, mode, ms_p50=p50, ms_p20=p20, ms_p80=p80, flops=flops, tflops=tflops,
        ratio_to_matmul_ceiling=(tflops / ceiling_tflops) if ceiling_tflops else None,
        min_bytes=nbytes, gbps=nbytes / (p50 * 1e-3) / 1e9,
        peak_extra_mem_mb=(peak / 2**20) if peak is not None else None,
        host_ms_p50=res.get("host_ms"), backward_timing=res["backward_timing"],
        backward_timing_note=res["backward_timing_note"], **fields,
    )


def _run_group(cfg: BenchConfig, op: Callable, shape: Shape, dtype: Any, n: int, base: dict, tag: str,
               op_kwargs: dict, need_grads: bool, *, device: str, timer: Any, peak_probe: Callable | None,
               ceiling_tflops: float | None, log: Callable[[str], None]) -> list[dict]:
    rows: list[dict] = []
    try:
        inputs, grad_out, refs, check_note = _group_inputs(cfg, op, shape, dtype, n, need_grads, device)
    except Exception as e:  # noqa: BLE001 - e.g. out of memory at the largest N
        err = f"inputs/reference: {_error_text(e)}"
        log(f"{tag} {err}")
        _free_memory(device)
        return [_row(base, p, m, error=err) for p in cfg.providers for m in cfg.modes]
    elem_bytes = inputs[0].element_size()
    for name in cfg.providers:
        note = {"check_note": check_note}
        try:
            prov = make_provider(name, op, shape.J, op_kwargs)
            wrt = tuple(inputs[i] for i in prov.wrt)
            incoming = prov.incoming_grad(grad_out, inputs) if prov.incoming_grad else grad_out
            check, det = _build_and_check(cfg, prov, inputs, grad_out, refs, need_grads, device)
        except Exception as e:  # noqa: BLE001 - a broken provider is recorded, the run goes on
            err = f"build/check: {_error_text(e)}"
            log(f"{tag} {name}: {err}")
            if name == "cublas":
                note = {"check_note": CUBLAS_NOTE}
            rows.extend(_row(base, name, m, error=err, **note) for m in cfg.modes)
            _free_memory(device)
            continue
        fields = {**note, **check, **det}
        if det:
            verdict = {True: "bitwise equal", False: "DIFFER", None: "not checked"}
            log(f"{tag} fused weight gradients over two runs: "
                f"{verdict[det.get('weight_grads_deterministic')]}")
        for mode in cfg.modes:
            try:
                res = measure_mode(mode, prov.fn, inputs, incoming, device=device, timer=timer,
                                   peak_probe=peak_probe, wrt=wrt, wrt_names=prov.wrt_names)
            except Exception as e:  # noqa: BLE001
                err = _error_text(e)
                log(f"{tag} {name} {mode}: {err}")
                rows.append(_row(base, name, mode, error=err, **fields))
                _free_memory(device)
                continue
            row = _measured_row(base, prov, mode, shape, n, elem_bytes, res, ceiling_tflops, **fields)
            rows.append(row)
            log(f"{tag} {name:11s} {mode:9s} {row['ms_p50']:9.3f} ms  {row['tflops']:7.1f} TFLOP/s"
                + (f"  {row['peak_extra_mem_mb']:9.1f} MiB" if row["peak_extra_mem_mb"] is not None else "")
                + (f"  host {row['host_ms_p50']:.3f} ms" if row["host_ms_p50"] is not None else ""))
            _free_memory(device)
        del prov, wrt, incoming
        _free_memory(device)
    del inputs, grad_out, refs
    return rows


# ----------------------------------------------------------------------------------------------
# Summaries
# ----------------------------------------------------------------------------------------------


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


def _field(provider: str) -> str:
    """A provider's name as a JSON field stem: compile-max -> compile_max."""
    return provider.replace("-", "_")


def _verdict(passed: list[bool | None]) -> bool | None:
    """False if any check failed; True if there were checks and all passed; else None."""
    if any(p is False for p in passed):
        return False
    if passed and all(p is True for p in passed):
        return True
    return None


def _median(row: dict | None) -> float | None:
    if row is None or row.get("error") is not None:
        return None
    return row.get("ms_p50")


def summarize_speedups(rows: list[dict]) -> list[dict]:
    """For each (shape, dtype, N, mode):

    - ``<provider>_ms``: every provider's median (``compile_max_ms`` for compile-max);
    - ``fused_vs_<b>`` = b's median / fused's for b in eager, compile, compile-max, cublas
      (> 1: fused is faster; against the cuBLAS line, which runs only the two projection GEMMs,
      expect < 1: it says how close fused comes to the bare GEMMs), and ``auto_vs_<b>`` the
      same for auto;
    - ``fused_mem_over_eager``, ``fused_mem_over_compile``, ``auto_mem_over_eager``: ratios of
      peak extra memory (< 1: needs less);
    - ``fused_ratio_to_matmul_ceiling``; ``weight_grads_deterministic`` from fused's
      determinism check of this (shape, dtype, N).

    None where a provider was not run or failed.
    """
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["shape"], r["dtype"], r["N"], r["mode"]), {})[r["provider"]] = r
    out = []
    for (shape, dtype, n, mode), by in groups.items():
        ok = {p: r for p, r in by.items() if _median(r) is not None}

        def ms(p):
            return ok[p]["ms_p50"] if p in ok else None

        def mem(p):
            return ok[p]["peak_extra_mem_mb"] if p in ok else None

        entry: dict[str, Any] = {"shape": shape, "dtype": dtype, "N": n, "mode": mode}
        entry.update({f"{_field(p)}_ms": ms(p) for p in PROVIDERS})
        for sub in ("fused", "auto"):
            entry.update({f"{sub}_vs_{_field(b)}": _ratio(ms(b), ms(sub)) for b in BASELINES})
            entry[f"{sub}_mem_over_eager"] = _ratio(mem(sub), mem("eager"))
            if sub == "fused":
                entry["fused_mem_over_compile"] = _ratio(mem("fused"), mem("compile"))
        entry["fused_ratio_to_matmul_ceiling"] = ok["fused"]["ratio_to_matmul_ceiling"] if "fused" in ok else None
        entry["weight_grads_deterministic"] = by["fused"].get("weight_grads_deterministic") if "fused" in by else None
        out.append(entry)
    return out


def _target_check(kind: str, shape: str, dtype: str, n: int, target: Target, entry: dict | None) -> dict:
    value = entry.get(target.metric) if entry is not None else None
    return {"kind": kind, "shape": shape, "dtype": dtype, "N": n, "mode": target.mode, "metric": target.metric,
            "value": value, "target": target.text(), "passed": target.passed(value), "headline": kind == "headline"}


def evaluate_targets(speedups: list[dict], device_name: str) -> dict:
    """The op issue's targets.

    ``headline``: :data:`HEADLINE_TARGETS` at BERT-base, bf16, N = 4096 (always listed; n/a
    where not measured). ``sweep``: :data:`SWEEP_TARGETS` (fused faster than eager and than
    compile-max, forward and full) at every measured N in [1024, 16384] of both shapes, bf16
    and fp16. ``headline_passed`` / ``sweep_passed``: False if any check failed, True if all
    passed, None otherwise; ``sweep_complete``: the whole default grid (N_SWEEP x both shapes x
    both dtypes) was measured for every sweep check.
    """
    by_key = {(s["shape"], s["dtype"], s["N"], s["mode"]): s for s in speedups}
    checks = [_target_check("headline", TARGET_SHAPE, TARGET_DTYPE, TARGET_HEADLINE_N, t,
                            by_key.get((TARGET_SHAPE, TARGET_DTYPE, TARGET_HEADLINE_N, t.mode)))
              for t in HEADLINE_TARGETS]
    lo, hi = SWEEP_N_RANGE
    measured = []
    for shape, dtype, n, _ in by_key:
        if shape in SWEEP_SHAPES and dtype in SWEEP_DTYPES and lo <= n <= hi and (shape, dtype, n) not in measured:
            measured.append((shape, dtype, n))
    sweep = [_target_check("sweep", shape, dtype, n, t, by_key.get((shape, dtype, n, t.mode)))
             for shape, dtype, n in measured for t in SWEEP_TARGETS]
    values = {(c["shape"], c["dtype"], c["N"], c["mode"], c["metric"]) for c in sweep if c["value"] is not None}
    complete = all((shape, dtype, n, t.mode, t.metric) in values for shape in SWEEP_SHAPES for dtype in SWEEP_DTYPES
                   for n in N_SWEEP for t in SWEEP_TARGETS)
    return {
        "stated_for": f"NVIDIA H100, {TARGET_SHAPE}, {TARGET_DTYPE} (headline N = {TARGET_HEADLINE_N} = 32 x 128)",
        "sweep_rule": (f"at every measured N in [{lo}, {hi}], shapes {' and '.join(SWEEP_SHAPES)}, dtypes "
                       f"{' and '.join(SWEEP_DTYPES)}, modes forward and full: fused_vs_eager > 1 and "
                       "fused_vs_compile_max > 1"),
        "measured_on": device_name,
        "on_target_device": "H100" in device_name,
        "headline_passed": _verdict([c["passed"] for c in checks]),
        "sweep_passed": _verdict([c["passed"] for c in sweep]),
        "sweep_complete": complete,
        "checks": checks + sweep,
    }


def _auto_pick(decision: str, shape: Shape, dtype: str, n: int) -> str:
    """What the shipped CUDA rule (``mhmla_fast.dispatch``) runs for one entry: "fused",
    "eager" or "mixed" (a fused forward behind an eager backward or the reverse)."""
    import torch

    from mhmla_fast.dispatch import fused_unsupported, layer_attention_kernels

    torch_dtype = _torch_dtype(dtype)
    pair = layer_attention_kernels(
        "auto", torch.device("cuda"), needs_grad=decision == "training", work=auto_work(shape, n),
        unsupported=fused_unsupported("cuda", torch_dtype, shape.H, shape.K), dtype=torch_dtype)
    if decision == "inference":
        pair = (pair[0], pair[0])
    return {("triton", "triton"): "fused", ("torch", "torch"): "eager"}.get(pair, "mixed")


def auto_work(shape: Shape, n: int) -> int:
    """L N H (H + K): the work measure of ``backend="auto"``'s thresholds (``dispatch.AutoRule``)."""
    return shape.L * n * shape.H * (shape.H + shape.K)


def _threshold(entries: list[dict]) -> dict:
    """Where fused starts winning along the work axis, from one decision and dtype's entries.

    ``eager_up_to_work``: the most work at which eager won or tied; ``fused_from_work``: the
    least at which fused won. ``separable``: every fused win lies above every eager win or tie,
    so a work threshold in (eager_up_to_work, fused_from_work] reproduces the measurements."""
    decided = [e for e in entries if e["winner"] is not None]
    eager = [e["work"] for e in decided if e["winner"] in ("eager", "tie")]
    fused = [e["work"] for e in decided if e["winner"] == "fused"]
    eager_up_to, fused_from = max(eager, default=None), min(fused, default=None)
    return {"entries": len(entries), "decided": len(decided), "fused_wins": len(fused),
            "eager_up_to_work": eager_up_to, "fused_from_work": fused_from,
            "separable": bool(decided) and (eager_up_to is None or fused_from is None or eager_up_to < fused_from)}


def auto_evidence(rows: list[dict], device_name: str) -> dict:
    """Eager against fused for each decision ``backend="auto"`` makes on CUDA, and whether the
    shipped rule (``mhmla_fast.dispatch.AUTO_KERNELS["cuda"]``) picked the faster one.

    The decisions (``AUTO_DECISIONS``): ``inference``, the forward when no gradient is needed
    (mode inference rows: fused forward against eager forward, under ``torch.no_grad``), and
    ``training``, forward + backward when one is (mode full rows: the fused pair against
    eager end to end; auto never mixes them there, since an eager backward behind a fused
    forward would re-run the eager forward). Each entry, per (shape, dtype, N, decision): both
    medians and auto's (what auto ran, measured), ``work`` = L N H (H + K), ``winner``
    ("fused", "eager", "tie", or None when either failed or was not run, with a ``note``),
    ``ratio`` = slower median / faster (>= 1), ``fused_vs_eager`` = eager / fused,
    ``auto_picks`` (the shipped rule's choice: "fused", "eager" or "mixed") and ``auto_right``
    (it picked the winner or the entry was a tie; None without a winner).

    ``thresholds[decision][dtype]`` (:func:`_threshold`) places the measured crossover on the
    work axis beside the rule's threshold for that decision (``rule_min_work``: ``min_fused_work``
    for inference, ``min_fused_backward_work`` for training); ``rule_right`` is False if the
    rule picked the slower implementation at any measured entry of that dtype, True if it picked
    the winner (or a tie) at every entry, None without a decided entry.
    """
    from mhmla_fast.dispatch import AUTO_KERNELS, AutoRule

    rule = AUTO_KERNELS.get("cuda", AutoRule())
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        for decision, mode in AUTO_DECISIONS.items():
            if r["mode"] == mode and r["provider"] in ("eager", "fused", "auto"):
                groups.setdefault((r["shape"], r["dtype"], r["N"], decision), {})[r["provider"]] = r
    entries = []
    for (shape, dtype, n, decision), by in groups.items():
        if "eager" not in by and "fused" not in by:
            continue
        eager_ms, fused_ms = _median(by.get("eager")), _median(by.get("fused"))
        winner, ratio, note = None, None, None
        if eager_ms is None or fused_ms is None:
            missing = [p for p, v in (("eager", eager_ms), ("fused", fused_ms)) if v is None]
            note = " and ".join(missing) + " not measured (failed or not run)"
        elif fused_ms < eager_ms:
            winner, ratio = "fused", eager_ms / fused_ms
        elif eager_ms < fused_ms:
            winner, ratio = "eager", fused_ms / eager_ms
        else:
            winner, ratio = "tie", 1.0
        picks = _auto_pick(decision, SHAPES[shape], dtype, n) if shape in SHAPES else None
        right = None if winner is None or picks is None else winner == "tie" or winner == picks
        entries.append({"shape": shape, "dtype": dtype, "N": n, "decision": decision,
                        "mode": AUTO_DECISIONS[decision],
                        "work": auto_work(SHAPES[shape], n) if shape in SHAPES else None,
                        "eager_ms": eager_ms, "fused_ms": fused_ms, "auto_ms": _median(by.get("auto")),
                        "winner": winner, "ratio": ratio, "fused_vs_eager": _ratio(eager_ms, fused_ms),
                        "auto_picks": picks, "auto_right": right, "note": note})
    rule_work = {"inference": rule.min_fused_work, "training": rule.min_fused_backward_work}
    thresholds: dict[str, dict[str, dict]] = {}
    for decision in AUTO_DECISIONS:
        for dtype in sorted({e["dtype"] for e in entries if e["decision"] == decision}):
            mine = [e for e in entries if e["decision"] == decision and e["dtype"] == dtype
                    and e["work"] is not None]
            thresholds.setdefault(decision, {})[dtype] = {
                **_threshold(mine), "rule_min_work": rule_work[decision],
                "rule_right": _verdict([e["auto_right"] for e in mine if e["auto_right"] is not None]),
            }
    return {
        "device": device_name,
        "rule": {"forward": rule.forward, "backward": rule.backward, "min_fused_work": rule.min_fused_work,
                 "min_fused_backward_work": rule.min_fused_backward_work},
        "decisions": {d: f"mode {m} rows" for d, m in AUTO_DECISIONS.items()},
        "rule_right": _verdict([e["auto_right"] for e in entries if e["auto_right"] is not None]),
        "thresholds": thresholds,
        "entries": entries,
    }


def summarize_determinism(rows: list[dict]) -> dict:
    """Fused's weight-gradient determinism per (shape, dtype, N) and overall
    (``weight_grads_deterministic``: False if any check found a difference, True if every
    check ran and found none, None if none ran)."""
    entries: dict[tuple, dict] = {}
    for r in rows:
        key = (r["shape"], r["dtype"], r["N"])
        if r["provider"] != "fused" or key in entries:
            continue
        entries[key] = {"shape": r["shape"], "dtype": r["dtype"], "N": r["N"],
                        "weight_grads_deterministic": r.get("weight_grads_deterministic"),
                        "weight_grads_max_abs_diff": r.get("weight_grads_max_abs_diff"),
                        "note": r.get("determinism_note") or r.get("error")}
    return {
        "check": "two identical forward + backward runs of fused; the weight gradients (w_v, b_v, w_k, b_k, "
                 "w_a, b_a) must be bitwise equal",
        "weight_grads_deterministic": _verdict([e["weight_grads_deterministic"] for e in entries.values()]),
        "entries": list(entries.values()),
    }


def _fmt(x: Any, spec: str) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, spec)


def format_table(rows: list[dict]) -> str:
    head = (f"{'shape':9s} {'dtype':5s} {'N':>6s} {'provider':11s} {'mode':9s} {'p50 ms':>9s} "
            f"{'p20-p80 ms':>17s} {'host ms':>8s} {'TFLOP/s':>8s} {'ceil':>5s} {'mem MiB':>9s} {'diff':>8s} "
            f"{'err64':>8s}  error")
    lines = [head, "-" * len(head)]
    for r in rows:
        spread = (f"{r['ms_p20']:.3f}-{r['ms_p80']:.3f}" if r["ms_p20"] is not None else "-")
        ratio = r["ratio_to_matmul_ceiling"]
        lines.append(
            f"{r['shape']:9s} {r['dtype']:5s} {r['N']:6d} {r['provider']:11s} {r['mode']:9s} "
            f"{_fmt(r['ms_p50'], '.3f'):>9s} {spread:>17s} {_fmt(r.get('host_ms_p50'), '.3f'):>8s} "
            f"{_fmt(r['tflops'], '.1f'):>8s} "
            f"{(_fmt(100 * ratio, '.0f') + '%') if ratio is not None else '-':>5s} "
            f"{_fmt(r['peak_extra_mem_mb'], '.1f'):>9s} {_fmt(r['max_abs_diff'], '.1e'):>8s} "
            f"{_fmt(r['max_abs_err_fp64'], '.1e'):>8s}  {(r['error'] or '')[:80]}"
        )
    return "\n".join(lines)


_VERDICT = {True: "PASS", False: "FAIL", None: "n/a"}


def format_speedups(speedups: list[dict], targets: dict | None = None) -> str:
    cols = [("f/eager", "fused_vs_eager"), ("f/compile", "fused_vs_compile"), ("f/c-max", "fused_vs_compile_max"),
            ("f/cublas", "fused_vs_cublas"), ("a/eager", "auto_vs_eager"), ("a/c-max", "auto_vs_compile_max")]
    head = (f"{'shape':9s} {'dtype':5s} {'N':>6s} {'mode':9s} " + " ".join(f"{c:>9s}" for c, _ in cols)
            + f" {'mem f/e':>8s} {'f ceil':>6s} {'det':>4s}")
    lines = ["speedup = other's median time / fused's (f) or auto's (a) (> 1: faster than the other); "
             "mem f/e = fused's peak extra memory / eager's; det = fused weight gradients bitwise "
             "reproducible", head, "-" * len(head)]
    for s in speedups:
        ceil = s["fused_ratio_to_matmul_ceiling"]
        det = {True: "yes", False: "NO", None: "-"}[s.get("weight_grads_deterministic")]
        lines.append(
            f"{s['shape']:9s} {s['dtype']:5s} {s['N']:6d} {s['mode']:9s} "
            + " ".join(f"{_fmt(s[k], '.2f'):>9s}" for _, k in cols)
            + f" {_fmt(s['fused_mem_over_eager'], '.3f'):>8s} "
            f"{(_fmt(100 * ceil, '.0f') + '%') if ceil is not None else '-':>6s} {det:>4s}"
        )
    if targets and targets["checks"]:
        lines.append("")
        lines.append(f"targets (stated for {targets['stated_for']}; measured on {targets['measured_on']}):")
        for c in targets["checks"]:
            mark = " *" if c["headline"] else ""
            lines.append(f"  {c['shape']:9s} {c['dtype']:5s} N={c['N']:6d} {c['mode']:8s} {c['metric']:22s} "
                         f"{_fmt(c['value'], '.3f'):>8s} (target {c['target']}) {_VERDICT[c['passed']]}{mark}")
        lines.append("  * headline")
        lines.append(f"  headline: {_VERDICT[targets['headline_passed']]}; sweep ({targets['sweep_rule']}): "
                     f"{_VERDICT[targets['sweep_passed']]}"
                     + ("" if targets["sweep_complete"] else " (the grid was not measured in full)"))
    return "\n".join(lines)


def format_auto_evidence(evidence: dict) -> str:
    rule = evidence["rule"]
    lines = [f"auto's evidence on {evidence['device']} (ratio = slower median / faster; picks = what the "
             f"shipped rule runs: fused forward from work {rule['min_fused_work']:.3g}, fused pair in "
             f"training from {rule['min_fused_backward_work']:.3g}, work = L N H (H + K)):"]
    head = (f"  {'decision':9s} {'shape':9s} {'dtype':5s} {'N':>6s} {'work':>8s} {'eager ms':>9s} "
            f"{'fused ms':>9s} {'auto ms':>9s} {'winner':>7s} {'ratio':>6s} {'picks':>6s} {'right':>5s}")
    lines += [head, "  " + "-" * (len(head) - 2)]
    for decision in AUTO_DECISIONS:
        for e in (e for e in evidence["entries"] if e["decision"] == decision):
            times = " ".join(f"{_fmt(e[k], '.3f'):>9s}" for k in ("eager_ms", "fused_ms", "auto_ms"))
            right = {True: "yes", False: "NO", None: "-"}[e["auto_right"]]
            lines.append(f"  {decision:9s} {e['shape']:9s} {e['dtype']:5s} {e['N']:6d} {_fmt(e['work'], '.2e'):>8s} "
                         f"{times} {e['winner'] or '-':>7s} {_fmt(e['ratio'], '.2f'):>6s} "
                         f"{e['auto_picks'] or '-':>6s} {right:>5s}" + (f"  ({e['note']})" if e["note"] else ""))
    for decision, by_dtype in evidence["thresholds"].items():
        for dtype, t in by_dtype.items():
            if not t["decided"]:
                lines.append(f"  {decision} {dtype}: nothing decided (eager or fused not measured)")
                continue
            where = ("fused never won" if t["fused_from_work"] is None else
                     f"fused won from work {t['fused_from_work']:.3g}"
                     + ("" if t["eager_up_to_work"] is None else f", eager up to {t['eager_up_to_work']:.3g}"))
            lines.append(f"  {decision} {dtype}: {where} ({t['fused_wins']} of {t['decided']} decided"
                         f"{'' if t['separable'] else '; NOT separable by work'}); rule's threshold "
                         f"{t['rule_min_work']:.3g}: {_VERDICT[t['rule_right']]}")
    lines.append(f"  the shipped rule picked the faster implementation everywhere measured: "
                 f"{_VERDICT[evidence['rule_right']]}")
    return "\n".join(lines)


def format_determinism(determinism: dict) -> str:
    verdict = {True: "bitwise equal", False: "DIFFER", None: "not checked"}
    lines = [f"fused weight gradients over two identical runs: {verdict[determinism['weight_grads_deterministic']]}"]
    for e in determinism["entries"]:
        if e["weight_grads_deterministic"] is not True:
            diffs = e["weight_grads_max_abs_diff"] or {}
            differing = ", ".join(f"{k} {v:.2e}" for k, v in diffs.items() if v) or e["note"] or "-"
            lines.append(f"  {e['shape']} {e['dtype']} N={e['N']}: {verdict[e['weight_grads_deterministic']]} "
                         f"({differing})")
    return "\n".join(lines)


def _json_safe(x: Any) -> Any:
    """Non-finite floats as strings, so the file is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


# ----------------------------------------------------------------------------------------------
# Environment, output path, CLI
# ----------------------------------------------------------------------------------------------


def git_commit() -> str:
    """$MHMLA_BENCH_COMMIT if set, else :func:`mhmla_fast.provenance.git_commit` ($MHMLA_COMMIT,
    which the GPU scripts set since a device's copy of the tree has no .git; else this
    checkout's HEAD; else "unknown")."""
    if os.environ.get("MHMLA_BENCH_COMMIT", "").strip():
        return os.environ["MHMLA_BENCH_COMMIT"].strip()
    from mhmla_fast.provenance import git_commit as package_commit

    return package_commit()


def gpu_slug(name: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "gpu"


def resolve_out_path(out: str | None, device_name: str, today: datetime.date) -> Path:
    """--out FILE.json is used as given; --out DIR (or none: bench/results/) gets the default
    name layer_attention_<gpu-slug>_<date>.json, with -2, -3 ... if that file exists."""
    from mhmla_fast.provenance import dated_results_path

    return dated_results_path(out, f"layer_attention_{gpu_slug(device_name)}", DEFAULT_OUT_DIR, today)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from mhmla_fast.commands.argtypes import positive_int, rate

    p = argparse.ArgumentParser(
        prog="benchmark_layer_attention.py",
        description="Time mhmla_fast.layer_attention (eager, torch.compile default and max-autotune, fused "
                    "Triton, backend auto, and the cuBLAS line of the two projections alone) on a CUDA "
                    "GPU: median ms with 20th/80th percentiles, TFLOP/s against the measured bf16 matmul "
                    "ceiling, peak extra memory, and the difference from eager; then the speedups, the "
                    "op issue's targets, auto's evidence (eager or fused in inference and in training, against the "
                    "shipped rule) and "
                    "fused's weight-gradient determinism. Writes one JSON file.",
        epilog=f"FLOP convention: {FLOP_CONVENTION} See bench/README.md.",
    )
    p.add_argument("--quick", action="store_true",
                   help="only BERT-base, bf16, N = 4096 (explicit --shapes/--dtypes/--n still win)")
    p.add_argument("--out", default=None,
                   help="output .json file, or a directory for the default name "
                        "layer_attention_<gpu-slug>_<date>.json (default: bench/results/)")
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None,
                   help="head shapes (default: bert-base minilm)")
    p.add_argument("--dtypes", nargs="+", choices=DTYPE_NAMES, default=None, help="default: bf16 fp16")
    p.add_argument("--n", nargs="+", type=positive_int, default=None, dest="ns",
                   help=f"token counts N (default: {' '.join(map(str, N_SWEEP))})")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS),
                   help=f"default: {' '.join(PROVIDERS)} (compile-max autotunes for minutes per shape, dtype and N)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="default: forward backward full inference ('inference' = forward under no_grad; auto's "
                        "evidence reads the inference and full rows)")
    p.add_argument("--dropout", type=rate, default=0.0,
                   help="train-mode dropout rate on h, k and p (default 0: no dropout; > 0 skips the "
                        "comparison with eager, whose masks differ)")
    p.add_argument("--seed", type=int, default=0, help="input seed (each N adds N to it)")
    p.add_argument("--warmup-ms", type=positive_int, default=25, help="timer warm-up budget, ms")
    p.add_argument("--rep-ms", type=positive_int, default=100, help="timer measuring budget, ms")
    p.add_argument("--bwd-group-elements", type=positive_int, default=None,
                   help="the fused backward's layer-group budget (kernels.layer_attention."
                        "BWD_GROUP_ELEMENTS; default: the module's, 2^27): fewer elements use less "
                        "memory and more launches; recorded in the header")
    p.add_argument("--evidence-from", nargs="+", metavar="FILE", default=None,
                   help="measure nothing: print auto's evidence from these result files (one per run; any "
                        "schema), against the rule this checkout ships; runs without a GPU")
    args = p.parse_args(argv)
    if args.shapes is None:
        args.shapes = ["bert-base"] if args.quick else list(SHAPES)
    if args.dtypes is None:
        args.dtypes = ["bf16"] if args.quick else list(DTYPE_NAMES)
    if args.ns is None:
        args.ns = [4096] if args.quick else list(N_SWEEP)
    return args


def _import_layer_attention() -> Callable:
    """The installed package if there is one, else this checkout's source tree."""
    try:
        from mhmla_fast import layer_attention
    except ImportError:
        sys.path.insert(0, str(REPO_ROOT))
        for name in [m for m in sys.modules if m == "mhmla_fast" or m.startswith("mhmla_fast.")]:
            del sys.modules[name]
        from mhmla_fast import layer_attention
    return layer_attention


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


TIMER_SINCE = "2026-12-07"  # CudaTimer for every provider (before: triton.testing.do_bench)


def evidence_from_files(paths: list[str]) -> int:
    """Auto's evidence recomputed from result files of earlier runs, one file at a time (its
    rows are one run's), against the rule this checkout ships. A file that is not a
    layer-attention result is named on stderr and skipped (so a glob over a results folder
    works); exit 2 if none was one."""
    read = 0
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
            device = data["header"]["device"]
            # a run's partial file (written row by row) names N "n"
            rows = [{**r, "N": r["N"] if "N" in r else r["n"]} for r in data["rows"]]
            for r in rows:
                r["shape"], r["dtype"], r["mode"], r["provider"]  # noqa: B018 (the fields read)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"{path}: skipped, not a layer-attention result file ({type(e).__name__}: {e})",
                  file=sys.stderr)
            continue
        read += 1
        timing = data["header"].get("timing") or "not recorded"
        print(f"== {path} (commit {data['header'].get('commit', 'unknown')}, "
              f"schema {data.get('schema_version', 1)}; timing: {timing})")
        if "CudaTimer" not in timing:
            print(f"   (timed before {TIMER_SINCE}: triton's do_bench timed host-bound calls, the "
                  "fused forward + backward among them, about 0.09 ms short on an H100; a win by "
                  "less than that is within the timer's bias)")
        print(format_auto_evidence(auto_evidence(rows, device)))
    return 0 if read else 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.evidence_from:
        return evidence_from_files(args.evidence_from)

    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE, file=sys.stderr)
        return 0

    try:
        import triton
    except ImportError as e:
        print(f"triton is needed (the fused op): {e}", file=sys.stderr)
        return 1
    try:
        op = _import_layer_attention()
    except ImportError as e:
        print(f"cannot import mhmla_fast.layer_attention: {e}", file=sys.stderr)
        return 1

    import mhmla_fast.kernels.layer_attention as kernels

    if args.bwd_group_elements is not None:
        kernels.BWD_GROUP_ELEMENTS = args.bwd_group_elements
    started = time.time()
    device_name = torch.cuda.get_device_name()
    props = torch.cuda.get_device_properties(0)
    meta = {
        "device": device_name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "commit": git_commit(),
    }
    timer = CudaTimer(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    _log(f"{device_name}: torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}, "
         f"commit {meta['commit']}")

    ceilings: dict[str, Any] = {}
    for name in ("bf16", "fp16"):
        try:
            ceilings[name] = measure_matmul_ceiling(timer, _torch_dtype(name))
            _log(f"{name} matmul ceiling ({MATMUL_CEILING_SIZE}^3): {ceilings[name]['tflops']:.1f} TFLOP/s")
        except Exception as e:  # noqa: BLE001
            ceilings[name] = {"error": _error_text(e)}
            _log(f"{name} matmul ceiling: {ceilings[name]['error']}")
    try:
        copy = measure_copy_ceiling(timer)
        _log(f"device-to-device copy: {copy['gbps']:.0f} GB/s (read + write)")
    except Exception as e:  # noqa: BLE001
        copy = {"error": _error_text(e)}
    ceiling_tflops = ceilings["bf16"].get("tflops")

    cfg = BenchConfig(shapes=[SHAPES[s] for s in args.shapes], dtypes=list(args.dtypes), ns=list(args.ns),
                      providers=list(args.providers), modes=list(args.modes), dropout=args.dropout,
                      seed=args.seed)
    rows = run_benchmark(cfg, op, device="cuda", timer=timer, peak_probe=cuda_peak_extra_bytes,
                         ceiling_tflops=ceiling_tflops, meta=meta, log=_log)
    speedups = summarize_speedups(rows)
    targets = evaluate_targets(speedups, device_name)
    evidence = auto_evidence(rows, device_name)
    determinism = summarize_determinism(rows)

    now = datetime.datetime.now(datetime.timezone.utc)
    header = {
        **meta,
        "capability": list(torch.cuda.get_device_capability()),
        "multiprocessors": props.multi_processor_count,
        "gpu_memory_gib": props.total_memory / 2**30,
        "python": sys.version.split()[0],
        "op_source": getattr(sys.modules.get(getattr(op, "__module__", "") or ""), "__file__", None),
        "timestamp": now.isoformat(timespec="seconds"),
        "wall_s": round(time.time() - started, 1),
        "matmul_ceiling_bf16_tflops": ceiling_tflops,
        "matmul_ceiling": ceilings,
        "copy_ceiling": copy,
        "flop_convention": FLOP_CONVENTION,
        "timing": f"CudaTimer: CUDA events around each call, quantiles {list(QUANTILES)}, "
                  f"warm-up {args.warmup_ms} ms, measured {args.rep_ms} ms; L2 flushed and the "
                  "GPU synchronised (idle) before each run (before 2026-12-07: "
                  "triton.testing.do_bench, no synchronisation after its flush)",
        "peak_extra_mem": "max_memory_allocated() after reset_peak_memory_stats() minus memory_allocated() "
                          "before one call, MiB (2^20 bytes); inputs (and for backward the built graph) excluded",
        "bwd_group_elements": kernels.BWD_GROUP_ELEMENTS,
        "config": {"shapes": [vars(s) for s in cfg.shapes], "dtypes": cfg.dtypes, "N": cfg.ns,
                   "providers": cfg.providers, "modes": cfg.modes, "dropout": cfg.dropout, "seed": cfg.seed,
                   "argv": list(sys.argv[1:] if argv is None else argv)},
    }
    result = {"benchmark": "layer_attention", "schema_version": 3, "header": header, "rows": rows,
              "speedups": speedups, "targets": targets, "auto_evidence": evidence,
              "determinism": determinism}

    print(format_table(rows))
    print()
    print(format_speedups(speedups, targets))
    print()
    print(format_auto_evidence(evidence))
    print()
    print(format_determinism(determinism))
    path = resolve_out_path(args.out, device_name, now.date())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(result), indent=1, allow_nan=False) + "\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
