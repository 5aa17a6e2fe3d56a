"""Runners: the network behind the engine, ``(input_ids, attention_mask) -> P(error)``.

Every runner takes int64 arrays [B, T] and returns float32 error probabilities [B, T]. All are
made by :func:`make_runner` with the one load contract of :mod:`.options` (backend, device,
dtype, kernels, threads); an option a runner cannot honour is a ValueError naming it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .options import BACKENDS, resolve_options

__all__ = ["TorchRunner", "Pending", "submit", "upload", "download", "make_runner", "set_torch_threads",
           "BACKENDS"]


def set_torch_threads(threads: int | None) -> None:
    """``torch.set_num_threads(threads)`` when given (None: leave torch's choice)."""
    if threads:
        import torch

        torch.set_num_threads(int(threads))


class TorchRunner:
    """Eager PyTorch: CPU (fp32) or CUDA (bf16 by default, SDPA attention); ``kernels`` is the
    head's implementation ("auto": what ``mhmla_fast.dispatch`` measured faster, the fused
    Triton forward for large batches on CUDA, else eager; "torch"; "triton").
    Device and dtype defaults: :func:`.options.resolve_options`.

    Where the head runs eager ("torch", or "auto" off CUDA) it runs folded with the classifier
    (:meth:`GedTagger.folded`: the same logits up to rounding, about half the head's work);
    ``fold=False`` runs the head and classifier as trained (for comparisons)."""

    backend = "torch"

    def __init__(self, model_dir: str | os.PathLike, *, device: str | None = None,
                 dtype: str | None = None, kernels: str = "auto", threads: int | None = None,
                 fold: bool = True):
        opts = resolve_options("torch", device, dtype, kernels)
        import torch

        from ..ged.model import GedTagger

        set_torch_threads(threads)
        self.torch = torch
        self.device = torch.device(opts.device)
        self.dtype = getattr(torch, opts.dtype)
        self.kernels = opts.kernels
        self.model = GedTagger.load(model_dir, device=self.device, dtype=self.dtype,
                                    backend=opts.kernels)
        eager = opts.kernels == "torch" or (opts.kernels == "auto" and self.device.type != "cuda")
        self.folded = fold and eager
        self.net = self.model.folded() if self.folded else self.model

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        return self.submit(input_ids, attention_mask).result()

    def submit(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> Pending:
        """Start a forward pass and return at once; ``.result()`` waits for the probabilities.

        On CUDA the batch goes up from pinned memory, the pass and the copy of the
        probabilities into a fresh pinned buffer are queued on the current stream, and an event
        marks their end, so the caller packs the next batch (or merges the last one) while the
        GPU works. Elsewhere the pass runs here and the result is ready."""
        torch = self.torch
        with torch.inference_mode():
            if self.device.type != "cuda":
                ids, mask = torch.from_numpy(input_ids), torch.from_numpy(attention_mask)
                return Pending(torch.softmax(self.net(ids, mask).float(), -1)[..., 1].numpy())
            ids, mask = (upload(a, self.device) for a in (input_ids, attention_mask))
            return download(torch.softmax(self.net(ids, mask).float(), -1)[..., 1])


def upload(array: np.ndarray, device, dtype=None):
    """``array`` on CUDA ``device`` (as ``dtype``, if given), copied from pinned memory without
    waiting: the copy is queued on the current stream."""
    import torch

    pinned = torch.from_numpy(np.ascontiguousarray(array)).pin_memory()
    out = pinned.to(device, non_blocking=True)
    return out if dtype is None else out.to(dtype)


def download(tensor) -> Pending:
    """A CUDA ``tensor``'s values as float32, copied into a fresh pinned buffer on the current
    stream; the :class:`Pending` waits for the event recorded after the copy."""
    import torch

    host = torch.empty(tensor.shape, dtype=torch.float32, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return Pending(host, done)


class Pending:
    """A forward pass started by a runner's ``submit``: ``result()`` waits for its end (a CUDA
    event, if any) and returns the probabilities as a float32 array."""

    __slots__ = ("_out", "_done")

    def __init__(self, out, done=None):
        self._out, self._done = out, done

    def result(self) -> np.ndarray:
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        out = self._out
        return np.asarray(out if isinstance(out, np.ndarray) else out.numpy(), dtype=np.float32)


def submit(runner, input_ids: np.ndarray, attention_mask: np.ndarray) -> Pending:
    """``runner.submit(...)`` where the runner has one (it overlaps with the caller), else the
    runner called now, its result wrapped as ready."""
    start = getattr(runner, "submit", None)
    if start is not None:
        return start(input_ids, attention_mask)
    return Pending(np.asarray(runner(input_ids, attention_mask), dtype=np.float32))


def make_runner(model_dir: str | os.PathLike, *, backend: str = "torch",
                device: str | None = None, dtype: str | None = None, kernels: str = "auto",
                threads: int | None = None, cache: bool | None = None):
    """The runner for ``backend`` on a tagger directory (or an export of one).

    ``device``/``dtype``/``kernels``: see :mod:`.options`; ``threads``: CPU threads (torch's
    intra-op threads; ONNX Runtime's intra-op threads; TensorRT: torch's, for the host side);
    ``cache``: the export cache of ``backend="auto"`` (:mod:`.export_cache`). Raises
    ValueError naming the option when ``backend`` cannot honour one."""
    opts = resolve_options(backend, device, dtype, kernels)
    if opts.backend == "auto":
        from .export_cache import auto_runner

        return auto_runner(model_dir, threads=threads, kernels=opts.kernels, cache=cache)
    if opts.backend == "torch":
        return TorchRunner(model_dir, device=opts.device, dtype=opts.dtype, kernels=opts.kernels,
                           threads=threads)
    if backend == "onnx":
        from .onnx_export import OnnxRunner

        return OnnxRunner.from_model_dir(Path(model_dir), device=opts.device, dtype=opts.dtype,
                                         kernels=opts.kernels, threads=threads)
    from .tensorrt_engine import TensorRTRunner

    set_torch_threads(threads)
    return TensorRTRunner.from_model_dir(Path(model_dir), device=opts.device, dtype=opts.dtype,
                                         kernels=opts.kernels)
