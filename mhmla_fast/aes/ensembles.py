"""Ensembles over the members' saved predictions: mean, majority vote, greedy selection; and
blends of their continuous predictions cut at fitted cutpoints, the members weighted by a
non-negative least-squares stack on out-of-fold training predictions or picked on dev."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .cutpoints import apply_cutpoints, fit_cutpoints
from .data import SCORE_RANGES
from .splits import qwk

__all__ = ["mean_ensemble", "greedy_ensemble", "majority_vote", "blend_values", "pick_weights",
           "greedy_blend", "stack_weights", "stack_blend"]


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

    return _forward_selection(len(dev_preds), score, rounds)


def _forward_selection(n: int, score: Callable[[list[int]], float], rounds: int) -> list[int]:
    """Greedy forward selection with replacement of ``n`` members by ``score(picks)`` (higher
    is better): the best single member, then each round the member whose addition scores best,
    until ``rounds`` picks or no addition improves the score; ties go to the earlier member."""
    values = [score([i]) for i in range(n)]
    picks = [max(range(n), key=lambda i: (values[i], -i))]
    best = values[picks[0]]
    for _ in range(rounds - 1):
        values = [score(picks + [i]) for i in range(n)]
        cand = max(range(n), key=lambda i: (values[i], -i))
        if values[cand] <= best:
            break
        picks, best = picks + [cand], values[cand]
    return picks


def blend_values(values: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """``sum_i w_i values[i]``: a blend of members' continuous predictions [E] with weights
    ``w`` [M] (:func:`pick_weights` of a greedy choice, or :func:`stack_weights`)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (len(values),):
        raise ValueError(f"blend_values: {len(values)} members, weights of shape {w.shape}")
    return np.stack([np.asarray(v, dtype=np.float64) for v in values], axis=1) @ w


def pick_weights(picks: Sequence[int], n: int) -> np.ndarray:
    """Weights [n] of a forward selection with replacement: each member's share of ``picks``."""
    return np.bincount(np.asarray(picks, dtype=np.int64), minlength=n) / len(picks)


def greedy_blend(train_oof: Sequence[np.ndarray], dev: Sequence[np.ndarray],
                 train_gold: np.ndarray, dev_gold: np.ndarray, prompt: int, rounds: int = 10,
                 ) -> tuple[list[int], np.ndarray]:
    """Members of a blend picked on dev, and the blend's cutpoints.

    A blend of picks ``S`` scores an essay ``cut(mean_{i in S} x_i)``, where ``x_i`` is
    member ``i``'s continuous prediction on the score scale and ``cut`` applies cutpoints
    fitted for QWK (:func:`~.cutpoints.fit_cutpoints`) on the same blend of the members'
    out-of-fold predictions of the training essays, ``train_oof[i]`` [E_tr] against
    ``train_gold`` [E_tr]. So the cutpoints never see dev (or test); dev, ``dev[i]`` [E_dev]
    against ``dev_gold``, only picks the members, by forward selection with replacement as in
    :func:`greedy_ensemble`. Returns ``(picks, cutpoints)``: score new essays with
    ``apply_cutpoints(blend_values(x, pick_weights(picks, len(x))), cutpoints, prompt)``.
    """
    if len(train_oof) != len(dev) or not dev:
        raise ValueError(f"greedy_blend: {len(train_oof)} members' training predictions and "
                         f"{len(dev)} members' dev predictions")
    fitted: dict[tuple[int, ...], np.ndarray] = {}

    n = len(dev)

    def cuts(picks: list[int]) -> np.ndarray:
        key = tuple(sorted(picks))
        if key not in fitted:
            fitted[key] = fit_cutpoints(blend_values(train_oof, pick_weights(picks, n)),
                                        train_gold, prompt)
        return fitted[key]

    def score(picks: list[int]) -> float:
        x = blend_values(dev, pick_weights(picks, n))
        return qwk(dev_gold, apply_cutpoints(x, cuts(picks), prompt), prompt)

    picks = _forward_selection(n, score, rounds)
    return picks, cuts(picks)


def stack_weights(train_oof: Sequence[np.ndarray], train_gold: np.ndarray) -> np.ndarray:
    """Weights [M] of a stack: ``w = argmin_{w >= 0} ||Xc w - yc||^2``, scaled to sum 1, where
    ``X`` [E_tr, M] holds the members' out-of-fold predictions of the training essays and
    ``y`` [E_tr] their gold scores, both centred (an intercept); :func:`scipy.optimize.nnls`.
    A blend is then cut at fitted cutpoints, which absorb any scale and offset, so only the
    weights' ratios matter. Equal weights if every member gets zero (none predicts ``y``)."""
    from scipy.optimize import nnls

    X = np.stack([np.asarray(v, dtype=np.float64) for v in train_oof], axis=1)
    y = np.asarray(train_gold, dtype=np.float64)
    if X.shape[0] != y.shape[0]:
        raise ValueError(f"stack_weights: {X.shape[0]} predictions per member for {y.shape[0]} "
                         "gold scores")
    w, _ = nnls(X - X.mean(0), y - y.mean())
    return w / w.sum() if w.sum() > 0 else np.full(X.shape[1], 1.0 / X.shape[1])


def stack_blend(train_oof: Sequence[np.ndarray], train_gold: np.ndarray, prompt: int,
                ) -> tuple[np.ndarray, np.ndarray]:
    """A blend that sees the training essays only: :func:`stack_weights` on the members'
    out-of-fold predictions ``train_oof`` [M x E_tr], and cutpoints fitted for QWK on the
    blend of the same predictions. Returns ``(weights [M], cutpoints)``: score new essays with
    ``apply_cutpoints(blend_values(x, weights), cutpoints, prompt)``. Neither dev nor test
    is seen (dev only chose each member's own settings)."""
    w = stack_weights(train_oof, train_gold)
    return w, fit_cutpoints(blend_values(train_oof, w), train_gold, prompt)


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
