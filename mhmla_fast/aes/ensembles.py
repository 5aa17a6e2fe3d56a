"""Ensembles over the members' saved predictions: mean, majority vote, greedy selection."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .data import SCORE_RANGES
from .splits import qwk

__all__ = ["mean_ensemble", "greedy_ensemble", "majority_vote"]


def mean_ensemble(preds: Sequence[np.ndarray], prompt: int) -> np.ndarray:
    """``floor(mean_m pred_m + 0.5)`` per essay, clipped to the prompt's range."""
    lo, hi = SCORE_RANGES[int(prompt)]
    m = np.mean(np.stack([np.asarray(p, dtype=np.float64) for p in preds]), axis=0)
    return np.clip(np.floor(m + 0.5).astype(np.int64), lo, hi)


def greedy_ensemble(dev_preds: Sequence[np.ndarray], dev_gold: np.ndarray, prompt: int,
                    rounds: int = 10) -> list[int]:
    """Members of a mean ensemble picked on dev: greedy forward selection with replacement.

    Start from the member with the best dev QWK; each round adds (again, possibly) the
    member whose addition gives the best dev QWK of :func:`mean_ensemble`, stopping after
    ``rounds`` or when no addition improves it. Ties go to the earlier member. Returns the
    picked member indices (with repeats, as weights).
    """
    def score(picks: list[int]) -> float:
        return qwk(dev_gold, mean_ensemble([dev_preds[i] for i in picks], prompt), prompt)

    picks = [max(range(len(dev_preds)), key=lambda i: (score([i]), -i))]
    best = score(picks)
    for _ in range(rounds - 1):
        cand = max(range(len(dev_preds)), key=lambda i: (score(picks + [i]), -i))
        value = score(picks + [cand])
        if value <= best:
            break
        picks, best = picks + [cand], value
    return picks


def majority_vote(preds: Sequence[np.ndarray], dev_scores: Sequence[float]) -> np.ndarray:
    """Most frequent score per essay; ties go to the best model on dev.

    With several scores sharing the top count, the members are taken in order of
    decreasing ``dev_scores`` (equal dev scores: the earlier member first) and the first
    one whose prediction is among the tied scores decides. Example: predictions
    (3, 3, 4, 4, 5) with dev QWK (.6, .7, .8, .5, .9): 3 and 4 tie; member 5 (best, .9)
    voted 5, not tied; member 3 (.8) voted 4 -> 4.
    """
    P = np.stack([np.asarray(p, dtype=np.int64) for p in preds])  # [M, E]
    if len(dev_scores) != P.shape[0]:
        raise ValueError(f"{P.shape[0]} members but {len(dev_scores)} dev scores")
    rank = sorted(range(P.shape[0]), key=lambda m: (-float(dev_scores[m]), m))
    out = np.empty(P.shape[1], dtype=np.int64)
    for e in range(P.shape[1]):
        values, counts = np.unique(P[:, e], return_counts=True)
        tied = set(values[counts == counts.max()].tolist())
        out[e] = next(P[m, e] for m in rank if P[m, e] in tied)
    return out
