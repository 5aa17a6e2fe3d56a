"""Artificial errors for GED training (mhmla_fast.ged.synthetic): what each edit does to the
words and labels, that copies are made of error-free sentences only and are reproducible, and
that a training run trains on them and refuses to resume with other ones."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from mhmla_fast.ged.data import Sentence
from mhmla_fast.ged.synthetic import (CONFUSIONS, EDIT_WEIGHTS, _edit, corrupt,
                                      with_synthetic_errors)
from mhmla_fast.ged.train import TrainConfig, length_bucketed_batches, train
from test_ged_train import config, tiny_encoder  # noqa: F401  (the fixture)


def sent(text: str, labels=None) -> Sentence:
    tokens = tuple(text.split())
    return Sentence(tokens, tuple(labels or [0] * len(tokens)), "t.tsv", 1)


def edit(text: str, k: int, kind: str, seed: int = 0):
    tokens, labels = text.split(), [0] * len(text.split())
    ok = _edit(tokens, labels, k, kind, random.Random(seed))
    return ok, " ".join(tokens), labels


def test_each_edit_kind_changes_the_words_and_labels_by_the_fce_convention():
    # a deleted function word marks the word after the gap
    assert edit("I look forward to hearing", 3, "delete") == (True, "I look forward hearing",
                                                              [0, 0, 0, 1])
    # an inserted word is the error
    ok, text, labels = edit("she went home", 1, "insert")
    assert ok and len(text.split()) == 4 and labels == [0, 1, 0, 0]
    assert text.split()[1] != "she"
    # a swap marks both words
    assert edit("she went home", 1, "swap") == (True, "she home went", [0, 1, 1])
    # a confusion keeps the set and the capital
    ok, text, labels = edit("The cat", 0, "confusion")
    assert ok and text.split()[0] in ("A", "An") and labels == [1, 0]
    # a typo and an inflection change the word
    for kind in ("spelling", "inflection"):
        ok, text, labels = edit("she walked home", 1, kind)
        assert ok and text.split()[1] != "walked" and labels == [0, 1, 0], (kind, text)
    ok, text, _ = edit("she walked home", 1, "inflection")
    assert text.split()[1] in ("walk", "walks", "walking", "walkeds", "walkeded", "walkeding")
    # a comma: removed (the next word marked) or inserted
    assert edit("Yes , please", 1, "comma") == (True, "Yes please", [0, 1])
    assert edit("Yes please", 1, "comma") == (True, "Yes , please", [0, 1, 0])


def test_an_edit_that_does_not_apply_leaves_the_sentence_alone():
    for text, k, kind in [("house", 0, "confusion"),      # no confusion set
                          ("to", 0, "delete"),            # no word after the gap
                          ("cat dog", 0, "delete"),       # not a function word
                          ("the cat", 0, "insert"),       # never before the first word
                          ("cat cat", 0, "swap"),         # the same word twice
                          ("an , b", 0, "spelling")]:     # too short
        assert edit(text, k, kind) == (False, text, [0] * len(text.split())), (text, kind)
    with pytest.raises(ValueError, match="unknown edit kind 'typo'"):
        edit("the cat", 0, "typo")


def test_confusion_sets_are_symmetric_and_never_map_a_word_to_itself():
    for word, others in CONFUSIONS.items():
        assert word not in others
        for other in others:
            assert word in CONFUSIONS[other]


def test_copies_of_error_free_sentences_only_each_with_an_error_and_reproducible():
    rng = random.Random(0)
    words = "the a to of in on cat dog went goes house , and is are very much".split()
    data = [sent(" ".join(rng.choice(words) for _ in range(rng.randint(2, 20))))
            for _ in range(300)]
    data += [sent("the cat go", [0, 0, 1]), sent("alone")]
    out = with_synthetic_errors(data, 0.1, seed=4)
    assert out[:len(data)] == data
    copies = out[len(data):]
    assert len(copies) == 300  # not the sentence with an error, nor the one-word one
    assert all(s.has_error and s.source == "t.tsv (synthetic)" for s in copies)
    assert out == with_synthetic_errors(data, 0.1, seed=4)
    assert out != with_synthetic_errors(data, 0.1, seed=5)
    # the edit rate: about rate x words edits per copy (at least one)
    rate = sum(map(sum, (s.labels for s in copies))) / sum(len(s) for s in copies)
    assert 0.08 < rate < 0.25
    assert set(EDIT_WEIGHTS) == {"spelling", "confusion", "inflection", "delete", "insert",
                                 "swap", "comma"}
    assert with_synthetic_errors(data, 0.0, seed=4) == data
    with pytest.raises(ValueError, match=r"synthetic_errors: expected an edit rate per word in \[0, 1\)"):
        with_synthetic_errors(data, 1.0, seed=4)


def test_corrupt_gives_up_when_no_edit_applies():
    # a single two-letter word: no kind applies (inserts never go before the first word)
    s = sent("xy")
    assert corrupt(s, 0.5, random.Random(0), tries=50) == Sentence(("xy",), (0,), "t.tsv (synthetic)", 1)


def test_a_run_trains_on_the_copies_and_resumes_only_with_the_same_ones(tmp_path, tiny_encoder):  # noqa: F811
    with pytest.raises(ValueError, match=r"synthetic_errors: expected an edit rate per word"):
        config(tmp_path, tiny_encoder, tmp_path / "bad", synthetic_errors=-0.1)
    plain = config(tmp_path, tiny_encoder, tmp_path / "plain", epochs=1)
    cfg = config(tmp_path, tiny_encoder, tmp_path / "run", epochs=1, synthetic_errors=0.15)
    # a whole epoch: the run steps through the real sentences and the copies
    from mhmla_fast.ged.data import read_ged
    real = read_ged(cfg.train)
    n_copies = sum(1 for s in real if not s.has_error and len(s) >= 2)
    assert n_copies > 0
    steps = [len(length_bucketed_batches([1] * n, 8, 3, 0)) for n in (len(real), len(real) + n_copies)]
    assert steps[1] > steps[0]
    for run, n_steps in zip((plain, cfg), steps):
        train(run)
        meta = json.loads((Path(run.out) / "checkpoint.json").read_text())
        assert meta["global_step"] == n_steps, run.out
    assert set(meta["data"]) == {"train", "dev", "train_synthetic"}
    # other artificial errors (the generator changed between kill and resume) are refused
    meta["data"]["train_synthetic"] = "0" * 64
    (tmp_path / "run" / "checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="the train_synthetic data differ"):
        train(cfg)
    # another rate is another run
    other = config(tmp_path, tiny_encoder, tmp_path / "run", epochs=1, synthetic_errors=0.2)
    with pytest.raises(ValueError, match="a checkpoint of a different run exists.*synthetic"):
        train(other)
    assert TrainConfig(train="t", dev="d", out="o").synthetic_errors == 0.0
