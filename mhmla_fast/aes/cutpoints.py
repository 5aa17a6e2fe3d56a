"""Score cutpoints fitted for QWK: a regression model's continuous essay scores cut into the
prompt's integer scores at fitted thresholds instead of rounded half up.

For continuous predictions ``x_e`` on the score scale of a prompt with scores ``lo .. hi``
(``k = hi - lo + 1`` of them) and cutpoints ``t_1 <= ... <= t_{k-1}``::

    score(x) = lo + #{i : x >= t_i}

Rounding half up is the special case ``t_i = lo + i - 1/2``. :func:`fit_cutpoints` starts
there and moves one cutpoint at a time (coordinate ascent) to the candidate in the interval
its neighbours leave that maximises QWK against the gold scores, sweeping over all cutpoints
until a sweep gains nothing (at most ``sweeps``). Candidates are the midpoints between
consecutive distinct predictions in that interval (at most ``max_candidates`` of them, evenly
spaced in rank), so a cutpoint only ever lands between two essays. A move is taken only if it
raises QWK by more than ``1e-12``: ties keep the current cutpoint, so the result stays
rounding wherever rounding is already optimal.

The fit is only as honest as the predictions it sees: fit on out-of-sample predictions
(:func:`out_of_fold_predictions` gives them for the training split), never on the split that
is scored. Where the cutpoints are fitted on the split that is scored (a fine-tuned scorer's
dev split: out-of-fold training predictions would need a fine-tuned model per fold),
:func:`cross_fitted_cut_scores` gives that split's honest scores: each essay cut at
cutpoints fitted on the other folds of the split.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .data import SCORE_RANGES
from .metrics import quadratic_weighted_kappa

__all__ = ["rounding_cutpoints", "fit_cutpoints", "apply_cutpoints", "out_of_fold_predictions",
           "cross_fitted_cut_scores"]


def rounding_cutpoints(prompt: int) -> np.ndarray:
    """The cutpoints of rounding half up on ``prompt``'s scale: ``lo + 1/2 .. hi - 1/2``."""
    lo, hi = SCORE_RANGES[int(prompt)]
    return np.arange(lo, hi, dtype=np.float64) + 0.5


def apply_cutpoints(x: np.ndarray, cuts: np.ndarray, prompt: int) -> np.ndarray:
    """Continuous scores ``x`` [E] -> int64 scores ``lo + #{i : x >= cuts_i}`` [E]."""
    lo, hi = SCORE_RANGES[int(prompt)]
    cuts = np.asarray(cuts, dtype=np.float64)
    if cuts.shape != (hi - lo,):
        raise ValueError(f"prompt {prompt}: expected {hi - lo} cutpoints, got shape {cuts.shape}")
    if np.any(np.diff(cuts) < 0):
        raise ValueError("cutpoints must be non-decreasing")
    x = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError("cannot cut non-finite scores")
    return lo + np.searchsorted(cuts, x, side="right").astype(np.int64)


def _qwk_of_sums(n: int, sum_sq_diff: np.ndarray, sum_g: int, sum_g2: int, sum_p: np.ndarray,
                 sum_p2: np.ndarray) -> np.ndarray:
    """QWK from integer sums over ``n`` essays (gold ``g``, predicted ``p``), exactly as
    :func:`~.metrics.quadratic_weighted_kappa`: with ``sum_ij hg_i hp_j (i - j)^2 =
    n (sum g^2 + sum p^2) - 2 sum g sum p``, ``QWK = 1 - n sum (g - p)^2 / that`` (1 where it
    is 0). Vectorised over candidates (the ``p`` sums and ``sum_sq_diff`` arrays)."""
    den = n * (sum_g2 + sum_p2) - 2 * sum_g * sum_p
    out = np.ones(den.shape, dtype=np.float64)
    ok = den != 0
    out[ok] = 1.0 - (n * sum_sq_diff[ok]) / den[ok]
    return out


