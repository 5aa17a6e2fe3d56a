"""The ridge stack scorer (the shipped scorer's kind since 2026-12-07): a ridge head with
"cls+mean" pooling and surface weights. Each essay's own term (``essay_offsets``) and where it
enters a score; the config's rules; the head against a float64 computation from the encoder's
hidden states and against the feature cache; the scorer fitted by ``fit_ridge_stack_scorer``
against the protocol's stack of the four members' units; backend auto's bf16 rule for a ridge
scorer without margins; ``mhmla-train aes --export-ridge DIR --ridge-stack``. Its save/load,
window-by-window scoring and ONNX export are tested beside the "cls" ridge scorer's
(``test_aes_ridge_scorer.py``, parametrised by pooling)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_aes_ridge_scorer import _ridge_scorer
from test_aes_train import tiny_encoder, write_asap  # noqa: F401 - tiny_encoder: the fixture

from mhmla_fast.aes.cutpoints import apply_cutpoints
from mhmla_fast.aes.data import SCORE_RANGES
from mhmla_fast.aes.model import ScorerConfig, collate_windows, encode_essay_windows
from mhmla_fast.aes.scoring import combine_windows, essay_offsets, essay_scores
from mhmla_fast.aes.surface import SURFACE_FEATURES, surface_features

TEXTS = ["The dog went to school every day , and saw a cat . " * k + "It was @CAPS1 fun !"
         for k in (1, 3, 6, 9)]


def test_combine_windows_adds_each_essays_offset_before_the_cut():
    outputs = np.array([0.1, 0.3, 0.5, 0.9])  # essay 0: windows 0, 1; essay 1: windows 2, 3
    cuts = (0.5, 1.5, 2.5)
    scores, mean = combine_windows(outputs, [0, 0, 1, 1], 3, "regression", return_mean=True,
                                   cutpoints=cuts, offsets=[0.25, -0.5])
    np.testing.assert_allclose(mean, [0.2 + 0.25, 0.7 - 0.5])
    lo, hi = SCORE_RANGES[3]
    assert scores.tolist() == apply_cutpoints(lo + mean * (hi - lo), cuts, 3).tolist()
    assert combine_windows(outputs, [0, 0, 1, 1], 3, "regression", cutpoints=cuts).tolist() != (
        scores.tolist())  # the offsets moved both essays
    with pytest.raises(ValueError, match="offsets: only a regression scorer"):
        combine_windows(np.full((2, 4), 0.25), [0, 1], 3, "classification", offsets=[0.0, 0.0])
    with pytest.raises(ValueError, match="offsets: expected one per essay"):
        combine_windows(outputs, [0, 0, 1, 1], 3, "regression", offsets=[0.1])
    # essay_scores hands each prompt's essays their own offsets
    got, means = essay_scores(list(outputs), [0, 0, 1, 1], [4, 3], "regression",
                              offsets=np.array([0.5, -0.25]))
    np.testing.assert_allclose(np.array(means, dtype=float), [0.7, 0.45])


def test_essay_offsets_are_the_surface_features_times_each_prompts_weights():
    rng = np.random.default_rng(0)
    weights = {3: tuple(rng.normal(size=len(SURFACE_FEATURES))),
               4: tuple(rng.normal(size=len(SURFACE_FEATURES)))}
    prompts = [3, 4, 4, 1]  # prompt 1 has no weights: no term
    got = essay_offsets(TEXTS, prompts, weights)
    s = surface_features(TEXTS)
    want = [float(np.dot(s[e], weights[p])) if p in weights else 0.0
            for e, p in enumerate(prompts)]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert essay_offsets(TEXTS, prompts, {}) is None
    # clipped to each prompt's training range: a feature past it counts as its bound
    from mhmla_fast.aes.scoring import surface_bounds_of

    bounds = {3: surface_bounds_of(s[:2]), 4: surface_bounds_of(s[1:3])}
    long_word = ["short words and then " + "a" * 2000]
    for p in (3, 4):
        lo, hi = map(np.array, bounds[p])
        x = surface_features(long_word)[0]
        assert x[SURFACE_FEATURES.index("mean_word_length")] > hi.max()  # far past the range
        clipped = essay_offsets(long_word, [p], weights, bounds)[0]
        assert clipped == pytest.approx(float(np.clip(x, lo, hi) @ np.array(weights[p])))
    np.testing.assert_allclose(essay_offsets(TEXTS[:2], [3, 3], weights, bounds),
                               essay_offsets(TEXTS[:2], [3, 3], weights))  # inside: unchanged


def test_surface_features_read_canonically_equivalent_text_alike():
    import unicodedata

    text = "Le café était très bon, et l'élève a été ravi. Très bien !"
    nfd = unicodedata.normalize("NFD", text)
    assert nfd != text
    np.testing.assert_array_equal(surface_features([nfd]), surface_features([text]))


def test_the_shipped_scorer_is_not_gamed_by_one_long_word():
    """One 3,000-letter token raised a short prompt-1 essay from its score to the scale's top
    (12): the mean word length, at most 5.8 in ASAP, was extrapolated linearly."""
    from mhmla_fast.serve.score import default_scorer_path, load_scorer

    scorer = load_scorer(default_scorer_path(), backend="torch", threads=1)
    assert set(scorer.config.surface_bounds) == set(range(1, 9))
    essay = ("Computers are good for people because they help us learn and talk with our "
             "friends. I think the newspaper should say that computers are good.")
    base, gamed = scorer.predict_scores([essay, essay + " " + "x" * 3000], 1).tolist()
    assert gamed <= base + 1 and gamed < 12, (base, gamed)
    top = scorer.predict_scores(["a" * 2000] * 8, list(range(1, 9))).tolist()
    assert all(t < SCORE_RANGES[p][1] for t, p in zip(top, range(1, 9))), top


def test_surface_advisories_flag_features_far_outside_the_training_range():
    """An advisory per surface feature beyond lo - 0.25 (hi - lo) or hi + 0.25 (hi - lo) of its
    prompt's training range; none inside the margin, for a prompt without bounds, or for a
    scorer without them."""
    from mhmla_fast.aes.scoring import surface_advisories
    from mhmla_fast.aes.surface import SURFACE_FEATURES, surface_features

    texts = ["the " * 300, "Dogs run fast. Cats sleep well, and birds sing."]
    s = surface_features(texts)
    i = SURFACE_FEATURES.index("distinct_ratio")
    lo, hi = np.minimum(s[1], s[0]) - 1e-9, np.maximum(s[1], s[0]) + 1e-9
    lo[i] = 0.5  # 0.5 .. 1: "the" x 300 (0.0033) lies 0.5 below, past the margin of 0.125
    bounds = {4: (tuple(lo), tuple(hi))}
    got = surface_advisories(texts, [4, 4], bounds)
    assert got[0] == [{"feature": "distinct_ratio", "value": 0.0033, "range": [0.5, round(hi[i], 4)]}]
    assert got[1] == []
    assert surface_advisories(texts, [3, 3], bounds) == [[], []]  # no bounds for prompt 3
    assert surface_advisories(texts, [4, 4], None) == [[], []]
    lo[i] = 0.12  # 0.0033 lies 0.1167 below: inside the margin of 0.25 * 0.88 = 0.22
    assert surface_advisories(texts[:1], [4], {4: (tuple(lo), tuple(hi))}) == [[]]


def test_the_shipped_scorer_advises_on_one_word_repeated():
    """One word repeated scored the top of prompts 4 and 5 (the encoder's linear map
    extrapolates); the score is unchanged, but every result says the essay lies far outside
    the training essays, and an ordinary essay gets no advisory."""
    from mhmla_fast.serve.score import default_scorer_path, load_scorer, score_essays

    scorer = load_scorer(default_scorer_path(), backend="torch", threads=1)
    essay = ("Computers are good for people because they help us learn and talk with our "
             "friends. I think the newspaper should say that computers are good.")
    results = score_essays(scorer, ["because " * 300, "because " * 300, essay], [4, 5, 1])
    for res in results[:2]:
        assert "distinct_ratio" in [a["feature"] for a in res["advisories"]], res
    assert "advisories" not in results[2]
    plain = score_essays(scorer, ["because " * 300], [4], advisories=False)
    assert plain == [{"prompt": 4, "score": results[0]["score"]}]


def test_ridge_stack_config_rules():
    w = {3: [0.1] * len(SURFACE_FEATURES)}
    cfg = ScorerConfig(encoder="x", head_kind="ridge", objective="regression", pooling="cls+mean",
                       prompts=(3, 4), surface_weights=w)
    again = ScorerConfig.from_json(cfg.to_json())
    assert again.pooling == "cls+mean" and again.surface_weights == {3: tuple(w[3])}
    plain = json.loads(ScorerConfig(encoder="x", head_kind="ridge", objective="regression")
                       .to_json())
    assert "surface_weights" not in plain  # a scorer without them writes the file as before
    with pytest.raises(ValueError, match="pooling 'cls\\+mean': a ridge head's only"):
        ScorerConfig(pooling="cls+mean", objective="regression")
    with pytest.raises(ValueError, match="surface_weights: a ridge head's only"):
        ScorerConfig(objective="regression", prompts=(3,), surface_weights=w)
    with pytest.raises(ValueError, match="surface_weights of prompt 3: expected 9 finite"):
        ScorerConfig(head_kind="ridge", objective="regression", prompts=(3,),
                     surface_weights={3: [0.1] * 8})
    with pytest.raises(ValueError, match="surface_weights of prompt 3: expected 9 finite"):
        ScorerConfig(head_kind="ridge", objective="regression", prompts=(3,),
                     surface_weights={3: [float("nan")] * 9})
    with pytest.raises(ValueError, match="surface_weights: prompt 3 is not among"):
        ScorerConfig(head_kind="ridge", objective="regression", prompts=(4,), surface_weights=w)
    b = {3: ([0.0] * len(SURFACE_FEATURES), [1.0] * len(SURFACE_FEATURES))}
    bounded = ScorerConfig(encoder="x", head_kind="ridge", objective="regression",
                           pooling="cls+mean", prompts=(3, 4), surface_weights=w,
                           surface_bounds=b)
    assert ScorerConfig.from_json(bounded.to_json()).surface_bounds == {
        3: (tuple(b[3][0]), tuple(b[3][1]))}
    assert "surface_bounds" not in json.loads(cfg.to_json())  # none: the file as before
    with pytest.raises(ValueError, match="surface_bounds: prompt 4 has no surface weights"):
        ScorerConfig(head_kind="ridge", objective="regression", prompts=(3, 4),
                     surface_weights=w, surface_bounds={4: b[3]})
    with pytest.raises(ValueError, match="surface_bounds of prompt 3: expected two lists"):
        ScorerConfig(head_kind="ridge", objective="regression", prompts=(3,),
                     surface_weights=w, surface_bounds={3: (b[3][1], b[3][0])})


def test_cls_mean_head_is_a_linear_map_of_each_layers_cls_and_token_mean(tiny_encoder):
    from mhmla_fast.aes.features import encode_window_poolings

    scorer = _ridge_scorer(tiny_encoder, "cls+mean")
    tok = scorer.tokenizer
    windows, essay_index = encode_essay_windows(tok, TEXTS, scorer.config.window)
    assert len(windows) > len(TEXTS)  # some essays have several windows
    ids, mask = collate_windows(windows, tok.pad_token_id)
    with torch.no_grad():
        states = scorer.encoder(input_ids=ids, attention_mask=mask,
                                output_hidden_states=True).hidden_states
    m = mask.double()
    parts = []  # independent float64: per layer 1..L, [CLS] then the mean over real tokens
    for h in states[1:]:
        h = h.double()
        parts += [h[:, 0], (h * m[:, :, None]).sum(1) / m.sum(1, keepdim=True)]
    x = torch.cat(parts, 1)
    assert scorer.head.outputs["3"].weight.shape[1] == x.shape[1] == 2 * 2 * 24
    outs = {}
    for p in (3, 4):
        out = scorer.head.outputs[str(p)]
        outs[p] = (x @ out.weight.detach().double().T + out.bias.detach().double()).squeeze(1)
        np.testing.assert_allclose(scorer.predict_windows(ids, mask, p).numpy(),
                                   outs[p].numpy(), atol=1e-5)
    # the feature cache's "cls" and "mean" vectors side by side are what the head reads
    cached, _ = encode_window_poolings(scorer.encoder, tok, TEXTS, window=scorer.config.window,
                                       poolings=("cls", "mean"))
    with torch.no_grad():
        both = torch.cat([cached["cls"], cached["mean"]], -1).float()
        np.testing.assert_allclose(scorer.head.forward_cls(both, 4).numpy(), outs[4].numpy(),
                                   atol=1e-2)  # (fp16 cache)
    # scores: windows averaged per essay, the essay's surface term added, then cut
    prompts = [3, 4, 3, 4]
    scores, means = scorer.predict_scores(TEXTS, prompts, return_outputs=True)
    s = surface_features(TEXTS)
    for e, p in enumerate(prompts):
        offset = float(s[e] @ np.array(scorer.config.surface_weights[p]))
        mean = outs[p].numpy()[np.array(essay_index) == e].mean() + offset
        assert means[e] == pytest.approx(mean, abs=1e-5)
        lo, hi = SCORE_RANGES[p]
        cut = apply_cutpoints(np.array([lo + mean * (hi - lo)]), scorer.config.cutpoints[p], p)
        assert scores[e] == int(np.clip(cut[0], lo, hi))
    plain = scorer.config.surface_weights
    scorer.config.surface_weights = {}
    assert not np.allclose(np.array(scorer.predict_scores(TEXTS, prompts, return_outputs=True)[1],
                                    dtype=float), np.array(means, dtype=float))
    scorer.config.surface_weights = plain


def test_fitted_ridge_stack_scorer_is_the_protocols_stack(tiny_encoder, tmp_path):
    from mhmla_fast.aes.data import split_essays
    from mhmla_fast.aes.ensembles import blend_values, stack_blend
    from mhmla_fast.aes.ridge_scorer import RIDGE_STACK_MEMBERS, fit_ridge_stack_scorer
    from mhmla_fast.aes.splits import feature_split, load_prompt_caches, read_asap_folds
    from mhmla_fast.aes.train import run_cpu_protocol

    members = [m for m, _ in RIDGE_STACK_MEMBERS]
    data, cache = write_asap(tmp_path / "data", n_per_prompt=40), tmp_path / "cache"
    run_cpu_protocol(data_dir=data, cache_dir=cache, run_dir=tmp_path / "run", folds=[0],
                     prompts=[3, 4], models=members, encoder=tiny_encoder, log=None)
    scorer = fit_ridge_stack_scorer(data_dir=data, cache_dir=cache, fold=0, prompts=[3, 4],
                                    encoder=tiny_encoder, log=None)
    cfg, training = scorer.config, scorer.config.training
    assert cfg.pooling == "cls+mean" and training["folded_max_abs_diff"] < 1e-8
    from mhmla_fast.aes.scoring import surface_bounds_of
    essays, folds = read_asap_folds(data)
    caches = load_prompt_caches(essays, [3, 4], cache, tiny_encoder, poolings=("cls", "mean"),
                                log=None)
    for p in (3, 4):
        units = [json.loads((tmp_path / "run" / "units" / f"{m}-fold0-p{p}.json").read_text())
                 for m in members]
        assert [training["alphas"][str(p)][m] for m in members] == [
            u["selected"]["alpha"] for u in units]
        splits = split_essays(essays, folds, 0, prompt=p)
        assert cfg.surface_bounds[p] == surface_bounds_of(  # the train split's range
            surface_features([e.text for e in splits["train"]]))
        train_gold = np.array([e.score for e in splits["train"]])
        w, cuts = stack_blend([np.array(u["continuous"]["train_oof"]) for u in units],
                              train_gold, p)
        np.testing.assert_allclose([training["weights"][str(p)][m] for m in members], w)
        np.testing.assert_allclose(cfg.cutpoints[p], cuts)
        want = blend_values([np.array(u["continuous"]["test"]) for u in units], w)
        assert training["test_qwk"][str(p)] == pytest.approx(
            _qwk(units[0]["gold"], apply_cutpoints(want, cuts, p), p))
        # the scorer's own head on the cached vectors plus its surface term: the same values
        split = {q: feature_split(caches[q][p], splits["test"]) for q in ("cls", "mean")}
        both = torch.cat([split["cls"].features, split["mean"].features], -1).float()
        with torch.no_grad():
            y = scorer.head.forward_cls(both, p).double().numpy()
        offsets = essay_offsets([e.text for e in splits["test"]], [p] * len(splits["test"]),
                                cfg.surface_weights)
        _, mean = combine_windows(y, split["cls"].essay_index, p, "regression",
                                  n_essays=len(splits["test"]), return_mean=True,
                                  cutpoints=cuts, offsets=offsets)
        lo, hi = SCORE_RANGES[p]
        np.testing.assert_allclose(lo + mean * (hi - lo), want, atol=1e-4)  # fp32 layers


def test_ridge_stack_fit_without_the_last_layers_token_means(tiny_encoder, tmp_path):
    """``last_layer_means=False``: the rows lack layer L's token means, so the scorer reads
    nothing there (exactly 0), and the folded map is still the blend of its members."""
    from mhmla_fast.aes.ridge_scorer import fit_ridge_stack_scorer

    data, cache = write_asap(tmp_path / "data", n_per_prompt=40), tmp_path / "cache"
    kw = dict(data_dir=data, cache_dir=cache, fold=0, prompts=[3, 4], encoder=tiny_encoder,
              log=None)
    full = fit_ridge_stack_scorer(**kw)
    cut = fit_ridge_stack_scorer(**kw, last_layer_means=False)
    assert cut.config.training["last_layer_means"] is False
    assert cut.config.training["folded_max_abs_diff"] < 1e-8
    for scorer, zero in ((full, False), (cut, True)):
        for p in ("3", "4"):
            w = scorer.head.outputs[p].weight.detach().reshape(2, 2, 24)  # [L, (cls, mean), H]
            assert bool((w[-1, 1] == 0).all()) is zero
            assert not bool((w[0, 1] == 0).all())  # the other layers' means are read


def _qwk(gold, pred, p):
    from mhmla_fast.aes.splits import qwk

    return qwk(np.asarray(gold), np.asarray(pred), p)


def test_auto_bf16_keeps_a_ridge_scorer_without_margins_on_onnxruntime_fp32(tiny_encoder,
                                                                            tmp_path):
    from mhmla_fast.serve.export_cache import _ridge_without_margins, auto_scorer
    from mhmla_fast.serve.score_onnx import OnnxScorer, export_scorer, write_check_margins

    scorer = _ridge_scorer(tiny_encoder, "cls+mean")
    path = scorer.save(tmp_path / "stack", tokenizer=scorer.tokenizer)
    export = tmp_path / "export"
    export_scorer(path, export)
    assert _ridge_without_margins(export)
    said: list[str] = []
    got = auto_scorer(export, torch=lambda: pytest.fail("torch"), dtype="bfloat16",
                      log=said.append, threads=1)
    assert type(got) is OnnxScorer and "without measured bf16 margins" in said[0]
    write_check_margins(export, {3: 0.01})
    assert _ridge_without_margins(export)  # prompt 4 still has none
    write_check_margins(export, {3: 0.01, 4: 0.02})
    assert not _ridge_without_margins(export)


def test_export_ridge_stack_command(tiny_encoder, tmp_path, capsys):
    from mhmla_fast.commands.eval import main as mhmla_eval
    from mhmla_fast.commands.train import main as mhmla_train

    data = write_asap(tmp_path / "data", n_per_prompt=40)
    common = ["--prompt", "3,4", "--data-dir", str(data), "--cache-dir", str(tmp_path / "cache")]
    out = tmp_path / "stack"
    assert mhmla_train(["aes", *common, "--fold", "0", "--encoder", tiny_encoder,
                        "--export-ridge", str(out), "--ridge-stack", "--quiet"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["head_kind"] == "ridge" and cfg["pooling"] == "cls+mean"
    assert sorted(cfg["surface_weights"]) == sorted(cfg["cutpoints"]) == ["3", "4"]
    assert cfg["training"]["model"].startswith("stack-blend of ridge-layers-both-surface-cuts")
    result = tmp_path / "eval.json"
    assert mhmla_eval(["aes", *common, "--model", str(out), "--json", str(result)]) == 0
    evaluated = json.loads(result.read_text())["prompts"]
    assert {e["via"] for e in evaluated.values()} == {"encoder"}  # no cache of its pooling
    capsys.readouterr()
    assert mhmla_train(["aes", *common, "--ridge-stack"]) == 2
    assert "--ridge-stack: with --export-ridge DIR" in capsys.readouterr().err


def test_scorer_arguments_are_value_errors_naming_them():
    """None as the essays and a text that is no str in plan_essay were TypeErrors from deep
    inside (the torch and ONNX scorers' differing); an unknown prompt passed for no essays;
    a numpy 0-d prompt failed."""
    from mhmla_fast.serve.score import default_scorer_path, load_scorer

    scorer = load_scorer(default_scorer_path(), backend="torch", threads=1)
    for call, message in ((lambda: scorer.predict_scores(None, 1), "texts: expected a sequence"),
                          (lambda: scorer.predict_scores([], 9), r"prompts \[9\]"),
                          (lambda: scorer.plan_essay(None, 1), r"texts\[0\]: expected a string"),
                          (lambda: scorer.plan_essay(b"x", 1), "got bytes"),
                          (lambda: scorer.plan_essay("x", 9), r"prompts \[9\]")):
        with pytest.raises(ValueError, match=message):
            call()
    assert scorer.predict_scores(["An essay."], np.array(3)).tolist() == \
        scorer.predict_scores(["An essay."], 3).tolist()


def test_the_advisories_benchmark_counts_per_split_and_margin(tmp_path, capsys):
    """bench/aes_advisories.py over a tiny ASAP: per fold, split and margin the essays with an
    advisory (an essay of one word repeated, put into the test split, among them), and the
    one-word essays; a scorer without bounds is refused."""
    from bench_scripts import load_bench_script

    from mhmla_fast.aes.scoring import default_model_path

    data = write_asap(tmp_path / "data", n_per_prompt=10)
    tsv = data / "asap_aes" / "training_set_rel3.nea_utf8.tsv"
    tsv.write_text(tsv.read_text() + "999\t4\t\"" + "the " * 300 + "\"\t1\t1\t1\r\n")
    test_ids = data / "asap_aes" / "nea_folds" / "fold_0" / "test_ids.txt"
    test_ids.write_text(test_ids.read_text() + "999\n")
    out = tmp_path / "adv.json"
    bench = load_bench_script("aes_advisories")
    assert bench.main(["--data-dir", str(data), "--margins", "0.25", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {(r["split"], r["margin"]): r for r in result["rows"]}
    test = rows["test", 0.25]
    assert test["essays"] == 5 and test["with_advisories"] >= 1 and "distinct_ratio" in test["features"]
    assert result["one_word_repeated"]["with_advisories"] == result["one_word_repeated"]["essays"] == 18
    assert result["model"] == default_model_path().name and "commit" in result["provenance"]
    bare = tmp_path / "bare"
    bare.mkdir()
    config = json.loads((default_model_path() / "config.json").read_text())
    del config["surface_bounds"]
    (bare / "config.json").write_text(json.dumps(config))
    assert bench.main(["--model", str(bare), "--data-dir", str(data), "--out", str(out)]) == 2
    assert "without surface_bounds" in capsys.readouterr().err
    (bare / "config.json").write_text("{}")
    assert bench.main(["--model", str(bare), "--data-dir", str(data), "--out", str(out)]) == 2
    assert "not an mhmla essay scorer" in capsys.readouterr().err


def test_the_fused_kernels_are_refused_for_a_ridge_scorer(capsys):
    """``mhmla-eval aes --backend triton`` on the shipped (ridge) scorer was accepted and ran
    nothing fused; the head refuses it as the avgl and last modes do."""
    from mhmla_fast.aes.model import EssayScorer
    from mhmla_fast.commands.eval import main
    from mhmla_fast.serve.score import default_scorer_path

    with pytest.raises(ValueError, match="'triton' .* ridge scorer, which has no layer attention"):
        EssayScorer.load(default_scorer_path(), backend="triton")
    assert main(["aes", "--backend", "triton", "--prompt", "1"]) == 2
    assert "ridge scorer, which has no layer attention" in capsys.readouterr().err
    assert EssayScorer.load(default_scorer_path(), backend="torch").head.layer_attention is None
