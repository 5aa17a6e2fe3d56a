"""Score cutpoints fitted for QWK (``mhmla_fast.aes.cutpoints``) and the ridge that uses them,
and the grammatical-error features of essays (``mhmla_fast.aes.ged_features``) with the
serving engine's essay tagger."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mhmla_fast.aes.baselines import ridge_layers, ridge_select_cutpoints
from mhmla_fast.aes.cutpoints import (apply_cutpoints, cross_fitted_cut_scores, fit_cutpoints,
                                      out_of_fold_predictions, rounding_cutpoints)
from mhmla_fast.aes.data import SCORE_RANGES, denormalise_scores
from mhmla_fast.aes.ensembles import (blend_values, greedy_blend, pick_weights, stack_blend,
                                      stack_weights)
from mhmla_fast.aes.ged_features import (GED_FEATURES, features_from_probs, ged_feature_cache,
                                         ged_features)
from mhmla_fast.aes.metrics import quadratic_weighted_kappa
from test_aes_train import synthetic_split, tiny_encoder  # noqa: F401 - tiny_encoder: the fixture


@pytest.mark.parametrize("prompt", [1, 3, 8])
def test_rounding_cutpoints_round_half_up_as_denormalise(prompt):
    lo, hi = SCORE_RANGES[prompt]
    rng = np.random.default_rng(prompt)
    a = rng.uniform(-0.2, 1.2, 500)
    a = a[np.abs((a * (hi - lo)) % 1 - 0.5) > 1e-6]  # no exact ties: float rounding may differ
    x = lo + a * (hi - lo)
    got = apply_cutpoints(x, rounding_cutpoints(prompt), prompt)
    assert got.tolist() == denormalise_scores(a, prompt).tolist()


def test_apply_cutpoints_refuses_bad_cutpoints_and_scores():
    with pytest.raises(ValueError, match="expected 3 cutpoints"):
        apply_cutpoints(np.zeros(2), np.zeros(2), 3)
    with pytest.raises(ValueError, match="non-decreasing"):
        apply_cutpoints(np.zeros(2), np.array([0.5, 2.5, 1.5]), 3)
    with pytest.raises(ValueError, match="non-finite"):
        apply_cutpoints(np.array([np.nan]), rounding_cutpoints(3), 3)


def test_fitted_cutpoints_undo_a_shrunk_prediction():
    """Predictions pulled toward the middle (as a ridge's are) round into the middle scores;
    fitted cutpoints recover the order exactly, and never score below rounding."""
    rng = np.random.default_rng(0)
    gold = rng.integers(0, 4, 300)  # prompt 3: 0..3
    x = 1.5 + 0.3 * (gold - 1.5) + rng.uniform(-0.1, 0.1, 300)  # ordered, but squeezed
    rounded = quadratic_weighted_kappa(gold, apply_cutpoints(x, rounding_cutpoints(3), 3), 0, 3)
    cuts = fit_cutpoints(x, gold, 3)
    fitted = quadratic_weighted_kappa(gold, apply_cutpoints(x, cuts, 3), 0, 3)
    assert rounded < 0.8 and fitted == 1.0
    assert np.all(np.diff(cuts) >= 0)
    # where rounding is already perfect, the cutpoints stay where rounding puts them
    exact = gold + rng.uniform(-0.3, 0.3, 300)
    np.testing.assert_array_equal(fit_cutpoints(exact, gold, 3), rounding_cutpoints(3))


def test_fit_cutpoints_reaches_the_best_single_cut_found_by_brute_force():
    """Two scores (one cutpoint): coordinate ascent is exhaustive over the candidates, so it
    must equal a brute-force search over every cut between two sorted predictions."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=80)
    gold = (x + rng.normal(scale=1.0, size=80) > 0.8).astype(int)
    # prompt 3 has 4 scores; use two of them by putting the other cuts out of reach
    best = max(quadratic_weighted_kappa(gold, (x >= c).astype(int), 0, 3)
               for c in np.concatenate([[x.min() - 1], (np.sort(x)[1:] + np.sort(x)[:-1]) / 2]))
    cuts = fit_cutpoints(x, gold, 3)
    got = quadratic_weighted_kappa(gold, apply_cutpoints(x, cuts, 3), 0, 3)
    assert got >= best - 1e-12


def _fit_trial_by_trial(x, gold, prompt, sweeps=10, max_candidates=256):
    """The coordinate ascent of the module doc, one trial at a time: every candidate's cut
    scores built and scored by ``quadratic_weighted_kappa`` (what ``fit_cutpoints`` did before
    it scored a cutpoint's candidates together from integer sums)."""
    lo, hi = SCORE_RANGES[prompt]
    cuts = rounding_cutpoints(prompt)

    def score(c):
        return quadratic_weighted_kappa(gold, apply_cutpoints(x, c, prompt), lo, hi)

    xs = np.unique(x)
    spots = np.concatenate([[xs[0] - 1.0], (xs[1:] + xs[:-1]) / 2 if xs.size > 1 else xs,
                            [xs[-1] + 1.0]])
    best = score(cuts)
    for _ in range(sweeps):
        gained = False
        for i in range(cuts.size):
            left = cuts[i - 1] if i > 0 else -np.inf
            right = cuts[i + 1] if i + 1 < cuts.size else np.inf
            cand = spots[(spots >= left) & (spots <= right)]
            if cand.size > max_candidates:
                cand = cand[np.linspace(0, cand.size - 1, max_candidates).round().astype(int)]
            for c in cand:
                trial = cuts.copy()
                trial[i] = c
                q = score(trial)
                if c != cuts[i] and q > best + 1e-12:
                    best, cuts, gained = q, trial, True
        if not gained:
            break
    return cuts


@pytest.mark.parametrize("prompt", [1, 3, 7, 8])
def test_fit_cutpoints_equals_the_trial_by_trial_ascent(prompt):
    """Scoring a cutpoint's candidates together from integer sums chooses exactly what scoring
    them one trial at a time by ``quadratic_weighted_kappa`` chooses: noisy, tied (rounded),
    constant and half-point predictions (essays exactly on a cutpoint), small and large sets,
    scales of 4 to 61 scores (prompt 8's candidates subsampled to 256)."""
    lo, hi = SCORE_RANGES[prompt]
    rng = np.random.default_rng(prompt)
    for case in range(16):
        n = int(rng.integers(2, 500))
        gold = rng.integers(lo, hi + 1, size=n)
        x = [gold + rng.normal(0, rng.uniform(0.2, 0.3 * (hi - lo) + 1), n),
             np.round(lo + 0.6 * (gold - lo) + rng.normal(0, 1, n)),
             np.full(n, float(rng.uniform(lo, hi))),
             # on the half points, where rounding's cutpoints sit: essays on a cutpoint
             np.round(2 * (gold + rng.normal(0, 1, n))) / 2][case % 4]
        np.testing.assert_array_equal(fit_cutpoints(x, gold, prompt),
                                      _fit_trial_by_trial(x, gold, prompt))


def test_out_of_fold_predictions_never_predict_a_group_from_itself():
    groups = np.repeat(np.arange(23), 1 + np.arange(23) % 3)  # 1-3 windows per essay
    seen = {}

    def fit(train_rows):
        train_groups = set(groups[train_rows].tolist())

        def predict(held):
            for g in groups[held]:
                assert g not in train_groups  # an essay's windows stay in one fold
                seen[g] = seen.get(g, 0) + 1
            return np.stack([held.astype(float), -held.astype(float)], axis=1)
        return predict

    out = out_of_fold_predictions(fit, groups, n_folds=5)
    assert out.shape == (len(groups), 2)
    np.testing.assert_array_equal(out[:, 0], np.arange(len(groups)))  # every row, once
    assert sorted(seen) == list(range(23))
    with pytest.raises(ValueError, match="3 groups for 5 folds"):
        out_of_fold_predictions(fit, np.array([0, 1, 2]), n_folds=5)


def test_cross_fitted_cut_scores_never_see_an_essays_own_score():
    """Each essay is cut at cutpoints fitted on the other folds: changing one essay's gold
    score changes no score of its own fold, while the squeezed predictions of
    test_fitted_cutpoints_undo_a_shrunk_prediction still get back far above rounding."""
    rng = np.random.default_rng(1)
    gold = rng.integers(0, 4, 120)
    x = 1.5 + 0.3 * (gold - 1.5) + rng.uniform(-0.1, 0.1, 120)
    got = cross_fitted_cut_scores(x, gold, 3)
    assert got.dtype == np.int64 and got.shape == (120,)
    rounded = quadratic_weighted_kappa(gold, apply_cutpoints(x, rounding_cutpoints(3), 3), 0, 3)
    assert quadratic_weighted_kappa(gold, got, 0, 3) > max(0.95, rounded + 0.2)
    fold = out_of_fold_predictions(lambda rows: (lambda held: np.full(held.size, float(
        held.min()))), np.arange(120))  # a row's fold, named by the fold's first row
    for i in (0, 7, 63):
        moved = gold.copy()
        moved[i] = 3 - gold[i]
        again = cross_fitted_cut_scores(x, moved, 3)
        same_fold = np.flatnonzero(fold == fold[i])
        np.testing.assert_array_equal(again[same_fold], got[same_fold])
    # the same folds as fitting by hand on the rest of each fold
    held = np.flatnonzero(fold == fold[0])
    rest = np.setdiff1d(np.arange(120), held)
    by_hand = apply_cutpoints(x[held], fit_cutpoints(x[rest], gold[rest], 3), 3)
    np.testing.assert_array_equal(got[held], by_hand)
    with pytest.raises(ValueError, match="one length"):
        cross_fitted_cut_scores(x, gold[:-1], 3)


def test_ridge_with_cutpoints_beats_rounding_a_heavily_shrunk_ridge():
    """At a large alpha the ridge's predictions shrink toward the mean score, and rounding
    then loses the extremes; cutpoints fitted on out-of-fold training predictions (dev and
    test unseen) put them back."""
    tr, dv, te = (synthetic_split(n, 1, s) for n, s in ((300, 0), (100, 1), (100, 2)))
    alphas = (3e4,)
    plain = ridge_layers(tr, dv, te, 1, alphas=alphas)
    cut = ridge_layers(tr, dv, te, 1, alphas=alphas, cuts=True)
    q = lambda r: quadratic_weighted_kappa(te.scores, r["test_pred"], 2, 12)  # noqa: E731
    assert q(cut) > q(plain) + 0.05 and cut["dev_qwk"] > plain["dev_qwk"]
    assert len(cut["selected"]["cutpoints"]) == 10
    lo, hi = SCORE_RANGES[1]
    assert cut["test_pred"].min() >= lo and cut["test_pred"].max() <= hi
    # the continuous predictions a blend needs, the scores being them cut
    x = cut["continuous"]
    assert [len(x[k]) for k in ("train_oof", "dev", "test")] == [300, 100, 100]
    for split, pred in (("dev", "dev_pred"), ("test", "test_pred")):
        np.testing.assert_array_equal(
            apply_cutpoints(np.array(x[split]), np.array(cut["selected"]["cutpoints"]), 1),
            cut[pred])
    assert "continuous" not in plain


def test_ridge_cutpoints_choose_alpha_on_dev_and_ties_go_to_the_larger():
    tr, dv, te = (synthetic_split(n, 3, s) for n, s in ((120, 0), (40, 1), (40, 2)))
    X = lambda s: s.features[:, 1:].reshape(len(s.features), -1).double().numpy()  # noqa: E731
    y = (tr.scores[tr.essay_index] - 0) / 3.0
    r = ridge_select_cutpoints(
        X(tr), y, tr.essay_index, tr.scores, X(dv), dv.essay_index, dv.scores, 3,
        alphas=(0.1, 1.0, 10.0))
    assert r.dev_qwk == 1.0 and r.alpha == 10.0  # all three perfect on dev: the simplest
    assert r.predict(X(te), te.essay_index, len(te.ids)).tolist() == te.scores.tolist()
    assert r.cutpoints.shape == (3,)
    # the scores are the continuous values cut; the cutpoints were fitted on the out-of-fold
    # training values, which are each essay's prediction by a ridge that did not see it
    x_te = r.values(X(te), te.essay_index, len(te.ids))
    np.testing.assert_array_equal(r.predict(X(te), te.essay_index, len(te.ids)),
                                  apply_cutpoints(x_te, r.cutpoints, 3))
    assert r.train_oof.shape == (len(tr.ids),)
    np.testing.assert_array_equal(r.cutpoints, fit_cutpoints(r.train_oof, tr.scores, 3))
    in_sample = r.values(X(tr), tr.essay_index, len(tr.ids))
    assert not np.allclose(r.train_oof, in_sample)


def test_greedy_blend_picks_on_dev_and_fits_cutpoints_on_the_training_blend():
    """Two members with independent noise blend into a better one than either; a member of
    pure noise is left out; the blend's cutpoints are those fitted on the same blend of the
    members' out-of-fold training predictions (dev only picks)."""
    rng = np.random.default_rng(0)
    gold = {s: rng.integers(0, 4, n) for s, n in (("train", 400), ("dev", 200))}

    def member(noise: float):  # shrunk toward the mean, as a ridge's predictions are
        return [1.5 + 0.5 * (gold[s] - 1.5) + rng.normal(0, noise, gold[s].size)
                for s in ("train", "dev")]

    a, b, junk = member(0.35), member(0.35), [rng.uniform(0, 3, gold[s].size)
                                              for s in ("train", "dev")]
    train, dev = [m[0] for m in (junk, a, b)], [m[1] for m in (junk, a, b)]
    picks, cuts = greedy_blend(train, dev, gold["train"], gold["dev"], 3)
    assert {1, 2} <= set(picks) and 0 not in picks
    np.testing.assert_array_equal(
        cuts, fit_cutpoints(blend_values(train, pick_weights(picks, 3)), gold["train"], 3))

    def dev_qwk(ps):
        w = pick_weights(ps, 3)
        c = fit_cutpoints(blend_values(train, w), gold["train"], 3)
        return quadratic_weighted_kappa(gold["dev"], apply_cutpoints(
            blend_values(dev, w), c, 3), 0, 3)

    assert dev_qwk(picks) > max(dev_qwk([1]), dev_qwk([2])) + 0.02
    np.testing.assert_allclose(pick_weights([1, 2, 2], 3), [0, 1 / 3, 2 / 3])
    np.testing.assert_allclose(blend_values(dev, [0, 1 / 3, 2 / 3]), (dev[1] + 2 * dev[2]) / 3)
    with pytest.raises(ValueError, match="greedy_blend"):
        greedy_blend(train, dev[:2], gold["train"], gold["dev"], 3)
    with pytest.raises(ValueError, match="3 members"):
        blend_values(dev, [0.5, 0.5])

    # the stack sees the training essays only: the noise member gets (almost) nothing, the two
    # others about half each, and its cutpoints are fitted on the stacked training predictions
    w, cuts = stack_blend(train, gold["train"], 3)
    assert w.sum() == pytest.approx(1.0) and (w >= 0).all()
    assert w[0] < 0.05 and abs(w[1] - w[2]) < 0.2
    np.testing.assert_array_equal(cuts, fit_cutpoints(blend_values(train, w), gold["train"], 3))
    stacked = quadratic_weighted_kappa(gold["dev"], apply_cutpoints(blend_values(dev, w), cuts, 3),
                                       0, 3)
    assert stacked > max(dev_qwk([1]), dev_qwk([2])) + 0.02
    # against a hand computation: a least-squares fit of the two good members, both weights
    # positive, so the non-negativity binds nowhere and NNLS is plain least squares
    X = np.stack([train[1], train[2]], 1)
    ls = np.linalg.lstsq(X - X.mean(0), gold["train"] - gold["train"].mean(), rcond=None)[0]
    np.testing.assert_allclose(stack_weights(train[1:], gold["train"]), ls / ls.sum(), atol=1e-10)
    # no member predicts the scores: equal weights
    np.testing.assert_allclose(stack_weights([-gold["train"], -2.0 * gold["train"]],
                                             gold["train"]), [0.5, 0.5])


# ------------------------------------------------------------ grammatical-error features


def test_features_from_probs_by_hand():
    probs = [np.array([0.1, 0.9, 0.2]), np.array([0.6]), np.array([0.0, 0.3])]
    f = dict(zip(GED_FEATURES, features_from_probs(probs, 0.5)))
    assert f["error_share"] == pytest.approx(2 / 6)
    assert f["mean_error_prob"] == pytest.approx(2.1 / 6)
    assert f["log_errors"] == pytest.approx(np.log1p(2))
    assert f["error_sentence_share"] == pytest.approx(2 / 3)
    assert f["errors_per_sentence"] == pytest.approx(2 / 3)
    assert features_from_probs([], 0.5).tolist() == [0.0] * len(GED_FEATURES)


class _WordTagger:
    """A stand-in tagger: a word's error probability is 0.9 if it is "goes", else 0.1."""

    def __init__(self, model_dir):
        self.model_dir, self.threshold, self.calls = Path(model_dir), 0.5, 0

    def __call__(self, texts, progress=None):
        self.calls += 1
        return [[np.array([0.9 if w == "goes" else 0.1 for w in s.split()])
                 for s in t.split(".") if s.strip()] for t in texts]


def test_ged_feature_cache_computes_once_per_tagger_and_essays(tmp_path):
    model = tmp_path / "tagger"
    model.mkdir()
    (model / "config.json").write_text("{}")
    tagger = _WordTagger(model)
    texts = ["he goes home. she goes", "we go home. they go"]
    a = ged_feature_cache([1, 2], texts, tmp_path / "cache", tagger)
    np.testing.assert_array_equal(a, ged_features(texts, tagger))
    assert a[0, 0] == pytest.approx(2 / 5) and a[1, 0] == 0.0
    calls = tagger.calls
    b = ged_feature_cache([1, 2], texts, tmp_path / "cache", tagger)
    assert tagger.calls == calls and np.array_equal(a, b)  # read back, not recomputed
    ged_feature_cache([1, 2], [texts[0], "they goes"], tmp_path / "cache", tagger)
    assert tagger.calls == calls + 1  # another essay text: computed afresh
    (model / "config.json").write_text('{"changed": 1}')
    ged_feature_cache([1, 2], texts, tmp_path / "cache", tagger)
    assert tagger.calls == calls + 2  # another tagger under the same folder: afresh
    maker_calls = []
    ged_feature_cache([1, 2], texts, tmp_path / "cache",
                      lambda: maker_calls.append(1) or tagger, model_dir=model)
    assert maker_calls == []  # a maker is called only when the cache lacks the essays
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="is not"):
        ged_feature_cache([3], ["x"], tmp_path / "cache", lambda: tagger, model_dir=other)


