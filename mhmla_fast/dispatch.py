"""What ``backend="auto"`` runs: per device type and direction, the implementation measured fastest.

The layer-attention op has two implementations of each direction, the eager reference
(``"torch"``) and the fused Triton kernels (``"triton"``), and ``autograd`` lets them be mixed:
a fused forward with an eager backward on the same dropout masks, or the other way round
(``mhmla_fast.kernels.layer_attention.LayerAttentionFunction``). ``AUTO_KERNELS`` holds, per
device type, an :class:`AutoRule`: the (forward, backward) pair that ``backend="auto"`` picks
and the least work at which the fused forward pays. It changes only with a benchmark run on
that device (``python bench/benchmark_layer_attention.py``, whose ``auto_evidence`` section
names the faster implementation of each decision, a forward without a gradient and forward +
backward, at every measured shape, dtype and N, and whether this rule picked it;
``--evidence-from FILE...`` recomputes it from committed result files).

CUDA, as measured on an NVIDIA H100 80GB HBM3 (torch 2.11, triton 3.6, commit 07aac5b,
``bench/results/gpu_2026-11-23/sweep_*.json``; bf16 and fp16, N = 1024, 4096, 16384):

- forward: the fused op is 1.9-2.0x eager at BERT-base shape from N = 4096 up (0.339 against
  0.645 ms at N = 4096, bf16) and 1.6x at MiniLM shape at N = 16384, but slower where the
  work is small and launch overhead dominates (BERT-base N = 1024 bf16: 0.257 against 0.198
  ms; MiniLM N = 1024 and 4096: 0.22 against 0.14-0.17 ms). The crossover lies between
  L N H (H + K) = 1.45e10 (lost or tied) and 2.9e10 (won): auto takes the fused forward from
  2^34 = 1.7e10 up, eager below.
- backward (``bench/results/gpu_2026-11-26/``, commit b094c51, bf16): the fused forward +
  backward recomputes v and z on chip (six GEMM-sized passes to eager's four, 1.19 ms of GPU
  time at BERT-base N = 4096) and is still bound by its host launches where the work is
  small. Against eager: BERT-base N = 1024 1.306 against 0.953 ms (lost), N = 4096 1.640
  against 1.688 and 1.735 against 1.693 in a second run (a tie), N = 16384 4.778 against
  6.382 ms (won, 1.34x); MiniLM lost at N = 1024 and 4096 and tied at 16384 (1.869 against
  1.846). So auto runs the fused pair only from L N H (H + K) = 2^37 = 1.4e11 up (BERT-base
  from about N = 9,700 tokens), in fp16 and bf16 (fp32 was not measured); below it, when a
  gradient is needed, eager end to end (an eager backward behind a fused forward would
  recompute the eager forward). Re-measured later that day (``gpu_2026-11-26-c/``, commit
  b8ba9e9, ``bench/layer_attention_graph_probe.py``): at BERT-base N = 4096 the fused pair's
  kernels take 1.072 ms replayed from a CUDA graph against eager's 1.656, but as called it is
  bound by 1.845 ms of host time (2.149 ms against eager's 1.841), so the rule stands until
  the host path is cheaper. With the launches going straight to the compiled kernels
  (``gpu_2026-11-27/run1_graph_probe.json``, commit 2b4c0d0) it is a tie there: 1.784 ms as
  called against eager's 1.827 (host 1.639 against 1.275 ms); MiniLM still loses at N = 1024
  and 4096 (1.524 against 1.219, 1.536 against 1.475 ms). The rule stands.
- 16-bit inputs whose H or K is not a multiple of 16 run eager (:func:`fused_unsupported`).

Devices without Triton (CPU without ``TRITON_INTERPRET=1``) always run eager.

While a graph is captured for every input shape at once (``torch.export`` and the ONNX
exporters, ``torch.jit.trace``) or under a ``torch.func`` transform (``vmap``, ``grad``),
``auto`` runs eager: a rule on the number of tokens would be a guard on a dynamic dimension
(``torch.export`` refuses it), the traced graph then holds only standard ops that any runtime
runs, and the fused launchers cannot take traced or batched tensors. ``backend="triton"`` is
refused under ``torch.jit.trace`` and ``torch.func`` transforms (``torch.export`` records
its custom op).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["AUTO_KERNELS", "BACKENDS", "AutoRule", "backend_unavailable", "fused_unsupported",
           "graph_capture", "layer_attention_kernels", "triton_missing"]

BACKENDS = ("auto", "torch", "triton")
IMPLEMENTATIONS = ("torch", "triton")


@dataclass(frozen=True)
class AutoRule:
    """What ``backend="auto"`` runs on one device type.

    ``forward``, ``backward``: "torch" or "triton". ``min_fused_work``: the fused forward runs
    only where the two projections' multiply-adds L N H (H + K) reach this (below it, launch
    overhead makes eager faster); eager runs below. ``min_fused_backward_work``: likewise for
    a fused backward ("triton" backward), which auto takes only for 16-bit inputs.
    """

    forward: str = "torch"
    backward: str = "torch"
    min_fused_work: int = 0
    min_fused_backward_work: int = 0

    def __post_init__(self):
        for name in ("forward", "backward"):
            if getattr(self, name) not in IMPLEMENTATIONS:
                raise ValueError(f"{name}: expected one of {IMPLEMENTATIONS}, got {getattr(self, name)!r}")


# device type -> rule; a device type not listed runs eager
AUTO_KERNELS: dict[str, AutoRule] = {
    "cuda": AutoRule(forward="triton", backward="triton", min_fused_work=1 << 34,
                     min_fused_backward_work=1 << 37),
}


def triton_missing() -> str | None:
    """Why the fused kernels cannot be imported at all (no ``triton`` package), or None."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return ("backend 'triton' (the fused kernels) needs the triton package: pip install "
                "'mhmla-fast[triton]' (CUDA builds of torch bring it); use 'auto' or 'torch' "
                "without it")
    return None


