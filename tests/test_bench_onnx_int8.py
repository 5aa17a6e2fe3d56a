"""bench/onnx_int8_accuracy.py end to end on the tiny tagger: both graphs exported and
validated, every set's speed, F0.5, agreement and differences recorded, and consistent."""

from __future__ import annotations

import json

import pytest

from bench_scripts import load_bench_script
from test_bench_serve import _write_fce

pytest.importorskip("onnxruntime")


def test_int8_against_fp32_on_a_small_file(tiny_tagger_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MHMLA_COMMIT", "test-commit")
    script = load_bench_script("onnx_int8_accuracy")
    data = _write_fce(tmp_path / "fce.tsv", 12)
    out = tmp_path / "int8.json"
    assert script.main(["--model", str(tiny_tagger_dir), "--data", str(data), "--threads", "1",
                        "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["commit"] == "test-commit" and result["threads"] == 1
    v = result["int8_validation"]
    assert isinstance(v["passed"], bool) and ("error" in v) != v["passed"]
    entry = result["sets"]["fce.tsv"]
    assert entry["sentences"] == 12 and entry["words"] > 12
    for dtype in ("float32", "int8"):
        assert entry[dtype]["sentences_per_s"] > 0
        assert 0 <= entry[dtype]["f05_at_threshold"] <= 100
    assert entry["int8_speedup"] == pytest.approx(
        entry["int8"]["sentences_per_s"] / entry["float32"]["sentences_per_s"])
    assert entry["f05_change_at_threshold"] == pytest.approx(
        entry["int8"]["f05_at_threshold"] - entry["float32"]["f05_at_threshold"])
    assert 0 <= entry["label_agreement_at_threshold"] <= 1
    d = entry["prob_diff"]
    assert 0 <= d["mean"] <= d["max"] <= 1 and d["p99.9"] <= d["max"]
    assert "fce.tsv: int8" in capsys.readouterr().out
