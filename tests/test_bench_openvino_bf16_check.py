"""bench/openvino_bf16_check_cpu.py end to end on the tiny tagger: deviations, re-checked rows
and missed flips per margin, and the speed rows, recorded and consistent with each other."""

from __future__ import annotations

import json

import pytest

from bench_scripts import load_bench_script
from test_bench_serve import _write_fce

pytest.importorskip("onnxruntime")
ov = pytest.importorskip("openvino")


def test_openvino_bf16_check_on_small_files(tiny_tagger_dir, tmp_path, monkeypatch):
    if "BF16" not in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        pytest.skip("this CPU has no bf16 instructions for OpenVINO")
    monkeypatch.setenv("MHMLA_COMMIT", "test-commit")
    script = load_bench_script("openvino_bf16_check_cpu")
    a, b = _write_fce(tmp_path / "a.tsv", 12), _write_fce(tmp_path / "b.tsv", 9)
    out = tmp_path / "check.json"
    assert script.main(["--model", str(tiny_tagger_dir), "--sets", f"both={a},{b}",
                        f"first5={a}:5", "--threads", "2", "--repeats", "1",
                        "--margins", "0.99", "0.01", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["provenance"]["commit"] == "test-commit" and result["lanes"] == 2
    assert list(result["sets"]) == ["both", "first5"]
    both, first5 = result["sets"]["both"], result["sets"]["first5"]
    assert (both["sentences"], first5["sentences"], both["files"]) == (21, 5, ["a.tsv", "b.tsv"])
    for row in (both, first5):
        dev = row["bf16_vs_fp32"]
        assert 0 <= dev["mean_abs"] <= dev["q99_abs"] <= dev["q999_abs"] <= dev["max_abs"] <= 1
        assert [c["margin"] for c in row["checked"]] == [0.01, 0.99]  # sorted
        wide = row["checked"][1]
        assert wide["rows_rechecked"] == wide["rows"] and wide["label_flips_missed"] == 0
        for c in row["checked"]:
            assert 0 <= c["label_flips_missed"] <= max(dev["label_flips"], 0)
            assert c["share_rechecked"] == pytest.approx(c["rows_rechecked"] / c["rows"],
                                                         abs=1e-4)
    speed = result["speed"]
    assert speed["set"] == "both" and speed["sentences"] == 21
    assert len(speed["sentences_per_s"]) == 3 and all(v > 0 for v in
                                                      speed["sentences_per_s"].values())
    split, = speed["checked_split"]  # one round
    assert split["fast"]["rows"] == 21 and 0 <= split["exact"]["rows"] <= 21
    for side in split.values():
        assert side["lane_seconds"] > 0 or side["calls"] == 0
        assert side["padded_tokens"] >= side["rows"]
