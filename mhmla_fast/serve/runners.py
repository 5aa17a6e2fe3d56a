"""Runners: the network behind the engine, ``(input_ids, attention_mask) -> P(error)``.

Every runner takes int64 arrays [B, T] and returns float32 error probabilities [B, T].
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

__all__ = ["TorchRunner", "make_runner", "BACKENDS"]

BACKENDS = ("torch", "onnx", "tensorrt")


class TorchRunner:
    """Eager PyTorch: CPU (fp32) or CUDA (bf16 by default, SDPA attention, the fused head)."""

    def __init__(self, model_dir: str | os.PathLike, *, device: str | None = None,
                 dtype: str | None = None):
        import torch

        from ..ged.model import GedTagger

        self.torch = torch
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None:
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        try:
            self.dtype = getattr(torch, dtype)
        except AttributeError:
            raise ValueError(f"dtype: unknown torch dtype {dtype!r}") from None
        self.model = GedTagger.load(model_dir, device=self.device, dtype=self.dtype)

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        torch = self.torch
        with torch.inference_mode():
            ids = torch.from_numpy(input_ids).to(self.device, non_blocking=True)
            mask = torch.from_numpy(attention_mask).to(self.device, non_blocking=True)
            logits = self.model(ids, mask)
            return torch.softmax(logits.float(), -1)[..., 1].cpu().numpy()


def make_runner(model_dir: str | os.PathLike, *, backend: str = "torch",
                device: str | None = None, dtype: str | None = None):
    """The runner for ``backend`` on a tagger directory (or an export of one)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return TorchRunner(model_dir, device=device, dtype=dtype)
    if backend == "onnx":
        from .onnx_export import OnnxRunner

        return OnnxRunner.from_model_dir(Path(model_dir), dtype=dtype)
    from .tensorrt_engine import TensorRTRunner

    return TensorRTRunner.from_model_dir(Path(model_dir), device=device)