def backend_unavailable(backend: str, device_type: str) -> str | None:
    """Why ``backend`` cannot run on devices of ``device_type`` at all, or None: asked before
    training starts, so a run is refused at once rather than at its first step."""
    if backend == "triton" and (missing := triton_missing()) is not None:
        return missing
    if (backend == "triton" and device_type == "cpu"
            and os.environ.get("TRITON_INTERPRET", "0") != "1"):
        return ("backend 'triton' (the fused kernels) runs on a CPU only under the Triton "
                "interpreter (TRITON_INTERPRET=1 set before Python starts: a test mode, far "
                "slower than eager); use 'auto' or 'torch' on this CPU")
    return None


def fused_unsupported(device_type: str, dtype: torch.dtype, H: int, K: int) -> str | None:
    """Why the fused kernels cannot take this case, or None if they can.

    On CUDA in fp16/bf16 they need H and K multiples of 16: at L, N, H, K, J = 13, 70, 120, 72,
    3 an H100 run faulted (illegal memory access in fp16, wrong values in bf16) while fp32
    and every shape with H or K a multiple of 16 matched eager (issue 10, open). The
    interpreter's memory check finds every access in bounds there
    (``tests/test_layer_attention_memcheck.py``), so the fault is in the compiled code. Every
    BERT-like encoder's H is a multiple of 64. On the CPU (the Triton interpreter, a test
    mode) bf16 is refused: the interpreter's bf16 ``tl.dot`` is wrong (a 16x16 product off by
    about 2e10 in Triton 3.6), so the kernels would return garbage there.
    """
    if device_type == "cpu" and dtype == torch.bfloat16:
        return ("the fused kernels on the CPU (the Triton interpreter) cannot take bf16: the "
                "interpreter's bf16 dot products are wrong (Triton 3.6); use fp32 or fp16 there, "
                "or backend='auto' or 'torch'")
    if device_type == "cuda" and dtype in (torch.float16, torch.bfloat16) and (H % 16 or K % 16):
        return (f"the fused kernels in {str(dtype).removeprefix('torch.')} on CUDA need H and K "
                f"multiples of 16, got H={H}, K={K} (a kernel fault at H=120, K=72 is open); "
                "use backend='auto' or 'torch'")
    return None


def graph_capture() -> str | None:
    """The capture that is tracing this call for every input shape (module doc), named, or
    None: ``torch.jit.trace``, ``torch.export`` or a ``torch.func`` transform."""
    if torch.jit.is_tracing():
        return "torch.jit.trace (the legacy ONNX exporter)"
    is_exporting = getattr(torch.compiler, "is_exporting", None)  # (torch >= 2.5)
    if is_exporting is not None and is_exporting():
        return "torch.export"
    transforms = getattr(torch._C, "_are_functorch_transforms_active", None)
    if transforms is not None and transforms():
        return "a torch.func transform (vmap, grad, jacrev, ...)"
    return None


def layer_attention_kernels(backend: str, device: torch.device, needs_grad: bool = False,
                            work: int | None = None, unsupported: str | None = None,
                            dtype: torch.dtype | None = None) -> tuple[str, str]:
    """The (forward, backward) implementations ``backend`` means on ``device``; eager under
    a capture for every input shape (:func:`graph_capture`, module doc).

    ``"torch"`` and ``"triton"`` mean that implementation in both directions; ``"auto"``
    follows ``AUTO_KERNELS[device.type]``: eager in both directions when a backward will run
    (``needs_grad``) and the rule's backward is eager, since an eager backward behind a fused
    forward recomputes the eager forward; an eager forward where ``work`` (L N H (H + K))
    is below the rule's ``min_fused_work`` or the fused kernels cannot take the case
    (``unsupported``, from :func:`fused_unsupported`). A fused backward needs ``dtype`` fp16 or
    bf16 and ``work`` at least the rule's ``min_fused_backward_work`` (else eager end to end
    when a gradient is needed).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend != "torch":
        capture = graph_capture()
        if capture is not None and (backend == "auto" or capture != "torch.export"):
            if backend == "triton":
                raise ValueError(f"backend: 'triton' (the fused kernels) cannot run under "
                                 f"{capture}; use 'auto' or 'torch' (eager while capturing)")
            return ("torch", "torch")
    if backend != "auto":
        return (backend, backend)
    rule = AUTO_KERNELS.get(device.type, AutoRule())
    forward, backward = rule.forward, rule.backward
    if unsupported is not None:
        return ("torch", "torch")
    if backward == "triton" and (
            dtype not in (torch.float16, torch.bfloat16)
            or (work is not None and work < rule.min_fused_backward_work)):
        backward = "torch"
    if needs_grad and backward == "torch":
        return ("torch", "torch")
    if forward == "triton" and work is not None and work < rule.min_fused_work:
        forward = "torch"
    return (forward, backward)
