"""Kernel ridge with a Gaussian kernel on per-window rows (``mhmla_fast.aes.kernel_ridge``)."""

from __future__ import annotations

import numpy as np
import pytest

from mhmla_fast.aes.baselines import window_rows
from mhmla_fast.aes.cutpoints import apply_cutpoints
from mhmla_fast.aes.data import SCORE_RANGES, normalise_score
from mhmla_fast.aes.kernel_ridge import KRR_ALPHAS, KRR_GAMMAS, krr_select, rbf_kernel
from mhmla_fast.aes.metrics import quadratic_weighted_kappa
from mhmla_fast.aes.splits import FeatureSplit
from test_aes_train import tiny_encoder  # noqa: F401 - the fixture

PROMPT = 3  # scores 0..3


def _windows(n_essays: int, seed: int, features: int = 5):
    """Rows of essays with one or two windows each: (X [W, F], essay of each row [W], scores
    [E]); the score is a step function of a non-linear (radial) function of the essay's
    features, so a Gaussian kernel can learn what a linear map cannot."""
    rng = np.random.default_rng(seed)
    Z = rng.normal(size=(n_essays, features))
    score = np.digitize(np.hypot(Z[:, 0], Z[:, 1]) + 0.1 * rng.normal(size=n_essays),
                        [0.6, 1.2, 1.8]).astype(np.int64)
    reps = rng.integers(1, 3, size=n_essays)
    index = np.repeat(np.arange(n_essays), reps)
    X = Z[index] + 0.05 * rng.normal(size=(len(index), features))
    return X, index, score


def _qwk(gold, pred) -> float:
    return quadratic_weighted_kappa(np.asarray(gold), np.asarray(pred), *SCORE_RANGES[PROMPT])


def _rows(seed_tr=0, seed_dev=1, seed_te=2, n=(160, 80, 90)):
    (X, ix, s), (Xd, ixd, sd), (Xt, ixt, st) = (_windows(k, seed) for k, seed in
                                                 zip(n, (seed_tr, seed_dev, seed_te)))
    y = np.array([normalise_score(v, PROMPT) for v in s[ix]])
    return (X, y, ix, s), (Xd, ixd, sd), (Xt, ixt, len(st)), st


def _by_hand(X, y, Z, gamma, alpha):
    """sklearn's KernelRidge on the centred targets with the module's median scale."""
    from sklearn.kernel_ridge import KernelRidge

    d = ((X[:, None, :] - X[None, :, :]) ** 2).sum(-1)
    scale = float(np.median(d[np.triu_indices(len(X), 1)]))
    m = KernelRidge(alpha=alpha, kernel="rbf", gamma=gamma / scale).fit(X, y - y.mean())
    return m.predict(Z) + y.mean()


def test_rbf_kernel_matches_sklearn():
    from sklearn.metrics.pairwise import rbf_kernel as sk_rbf

    rng = np.random.default_rng(0)
    A, B = rng.normal(size=(7, 4)), rng.normal(size=(5, 4))
    assert np.allclose(rbf_kernel(A, B, 0.5, 3.0), sk_rbf(A, B, gamma=0.5 / 3.0), atol=1e-12)
    assert np.allclose(np.diag(rbf_kernel(A, A, 2.0, 1.0)), 1.0)


def test_setting_by_dev_qwk_and_predictions_equal_sklearn():
    """Rounded: each setting's dev essays (window outputs averaged, rounded half up) scored by
    QWK; the unit keeps the best (ties: smaller gamma, then larger alpha), and its dev and test
    scores equal sklearn's KernelRidge at that setting."""
    train, dev, test, _ = _rows()
    X, y, ix, _ = train
    unit = krr_select(train, dev, test, PROMPT)
    lo, hi = SCORE_RANGES[PROMPT]

    def scores(Z, index, n, g, a):
        w = _by_hand(X, y, Z, g, a)
        e = np.array([w[index == k].mean() for k in range(n)])
        return np.clip(np.floor(lo + np.clip(e, 0, 1) * (hi - lo) + 0.5), lo, hi).astype(int)

    grid = [(g, a) for g in KRR_GAMMAS for a in sorted(KRR_ALPHAS, reverse=True)]
    dev_q = [_qwk(dev[2], scores(dev[0], dev[1], len(dev[2]), g, a)) for g, a in grid]
    best = grid[int(np.argmax(dev_q))]  # argmax: the first of the ties, in tie-break order
    assert (unit["selected"]["gamma"], unit["selected"]["alpha"]) == best
    assert unit["dev_qwk"] == pytest.approx(max(dev_q), abs=1e-12)
    assert list(unit["dev_pred"]) == scores(dev[0], dev[1], len(dev[2]), *best).tolist()
    assert list(unit["test_pred"]) == scores(test[0], test[1], test[2], *best).tolist()


