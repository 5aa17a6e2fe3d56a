"""Surface features of essays, against counts done by hand."""

from __future__ import annotations

import math

import numpy as np

from mhmla_fast.aes.surface import SURFACE_FEATURES, surface_features


def test_counts_by_hand():
    text = "Dear @CAPS1, I don't think computers hurt us. They help! Do they?"
    f = dict(zip(SURFACE_FEATURES, surface_features([text])[0]))
    words = ["Dear", "CAPS1", "I", "don't", "think", "computers", "hurt", "us", "They", "help",
             "Do", "they"]
    assert f["log_words"] == math.log1p(len(words))
    assert f["log_chars"] == math.log1p(len(text))
    assert f["log_sentences"] == math.log1p(3)
    assert f["log_distinct"] == math.log1p(11)  # "They" and "they" are one word
    assert f["distinct_ratio"] == 11 / 12
    assert f["mean_word_length"] == sum(map(len, words)) / 12
    assert f["long_word_share"] == 1 / 12  # "computers"
    assert f["log_commas"] == math.log1p(1) and f["log_anonymised"] == math.log1p(1)


def test_empty_and_shape():
    X = surface_features(["", "   ", "one", "no end mark"])
    assert X.shape == (4, len(SURFACE_FEATURES)) and X.dtype == np.float64
    assert (X[0] == 0).all()
    assert X[1, 1] == math.log1p(3) and (np.delete(X[1], 1) == 0).all()  # blanks: only characters
    assert X[2, 2] == math.log1p(1) and X[3, 2] == math.log1p(1)  # a sentence without a full stop
    assert surface_features([]).shape == (0, len(SURFACE_FEATURES))
