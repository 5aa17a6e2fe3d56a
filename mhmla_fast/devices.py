"""Where work runs: the one rule for "cuda if available, else cpu".

Training (``ged/``, ``aes/``) and serving (``serve/options.py``) both ask :func:`resolve_device`,
so the rule is written once and nothing below ``serve/`` has to import from it. Importing this
module imports neither torch nor ONNX Runtime; each check imports only the runtime it asks about.
"""

from __future__ import annotations

__all__ = ["cuda_available", "resolve_device"]


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
