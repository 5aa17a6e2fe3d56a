"""bench/bf16_label_check_cpu.py end to end on the tiny tagger: deviations, flips and the
cascade per margin recorded and consistent with each other."""

from __future__ import annotations

import json

import pytest

from bench_scripts import load_bench_script
from test_bench_serve import _write_fce

pytest.importorskip("onnxruntime")


def test_bf16_label_check_on_a_small_file(tiny_tagger_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MHMLA_COMMIT", "test-commit")
    script = load_bench_script("bf16_label_check_cpu")
    data = _write_fce(tmp_path / "fce.tsv", 12)
    out = tmp_path / "check.json"
    assert script.main(["--model", str(tiny_tagger_dir), "--data", str(data), "--threads", "1",
                        "--import-repeats", "1", "--margins", "0.5", "0.01", "1.0",
                        "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["provenance"]["commit"] == "test-commit"
    assert result["data"] == {"files": ["fce.tsv"], "sentences": 12,
                              "words": result["data"]["words"]}
    assert set(result["startup_s"]) == {"python", "torch", "torch + encoder code", "onnxruntime"}
    assert all(s > 0 for s in result["startup_s"].values())
    dev = result["bf16_vs_fp32"]
    assert 0 <= dev["mean_abs"] <= dev["q99_abs"] <= dev["q999_abs"] <= dev["max_abs"] <= 1
    assert dev["largest_flipped_deviation"] <= dev["max_abs"]
    rows = result["cascade"]
    assert [r["margin"] for r in rows] == [0.01, 0.5, 1.0]  # sorted
    shares = [r["sentences_rechecked"] for r in rows]
    assert shares == sorted(shares) and shares[-1] == 12  # every probability is within 1 of thr
    for r in rows:
        assert r["share_rechecked"] == pytest.approx(r["sentences_rechecked"] / 12, abs=1e-4)
        assert r["cascade_s"] == pytest.approx(r["bf16_pass_s"] + r["fp32_recheck_s"], abs=2e-3)
        assert 0 <= r["flips_missed"] <= dev["label_flips"]
        if r["margin"] > dev["max_abs"]:  # a margin past every deviation misses no flip
            assert r["flips_missed"] == 0
    assert rows[-1]["flips_missed"] == 0
