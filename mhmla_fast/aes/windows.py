"""Fixed-length windows over long essays, and per-essay averaging of window predictions.

The study (Uria Rodriguez, Jafari & Ormerod; DESIGN.md section 4) feeds BERT at most 510
word pieces (512 minus ``[CLS]`` and ``[SEP]``). A longer essay is cut into consecutive
510-piece windows, and the last window is moved back so that it ends at the last piece and
is full length (it overlaps the previous window) instead of being a short, padding-heavy
tail. The essay's prediction is the mean of its windows' predictions (rounded by the caller
when a score is wanted).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Sequence, TypeVar, Union

import numpy as np

if TYPE_CHECKING:  # torch is imported only by its callers: numpy input needs no torch
    import torch

__all__ = ["average_windows", "split_windows", "window_plan"]

ArrayT = TypeVar("ArrayT", np.ndarray, "torch.Tensor")


def split_windows(n_pieces: int, window: int = 510) -> list[tuple[int, int]]:
    """Half-open spans ``[start, end)`` covering ``[0, n_pieces)`` with windows of ``window`` pieces.

    Rule: if ``n_pieces <= window`` there is one window ``(0, n_pieces)`` (also for 0 pieces,
    so an empty essay still gets one input). Otherwise the windows are ``(i*window,
    (i+1)*window)`` for ``i = 0 .. n_pieces//window - 1``, and if a remainder is left, one more
    window ``(n_pieces - window, n_pieces)``, which overlaps the one before it. Every window
    then has exactly ``window`` pieces. Example: ``split_windows(1021)`` is
    ``[(0, 510), (510, 1020), (511, 1021)]``; ``split_windows(1020)`` is
    ``[(0, 510), (510, 1020)]``.
    """
    n = int(n_pieces)
    w = int(window)
    if n < 0:
        raise ValueError(f"n_pieces must be >= 0, got {n_pieces}")
    if w < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if n <= w:
        return [(0, n)]
    spans = [(s, s + w) for s in range(0, n - w + 1, w)]
    if spans[-1][1] < n:
        spans.append((n - w, n))
    return spans


def window_plan(lengths: Sequence[int], window: int = 510) -> tuple[list[tuple[int, int]], list[int]]:
    """Windows of many essays, flattened: ``(spans, essay_index)``.

    ``spans[j]`` is :func:`split_windows` span of essay ``essay_index[j]``; essays appear in
    order, each with at least one window. ``essay_index`` is what :func:`average_windows` needs.
    """
    spans: list[tuple[int, int]] = []
    index: list[int] = []
    for i, n in enumerate(lengths):
        s = split_windows(n, window)
        spans.extend(s)
        index.extend([i] * len(s))
    return spans, index


def average_windows(
    window_preds: ArrayT,
    essay_index: Union[np.ndarray, "torch.Tensor", Sequence[int]],
    n_essays: int | None = None,
) -> ArrayT:
    """Per-essay mean of window predictions: ``out[e] = mean(window_preds[j] for j with essay_index[j] == e)``.

    ``window_preds`` is a numpy array or torch tensor of shape ``[n_windows]`` or
    ``[n_windows, C]``; the result has the same type (and device) with shape ``[n_essays]``
    or ``[n_essays, C]``. Integer or bool predictions are averaged as float (float64 for numpy,
    the default float dtype for torch); float dtypes are kept. The torch path uses
    ``index_add`` and is differentiable. ``essay_index`` holds, per window, the essay
    (``0 .. n_essays-1``) it came from, in any order. ``n_essays`` defaults to
    ``max(essay_index) + 1``; an essay with no window raises ValueError (its mean is undefined).
    """
    if _is_tensor(window_preds):
        return _average_torch(window_preds, essay_index, n_essays)
    if isinstance(window_preds, np.ndarray):
        return _average_numpy(window_preds, essay_index, n_essays)
    raise TypeError(f"window_preds must be a numpy array or torch tensor, not {type(window_preds).__name__}")


def _is_tensor(x: object) -> bool:
    """Whether ``x`` is a torch tensor, asked without importing torch (a tensor exists only
    once its caller imported torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _check_index(idx: np.ndarray, n_windows: int, n_essays: int | None) -> int:
    if idx.ndim != 1 or idx.shape[0] != n_windows:
        raise ValueError(f"essay_index must have shape [{n_windows}], got {list(idx.shape)}")
    if idx.size and not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(f"essay_index must hold integers, got dtype {idx.dtype}")
    n = int(idx.max()) + 1 if n_essays is None and idx.size else int(n_essays or 0)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise ValueError(f"essay_index values must be in [0, {n}), got {int(idx.min())}..{int(idx.max())}")
    counts = np.bincount(idx.astype(np.int64), minlength=n)
    empty = np.flatnonzero(counts == 0)
    if empty.size:
        raise ValueError(f"{empty.size} essays have no window (e.g. essay {int(empty[0])})")
    return n


def _average_numpy(preds: np.ndarray, essay_index: object, n_essays: int | None) -> np.ndarray:
    if preds.ndim not in (1, 2):
        raise ValueError(f"window_preds must have shape [n_windows] or [n_windows, C], got {list(preds.shape)}")
    if _is_tensor(essay_index):
        essay_index = essay_index.detach().cpu().numpy()
    idx = np.asarray(essay_index)
    if idx.size == 0:
        idx = idx.astype(np.int64)
    n = _check_index(idx, preds.shape[0], n_essays)
    values = preds if np.issubdtype(preds.dtype, np.floating) else preds.astype(np.float64)
    sums = np.zeros((n, *values.shape[1:]), dtype=values.dtype)
    np.add.at(sums, idx, values)
    counts = np.bincount(idx.astype(np.int64), minlength=n).astype(values.dtype)
    return sums / (counts if values.ndim == 1 else counts[:, None])


def _average_torch(preds: torch.Tensor, essay_index: object, n_essays: int | None) -> torch.Tensor:
    import torch

    if preds.dim() not in (1, 2):
        raise ValueError(f"window_preds must have shape [n_windows] or [n_windows, C], got {list(preds.shape)}")
    if isinstance(essay_index, torch.Tensor):
        idx_np = essay_index.detach().cpu().numpy()
    else:
        idx_np = np.asarray(essay_index)
    if idx_np.size == 0:
        idx_np = idx_np.astype(np.int64)
    n = _check_index(idx_np, preds.shape[0], n_essays)
    idx = torch.as_tensor(idx_np.astype(np.int64), device=preds.device)
    values = preds if preds.is_floating_point() else preds.to(torch.get_default_dtype())
    sums = torch.zeros((n, *values.shape[1:]), dtype=values.dtype, device=values.device)
    sums = sums.index_add(0, idx, values)
    counts = torch.bincount(idx, minlength=n).to(values.dtype)
    return sums / (counts if values.dim() == 1 else counts[:, None])
