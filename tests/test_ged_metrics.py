"""Tests of the token-level GED metrics (mhmla_fast.ged.metrics), against hand-computed numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mhmla_fast.ged.metrics import GedScores, best_threshold, f_beta, flatten, ged_scores


def test_scores_symmetric_case() -> None:
    # gold 1 0 1 1 0 0 / pred 1 1 0 1 0 0: tp 2 (pos 0, 3), fp 1 (pos 1), fn 1 (pos 2), tn 2.
    s = ged_scores([1, 0, 1, 1, 0, 0], [1, 1, 0, 1, 0, 0])
    assert (s.tp, s.fp, s.fn, s.tn) == (2, 1, 1, 2)
    assert s.precision == pytest.approx(2 / 3)
    assert s.recall == pytest.approx(2 / 3)
    assert s.f05 == pytest.approx(2 / 3)  # P == R -> F == P


def test_scores_precision_weighted() -> None:
    # tp 1, fp 0, fn 3: P = 1, R = 0.25, F0.5 = 1.25 * 0.25 / (0.25 * 1 + 0.25) = 0.625.
    s = ged_scores([1, 1, 1, 1, 0], [1, 0, 0, 0, 0])
    assert (s.tp, s.fp, s.fn, s.tn) == (1, 0, 3, 1)
    assert (s.precision, s.recall) == (1.0, 0.25)
    assert s.f05 == pytest.approx(0.625)
    # F1 = 2 * 1 * 0.25 / 1.25 = 0.4; F2 = 5 * 0.25 / (4 + 0.25) = 0.2941...
    assert ged_scores([1, 1, 1, 1, 0], [1, 0, 0, 0, 0], beta=1.0).fbeta == pytest.approx(0.4)
    s2 = ged_scores([1, 1, 1, 1, 0], [1, 0, 0, 0, 0], beta=2.0)
    assert s2.fbeta == pytest.approx(1.25 / 4.25)
    assert s2.f05 == pytest.approx(0.625)  # f05 stays F0.5 whatever beta is


def test_scores_recall_weighted_case() -> None:
    # tp 2, fp 3, fn 0: P = 0.4, R = 1, F0.5 = 1.25 * 0.4 / (0.25 * 0.4 + 1) = 0.5 / 1.1.
    s = ged_scores([1, 1, 0, 0, 0], [1, 1, 1, 1, 1])
    assert (s.precision, s.recall) == (0.4, 1.0)
    assert s.f05 == pytest.approx(0.5 / 1.1)


@pytest.mark.parametrize(
    ("gold", "pred", "p", "r"),
    [
        ([0, 0, 0], [0, 0, 0], 0.0, 0.0),  # nothing predicted, no gold error
        ([1, 0, 1], [0, 0, 0], 0.0, 0.0),  # nothing predicted
        ([0, 0, 0], [1, 0, 1], 0.0, 0.0),  # no gold error
        ([1, 0, 0], [0, 1, 0], 0.0, 0.0),  # tp = 0
        ([], [], 0.0, 0.0),  # no token
    ],
)
def test_scores_zero_division_is_zero(gold: list[int], pred: list[int], p: float, r: float) -> None:
    s = ged_scores(gold, pred)
    assert (s.precision, s.recall, s.f05, s.fbeta) == (p, r, 0.0, 0.0)


def test_scores_per_sentence_input_and_arrays() -> None:
    gold = [(1, 0), (1, 1, 0, 0)]
    pred = [[1, 1], [0, 1, 0, 0]]
    flat = ged_scores([1, 0, 1, 1, 0, 0], [1, 1, 0, 1, 0, 0])
    assert ged_scores(gold, pred) == flat
    assert ged_scores(np.array([1, 0, 1, 1, 0, 0]), np.array([True, True, False, True, False, False])) == flat
    assert flatten([np.array([1, 0]), [1]]).tolist() == [1, 0, 1]


def test_scores_input_errors() -> None:
    with pytest.raises(ValueError, match="6 labels but pred has 5"):
        ged_scores([1, 0, 1, 1, 0, 0], [1, 1, 0, 1, 0])
    with pytest.raises(ValueError, match="sentence 1"):
        ged_scores([[1, 0], [1, 1, 0]], [[1, 1], [1, 1, 0, 0]])
    with pytest.raises(ValueError, match="2 sentences but pred has 1"):
        ged_scores([[1, 0], [1]], [[1, 0, 1]])
    with pytest.raises(ValueError, match="gold labels must be 0 or 1"):
        ged_scores([0.7, 0], [1, 0])
    with pytest.raises(ValueError, match="pred labels must be 0 or 1"):
        ged_scores([1, 0], [2, 0])


def test_to_dict_is_json_ready() -> None:
    d = ged_scores([1, 0, 1, 1, 0, 0], [1, 1, 0, 1, 0, 0]).to_dict()
    assert set(d) == {"tp", "fp", "fn", "tn", "precision", "recall", "f05", "beta", "fbeta"}
    assert (d["tp"], d["fp"], d["fn"], d["tn"], d["beta"]) == (2, 1, 1, 2, 0.5)
    json.dumps(d)
    assert GedScores.from_counts(2, 1, 1, 2) == ged_scores([1, 0, 1, 1, 0, 0], [1, 1, 0, 1, 0, 0])


def test_f_beta_formula() -> None:
    assert f_beta(0, 0, 0) == 0.0
    assert f_beta(1, 0, 1) == pytest.approx(1.25 / 1.5)
    assert f_beta(3, 2, 1, beta=1.0) == pytest.approx(2 * 3 / (2 * 3 + 1 + 2))


def test_best_threshold_tiny() -> None:
    # Thresholds and (tp, fp, fn) -> F0.5:
    #   0.9: (1, 0, 1) -> 1.25 / 1.5  = 0.833  <- best
    #   0.8: (1, 1, 1) -> 1.25 / 2.5  = 0.5
    #   0.4: (2, 1, 0) -> 2.5 / 3.5   = 0.714
    #   0.1: (2, 2, 0) -> 2.5 / 4.5   = 0.556
    thr, s = best_threshold([1, 0, 1, 0], [0.9, 0.8, 0.4, 0.1])
    assert thr == 0.9
    assert (s.tp, s.fp, s.fn, s.tn) == (1, 0, 1, 2)
    assert s.f05 == pytest.approx(1.25 / 1.5)
    # With F1 the lower threshold 0.4 wins: F1 = 4 / 5 = 0.8 > 2 / 3.
    thr1, s1 = best_threshold([1, 0, 1, 0], [0.9, 0.8, 0.4, 0.1], beta=1.0)
    assert thr1 == 0.4 and s1.fbeta == pytest.approx(0.8)


def test_best_threshold_tie_goes_to_higher_threshold() -> None:
    # Sorted by probability, gold = 1 1 0 1 1:
    #   0.8: (2, 0, 2) -> 2.5 / 3.0 = 0.8333;  0.5: (4, 1, 0) -> 5.0 / 6.0 = 0.8333 -> pick 0.8.
    probs = [0.5, 0.9, 0.6, 0.8, 0.7]  # unsorted on purpose
    gold = [1, 1, 1, 1, 0]
    thr, s = best_threshold(gold, probs)
    assert thr == 0.8
    assert (s.tp, s.fp, s.fn) == (2, 0, 2)
    assert s == ged_scores(gold, [0, 1, 0, 1, 0])
    assert s.f05 == ged_scores(gold, [1, 1, 1, 1, 1]).f05  # the lower threshold 0.5 ties exactly


def test_best_threshold_repeated_probabilities_and_no_gold_error() -> None:
    # Equal probabilities are one candidate: 0.7 selects both tokens at once.
    thr, s = best_threshold([[1, 0], [1, 0]], [[0.7, 0.7], [0.2, 0.1]])
    # 0.7: (1, 1, 1) -> 1.25 / 2.5 = 0.5; 0.2: (2, 1, 0) -> 2.5 / 3.5 = 0.714; 0.1: (2, 2, 0) -> 0.556
    assert thr == 0.2 and (s.tp, s.fp, s.fn) == (2, 1, 0)
    thr0, s0 = best_threshold([0, 0, 0], [0.3, 0.9, 0.1])
    assert thr0 == 0.9 and s0.f05 == 0.0


def test_best_threshold_matches_brute_force() -> None:
    rng = np.random.default_rng(0)
    for _ in range(30):
        n = int(rng.integers(1, 60))
        gold = rng.integers(0, 2, n)
        probs = np.round(rng.random(n), 1)  # many repeated values
        thr, s = best_threshold(gold, probs)
        cands = sorted(set(probs.tolist()), reverse=True)
        fs = [ged_scores(gold, probs >= t).f05 for t in cands]
        best = max(fs)
        assert thr == cands[fs.index(best)]
        assert s == ged_scores(gold, probs >= thr)


def test_best_threshold_input_errors() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        best_threshold([], [])
    with pytest.raises(ValueError, match="NaN"):
        best_threshold([1, 0], [0.5, float("nan")])
    with pytest.raises(ValueError, match="2 labels but error_probs has 3"):
        best_threshold([1, 0], [0.5, 0.2, 0.1])