def test_engine_essay_tagger_gives_the_engines_probabilities_per_sentence(tiny_tagger_dir):
    from mhmla_fast.serve.engine import Engine
    from mhmla_fast.serve.essays import EngineEssayTagger, essay_sentences

    tagger = EngineEssayTagger(tiny_tagger_dir, backend="torch", chunk=3)
    texts = ["He go to school . She like it ! Why ?", "", "One sentence without an end"]
    got = tagger(texts)
    assert [len(g) for g in got] == [3, 0, 1]
    engine = Engine.load(tiny_tagger_dir, backend="torch")
    for text, per_sentence in zip(texts, got):
        want = engine.tag_tokens(essay_sentences(text)) if essay_sentences(text) else []
        assert len(per_sentence) == len(want)
        for q, r in zip(per_sentence, want):
            np.testing.assert_allclose(q, r.probs, rtol=0, atol=1e-6)
    assert tagger.threshold == engine.threshold


# ------------------------------------------------------------------ a scorer's cutpoints


def test_scorer_config_cutpoints_are_validated_and_round_trip():
    from mhmla_fast.aes.model import ScorerConfig

    cfg = ScorerConfig(objective="regression", prompts=(3, 4),
                       cutpoints={"3": [0.4, 1.6, 2.5], 4: (0.5, 1.5, 2.5)})
    assert cfg.cutpoints == {3: (0.4, 1.6, 2.5), 4: (0.5, 1.5, 2.5)}
    assert ScorerConfig.from_json(cfg.to_json()).cutpoints == cfg.cutpoints
    assert "cutpoints" not in ScorerConfig(objective="regression").to_json()  # as before
    for bad, message in (
            (dict(objective="classification", cutpoints={3: [0.5, 1.5, 2.5]}), "only a regression"),
            (dict(objective="regression", prompts=(4,), cutpoints={3: [0.5, 1.5, 2.5]}),
             "prompt 3 is not among"),
            (dict(objective="regression", cutpoints={3: [0.5, 1.5]}), "expected 3 finite"),
            (dict(objective="regression", cutpoints={3: [0.5, 2.5, 1.5]}), "non-decreasing"),
            (dict(objective="regression", cutpoints={3: [0.5, float("nan"), 2.5]}), "finite")):
        with pytest.raises(ValueError, match=message):
            ScorerConfig(**bad)


