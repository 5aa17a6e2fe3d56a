"""Kernel ridge regression with a Gaussian (RBF) kernel on per-window rows: a non-linear
member over the same features as the linear ridges of :mod:`.baselines`.

For standardised rows ``x`` [F] (the per-layer vectors, optionally with per-essay features
appended), the kernel is ``k(x, x') = exp(-gamma * |x - x'|^2 / m)``, ``m`` the median squared
distance between training rows (so ``gamma`` is unit-free), and the prediction of a row is
``f(x) = ybar + sum_i c_i k(x, x_i)`` with ``c = (K + alpha I)^-1 (y - ybar)`` on the training
rows' normalised scores ``y`` (:class:`sklearn.kernel_ridge.KernelRidge` on centred targets).
One eigendecomposition ``K = Q diag(lam) Q'`` per ``gamma`` gives the solution for every
``alpha``. Essay predictions are the mean of their windows' outputs; settings ``(gamma,
alpha)`` are chosen by dev QWK, and scores are rounded or cut at cutpoints fitted for QWK on
out-of-fold predictions of the training essays, as the ridges' (:func:`~.baselines.choose_cut`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .baselines import choose_cut, cut_unit, score_scale
from .cutpoints import out_of_fold_predictions
from .model import combine_windows
from .splits import qwk
from .windows import average_windows

__all__ = ["KRR_GAMMAS", "KRR_ALPHAS", "rbf_kernel", "krr_select"]

KRR_GAMMAS = (0.0625, 0.125, 0.25, 0.5, 1.0)
KRR_ALPHAS = tuple(float(a) for a in np.logspace(-3, 1, 9))  # 0.001 .. 10, half decades


def _sq_dists(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """[len(A), len(B)] squared Euclidean distances (clipped at 0 against rounding)."""
    d = (A * A).sum(1)[:, None] + (B * B).sum(1)[None, :] - 2.0 * (A @ B.T)
    return np.maximum(d, 0.0)


def rbf_kernel(A: np.ndarray, B: np.ndarray, gamma: float, scale: float) -> np.ndarray:
    """``exp(-gamma * |a - b|^2 / scale)`` for rows ``A`` [n, F], ``B`` [m, F] -> [n, m]."""
    return np.exp(-gamma * _sq_dists(A, B) / scale)


def _krr_path(K: np.ndarray, y: np.ndarray, alphas: Sequence[float]) -> np.ndarray:
    """Dual coefficients [n, A] of ``(K + alpha I) c = y - ybar`` for every alpha."""
    lam, Q = np.linalg.eigh(K)
    lam = np.maximum(lam, 0.0)
    Qty = Q.T @ (y - y.mean())
    return Q @ (Qty[:, None] / (lam[:, None] + np.asarray(alphas)[None, :]))


def krr_select(train: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
               dev: tuple[np.ndarray, np.ndarray, np.ndarray],
               test: tuple[np.ndarray, np.ndarray, int], prompt: int,
               gammas: Sequence[float] = KRR_GAMMAS, alphas: Sequence[float] = KRR_ALPHAS,
               cuts: bool = False, n_folds: int = 5) -> dict:
    """Kernel ridge for one prompt: ``train`` (X [W, F] standardised, normalised targets [W],
    essay of each row [W], gold scores [E]), ``dev`` (X, essay of each row, gold scores),
    ``test`` (X, essay of each row, number of essays); ``(gamma, alpha)`` by dev QWK (ties: the
    smoother setting, smaller gamma then larger alpha). Returns a unit's fields as
    :func:`~.baselines.ridge_layers` (with ``cuts``, the continuous predictions too)."""
    (X, y, tr_index, tr_gold), (Xdev, dev_index, dev_gold), (Xte, te_index, n_test) = (
        train, dev, test)
    X, Xdev, Xte = (np.asarray(a, dtype=np.float64) for a in (X, Xdev, Xte))
    y = np.asarray(y, dtype=np.float64)
    if not (X.shape[1] == Xdev.shape[1] == Xte.shape[1]) or len(X) != len(y):
        raise ValueError(f"krr_select: rows {X.shape}, {Xdev.shape}, {Xte.shape} for "
                         f"{len(y)} targets")
    D = _sq_dists(X, X)
    scale = float(np.median(D[np.triu_indices(len(X), 1)])) or 1.0
    settings = [(g, a) for g in gammas for a in alphas]
    order = sorted(range(len(settings)), key=lambda i: (settings[i][0], -settings[i][1]))

    ybar = y.mean()
    per_gamma = []  # (dev [E_dev, A], test [E_te, A], oof [E_tr, A]) normalised, per gamma
    for g in gammas:
        K = np.exp(-g * D / scale)
        C = _krr_path(K, y, alphas)  # [W, A]; essay predictions are their windows' means
        p_dev = average_windows(rbf_kernel(Xdev, X, g, scale) @ C + ybar, dev_index,
                                len(dev_gold))
        p_te = average_windows(rbf_kernel(Xte, X, g, scale) @ C + ybar, te_index, n_test)
        oof = None
        if cuts:
            def fit(rows: np.ndarray, K=K):
                Cr = _krr_path(K[np.ix_(rows, rows)], y[rows], alphas)
                return lambda held: K[np.ix_(held, rows)] @ Cr + y[rows].mean()

            oof = average_windows(out_of_fold_predictions(fit, tr_index, n_folds=n_folds),
                                  tr_index, len(tr_gold))
        per_gamma.append((p_dev, p_te, oof))
    p_dev, p_te = (np.concatenate([t[i] for t in per_gamma], axis=1) for i in (0, 1))

    def chosen(a: int) -> dict:
        return {"gamma": settings[a][0], "alpha": settings[a][1]}

    if cuts:
        oof = np.concatenate([t[2] for t in per_gamma], axis=1)
        oof, x_dev, x_te = (score_scale(v, prompt) for v in (oof, p_dev, p_te))
        a, dev_q, cutpoints = choose_cut(oof, np.asarray(tr_gold), x_dev, np.asarray(dev_gold),
                                         order, prompt)
        return cut_unit(x_dev[:, a], x_te[:, a], oof[:, a], cutpoints, dev_q, prompt, chosen(a))

    def rounded(p: np.ndarray) -> np.ndarray:
        return combine_windows(p, np.arange(len(p)), prompt, "regression")

    scores = {a: qwk(dev_gold, rounded(p_dev[:, a]), prompt) for a in order}
    a = max(order, key=lambda i: (scores[i], -order.index(i)))
    return {"dev_pred": rounded(p_dev[:, a]), "test_pred": rounded(p_te[:, a]),
            "dev_qwk": scores[a], "selected": chosen(a)}
