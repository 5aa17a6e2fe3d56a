"""Where work runs: the one rule for "cuda if available, else cpu", and the CPU's physical cores.

Training (``ged/``, ``aes/``) and serving (``serve/options.py``) both ask :func:`resolve_device`,
so the rule is written once and nothing below ``serve/`` has to import from it; likewise
:func:`physical_cores` (ONNX Runtime's default thread count, and what results files record).
Importing this module imports neither torch nor ONNX Runtime; each check imports only the
runtime it asks about.
"""

from __future__ import annotations

import os

__all__ = ["cuda_available", "resolve_device", "physical_cores"]


def cuda_available(backend: str = "torch") -> bool:
    """Whether ``backend`` ("torch", "onnx" or "tensorrt") can run on a CUDA GPU here:
    torch: a usable ``torch.cuda`` device; ONNX Runtime: its CUDA execution provider is
    installed; TensorRT: a usable ``torch.cuda`` device (it runs on nothing else)."""
    if backend == "onnx":
        import onnxruntime as ort

        return "CUDAExecutionProvider" in ort.get_available_providers()
    import torch

    return torch.cuda.is_available()


def resolve_device(device: str | None = None, backend: str = "torch") -> str:
    """``device`` as given, else "cuda" when ``backend`` can use a CUDA GPU, else "cpu"
    (TensorRT: always "cuda")."""
    if device:
        return str(device)
    if backend == "tensorrt":
        return "cuda"
    return "cuda" if cuda_available(backend) else "cpu"


def physical_cores() -> int:
    """Physical CPU cores usable by this process (hyper-threads not counted)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count() or 1
    cores = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            phys = None
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "physical id":
                    phys = value.strip()
                elif key == "core id":
                    cores.add((phys, value.strip()))
    except OSError:
        pass
    if not cores:
        try:
            import psutil

            n = psutil.cpu_count(logical=False)
            if n:
                cores = set(range(n))
        except ImportError:
            pass
    return max(1, min(usable, len(cores))) if cores else max(1, usable)