def test_combine_windows_and_near_boundary_with_cutpoints():
    from mhmla_fast.aes.scoring import combine_windows, near_boundary

    rng = np.random.default_rng(0)
    mean = rng.uniform(0, 1, 200)
    mean = mean[np.abs((mean * 3) % 1 - 0.5) > 1e-6]
    index = np.arange(len(mean))
    rounding = rounding_cutpoints(3)
    assert (combine_windows(mean, index, 3, "regression", cutpoints=rounding).tolist()
            == combine_windows(mean, index, 3, "regression").tolist())
    np.testing.assert_array_equal(
        near_boundary(mean, 3, "regression", margin=0.05, cutpoints=rounding),
        near_boundary(mean, 3, "regression", margin=0.05))
    cuts = np.array([0.2, 0.9, 2.9])
    got = combine_windows(mean, index, 3, "regression", cutpoints=cuts)
    assert got.tolist() == apply_cutpoints(mean * 3, cuts, 3).tolist()
    near = near_boundary(mean, 3, "regression", margin=0.02, cutpoints=cuts)
    assert near.tolist() == (np.abs(mean[:, None] * 3 - cuts).min(1) <= 0.06).tolist()
    # a move below the margin never changes a score that is not near a cutpoint
    moved = combine_windows(np.clip(mean + 0.019, 0, 1), index, 3, "regression", cutpoints=cuts)
    assert (moved[~near] == got[~near]).all()
    with pytest.raises(ValueError, match="only a regression"):
        combine_windows(np.full((2, 4), 0.25), [0, 1], 3, "classification", cutpoints=cuts)