def test_cut_unit_keeps_honest_out_of_fold_predictions():
    """Cut: scores are the continuous predictions cut at the unit's cutpoints; the test values
    equal sklearn's at the chosen setting; a training essay's out-of-fold value does not move
    when its own score does; and on a radial score the kernel beats the linear ridge."""
    from mhmla_fast.aes.baselines import _select_unit, RIDGE_ALPHAS

    train, dev, test, test_gold = _rows(3, 4, 5, n=(200, 90, 150))
    X, y, ix, gold = train
    unit = krr_select(train, dev, test, PROMPT, cuts=True)
    x = unit["continuous"]
    assert (len(x["train_oof"]), len(x["dev"]), len(x["test"])) == (200, 90, 150)
    cuts = np.array(unit["selected"]["cutpoints"])
    assert apply_cutpoints(np.array(x["test"]), cuts, PROMPT).tolist() == list(unit["test_pred"])
    assert apply_cutpoints(np.array(x["dev"]), cuts, PROMPT).tolist() == list(unit["dev_pred"])
    g, a = unit["selected"]["gamma"], unit["selected"]["alpha"]
    lo, hi = SCORE_RANGES[PROMPT]
    w = _by_hand(X, y, test[0], g, a)
    by_hand = lo + (hi - lo) * np.array([w[test[1] == k].mean() for k in range(test[2])])
    assert np.allclose(x["test"], by_hand, atol=1e-8)
    flipped = gold.copy()
    flipped[7] = 0 if gold[7] else 3
    y2 = np.array([normalise_score(v, PROMPT) for v in flipped[ix]])
    other = krr_select((X, y2, ix, flipped), dev, test, PROMPT, cuts=True,
                       gammas=[g], alphas=[a])["continuous"]
    mine = krr_select(train, dev, test, PROMPT, cuts=True, gammas=[g], alphas=[a])["continuous"]
    assert other["train_oof"][7] == pytest.approx(mine["train_oof"][7], abs=1e-12)
    assert not np.allclose(other["train_oof"], mine["train_oof"])
    ridge = _select_unit(train, dev, test, PROMPT, RIDGE_ALPHAS, cuts=True)
    assert _qwk(test_gold, unit["test_pred"]) > _qwk(test_gold, ridge["test_pred"]) + 0.1


def test_window_rows_append_standardised_essay_features():
    """The rows the ridges and the kernel ridge share: layers 1..L of each window side by side,
    standardised on train, then the essay's own features, standardised on train."""
    import torch

    rng = np.random.default_rng(1)

    def split(n_windows, essay_index):
        return FeatureSplit(torch.tensor(rng.normal(size=(n_windows, 3, 2))), essay_index,
                            np.array([1, 2, 3][:essay_index.max() + 1]), np.full(3, PROMPT)[
                                :essay_index.max() + 1], np.arange(essay_index.max() + 1))

    tr, dv, te = split(4, np.array([0, 0, 1, 2])), split(2, np.array([0, 1])), split(
        3, np.array([0, 1, 1]))
    surface = (rng.normal(size=(3, 2)), rng.normal(size=(2, 2)), rng.normal(size=(2, 2)))
    (X, y, ix, gold), (Xd, ixd, _), (Xt, ixt, n) = window_rows(tr, dv, te, PROMPT, surface)
    L = tr.features[:, 1:].reshape(4, -1).numpy()
    mu, sd = L.mean(0), L.std(0)
    assert np.allclose(X[:, :4], (L - mu) / sd)
    assert np.allclose(Xt[:, :4], (te.features[:, 1:].reshape(3, -1).numpy() - mu) / sd)
    s_mu, s_sd = surface[0].mean(0), surface[0].std(0)
    assert np.allclose(X[:, 4:], ((surface[0] - s_mu) / s_sd)[ix])
    assert np.allclose(Xd[:, 4:], ((surface[1] - s_mu) / s_sd)[ixd])
    assert n == 2 and list(ixt) == [0, 1, 1]
    assert np.allclose(y, [normalise_score(v, PROMPT) for v in gold[ix]])


def test_mismatched_rows_are_refused():
    train, dev, test, _ = _rows(n=(30, 20, 20))
    X, y, ix, gold = train
    with pytest.raises(ValueError, match="krr_select: rows"):
        krr_select((X, y, ix, gold), (dev[0][:, :3], dev[1], dev[2]), test, PROMPT)
    with pytest.raises(ValueError, match="krr_select: rows"):
        krr_select((X, y[:-1], ix, gold), dev, test, PROMPT)


def test_protocol_runs_the_kernel_ridge_as_a_stack_member(tiny_encoder, tmp_path):
    """``krr-layers-both-surface-cuts`` through the protocol: it reads both feature caches and
    the surface features, records its grid and encoder in its settings, keeps its continuous
    predictions, joins the stack of cut models, and its units are reused by a second run."""
    import json

    from mhmla_fast.aes.protocol import run_cpu_protocol
    from test_aes_train import write_asap

    data = write_asap(tmp_path / "data", n_per_prompt=20)
    kw = dict(data_dir=data, cache_dir=tmp_path / "cache", run_dir=tmp_path / "run", folds=[0],
              prompts=[3], encoder=tiny_encoder, log=None,
              models=["krr-layers-both-surface-cuts", "ridge-layers-both-surface-cuts"])
    result = run_cpu_protocol(results=None, **kw)
    krr = result["models"]["krr-layers-both-surface-cuts"]
    assert krr["settings"]["gammas"] == list(KRR_GAMMAS)
    assert krr["settings"]["alphas"] == list(KRR_ALPHAS)
    assert krr["settings"]["encoder"] == tiny_encoder
    assert krr["settings"]["features"] == "cls+mean" and krr["settings"]["cuts"]
    assert set(krr["selected"]["0"]["3"]) == {"gamma", "alpha", "cutpoints"}
    unit = json.loads((tmp_path / "run" / "units" /
                       "krr-layers-both-surface-cuts-fold0-p3.json").read_text())
    cuts = np.array(unit["selected"]["cutpoints"])
    assert apply_cutpoints(np.array(unit["continuous"]["test"]), cuts, 3).tolist() == unit["pred"]
    assert result["ensembles"]["ensemble-stack"]["members"] == kw["models"]
    assert run_cpu_protocol(results=None, **kw)["models"] == result["models"]
