"""Gradient-boosted trees on per-essay features (``mhmla_fast.aes.trees``)."""

from __future__ import annotations

import numpy as np
import pytest

from mhmla_fast.aes.baselines import surface_ridge
from mhmla_fast.aes.cutpoints import apply_cutpoints
from mhmla_fast.aes.data import SCORE_RANGES, normalise_score
from mhmla_fast.aes.metrics import quadratic_weighted_kappa
from mhmla_fast.aes.trees import GBDT_FIXED, GBDT_GRID, gbdt_select

PROMPT = 3  # scores 0..3


def _essays(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Features [n, 4] and scores [n]: the score is a step function of feature 0 (length that
    saturates) with a little noise; features 1..3 are noise."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 4))
    score = np.digitize(X[:, 0] + 0.15 * rng.normal(size=n), [-0.8, 0.0, 0.3])
    return X, score.astype(np.int64)


def _qwk(gold, pred) -> float:
    return quadratic_weighted_kappa(np.asarray(gold), np.asarray(pred), *SCORE_RANGES[PROMPT])


def test_setting_chosen_by_dev_qwk_of_rounded_predictions():
    """Without cutpoints: each setting's rounded dev predictions, from trees fitted by hand,
    scored by QWK; the unit keeps the best (ties: the earlier) and its test predictions."""
    from sklearn.ensemble import HistGradientBoostingRegressor

    (X, y), (Xd, yd), (Xt, _) = _essays(300, 0), _essays(120, 1), _essays(100, 2)
    unit = gbdt_select((X, y), (Xd, yd), Xt, PROMPT)
    target = np.array([normalise_score(s, PROMPT) for s in y])
    lo, hi = SCORE_RANGES[PROMPT]
    by_hand = []
    for g in GBDT_GRID:
        m = HistGradientBoostingRegressor(**GBDT_FIXED, **g).fit(X, target)
        rounded = [np.clip(np.floor(lo + np.clip(m.predict(Z), 0, 1) * (hi - lo) + 0.5), lo, hi)
                   for Z in (Xd, Xt)]
        by_hand.append((_qwk(yd, rounded[0]), rounded))
    best = max(range(len(GBDT_GRID)), key=lambda i: (by_hand[i][0], -i))
    assert unit["selected"] == GBDT_GRID[best]
    assert unit["dev_qwk"] == pytest.approx(by_hand[best][0], abs=1e-12)
    assert np.asarray(unit["dev_pred"]).tolist() == by_hand[best][1][0].astype(int).tolist()
    assert np.asarray(unit["test_pred"]).tolist() == by_hand[best][1][1].astype(int).tolist()
    assert "continuous" not in unit


def test_cut_trees_keep_out_of_fold_predictions_that_never_see_their_own_essay():
    """With cutpoints: the unit's scores are its continuous predictions cut at its cutpoints,
    and a training essay's out-of-fold prediction does not move when its own score does
    (the trees that predict it never saw it), while the full fit's predictions do."""
    (X, y), (Xd, yd), (Xt, yt) = _essays(300, 3), _essays(120, 4), _essays(150, 5)
    grid = GBDT_GRID[:1]
    unit = gbdt_select((X, y), (Xd, yd), Xt, PROMPT, grid=grid, cuts=True)
    x = unit["continuous"]
    assert (len(x["train_oof"]), len(x["dev"]), len(x["test"])) == (300, 120, 150)
    cuts = np.array(unit["selected"]["cutpoints"])
    assert apply_cutpoints(np.array(x["test"]), cuts, PROMPT).tolist() == list(unit["test_pred"])
    assert apply_cutpoints(np.array(x["dev"]), cuts, PROMPT).tolist() == list(unit["dev_pred"])
    assert unit["dev_qwk"] == pytest.approx(_qwk(yd, unit["dev_pred"]), abs=1e-12)
    assert _qwk(yt, unit["test_pred"]) > 0.85  # the step function is learnt
    flipped = y.copy()
    flipped[7] = 3 - y[7] if y[7] != 1 else 3
    other = gbdt_select((X, flipped), (Xd, yd), Xt, PROMPT, grid=grid, cuts=True)["continuous"]
    assert other["train_oof"][7] == x["train_oof"][7]
    assert not np.allclose(other["train_oof"], x["train_oof"])  # the other folds' trees saw it
    assert other["dev"] != x["dev"]
    # deterministic: the same unit again
    again = gbdt_select((X, y), (Xd, yd), Xt, PROMPT, grid=grid, cuts=True)
    assert again["continuous"] == x and again["selected"] == unit["selected"]
    assert list(again["test_pred"]) == list(unit["test_pred"])


def test_trees_beat_the_surface_ridge_on_a_non_linear_score():
    """The reason for the member: on a score that is not linear in the features, the trees'
    cut predictions beat the cut ridge on the same features (test split, not chosen on)."""
    (X, y), (Xd, yd), (Xt, yt) = _essays(400, 6), _essays(150, 7), _essays(300, 8)
    X, Xd, Xt = (np.c_[np.exp(2 * Z[:, :1]), Z[:, 1:]] for Z in (X, Xd, Xt))  # skewed length
    trees = gbdt_select((X, y), (Xd, yd), Xt, PROMPT, cuts=True)
    ridge = surface_ridge((X, y), (Xd, yd), Xt, PROMPT, cuts=True)
    assert _qwk(yt, trees["test_pred"]) > _qwk(yt, ridge["test_pred"]) + 0.02


def test_mismatched_features_are_refused():
    (X, y), (Xd, yd) = _essays(50, 9), _essays(20, 10)
    with pytest.raises(ValueError, match="gbdt_select: features"):
        gbdt_select((X, y), (Xd[:, :3], yd), Xd, PROMPT)
    with pytest.raises(ValueError, match="gbdt_select: features"):
        gbdt_select((X, y[:-1]), (Xd, yd), Xd, PROMPT)
