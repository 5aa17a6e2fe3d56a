"""Gradient-boosted trees on per-essay features: a non-linear member beside the ridges.

The ridges of :mod:`.baselines` are linear in their features; an essay's score is not (it
rises with length and then saturates, and error density matters more in short essays).
:func:`gbdt_select` fits :class:`sklearn.ensemble.HistGradientBoostingRegressor` (squared
error, ``f(x) = sum_t eta * tree_t(x)`` on the normalised score) on one row of features per
essay (the surface and grammatical-error features, :mod:`.surface`, :mod:`.ged_features`) for
each setting of :data:`GBDT_GRID`, and keeps the one whose dev QWK is best. Trees need no
standardisation; the fits are seeded (``random_state=0``) and use no early stopping, so a
unit is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .baselines import choose_cut, cut_unit, score_scale
from .cutpoints import out_of_fold_predictions
from .data import normalise_score
from .model import combine_windows
from .splits import qwk

__all__ = ["GBDT_GRID", "GBDT_FIXED", "gbdt_select"]

# the settings tried per (fold, prompt), simplest first (dev-QWK ties go to the earlier one)
GBDT_GRID: tuple[dict, ...] = (
    {"max_iter": 100, "max_leaf_nodes": 7}, {"max_iter": 300, "max_leaf_nodes": 7},
    {"max_iter": 100, "max_leaf_nodes": 15}, {"max_iter": 300, "max_leaf_nodes": 15})
# the settings every fit shares
GBDT_FIXED = {"learning_rate": 0.05, "min_samples_leaf": 20, "l2_regularization": 1.0,
              "early_stopping": False, "random_state": 0}


def _fit_grid(X: np.ndarray, y: np.ndarray, grid: Sequence[dict]):
    """One regressor per setting of ``grid`` on ``X`` [E, F], ``y`` [E]; returns
    ``predict(X) -> [E', len(grid)]`` (normalised scores)."""
    from sklearn.ensemble import HistGradientBoostingRegressor

    models = [HistGradientBoostingRegressor(**GBDT_FIXED, **g).fit(X, y) for g in grid]
    return lambda Z: np.stack([m.predict(Z) for m in models], axis=1)


def gbdt_select(train: tuple[np.ndarray, np.ndarray], dev: tuple[np.ndarray, np.ndarray],
                test: np.ndarray, prompt: int, grid: Sequence[dict] = GBDT_GRID,
                cuts: bool = False, n_folds: int = 5) -> dict:
    """Trees on per-essay features for one prompt: ``train`` and ``dev`` are (features [E, F],
    gold scores [E]), ``test`` features [E_te, F]; the setting of ``grid`` by dev QWK.

    Scores are the predictions rounded half up, or (``cuts``) cut at cutpoints fitted for QWK
    on out-of-fold predictions of the training essays (``n_folds`` folds, each predicted by
    trees fitted on the others; the setting then chosen by the dev QWK of the cut scores), in
    which case the result keeps the continuous predictions (``continuous``: ``train_oof``,
    ``dev``, ``test``) as the ridges' units do, for blends and stacks (:mod:`.ensembles`).
    Returns a unit's fields: ``dev_pred``, ``test_pred``, ``dev_qwk``, ``selected``.
    """
    X, gold = np.asarray(train[0], dtype=np.float64), np.asarray(train[1])
    Xdev, dev_gold = np.asarray(dev[0], dtype=np.float64), np.asarray(dev[1])
    Xte = np.asarray(test, dtype=np.float64)
    if not (X.shape[1] == Xdev.shape[1] == Xte.shape[1]) or len(X) != len(gold) or (
            len(Xdev) != len(dev_gold)):
        raise ValueError(f"gbdt_select: features {X.shape}, {Xdev.shape}, {Xte.shape} for "
                         f"{len(gold)} train and {len(dev_gold)} dev scores")
    y = np.array([normalise_score(s, prompt) for s in gold])
    full = _fit_grid(X, y, grid)
    p_dev, p_test = full(Xdev), full(Xte)  # normalised, [E, len(grid)]
    if cuts:
        oof = out_of_fold_predictions(lambda rows: lambda held: _fit_grid(X[rows], y[rows], grid)(
            X[held]), np.arange(len(X)), n_folds=n_folds)
        oof, x_dev, x_test = (score_scale(v, prompt) for v in (oof, p_dev, p_test))
        # ties go to the earlier (simpler) setting
        a, dev_q, cutpoints = choose_cut(oof, gold, x_dev, dev_gold, range(len(grid)), prompt)
        return cut_unit(x_dev[:, a], x_test[:, a], oof[:, a], cutpoints, dev_q, prompt, grid[a])

    def rounded(p: np.ndarray) -> np.ndarray:  # normalised [E] -> scores rounded half up
        return combine_windows(p, np.arange(len(p)), prompt, "regression")

    scores = [qwk(dev_gold, rounded(p_dev[:, a]), prompt) for a in range(len(grid))]
    a = max(range(len(grid)), key=lambda i: (scores[i], -i))
    return {"dev_pred": rounded(p_dev[:, a]), "test_pred": rounded(p_test[:, a]),
            "dev_qwk": scores[a], "selected": dict(grid[a])}
