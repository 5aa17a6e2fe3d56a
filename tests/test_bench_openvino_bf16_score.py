"""bench/openvino_bf16_score_cpu.py end to end on a tiny [CLS] regression scorer and a tiny
ASAP-like TSV: deviations, re-scored shares and missed score changes per margin, and the speed
rows with the checked scorer's scores equal to fp32's, recorded and consistent."""

from __future__ import annotations

import json
import shutil

import pytest

from bench_scripts import load_bench_script
from test_bench_serve_score import _write_tsv

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
ov = pytest.importorskip("openvino")

from mhmla_fast.serve.score_onnx import read_check_margins  # noqa: E402
from test_serve_score_onnx import cls_regression_scorer_dir  # noqa: E402, F401 - the fixture


def test_openvino_bf16_score_check_on_a_small_file(cls_regression_scorer_dir, tmp_path,
                                                   monkeypatch):
    if "BF16" not in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        pytest.skip("this CPU has no bf16 instructions for OpenVINO")
    monkeypatch.setenv("MHMLA_COMMIT", "test-commit")
    script = load_bench_script("openvino_bf16_score_cpu")
    tsv = _write_tsv(tmp_path / "asap.tsv", per_prompt=5, prompts=range(1, 9), seed=7,
                     max_words=140)
    out = tmp_path / "score.json"
    model = tmp_path / "scorer"
    shutil.copytree(cls_regression_scorer_dir, model)
    assert script.main(["--model", str(model), "--tsv", str(tsv),
                        "--every", "2", "--threads", "2", "--token-budget", "256",
                        "--margins", "0.99", "0.001", "--speed-essays", "16",
                        "--speed-margin", "0.99", "--repeats", "1", "--write-margins",
                        str(model), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    margins = result["calibration"]["per_prompt_margins"]
    assert list(margins) == [str(p) for p in range(1, 9)]
    assert read_check_margins(model) == {int(p): m for p, m in margins.items()}
    for p, m in margins.items():  # 1.35 x the prompt's largest error, rounded up
        top = result["calibration"]["prompts"][f"prompt {p}"]["bf16_vs_fp32"]["window"]["max_abs"]
        assert 1.35 * top <= m <= 1.35 * top + 1e-4
    halves = result["calibration"]["split_half_check"]
    assert list(halves) == ["even -> odd", "odd -> even"]
    assert all(0 <= h["scores_missed"] and 0 <= h["share_tokens"] <= 1 for h in halves.values())
    assert result["provenance"]["commit"] == "test-commit" and result["every"] == 2
    cal = result["calibration"]
    assert cal["essays"] == 20 and cal["windows"] > cal["essays"]  # windows are exercised
    table = cal["prompts"]
    assert list(table) == [f"prompt {p}" for p in range(1, 9)] + ["all"]
    assert sum(table[f"prompt {p}"]["essays"] for p in range(1, 9)) == table["all"]["essays"]
    for row in table.values():
        dev = row["bf16_vs_fp32"]
        win = dev["window"]
        assert 0 <= win["mean_abs"] <= win["q99_abs"] <= win["q999_abs"] <= win["max_abs"] <= 1
        assert dev["essay_max_abs"] <= win["max_abs"] + 1e-7  # an average moves no further
        assert [c["margin"] for c in row["checked"]] == [0.001, 0.99]  # sorted
        wide = row["checked"][1]
        assert wide["essays_rescored"] == row["essays"] and wide["scores_missed"] == 0
        assert wide["share_tokens"] == wide["share_windows"] == 1.0
        own = row["checked_per_prompt_margins"]
        assert own["scores_missed"] == 0  # fitted on these essays: nothing can be missed
        for c in [*row["checked"], own]:
            assert 0 <= c["scores_missed"] <= dev["scores_changed"]
            assert c["share_essays"] == pytest.approx(c["essays_rescored"] / row["essays"],
                                                      abs=1e-4)
    speed = result["speed"]
    assert speed["essays"] == 16 and speed["margin"] == 0.99
    assert len(speed["essays_per_s"]) == 3 and all(v > 0 for v in speed["essays_per_s"].values())
    assert speed["rescored_per_round"] == [16] and speed["checked_equals_fp32"] is True
    assert speed["scores_differing_from_fp32"]["onnxruntime float32"] == 0
