"""bench/ged_teacher_fit.py: how closely a teacher's probabilities follow the gold labels."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench_scripts import load_bench_script


def test_fit_against_a_hand_count():
    tf = load_bench_script("ged_teacher_fit")
    gold = np.array([1, 1, 0, 0, 1], dtype=np.float32)
    q = np.array([0.9, 0.2, 0.6, 0.1, 0.7], dtype=np.float32)
    r = tf.fit(q, gold)
    p, rec = 2 / 3, 2 / 3  # tp 2 (0.9, 0.7), fp 1 (0.6), fn 1 (0.2)
    assert r["precision"] == pytest.approx(p) and r["recall"] == pytest.approx(rec)
    assert r["f05"] == pytest.approx(1.25 * p * rec / (0.25 * p + rec))
    assert r["mean_abs_q_minus_gold"] == pytest.approx((0.1 + 0.8 + 0.6 + 0.1 + 0.3) / 5)
    h = [-(x * math.log(x) + (1 - x) * math.log(1 - x)) for x in map(float, q)]
    assert r["mean_entropy"] == pytest.approx(sum(h) / 5, rel=1e-6)
    perfect = tf.fit(gold.copy(), gold)
    assert perfect["f05"] == 1.0 and perfect["mean_abs_q_minus_gold"] == 0.0
