"""Token-level GED metrics for the error class.

With gold labels ``g`` and predictions ``p`` (1 = error, 0 = correct) over all tokens of a corpus
(sentences flattened into one sequence):

* ``tp = #{g = 1, p = 1}``, ``fp = #{g = 0, p = 1}``, ``fn = #{g = 1, p = 0}``;
* ``precision = tp / (tp + fp)``, defined as 0 when nothing is predicted as an error;
* ``recall = tp / (tp + fn)``, defined as 0 when there is no gold error;
* ``F_beta = (1 + beta^2) * P * R / (beta^2 * P + R)``
  ``= (1 + beta^2) * tp / ((1 + beta^2) * tp + beta^2 * fn + fp)``, defined as 0 when ``tp = 0``
  (this covers every zero division). The standard GED score is F0.5 (precision weighted higher).

Probabilities are turned into labels with ``p = 1 iff prob >= threshold``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = ["GedScores", "best_threshold", "f_beta", "flatten", "ged_scores"]


def f_beta(tp: int, fp: int, fn: int, beta: float = 0.5) -> float:
    """``(1 + beta^2) tp / ((1 + beta^2) tp + beta^2 fn + fp)``; 0 when ``tp == 0``."""
    if tp == 0:
        return 0.0
    b2 = beta * beta
    return (1 + b2) * tp / ((1 + b2) * tp + b2 * fn + fp)


@dataclass(frozen=True)
class GedScores:
    """Counts and scores of the error class. ``f05`` is always F0.5; ``fbeta`` is F at ``beta``
    (equal to ``f05`` for the default ``beta = 0.5``). Zero divisions give 0 (module docstring)."""

    tp: int
    fp: int
    fn: int
    tn: int
    precision: float
    recall: float
    f05: float
    beta: float = 0.5
    fbeta: float = 0.0

    @classmethod
    def from_counts(cls, tp: int, fp: int, fn: int, tn: int = 0, beta: float = 0.5) -> GedScores:
        """Scores from confusion counts (rules in the module docstring)."""
        tp, fp, fn, tn = int(tp), int(fp), int(fn), int(tn)
        return cls(
            tp=tp,
            fp=fp,
            fn=fn,
            tn=tn,
            precision=tp / (tp + fp) if tp + fp else 0.0,
            recall=tp / (tp + fn) if tp + fn else 0.0,
            f05=f_beta(tp, fp, fn, 0.5),
            beta=float(beta),
            fbeta=f_beta(tp, fp, fn, beta),
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain ``dict`` of all fields (JSON-serialisable)."""
        return asdict(self)


def flatten(labels: Any, *, dtype: Any = None) -> np.ndarray:
    """A 1-D numpy array from a flat sequence/array or a sequence of per-sentence sequences.

    Per-sentence input (a list of lists, tuples or arrays) is concatenated in order. ``dtype=None``
    keeps the inferred dtype (so non-binary gold values are caught, not truncated).
    """
    if isinstance(labels, np.ndarray):
        return np.asarray(labels, dtype=dtype).reshape(-1)
    seq = list(labels)
    if seq and all(isinstance(x, (Sequence, np.ndarray)) and not isinstance(x, str) for x in seq):
        parts = [np.asarray(x, dtype=dtype).reshape(-1) for x in seq]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    return np.asarray(seq, dtype=dtype).reshape(-1)


def _check_same_length(gold: Any, other: Any, what: str) -> None:
    """Per-sentence inputs must agree sentence by sentence, not only in total."""
    if isinstance(gold, np.ndarray) or isinstance(other, np.ndarray):
        return
    g, o = list(gold), list(other)
    g_nested = bool(g) and all(isinstance(x, (Sequence, np.ndarray)) for x in g)
    o_nested = bool(o) and all(isinstance(x, (Sequence, np.ndarray)) for x in o)
    if g_nested and o_nested:
        if len(g) != len(o):
            raise ValueError(f"gold has {len(g)} sentences but {what} has {len(o)}")
        for k, (a, b) in enumerate(zip(g, o)):
            if len(a) != len(b):
                raise ValueError(f"sentence {k}: gold has {len(a)} labels but {what} has {len(b)}")


def _binary(x: np.ndarray, what: str) -> np.ndarray:
    if x.size and not np.isin(x, (0, 1)).all():
        raise ValueError(f"{what} labels must be 0 or 1")
    return x.astype(bool)


def ged_scores(gold: Any, pred: Any, beta: float = 0.5) -> GedScores:
    """Token-level precision, recall and F of the error class (label 1) over all tokens.

    ``gold`` and ``pred`` are flat 0/1 sequences or per-sentence sequences of them (flattened in
    order; per-sentence lengths must agree). Zero divisions give 0 (module docstring).
    """
    _check_same_length(gold, pred, "pred")
    g = _binary(flatten(gold), "gold")
    p = _binary(flatten(pred), "pred")
    if g.shape != p.shape:
        raise ValueError(f"gold has {g.size} labels but pred has {p.size}")
    tp = int(np.count_nonzero(g & p))
    fp = int(np.count_nonzero(~g & p))
    fn = int(np.count_nonzero(g & ~p))
    tn = int(g.size - tp - fp - fn)
    return GedScores.from_counts(tp, fp, fn, tn, beta=beta)


def best_threshold(gold: Any, error_probs: Any, beta: float = 0.5) -> tuple[float, GedScores]:
    """The threshold ``t`` that maximises F_beta of ``pred = error_probs >= t``, and its scores.

    Candidates are the distinct probability values (every other threshold gives the same predictions
    as one of them or predicts nothing, which scores 0). Ties go to the higher threshold; if every
    candidate scores 0 (e.g. no gold error), the highest probability is returned. Sorts once:
    O(n log n). Raises ``ValueError`` on empty input, NaN, or a length mismatch.
    """
    _check_same_length(gold, error_probs, "error_probs")
    g = _binary(flatten(gold), "gold")
    probs = flatten(error_probs, dtype=np.float64)
    if g.shape != probs.shape:
        raise ValueError(f"gold has {g.size} labels but error_probs has {probs.size}")
    if probs.size == 0:
        raise ValueError("best_threshold needs at least one token")
    if np.isnan(probs).any():
        raise ValueError("error_probs contains NaN")

    order = np.argsort(-probs, kind="stable")  # descending probability
    p_sorted = probs[order]
    tp_cum = np.cumsum(g[order], dtype=np.int64)
    # Last index of each run of equal probabilities: predicting ">= that value" selects [0, idx].
    last = np.flatnonzero(np.append(p_sorted[1:] != p_sorted[:-1], True))
    tp = tp_cum[last]
    fp = (last + 1) - tp
    fn = int(tp_cum[-1]) - tp
    b2 = beta * beta
    denom = (1 + b2) * tp + b2 * fn + fp
    f = np.where(tp > 0, (1 + b2) * tp / np.maximum(denom, 1e-300), 0.0)
    k = int(np.argmax(f))  # first maximum = highest threshold among ties
    thr = float(p_sorted[last[k]])
    tp_k, fp_k, fn_k = int(tp[k]), int(fp[k]), int(fn[k])
    return thr, GedScores.from_counts(tp_k, fp_k, fn_k, g.size - tp_k - fp_k - fn_k, beta=beta)
