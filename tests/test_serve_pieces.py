"""The engine's word pieces (:class:`mhmla_fast.serve.pieces.WordPieces`): read from a saved
tokenizer directory with ``tokenizers`` alone, equal to what transformers' fast tokenizer
gives, and an ONNX engine that starts without importing transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from mhmla_fast.serve.engine import default_tagger_path, load_tokenizer
from mhmla_fast.serve.pieces import WordPieces


def _same(a: WordPieces, b: WordPieces) -> None:
    assert (a.cls_id, a.sep_id, a.pad_id, a.unk) == (b.cls_id, b.sep_id, b.pad_id, b.unk)
    assert a.pieces.to_str() == b.pieces.to_str()
    words = ["He", "go", "to", "schoool", "every", "days", "naïve", "東京", "\u200b"]
    assert (a.pieces.encode(words, is_pretokenized=True, add_special_tokens=False).ids
            == b.pieces.encode(words, is_pretokenized=True, add_special_tokens=False).ids)


@pytest.mark.parametrize("which", ["shipped", "tiny"])
def test_from_dir_equals_the_hugging_face_tokenizer(which, tiny_tagger_dir):
    path = default_tagger_path() if which == "shipped" else tiny_tagger_dir
    _same(WordPieces.from_dir(path), WordPieces.from_hf(load_tokenizer(path)))


def test_from_dir_reads_dict_tokens_and_the_map_wins(tmp_path, tiny_tagger_dir):
    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(tiny_tagger_dir / "tokenizer.json", d)
    cfg = {"cls_token": {"content": "[CLS]", "special": True}, "sep_token": "[unused1]",
           "pad_token": "[PAD]", "unk_token": {"content": "[UNK]"}}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "special_tokens_map.json").write_text(json.dumps({"sep_token": "[SEP]"}))
    _same(WordPieces.from_dir(d), WordPieces.from_hf(load_tokenizer(tiny_tagger_dir)))


def test_from_dir_declines_what_it_cannot_read(tmp_path, tiny_tagger_dir):
    assert WordPieces.from_dir(tmp_path) is None  # no tokenizer.json
    shutil.copy(tiny_tagger_dir / "tokenizer.json", tmp_path)
    assert WordPieces.from_dir(tmp_path) is None  # no config naming the special tokens
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"cls_token": "<no such token>", "sep_token": "[SEP]", "pad_token": "[PAD]"}))
    assert WordPieces.from_dir(tmp_path) is None  # a token the vocabulary lacks


def test_an_onnx_engine_starts_without_transformers_or_torch(tmp_path, tiny_tagger_dir, tiny_engine):
    from mhmla_fast.serve.onnx_export import export_onnx

    export_onnx(tiny_tagger_dir, tmp_path / "exp")
    code = ("import sys; from mhmla_fast.serve.engine import Engine; "
            f"e = Engine.load({str(tmp_path / 'exp')!r}, backend='onnx', threads=1); "
            "r = e.tag_texts(['He go to school every days .']); print(r[0].labels); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    labels, imported = done.stdout.strip().splitlines()
    assert imported == "[]"
    want = tiny_engine.tag_texts(["He go to school every days ."])[0].labels
    assert labels == str(want)
