"""Baselines of the protocol in the same harness: ridge on per-layer vectors (with or without
surface features), ridge on surface features alone, TF-IDF ridge, and the human agreement."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from .cutpoints import apply_cutpoints, fit_cutpoints, out_of_fold_predictions
from .data import SCORE_RANGES, Essay, normalise_score
from .metrics import exact_agreement, quadratic_weighted_kappa
from .model import combine_windows
from .splits import FeatureSplit, qwk
from .windows import average_windows

__all__ = ["RIDGE_ALPHAS", "TFIDF_ALPHAS", "SURFACE_ALPHAS", "ridge_select", "CutRidge",
           "ridge_select_cutpoints", "choose_cut", "cut_unit", "score_scale", "layer_rows",
           "window_rows", "ridge_layers", "surface_ridge", "tfidf_select", "human_agreement"]

RIDGE_ALPHAS = tuple(float(a) for a in np.logspace(-1, 5, 13))  # 0.1 .. 1e5, half decades
TFIDF_ALPHAS = tuple(float(a) for a in np.logspace(-2, 2, 9))
SURFACE_ALPHAS = tuple(float(a) for a in np.logspace(-3, 3, 13))


def _ridge_path(X: np.ndarray, y: np.ndarray, alphas: Sequence[float]) -> list[tuple[np.ndarray, float]]:
    """Ridge solutions ``w = (Xc'Xc + alpha I)^-1 Xc'yc = Xc' (Xc Xc' + alpha I)^-1 yc`` (Xc, yc
    centred; intercept ``mean(y) - mean(X) w``) for every alpha from one eigendecomposition
    ``G = Q diag(lam) Q'`` of the smaller Gram matrix: ``(G + alpha I)^-1 = Q diag(1/(lam + alpha)) Q'``."""
    mu = X.mean(0)
    ym = float(y.mean())
    Xc, yc = X - mu, y - ym
    dual = Xc.shape[0] <= Xc.shape[1]
    lam, Q = np.linalg.eigh(Xc @ Xc.T if dual else Xc.T @ Xc)
    lam = np.maximum(lam, 0.0)
    Qtb = Q.T @ (yc if dual else Xc.T @ yc)
    out = []
    for a in alphas:
        sol = Q @ (Qtb / (lam + a))
        w = Xc.T @ sol if dual else sol
        out.append((w, ym - float(mu @ w)))
    return out


def ridge_select(Xtr: np.ndarray, ytr: np.ndarray, Xdev: np.ndarray, dev_index: np.ndarray,
                 dev_gold: np.ndarray, prompt: int, alphas: Sequence[float] = RIDGE_ALPHAS,
                 ) -> tuple[Callable[[np.ndarray, np.ndarray], np.ndarray], float, float]:
    """Ridge on normalised scores with alpha chosen by dev QWK.

    Rows of ``Xdev`` are windows, ``dev_index`` their essays; an essay's prediction is the
    mean of its windows' outputs, denormalised. The ridge is fitted on train only
    (:class:`sklearn.linear_model.Ridge`'s solution for every alpha, from one eigendecomposition).
    Returns ``(predict(X, index) -> scores, alpha, dev QWK)``; ties in dev QWK go to the
    larger alpha (the simpler model).
    """
    best: tuple[float, float, tuple[np.ndarray, float]] | None = None
    for alpha, (w, b) in sorted(zip(alphas, _ridge_path(Xtr, ytr, alphas)), key=lambda t: -t[0]):
        pred = combine_windows(Xdev @ w + b, dev_index, prompt, "regression",
                               n_essays=len(dev_gold))
        score = qwk(dev_gold, pred, prompt)
        if best is None or score > best[0]:
            best = (score, alpha, (w, b))
    assert best is not None
    w, b = best[2]

    def predict(X: np.ndarray, index: np.ndarray, n_essays: int | None = None) -> np.ndarray:
        return combine_windows(X @ w + b, index, prompt, "regression", n_essays=n_essays)

    return predict, best[1], best[0]


def score_scale(normalised: np.ndarray, prompt: int) -> np.ndarray:
    """Normalised essay predictions -> the prompt's score scale, unrounded."""
    lo, hi = SCORE_RANGES[int(prompt)]
    return lo + np.asarray(normalised, dtype=np.float64) * (hi - lo)


class CutRidge(NamedTuple):
    """A ridge whose essay predictions are cut at fitted cutpoints (:func:`ridge_select_cutpoints`).

    ``values(X, index, n_essays)``: the essays' continuous predictions on the score scale (the
    mean of their windows' outputs, denormalised) [E]; ``predict``: the same cut into int
    scores [E]; ``train_oof``: the out-of-fold continuous predictions of the training essays
    [E_tr] at the chosen alpha, on which ``cutpoints`` [k - 1] were fitted; ``coef`` [F] and
    ``intercept``: the chosen ridge on the rows as given (a window's output in normalised
    score units is ``x . coef + intercept``)."""

    predict: Callable[..., np.ndarray]
    values: Callable[..., np.ndarray]
    alpha: float
    dev_qwk: float
    cutpoints: np.ndarray
    train_oof: np.ndarray
    coef: np.ndarray
    intercept: float


def choose_cut(oof: np.ndarray, train_gold: np.ndarray, x_dev: np.ndarray,
                dev_gold: np.ndarray, order: Sequence[int], prompt: int,
                ) -> tuple[int, float, np.ndarray]:
    """The candidate setting (its index) whose dev essays ``x_dev[:, a]`` [E_dev, A], cut at
    cutpoints fitted on the out-of-fold training predictions ``oof[:, a]`` [E_tr, A], have the
    best dev QWK; ``order``: the candidates' indices, ties going to the earlier one (the
    ridges': the larger alpha first, :func:`_larger_alpha_first`). Returns ``(index, dev QWK,
    cutpoints)``."""
    best = None
    for a in order:
        cuts = fit_cutpoints(oof[:, a], train_gold, prompt)
        score = qwk(dev_gold, apply_cutpoints(x_dev[:, a], cuts, prompt), prompt)
        if best is None or score > best[1]:
            best = (a, score, cuts)
    assert best is not None
    return best


def _larger_alpha_first(alphas: Sequence[float]) -> list[int]:
    return sorted(range(len(alphas)), key=lambda i: -alphas[i])


def cut_unit(x_dev: np.ndarray, x_test: np.ndarray, train_oof: np.ndarray, cuts: np.ndarray,
              dev_qwk: float, prompt: int, selected: dict) -> dict:
    """A cut model's unit fields from its chosen setting's continuous predictions on the score
    scale (dev [E_dev], test [E_te], the training essays' out-of-fold ones [E_tr]) and
    cutpoints; ``selected``: the setting (the cutpoints are added)."""
    return {"dev_pred": apply_cutpoints(x_dev, cuts, prompt),
            "test_pred": apply_cutpoints(x_test, cuts, prompt), "dev_qwk": dev_qwk,
            "selected": {**selected, "cutpoints": cuts.tolist()},
            "continuous": {"train_oof": np.asarray(train_oof).tolist(),
                           "dev": np.asarray(x_dev).tolist(),
                           "test": np.asarray(x_test).tolist()}}


def ridge_select_cutpoints(Xtr: np.ndarray, ytr: np.ndarray, train_index: np.ndarray,
                           train_gold: np.ndarray, Xdev: np.ndarray, dev_index: np.ndarray,
                           dev_gold: np.ndarray, prompt: int,
                           alphas: Sequence[float] = RIDGE_ALPHAS, n_folds: int = 5,
                           ) -> CutRidge:
    """:func:`ridge_select` with the essay predictions cut into scores at cutpoints fitted for
    QWK (:mod:`.cutpoints`) instead of rounded.

    For every alpha the cutpoints are fitted on out-of-fold predictions of the training essays
    (``n_folds`` folds of essays, each predicted by a ridge fitted on the others), so neither
    the dev split, which then chooses alpha by its QWK, nor the test split is seen by the fit.
    ``train_index`` [W_tr] gives each training window's essay, ``train_gold`` [E_tr] their
    scores. Returns a :class:`CutRidge`; ties in dev QWK go to the larger alpha, as in
    :func:`ridge_select`.
    """
    train_index = np.asarray(train_index)
    n_train = len(train_gold)

    def fit(rows: np.ndarray):
        path = _ridge_path(Xtr[rows], ytr[rows], alphas)
        W = np.stack([w for w, _ in path], axis=1)  # [F, A]
        b = np.array([b for _, b in path])
        return lambda held: Xtr[held] @ W + b

    oof = out_of_fold_predictions(fit, train_index, n_folds=n_folds)  # [W_tr, A]
    oof_essays = score_scale(average_windows(oof, train_index, n_train), prompt)  # [E_tr, A]
    path = _ridge_path(Xtr, ytr, alphas)
    x_dev = np.stack([score_scale(average_windows(Xdev @ w + b, dev_index, len(dev_gold)),
                                   prompt) for w, b in path], axis=1)  # [E_dev, A]
    a, dev_q, cuts = choose_cut(oof_essays, train_gold, x_dev, dev_gold,
                                 _larger_alpha_first(alphas), prompt)
    alpha, (w, b) = alphas[a], path[a]

    def values(X: np.ndarray, index: np.ndarray, n_essays: int | None = None) -> np.ndarray:
        return score_scale(average_windows(X @ w + b, index, n_essays), prompt)

    def predict(X: np.ndarray, index: np.ndarray, n_essays: int | None = None) -> np.ndarray:
        return apply_cutpoints(values(X, index, n_essays), cuts, prompt)

    return CutRidge(predict, values, alpha, dev_q, cuts, oof_essays[:, a], w, float(b))


def _layer_matrix(split: FeatureSplit, mean: np.ndarray | None = None,
                   std: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[W, L*H] concatenated vectors of layers 1..L, standardised (train statistics)."""
    X = split.features[:, 1:].reshape(split.features.shape[0], -1).double().numpy()
    return _standardise(X, mean, std)


def layer_rows(train: FeatureSplit, dev: FeatureSplit, test: FeatureSplit, prompt: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A ridge's rows on the per-layer vectors: ``(X_train, y_train, X_dev, X_test, mean,
    std)``, X [W, L*H] the windows' vectors of layers 1..L standardised with the training
    split's ``mean`` and ``std`` [L*H], ``y_train`` [W_tr] each training window's essay score
    normalised to [0, 1]."""
    Xtr, mu, sd = _layer_matrix(train)
    ytr = np.array([normalise_score(s, prompt) for s in train.scores[train.essay_index]])
    return Xtr, ytr, _layer_matrix(dev, mu, sd)[0], _layer_matrix(test, mu, sd)[0], mu, sd


def _standardise(X: np.ndarray, mean: np.ndarray | None = None, std: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if mean is None:
        mean, std = X.mean(0), X.std(0)
        std = np.where(std > 1e-8, std, 1.0)
    return (X - mean) / std, mean, std  # type: ignore[operator]


def window_rows(train: FeatureSplit, dev: FeatureSplit, test: FeatureSplit, prompt: int,
                surface: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                ) -> tuple[tuple, tuple, tuple]:
    """The rows a model on per-window vectors fits: ``train`` (X [W, F], normalised targets
    [W], essay of each row [W], gold scores [E]), ``dev`` (X, essay of each row, gold scores)
    and ``test`` (X, essay of each row, number of essays); X the windows' vectors of layers
    1..L (:func:`layer_rows`) with ``surface``'s per-essay rows (train, dev, test) appended,
    each block standardised on train."""
    Xtr, ytr, Xdev, Xte, _, _ = layer_rows(train, dev, test, prompt)
    if surface is not None:
        s_tr, m, d = _standardise(surface[0])
        s_dev, s_te = _standardise(surface[1], m, d)[0], _standardise(surface[2], m, d)[0]
        Xtr = np.hstack([Xtr, s_tr[train.essay_index]])
        Xdev = np.hstack([Xdev, s_dev[dev.essay_index]])
        Xte = np.hstack([Xte, s_te[test.essay_index]])
    return ((Xtr, ytr, train.essay_index, train.scores), (Xdev, dev.essay_index, dev.scores),
            (Xte, test.essay_index, len(test.ids)))


def ridge_layers(train: FeatureSplit, dev: FeatureSplit, test: FeatureSplit, prompt: int,
                 alphas: Sequence[float] = RIDGE_ALPHAS,
                 surface: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                 cuts: bool = False) -> dict:
    """``ridge-layers`` for one prompt: test/dev predictions, chosen alpha, dev QWK.

    ``surface``: per-essay features (:func:`~.surface.surface_features`, and with them any
    other per-essay features such as :mod:`.ged_features`) of the train, dev and test essays,
    standardised on train and appended to every window's row (``ridge-layers-surface``;
    :func:`window_rows`).
    ``cuts``: scores cut at cutpoints fitted for QWK on out-of-fold training predictions
    (:func:`ridge_select_cutpoints`) instead of rounded; the result then also holds the
    continuous predictions on the score scale (``continuous``: ``train_oof``, the out-of-fold
    ones of the training essays, ``dev`` and ``test``) that blends and stacks of members need
    (:mod:`.ensembles`).
    """
    return _select_unit(*window_rows(train, dev, test, prompt, surface), prompt, alphas, cuts)


def _select_unit(train: tuple, dev: tuple, test: tuple, prompt: int, alphas: Sequence[float],
                 cuts: bool) -> dict:
    """A ridge's unit: ``train`` (X [W, F], normalised targets [W], essay of each row [W],
    gold scores [E]), ``dev`` (X, essay of each row, gold scores), ``test`` (X, essay of each
    row, number of essays); alpha by dev QWK, scores rounded or (``cuts``) cut at cutpoints
    fitted on out-of-fold training predictions, with the continuous predictions kept."""
    (Xtr, ytr, tr_index, tr_gold), (Xdev, dev_index, dev_gold), (Xte, te_index, n_test) = (
        train, dev, test)
    if cuts:
        r = ridge_select_cutpoints(Xtr, ytr, tr_index, tr_gold, Xdev, dev_index, dev_gold,
                                   prompt, alphas)
        return cut_unit(r.values(Xdev, dev_index, len(dev_gold)), r.values(Xte, te_index, n_test),
                         r.train_oof, r.cutpoints, r.dev_qwk, prompt, {"alpha": r.alpha})
    predict, alpha, dev_q = ridge_select(Xtr, ytr, Xdev, dev_index, dev_gold, prompt, alphas)
    return {"dev_pred": predict(Xdev, dev_index, len(dev_gold)),
            "test_pred": predict(Xte, te_index, n_test),
            "dev_qwk": dev_q, "selected": {"alpha": alpha}}


def surface_ridge(train: tuple[np.ndarray, np.ndarray], dev: tuple[np.ndarray, np.ndarray],
                  test: np.ndarray, prompt: int, alphas: Sequence[float] = SURFACE_ALPHAS,
                  cuts: bool = False) -> dict:
    """``surface-ridge``: ridge on the standardised surface features alone (``train`` and
    ``dev`` are (features [E, F], gold scores [E])); alpha by dev QWK; ``cuts`` as in
    :func:`ridge_layers` (one row per essay)."""
    Xtr, m, d = _standardise(train[0])
    Xdev, Xte = _standardise(dev[0], m, d)[0], _standardise(test, m, d)[0]
    ytr = np.array([normalise_score(s, prompt) for s in train[1]])
    return _select_unit((Xtr, ytr, np.arange(len(Xtr)), np.asarray(train[1])),
                        (Xdev, np.arange(len(Xdev)), np.asarray(dev[1])),
                        (Xte, np.arange(len(Xte)), len(Xte)), prompt, alphas, cuts)


def tfidf_select(train_texts: Sequence[str], train_scores: np.ndarray, dev_texts: Sequence[str],
                 dev_scores: np.ndarray, test_texts: Sequence[str], prompt: int,
                 alphas: Sequence[float] = TFIDF_ALPHAS, cuts: bool = False) -> dict:
    """``tfidf-ridge``: TF-IDF (word 1-2 grams, sublinear tf, min_df 2, fitted on train) +
    ridge on normalised scores, alpha by dev QWK. Essay level (no windows). ``cuts``: as in
    :func:`ridge_layers` (:func:`_tfidf_cuts`)."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import Ridge

    y = np.array([normalise_score(s, prompt) for s in train_scores])
    if cuts:
        return _tfidf_cuts(list(train_texts), np.asarray(train_scores), y, dev_texts,
                           np.asarray(dev_scores), test_texts, prompt, alphas)
    vec = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True)
    Xtr = vec.fit_transform(train_texts)
    Xdev, Xte = vec.transform(dev_texts), vec.transform(test_texts)
    index_dev = np.arange(len(dev_texts))
    best = None
    for alpha in sorted(alphas, reverse=True):
        model = Ridge(alpha=alpha).fit(Xtr, y)
        pred = combine_windows(model.predict(Xdev), index_dev, prompt, "regression")
        score = qwk(dev_scores, pred, prompt)
        if best is None or score > best[0]:
            best = (score, alpha, model, pred)
    assert best is not None
    test_pred = combine_windows(best[2].predict(Xte), np.arange(len(test_texts)), prompt,
                                "regression")
    return {"dev_pred": best[3], "test_pred": test_pred, "dev_qwk": best[0],
            "selected": {"alpha": best[1], "vocabulary": len(vec.vocabulary_)}}


def _tfidf_cuts(train_texts: list[str], train_gold: np.ndarray, y: np.ndarray,
                dev_texts: Sequence[str], dev_gold: np.ndarray, test_texts: Sequence[str],
                prompt: int, alphas: Sequence[float], n_folds: int = 5) -> dict:
    """``tfidf-ridge-cuts``: for every alpha, cutpoints fitted on out-of-fold predictions of
    the training essays (each fold's vectoriser and ridges fitted on the other folds' essays
    only), alpha chosen by dev QWK of the cut scores (:func:`choose_cut`)."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import Ridge

    def fit(rows: np.ndarray) -> Callable[[Sequence[str]], np.ndarray]:
        vec = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True)
        X = vec.fit_transform([train_texts[i] for i in rows])
        models = [Ridge(alpha=a).fit(X, y[rows]) for a in alphas]
        return lambda texts: np.stack([m.predict(vec.transform(texts)) for m in models], axis=1)

    def fold(rows: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
        predict = fit(rows)
        return lambda held: predict([train_texts[i] for i in held])

    oof = out_of_fold_predictions(fold, np.arange(len(train_texts)), n_folds=n_folds)
    full = fit(np.arange(len(train_texts)))
    x_dev, x_test = (score_scale(full(list(t)), prompt) for t in (dev_texts, test_texts))
    oof = score_scale(oof, prompt)
    a, dev_q, cuts = choose_cut(oof, train_gold, x_dev, dev_gold, _larger_alpha_first(alphas),
                                 prompt)
    return cut_unit(x_dev[:, a], x_test[:, a], oof[:, a], cuts, dev_q, prompt,
                     {"alpha": alphas[a]})


def human_agreement(essays: Sequence[Essay]) -> dict:
    """Rater 1 against rater 2 (essays with both ratings): QWK, exact agreement, n."""
    pairs = [(e.rater1, e.rater2) for e in essays if e.rater1 is not None and e.rater2 is not None]
    if not pairs:
        return {"qwk": None, "exact": None, "n": 0}
    a, b = np.array(pairs, dtype=np.int64).T
    return {"qwk": quadratic_weighted_kappa(a, b), "exact": exact_agreement(a, b), "n": len(pairs)}
