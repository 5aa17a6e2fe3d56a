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


def test_rows_are_kept_and_equal_a_fresh_computation():
    """A text read twice (a scorer's score, then its advisories) is computed once, to the same
    row; a row read from the cache cannot be changed through the returned array."""
    from mhmla_fast.aes import surface

    texts = [f"Essay number {i}, with words of some length." for i in range(3)]
    surface._surface_row.cache_clear()
    first = surface_features(texts)
    first[:] = -1.0  # the caller's array, not the kept rows
    again = surface_features(texts)
    info = surface._surface_row.cache_info()
    assert (info.misses, info.hits) == (3, 3)
    surface._surface_row.cache_clear()
    assert np.array_equal(again, surface_features(texts)) and (again > -1).all()
    assert surface.CACHED_ESSAYS >= 64  # above a `mhmla-serve score` batch (--batch-essays)


def test_a_score_call_reads_each_essays_features_once(monkeypatch):
    """``score_essays`` with advisories: the offsets and the advisories read one row per
    essay (the second read a cache hit); the advisories are those of a fresh computation."""
    from mhmla_fast.aes import surface
    from mhmla_fast.serve.score import default_scorer_path, load_scorer, score_essays

    scorer = load_scorer(default_scorer_path(), backend="torch", threads=1)
    essays = ["because " * 300, "Computers help us learn, and they help us talk with friends."]
    surface._surface_row.cache_clear()
    results = score_essays(scorer, essays, [4, 1])
    info = surface._surface_row.cache_info()
    assert (info.misses, info.hits) == (2, 2), info
    assert "advisories" in results[0] and "advisories" not in results[1]
