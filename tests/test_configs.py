"""One config per concept (issue 15): the layer-attention config and the encoder spec, the
flat layout of before read into them, the CLI flags generated from the dataclasses, the
shipped models loading with the same outputs, and the layering of devices/provenance."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from mhmla_fast.configs import EncoderSpec, LayerAttentionConfig, config_diff, nest_flat

PACKAGE = Path(__file__).resolve().parents[1] / "mhmla_fast"


# ------------------------------------------------------------------ the two groups


def test_layer_attention_config_validates_once_with_named_errors():
    cfg = LayerAttentionConfig(num_heads=4, layers=[1, 3])
    assert cfg.layers == (1, 3) and cfg.heads == 4
    assert LayerAttentionConfig(mode="shmla", num_heads=12).heads == 1
    assert cfg.resolve(48, 3) == ([1, 3], 4, 48)
    for kw, message in [({"mode": "bogus"}, "mode: expected one of"),
                        ({"num_heads": 0}, "num_heads: expected a positive integer"),
                        ({"key_size": 0}, "key_size: expected a positive integer"),
                        ({"dropout": 1.0}, r"dropout: expected a rate in \[0, 1\)")]:
        with pytest.raises(ValueError, match=message):
            LayerAttentionConfig(**kw)
    with pytest.raises(ValueError, match="num_heads: H = 48 is not divisible by J = 5"):
        LayerAttentionConfig(num_heads=5).resolve(48, 3)
    with pytest.raises(ValueError, match="key_size: K = 10 is not divisible by J = 4"):
        LayerAttentionConfig(num_heads=4, key_size=10, block_diagonal=True).resolve(48, 3)
    with pytest.raises(ValueError, match=r"layers: expected indices in \[0, 3\]"):
        LayerAttentionConfig(layers=(1, 4)).resolve(48, 3)
    with pytest.raises(ValueError, match="freeze: expected one of"):
        EncoderSpec(freeze="some")


def test_the_module_takes_the_config_object_itself():
    from mhmla_fast.modules.layer_attention import FusedLayerAttention

    cfg = LayerAttentionConfig(num_heads=4, key_size=24)
    mod = FusedLayerAttention(48, 3, config=cfg, backend="torch")
    assert mod.config is cfg and mod.num_heads == 4 and mod.w_k.shape == (3, 48, 24)
    torch.manual_seed(0)
    a = FusedLayerAttention(48, 3, config=cfg, backend="torch").state_dict()
    torch.manual_seed(0)
    b = FusedLayerAttention(48, 3, num_heads=4, key_size=24, backend="torch").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # keywords and config build the same head
    with pytest.raises(ValueError, match="config: given with"):
        FusedLayerAttention(48, 3, config=cfg, num_heads=4)


def test_flat_keywords_and_keys_of_before_are_read_into_the_groups():
    from mhmla_fast.aes.model import ScorerConfig
    from mhmla_fast.ged.model import TaggerConfig
    from mhmla_fast.ged.train import TrainConfig

    t = TaggerConfig(encoder="some/path", head="shmla", num_heads=4, max_length=64)
    assert t.encoder_spec == EncoderSpec("some/path", 64, "none")
    assert t.layer_attention == LayerAttentionConfig(mode="shmla", num_heads=4)
    assert TaggerConfig().encoder_spec.max_length == 128  # GED's own default
    s = ScorerConfig(encoder="x", window=32, freeze_encoder=True, num_heads=6)
    assert s.encoder_spec == EncoderSpec("x", 34, "all") and s.window == 32 and s.freeze_encoder
    run = TrainConfig(train="t", dev="d", out="o", freeze_word_embeddings=True, dropout=0.1)
    assert run.encoder_spec.freeze == "word_embeddings" and run.layer_attention.dropout == 0.1
    la = LayerAttentionConfig(num_heads=3)
    assert TaggerConfig(layer_attention=la).layer_attention is la  # the object, not a copy
    with pytest.raises(TypeError, match="unexpected settings"):
        TaggerConfig(bogus=1)
    # what is written is the nested layout only
    data = json.loads(TaggerConfig(encoder="x", num_heads=4).to_json())
    assert data["layer_attention"]["num_heads"] == 4 and data["encoder_spec"]["name_or_path"] == "x"
    assert not {"head", "num_heads", "encoder", "max_length"} & set(data)
    assert TaggerConfig.from_json(json.dumps(data)) == TaggerConfig(encoder="x", num_heads=4)


def test_a_checkpoint_config_of_before_compares_equal_to_todays():
    from mhmla_fast.ged.train import TrainConfig

    old = dict(train="a", dev="b", out="c", encoder="x", head="mhmla", num_heads=4, key_size=None,
               dropout=0.3, epochs=5, batch_size=32, lr=5e-5, weight_decay=0.0, max_length=32,
               seed=0, freeze_word_embeddings=True, checkpoint_every=200, eval_batch_size=64,
               max_train_sentences=None, backend="auto", progress=True, extra={})
    now = TrainConfig(train="a", dev="b", out="c", encoder_spec=EncoderSpec("x", 32, "word_embeddings"),
                      layer_attention=LayerAttentionConfig(num_heads=4))
    assert config_diff(now, old) == {}  # lr_schedule & co. predate nothing: their defaults
    assert config_diff(now, {**old, "num_heads": 6}) == {"layer_attention.num_heads": (6, 4)}
    assert config_diff(now, json.loads(json.dumps(dataclasses.asdict(now)))) == {}
    assert nest_flat(TrainConfig, old)["encoder_spec"].freeze == "word_embeddings"


# ------------------------------------------------------------------ the command line


def _parser():
    from mhmla_fast.commands.train import add_ged_parser

    parser = argparse.ArgumentParser()
    add_ged_parser(parser.add_subparsers(dest="task"))
    return parser


def test_every_training_field_has_a_flag_with_the_dataclass_default():
    from mhmla_fast.commands.config_flags import config_flags, config_from_args
    from mhmla_fast.ged.train import TrainConfig

    args = _parser().parse_args(["ged", "--out", "o", "--train", "t", "--dev", "d"])
    flags = {f.name for _, f, _, _ in config_flags(TrainConfig)}
    wanted = {f.name for f in dataclasses.fields(TrainConfig) if f.name not in
              ("encoder_spec", "layer_attention", "extra")}
    wanted |= {f.name for f in dataclasses.fields(LayerAttentionConfig)}
    wanted |= {f.name for f in dataclasses.fields(EncoderSpec)}
    assert flags == wanted
    assert config_from_args(TrainConfig, args) == TrainConfig(train="t", dev="d", out="o")


def test_num_heads_is_one_name_from_the_flag_to_the_module(tmp_path):
    from mhmla_fast.commands.config_flags import config_from_args
    from mhmla_fast.ged.train import TrainConfig

    args = _parser().parse_args(["ged", "--out", "o", "--num-heads", "4", "--mode", "mhmla",
                                 "--freeze", "word_embeddings", "--layers", "1", "2",
                                 "--no-progress"])
    cfg = config_from_args(TrainConfig, args, train="t", dev="d")
    assert cfg.layer_attention == LayerAttentionConfig(mode="mhmla", num_heads=4, layers=(1, 2))
    args.mode = "shmla"  # one head: J = 4 would be recorded and do nothing
    with pytest.raises(ValueError, match="num_heads: J = 4 is read by mode 'mhmla' only"):
        config_from_args(TrainConfig, args, train="t", dev="d")
    assert cfg.encoder_spec.freeze == "word_embeddings" and cfg.progress is False
    with pytest.warns(FutureWarning, match="--heads is deprecated.*--num-heads"):
        old = _parser().parse_args(["ged", "--out", "o", "--heads", "6"])
    assert old.num_heads == 6
    with pytest.warns(FutureWarning, match="--head is deprecated.*--mode"):
        assert _parser().parse_args(["ged", "--out", "o", "--head", "avgl"]).mode == "avgl"
    with pytest.warns(FutureWarning, match="--freeze-word-embeddings is deprecated"):
        assert _parser().parse_args(["ged", "--out", "o", "--freeze-word-embeddings"]).freeze == \
            "word_embeddings"


def test_aes_feature_precision_choices_are_the_caches():
    """``--feature-precision`` offers exactly the cache precisions (written out in the parser,
    which imports no torch)."""
    from mhmla_fast.aes.features import PRECISIONS
    from mhmla_fast.commands.aes import add_train_parser

    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(dest="task"))
    for value in PRECISIONS:
        assert parser.parse_args(["aes", "--feature-precision", value]).feature_precision == value
    with pytest.raises(SystemExit):
        parser.parse_args(["aes", "--feature-precision", "fp16"])


def test_aes_training_flags_name_config_fields():
    """The ``mhmla-train aes`` flags that set head or fine-tuning fields name real fields."""
    from mhmla_fast.aes.train import FinetuneConfig, HeadTrainConfig
    from mhmla_fast.commands.aes import _overrides, add_train_parser

    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(dest="task"))
    args = parser.parse_args(["aes", "--epochs", "2", "--patience", "3", "--lr", "0.1",
                              "--batch-size", "4", "--seed", "5", "--objective", "regression",
                              "--export-shipped", "x"])
    names = {f.name for f in dataclasses.fields(HeadTrainConfig)}
    assert set(_overrides(args)) <= names
    HeadTrainConfig(**_overrides(args))  # they build one
    ft = {f.name for f in dataclasses.fields(FinetuneConfig)}
    assert {"epochs", "batch_size", "lr", "head_lr", "seed", "backend", "encoder_spec"} <= ft


# ------------------------------------------------------------------ files on disk


def test_the_shipped_models_load_from_the_keys_of_before_with_the_same_outputs(
        tmp_path, tiny_scorer_dir):
    """The shipped tagger (grouped layout since its re-ship of 2026-12-01) and the same model
    with its config.json in the flat layout of before issue 15 load to one config and give the
    recorded outputs; the shipped scorer (a ridge stack scorer since 2026-12-07, grouped layout)
    gives its recorded outputs, and a scorer's config.json in the flat layout (the scorer
    shipped until 2026-12-06 had one) loads to the same config and scores."""
    import shutil

    from mhmla_fast.aes.model import EssayScorer
    from mhmla_fast.aes.model import default_model_path as scorer_path
    from mhmla_fast.ged.model import GedTagger, encode_words, load_tokenizer
    from mhmla_fast.ged.predict import default_model_path

    path = default_model_path()
    grouped = json.loads((path / "config.json").read_text())
    la, es = grouped["layer_attention"], grouped["encoder_spec"]
    flat = {k: v for k, v in grouped.items() if k not in ("layer_attention", "encoder_spec")}
    flat.update(encoder=es["name_or_path"], head=la["mode"], num_heads=la["num_heads"],
                key_size=la["key_size"], dropout=la["dropout"], max_length=es["max_length"])
    # the flat layout kept the freeze in the training record only
    flat["training"] = {**grouped["training"],
                        "config": {"freeze_word_embeddings": es["freeze"] != "none"}}
    old = tmp_path / "flat"
    shutil.copytree(path, old)
    (old / "config.json").write_text(json.dumps(flat))
    assert "num_heads" in json.loads((old / "config.json").read_text())  # the old layout
    words = "He go to school every days .".split()
    recorded = [0.024448, 0.898818, 0.012344, 0.008845, 0.03793, 0.635626, 0.016586]
    for folder in (path, old):
        tagger, tok = GedTagger.load(folder), load_tokenizer(folder)
        assert tagger.config.layer_attention == LayerAttentionConfig(num_heads=12)
        assert tagger.config.encoder_spec == EncoderSpec(max_length=128, freeze="none")
        batch = encode_words(tok, [words], 128)
        with torch.no_grad():
            p = tagger(batch["input_ids"], batch["attention_mask"]).softmax(-1)[0, :, 1]
        np.testing.assert_allclose(p[batch["word_index"][0] >= 0].numpy(), recorded, atol=2e-6)

    scorer = EssayScorer.load(scorer_path())
    assert scorer.config.encoder_spec == EncoderSpec(max_length=512, freeze="all")
    assert scorer.config.window == 510 and scorer.config.head_kind == "ridge"
    essay = ("Computers are good because they help people learn. However, some people spend "
             "too much time in front of a screen.")
    scores, outs = scorer.predict_scores([essay] * 8, list(range(1, 9)), return_outputs=True)
    # cut at the scorer's cutpoints; rounded they would be [2, 1, 1, 0, 0, 0, 8, 23] (the ridge
    # stack scorer shipped since 2026-12-07: its averaged outputs include the surface term)
    assert scores.tolist() == [2, 1, 0, 0, 0, 0, 7, 21]
    from mhmla_fast.aes.data import denormalise_scores
    assert [int(denormalise_scores([float(o)], p)[0]) for p, o in zip(range(1, 9), outs)] == [
        2, 1, 1, 0, 0, 0, 8, 23]
    # prompt 2's output: -0.026463 before its surface features were clipped to the training
    # split's range (2026-12-07; this two-sentence essay is shorter than any of prompt 2's)
    np.testing.assert_allclose([float(o) for o in outs], [-0.000121, 0.022836, 0.220646,
                                                          -0.078281, 0.10621, -0.046995,
                                                          0.271519, 0.375435], atol=2e-6)

    grouped = json.loads((tiny_scorer_dir / "config.json").read_text())
    la, es = grouped["layer_attention"], grouped["encoder_spec"]
    flat = {k: v for k, v in grouped.items() if k not in ("layer_attention", "encoder_spec")}
    flat.update(encoder=es["name_or_path"], head=la["mode"], num_heads=la["num_heads"],
                key_size=la["key_size"], dropout=la["dropout"], window=es["max_length"] - 2,
                freeze_encoder=es["freeze"] == "all")
    old = tmp_path / "flat-scorer"
    shutil.copytree(tiny_scorer_dir, old)
    (old / "config.json").write_text(json.dumps(flat))
    a, b = EssayScorer.load(tiny_scorer_dir), EssayScorer.load(old)
    assert a.config == b.config
    texts = [essay, essay + " " + essay]
    assert a.predict_scores(texts, [1, 2]).tolist() == b.predict_scores(texts, [1, 2]).tolist()


def test_a_model_written_now_round_trips(tmp_path, tiny_tagger_dir, tiny_scorer_dir):
    from mhmla_fast.aes.model import EssayScorer
    from mhmla_fast.ged.model import GedTagger

    for cls, path in ((GedTagger, tiny_tagger_dir), (EssayScorer, tiny_scorer_dir)):
        model = cls.load(path)
        data = json.loads((path / "config.json").read_text())
        assert "layer_attention" in data and "encoder_spec" in data and "head" not in data
        again = cls.load(model.save(tmp_path / cls.__name__))
        assert again.config.to_json() == model.config.to_json()


# ------------------------------------------------------------------ layering


def test_physical_cores_lives_with_the_device_rule():
    import os

    from mhmla_fast import devices, provenance

    assert 1 <= devices.physical_cores() <= len(os.sched_getaffinity(0))
    assert provenance.cpu_info()["physical_cores"] == devices.physical_cores()
    upward = re.compile(r"from\s+(\.serve|\.\.serve|mhmla_fast\.serve)\b")
    for name in ("provenance.py", "devices.py", "configs.py", "encoder.py", "model_dir.py"):
        assert not upward.search((PACKAGE / name).read_text()), name


def test_aes_train_is_split_into_small_modules():
    for path in (PACKAGE / "aes").glob("*.py"):
        if path.name in ("data.py", "model.py"):  # readers and the model: not training code
            continue
        assert len(path.read_text().splitlines()) <= 400, path.name