def test_fit_cutpoints_of_a_saved_scorer_and_score_with_them(tiny_encoder, tmp_path, capsys):
    """``mhmla-train aes --fit-cutpoints``: out-of-fold heads of the scorer's training config,
    cutpoints for each of its prompts in config.json with the dev record, and every scoring
    path (the torch scorer, the feature cache's head, the ONNX export) cuts with them."""
    import json

    from mhmla_fast.aes.model import EssayScorer
    from mhmla_fast.commands.eval import main as mhmla_eval
    from mhmla_fast.commands.train import main as mhmla_train
    from mhmla_fast.serve.score_onnx import OnnxScorer, export_scorer
    from test_aes_train import write_asap

    data = write_asap(tmp_path / "data", n_per_prompt=40)
    common = ["--prompt", "3,4", "--data-dir", str(data), "--cache-dir", str(tmp_path / "cache"),
              "--backend", "torch"]
    scorer_dir = tmp_path / "scorer"
    assert mhmla_train(["aes", *common, "--fold", "0", "--encoder", tiny_encoder,
                        "--export-shipped", str(scorer_dir), "--epochs", "2",
                        "--objective", "regression", "--quiet"]) == 0
    before = json.loads((scorer_dir / "config.json").read_text())
    assert "cutpoints" not in before
    capsys.readouterr()
    assert mhmla_train(["aes", "--data-dir", str(data), "--cache-dir", str(tmp_path / "cache"),
                        "--backend", "torch", "--fit-cutpoints", str(scorer_dir), "--quiet"]) == 0
    assert "dev mean QWK" in capsys.readouterr().out
    cfg = json.loads((scorer_dir / "config.json").read_text())
    assert set(cfg["cutpoints"]) == {"3", "4"}
    assert all(len(c) == 3 for c in cfg["cutpoints"].values())
    record = cfg["training"]["cutpoints"]
    assert set(record["dev_qwk_cut"]) == {"3", "4"} and "out-of-fold" in record["method"]
    assert cfg["training"]["test_qwk"] == before["training"]["test_qwk"]  # the rest as it was
    scorer = EssayScorer.load(scorer_dir, backend="torch")
    assert scorer.config.cutpoints == {int(p): tuple(c) for p, c in cfg["cutpoints"].items()}
    texts = ["the cat goes to school every day", "a dog", "they went home and she sees the house"]
    scores, outputs = scorer.predict_scores(texts, 3, return_outputs=True)
    want = apply_cutpoints(np.array([float(o) for o in outputs]) * 3, cfg["cutpoints"]["3"], 3)
    assert scores.tolist() == want.tolist()
    export_scorer(scorer_dir, tmp_path / "onnx")  # validated against torch with the cutpoints
    onnx = OnnxScorer(tmp_path / "onnx")
    assert onnx.config.cutpoints == scorer.config.cutpoints
    assert onnx.predict_scores(texts, 3).tolist() == scores.tolist()
    out = tmp_path / "eval.json"  # the feature cache's head cuts as the scorer does
    assert mhmla_eval(["aes", *common, "--model", str(scorer_dir), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["prompts"]["3"]["via"] == "feature cache"
    with pytest.raises(ValueError, match="regression scorer with a frozen encoder"):
        cls_dir = tmp_path / "cls"
        assert mhmla_train(["aes", *common, "--fold", "0", "--encoder", tiny_encoder,
                            "--export-shipped", str(cls_dir), "--epochs", "1",
                            "--objective", "classification", "--quiet"]) == 0
        from mhmla_fast.aes.shipped import fit_scorer_cutpoints

        fit_scorer_cutpoints(cls_dir, data_dir=data, cache_dir=tmp_path / "cache", log=None)
