"""What ``backend="auto"`` runs: per device type and direction, the implementation measured fastest.

The layer-attention op has two implementations of each direction, the eager reference
(``"torch"``) and the fused Triton kernels (``"triton"``), and ``autograd`` lets them be mixed:
a fused forward with an eager backward on the same dropout masks, or the other way round
(``mhmla_fast.kernels.layer_attention.LayerAttentionFunction``). ``AUTO_KERNELS`` holds, per
device type, the (forward, backward) pair that ``backend="auto"`` picks. It changes only with a
benchmark run on that device (``python bench/benchmark_layer_attention.py``, whose
``direction_winners`` section names the faster implementation of each direction at every
measured shape, dtype and N), and the fused one is chosen only where it won everywhere.

CUDA, as measured (NVIDIA H100 80GB HBM3, torch 2.11, triton 3.6, commit 91242dd, issue 10):
the fused forward was faster than eager at BERT-base shape (0.470 against 0.646 ms, bf16,
N = 4096) but slower at MiniLM shape (0.27 against 0.23 ms), and the fused backward was 9x
slower than eager. The kernels have been rewritten since (GEMM-shaped backward, autotuned
tiles) without a GPU to measure them on, so CUDA stays on eager in both directions until a
GPU run shows otherwise. Devices without Triton (CPU without ``TRITON_INTERPRET=1``) always
run eager.
"""

from __future__ import annotations

import torch

__all__ = ["AUTO_KERNELS", "BACKENDS", "layer_attention_kernels"]

BACKENDS = ("auto", "torch", "triton")

# device type -> (forward, backward); a device type not listed runs ("torch", "torch")
AUTO_KERNELS: dict[str, tuple[str, str]] = {
    "cuda": ("triton", "torch"),
}


def layer_attention_kernels(backend: str, device: torch.device,
                            needs_grad: bool = False) -> tuple[str, str]:
    """The (forward, backward) implementations ``backend`` means on ``device``.

    ``"torch"`` and ``"triton"`` mean that implementation in both directions; ``"auto"``
    looks ``device.type`` up in ``AUTO_KERNELS``. When a backward will run (``needs_grad``)
    and the table's backward is eager, ``"auto"`` runs eager in both directions: an eager
    backward behind a fused forward recomputes the eager forward, so the pair would cost a
    fused forward more than eager alone.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        forward, backward = AUTO_KERNELS.get(device.type, ("torch", "torch"))
        if needs_grad and backward == "torch":
            return ("torch", "torch")
        return (forward, backward)
    return (backend, backend)