def fit_cutpoints(x: np.ndarray, gold: np.ndarray, prompt: int, *, sweeps: int = 10,
                  max_candidates: int = 256) -> np.ndarray:
    """Cutpoints [k - 1] that maximise QWK of ``apply_cutpoints(x)`` against ``gold`` (see the
    module doc); ``x`` [E] continuous predictions on the score scale, ``gold`` [E] int scores.

    The QWK of every candidate of one cutpoint comes at once from integer sums: moving cutpoint
    ``i`` within its neighbours ``[t_{i-1}, t_{i+1}]`` only decides whether the essays between
    them score ``lo + i - 1`` or one more, so suffix sums over those essays sorted by ``x`` give
    each candidate's ``sum p``, ``sum p^2`` and ``sum (g - p)^2`` (:func:`_qwk_of_sums`). The
    candidates are then taken in order, each kept if it beats the best so far by ``1e-12``,
    as one trial at a time would."""
    x = np.asarray(x, dtype=np.float64)
    gold = np.asarray(gold)
    if x.ndim != 1 or x.shape != gold.shape or x.size == 0:
        raise ValueError(f"x and gold: expected two 1-D arrays of one non-zero length, got "
                         f"{x.shape} and {gold.shape}")
    lo, hi = SCORE_RANGES[int(prompt)]
    cuts = rounding_cutpoints(prompt)
    quadratic_weighted_kappa(gold, gold, lo, hi)  # whole-number ratings, else an error
    g = gold.astype(np.int64)
    n, sum_g, sum_g2 = g.size, int(g.sum()), int((g * g).sum())
    order = np.argsort(x, kind="stable")
    xo, go = x[order], g[order]

    xs = np.unique(x)
    mids = (xs[1:] + xs[:-1]) / 2 if xs.size > 1 else xs
    # the ends too, so that a cutpoint can move past every prediction (an empty score)
    spots = np.concatenate([[xs[0] - 1.0], mids, [xs[-1] + 1.0]])
    p = apply_cutpoints(x, cuts, prompt)  # rounding's scores, the start
    best = float(_qwk_of_sums(n, np.array([int(((g - p) ** 2).sum())]), sum_g, sum_g2,
                              np.array([int(p.sum())]), np.array([int((p * p).sum())]))[0])
    for _ in range(sweeps):
        gained = False
        for i in range(cuts.size):
            left = cuts[i - 1] if i > 0 else -np.inf
            right = cuts[i + 1] if i + 1 < cuts.size else np.inf
            cand = spots[(spots >= left) & (spots <= right)]
            if cand.size > max_candidates:
                cand = cand[np.linspace(0, cand.size - 1, max_candidates).round().astype(int)]
            if cand.size == 0:
                continue
            # scores with cutpoint i above every essay of the band [left, right): the band
            # scores lo + i, and a candidate c adds 1 to the band's essays with x >= c
            trial = cuts.copy()
            trial[i] = right
            p0 = apply_cutpoints(xo, trial, prompt)
            a, b = np.searchsorted(xo, left, side="left"), np.searchsorted(xo, right, side="left")
            band_g, band_p = go[a:b], p0[a:b]
            # suffix sums over the band (sorted by x): essays j..end are the ones moved up
            up_p = np.concatenate([np.cumsum((2 * band_p + 1)[::-1])[::-1], [0]])
            up_d = np.concatenate([np.cumsum((1 - 2 * (band_g - band_p))[::-1])[::-1], [0]])
            up_n = np.arange(band_g.size, -1, -1)
            j = np.searchsorted(xo[a:b], cand, side="left")  # first band essay with x >= c
            q = _qwk_of_sums(n, int(((go - p0) ** 2).sum()) + up_d[j], sum_g, sum_g2,
                             int(p0.sum()) + up_n[j], int((p0 * p0).sum()) + up_p[j])
            for c, qc in zip(cand, q):
                if c == cuts[i]:
                    continue
                if qc > best + 1e-12:
                    best, gained = float(qc), True
                    cuts[i] = c  # cuts is this call's own array (rounding_cutpoints')
        if not gained:
            break
    return cuts


def out_of_fold_predictions(fit: Callable[[np.ndarray], Callable[[np.ndarray], np.ndarray]],
                            groups: np.ndarray, n_folds: int = 5, seed: int = 0) -> np.ndarray:
    """Out-of-fold predictions for every row of a training split: the rows are dealt into
    ``n_folds`` folds by ``groups`` (the essay of each window: an essay's windows stay in one
    fold), and each fold is predicted by ``fit(train_rows)`` -- a function of the training
    rows' indices returning ``predict(rows) -> [len(rows), ...]`` -- fitted on the other
    folds. The folds are a fixed shuffle of the groups (``seed``). Returns [len(groups), ...]."""
    groups = np.asarray(groups)
    ids = np.unique(groups)
    if ids.size < n_folds:
        raise ValueError(f"out_of_fold_predictions: {ids.size} groups for {n_folds} folds")
    order = np.random.default_rng(seed).permutation(ids.size)
    fold_of_group = np.empty(ids.size, dtype=np.int64)
    fold_of_group[order] = np.arange(ids.size) % n_folds
    fold = fold_of_group[np.searchsorted(ids, groups)]
    out = None
    for f in range(n_folds):
        held = np.flatnonzero(fold == f)
        pred = np.asarray(fit(np.flatnonzero(fold != f))(held), dtype=np.float64)
        if out is None:
            out = np.full((groups.shape[0], *pred.shape[1:]), np.nan)
        out[held] = pred
    assert out is not None
    return out


def cross_fitted_cut_scores(x: np.ndarray, gold: np.ndarray, prompt: int, *, n_folds: int = 5,
                            seed: int = 0) -> np.ndarray:
    """Int scores [E] of continuous predictions ``x`` [E] (on the score scale), each essay's
    cut at cutpoints fitted (:func:`fit_cutpoints`) on the gold scores ``gold`` [E] of the
    other ``n_folds - 1`` folds (a fixed shuffle, ``seed``): the QWK of these scores estimates,
    without looking at an essay's own score, that of cutpoints fitted on all ``E`` essays and
    applied to new ones (:func:`out_of_fold_predictions` with one essay a group)."""
    x = np.asarray(x, dtype=np.float64)
    gold = np.asarray(gold)
    if x.ndim != 1 or x.shape != gold.shape:
        raise ValueError(f"x and gold: expected two 1-D arrays of one length, got {x.shape} "
                         f"and {gold.shape}")

    def fit(rows: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
        cuts = fit_cutpoints(x[rows], gold[rows], prompt)
        return lambda held: apply_cutpoints(x[held], cuts, prompt)

    return out_of_fold_predictions(fit, np.arange(x.size), n_folds, seed).astype(np.int64)
