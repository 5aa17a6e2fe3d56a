"""Tests for mhmla_fast.aes.metrics: QWK against sklearn and hand-computed cases."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from mhmla_fast.aes.metrics import exact_agreement, quadratic_weighted_kappa as qwk

sklearn_metrics = pytest.importorskip("sklearn.metrics", reason="scikit-learn is needed for the reference QWK")

RANGES = [(0, 1), (0, 3), (0, 4), (1, 6), (2, 12), (0, 30), (0, 60)]


def sk_qwk(a: np.ndarray, b: np.ndarray, lo: int, hi: int) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(sklearn_metrics.cohen_kappa_score(a, b, weights="quadratic", labels=np.arange(lo, hi + 1)))


@pytest.mark.parametrize(("lo", "hi"), RANGES)
def test_qwk_matches_sklearn_on_random_vectors(lo: int, hi: int) -> None:
    checked = 0
    for seed in range(120):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(1, 300))
        a = rng.integers(lo, hi + 1, size=n)
        if seed % 2:  # correlated raters, as in real scoring
            b = np.clip(a + rng.integers(-2, 3, size=n), lo, hi)
        else:
            b = rng.integers(lo, hi + 1, size=n)
        ref = sk_qwk(a, b, lo, hi)
        ours = qwk(a, b, lo, hi)
        if np.isnan(ref):  # both raters constant and equal: sklearn divides 0 by 0
            assert ours == 1.0 and len(set(a)) == 1 and set(a) == set(b)
            continue
        assert ours == pytest.approx(ref, abs=1e-12)
        assert qwk(a, b) == pytest.approx(ref, abs=1e-12)  # the range does not change QWK
        assert qwk(a.tolist(), b.tolist(), lo - 3, hi + 5) == pytest.approx(ref, abs=1e-12)
        checked += 1
    assert checked > 100


def test_qwk_hand_computed() -> None:
    assert qwk([0, 1, 2], [0, 1, 2]) == 1.0
    assert qwk([0, 0, 1, 1], [0, 1, 0, 1]) == pytest.approx(0.0, abs=1e-15)
    assert qwk([0, 1], [1, 0]) == pytest.approx(-1.0)
    # O = {(0,0), (1,2), (2,2), (2,1)}; W = (i-j)^2/4; sum W*O = 0.5, sum W*E = 1.375.
    assert qwk([0, 1, 2, 2], [0, 2, 2, 1]) == pytest.approx(7 / 11)
    assert qwk([0, 1, 2, 2], [0, 2, 2, 1], min_rating=0, max_rating=10) == pytest.approx(7 / 11)
    # Symmetric in the two raters.
    assert qwk([0, 2, 2, 1], [0, 1, 2, 2]) == pytest.approx(7 / 11)


def test_qwk_degenerate_and_input_types() -> None:
    assert qwk([3, 3, 3], [3, 3, 3]) == 1.0
    assert qwk([3, 3, 3], [3, 3, 3], 0, 5) == 1.0
    assert qwk([2, 2, 2], [1, 2, 3]) == pytest.approx(0.0, abs=1e-15)
    assert qwk(np.array([1.0, 2.0, 3.0]), np.array([1, 2, 2])) == qwk([1, 2, 3], [1, 2, 2])
    assert qwk(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 2])) == qwk([1, 2, 3], [1, 2, 2])


def test_qwk_errors() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        qwk([1, 2], [1])
    with pytest.raises(ValueError, match="at least one"):
        qwk([], [])
    with pytest.raises(ValueError, match="outside"):
        qwk([1, 2, 7], [1, 2, 3], 1, 6)
    with pytest.raises(ValueError, match="whole-number"):
        qwk([1.5, 2.0], [1, 2])
    with pytest.raises(ValueError, match="1-D"):
        qwk([[1, 2]], [[1, 2]])
    with pytest.raises(ValueError, match="min_rating"):
        qwk([1], [1], 3, 2)


def test_exact_agreement() -> None:
    assert exact_agreement([1, 2, 3], [1, 2, 4]) == pytest.approx(2 / 3)
    assert exact_agreement(np.array([5]), np.array([5.0])) == 1.0
    with pytest.raises(ValueError):
        exact_agreement([1, 2], [1])
    with pytest.raises(ValueError):
        exact_agreement([], [])
