"""The GED tagger shipped inside the package loads offline and finds errors."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from mhmla_fast.ged.model import GedTagger, encode_words, load_tokenizer
from mhmla_fast.ged.predict import default_model_path


def test_shipped_model_is_small_and_complete():
    path = default_model_path()
    files = {p.name: p.stat().st_size for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert sum(files.values()) < 30 * 2**20
    config = json.loads((path / "config.json").read_text())
    assert config["head"] == "mhmla" and config["num_heads"] == 12
    assert 0 < config["threshold"] < 1
    assert config["base_tensors"] == {
        "encoder.embeddings.word_embeddings.weight": "embeddings.word_embeddings.weight"}


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
