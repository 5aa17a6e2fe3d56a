"""bench/aes_char_tfidf_probe.py: inside its protocol run the word TF-IDF vectoriser is the
character one (whatever word settings the protocol passes), and it is put back afterwards."""

from __future__ import annotations

import sklearn.feature_extraction.text as text

from tests.bench_scripts import load_bench_script

probe = load_bench_script("aes_char_tfidf_probe")


def test_units_swaps_in_character_ngrams_for_the_protocol_run(tmp_path, monkeypatch):
    from mhmla_fast.aes import protocol
    from mhmla_fast.aes.registry import MODELS

    words = text.TfidfVectorizer
    seen = {}

    def run_cpu_protocol(**kw):  # what baselines._tfidf_cuts builds inside the real run
        vec = text.TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True)
        vec.fit(["cats sat", "cats ran", "dogs sat"])
        seen.update(kw, vocabulary=set(vec.vocabulary_))

    monkeypatch.setattr(protocol, "run_cpu_protocol", run_cpu_protocol)
    monkeypatch.delitem(MODELS, probe.C, raising=False)
    probe.units(tmp_path / "run", tmp_path / "cache")
    assert seen["models"] == [probe.C] and MODELS[probe.C].kind == "tfidf" and MODELS[probe.C].cuts
    assert " ca" in seen["vocabulary"] and "sat " in seen["vocabulary"]  # char_wb 2-5 grams
    assert max(map(len, seen["vocabulary"])) == 5 and "cats sat" not in seen["vocabulary"]
    assert text.TfidfVectorizer is words
    monkeypatch.delitem(MODELS, probe.C)
