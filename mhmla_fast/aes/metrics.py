"""Agreement metrics for essay scores: quadratic weighted kappa (QWK) and exact agreement."""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np

__all__ = ["exact_agreement", "quadratic_weighted_kappa"]

Ratings = Union[Sequence[int], np.ndarray]


def _as_int_ratings(values: object, name: str) -> np.ndarray:
    """1-D int64 array; floats must be whole numbers (``3.0`` is fine, ``2.5`` raises)."""
    if hasattr(values, "detach"):  # torch tensor, without importing torch here
        values = values.detach().cpu().numpy()  # type: ignore[attr-defined]
    a = np.asarray(values)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.dtype == bool or not (np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)):
        if a.size:
            raise TypeError(f"{name} must hold integer ratings, got dtype {a.dtype}")
        return a.astype(np.int64)
    if np.issubdtype(a.dtype, np.floating):
        if not np.all(np.isfinite(a)) or not np.all(a == np.round(a)):
            raise ValueError(f"{name} must hold whole-number ratings (round predictions first)")
    return a.astype(np.int64)


def _paired_ratings(y_true: Ratings, y_pred: Ratings, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Both rating vectors as int arrays of one, non-zero length (else ValueError)."""
    a = _as_int_ratings(y_true, "y_true")
    b = _as_int_ratings(y_pred, "y_pred")
    if a.shape != b.shape:
        raise ValueError(f"y_true and y_pred differ in length: {a.shape[0]} vs {b.shape[0]}")
    if a.size == 0:
        raise ValueError(f"{what} needs at least one rating")
    return a, b


def quadratic_weighted_kappa(
    y_true: Ratings,
    y_pred: Ratings,
    min_rating: int | None = None,
    max_rating: int | None = None,
) -> float:
    """Cohen's kappa with quadratic weights: ``1 - sum(W * O) / sum(W * E)``.

    With ratings ``min_rating .. max_rating`` (``k`` categories; by default the smallest and
    largest value in either vector), ``O[i, j]`` is the number of items rated ``i`` by
    ``y_true`` and ``j`` by ``y_pred``, ``E = outer(hist_true, hist_pred) / N`` is the count
    expected by chance from the two marginal histograms, and
    ``W[i, j] = (i - j)**2 / (k - 1)**2``. The result is the same for any range that contains
    the data (the ``(k-1)**2`` factor cancels, and empty categories add nothing), so the range
    only validates input. It equals ``sklearn.metrics.cohen_kappa_score(y_true, y_pred,
    weights="quadratic", labels=range(min_rating, max_rating + 1))``.

    Degenerate case: ``sum(W * E) == 0`` happens exactly when both raters give one and the
    same rating to every item; that is perfect agreement and returns 1.0 (sklearn gives NaN).
    If only one rater is constant the result is 0.0. Ratings must be whole numbers; a value
    outside the given range, unequal lengths, or empty input raise ValueError.
    """
    a, b = _paired_ratings(y_true, y_pred, "quadratic_weighted_kappa")
    lo = int(min(a.min(), b.min())) if min_rating is None else int(min_rating)
    hi = int(max(a.max(), b.max())) if max_rating is None else int(max_rating)
    if lo > hi:
        raise ValueError(f"min_rating {lo} > max_rating {hi}")
    for name, v in (("y_true", a), ("y_pred", b)):
        if v.min() < lo or v.max() > hi:
            raise ValueError(f"{name} has ratings outside {lo}..{hi}: {int(v.min())}..{int(v.max())}")
    k = hi - lo + 1
    if k == 1:
        return 1.0
    n = a.size
    observed = np.bincount((a - lo) * k + (b - lo), minlength=k * k).reshape(k, k).astype(np.float64)
    hist_a = observed.sum(axis=1)
    hist_b = observed.sum(axis=0)
    expected = np.outer(hist_a, hist_b) / n
    i = np.arange(k, dtype=np.float64)
    weights = (i[:, None] - i[None, :]) ** 2 / (k - 1) ** 2
    denominator = float((weights * expected).sum())
    if denominator == 0.0:
        return 1.0
    return 1.0 - float((weights * observed).sum()) / denominator


def exact_agreement(y_true: Ratings, y_pred: Ratings) -> float:
    """Fraction of items on which the two ratings are equal: ``mean(y_true == y_pred)``.

    Ratings must be whole numbers of equal, non-zero length.
    """
    a, b = _paired_ratings(y_true, y_pred, "exact_agreement")
    return float(np.mean(a == b))
