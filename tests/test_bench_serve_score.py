"""The essay-scoring throughput benchmark (bench/benchmark_serve_score_cpu.py) runs end to end on a
tiny scorer and a tiny ASAP-like TSV: the timed command's scores equal the in-process ones, and
the results file names its device, settings and commit."""

from __future__ import annotations

import datetime
import json
import random
from pathlib import Path

import pytest

from bench_scripts import load_bench_script

WORDS = "the a student school computer people think because many help write good".split()


def _write_tsv(path: Path, per_prompt: int, prompts=range(1, 8), seed: int = 5,
               max_words: int = 120) -> Path:
    """Essays of ``prompts`` (default 1-7, the tiny scorer's), some longer than one 62-piece
    window."""
    from mhmla_fast.aes.data import SCORE_RANGES

    rng = random.Random(seed)
    lines = ["essay_id\tessay_set\tessay\trater1_domain1\trater2_domain1\tdomain1_score"]
    k = 0
    for prompt in prompts:
        lo, hi = SCORE_RANGES[prompt]
        for _ in range(per_prompt):
            k += 1
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, max_words)))
            s = rng.randint(lo, hi)
            lines.append(f"{k}\t{prompt}\t{text}\t{s}\t{s}\t{s}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_score_benchmark_main_writes_a_checked_result(tiny_scorer_dir, tmp_path, monkeypatch,
                                                      capsys):
    bench = load_bench_script("benchmark_serve_score_cpu")
    monkeypatch.setenv("MHMLA_COMMIT", "test-commit")
    tsv = _write_tsv(tmp_path / "asap.tsv", per_prompt=4)
    out = tmp_path / "score.json"
    rc = bench.main(["--model", str(tiny_scorer_dir), "--tsv", str(tsv), "--essays", "24",
                     "--threads", "1", "--batch-essays", "8", "--token-budget", "256",
                     "--compare-torch", "--out", str(out)])
    assert rc == 0, capsys.readouterr()
    result = json.loads(out.read_text())
    head = result["header"]
    assert head["commit"] == "test-commit" and head["device"]["cpu"]
    assert head["settings"]["device"] == "cpu" and head["settings"]["dtype"] is None
    assert head["settings"]["resolved_dtype"] == "float32"  # no AMX (tests/conftest.py)
    assert result["sample"]["essays"] == 21  # 3 per prompt; the TSV has no prompt 8
    assert result["sample"]["per_prompt"] == {**{str(p): 3 for p in range(1, 8)}, "8": 0}
    assert result["sample"]["multi_window_essays"] >= 1  # windows are exercised
    assert result["end_to_end"]["exit_status"] == 0
    assert "--device cpu --threads 1" in result["end_to_end"]["command"]  # the default dtype
    assert result["check"]["cli_equals_in_process"] is True and result["check"]["mismatches"] == 0
    assert head["settings"]["backend"] == "auto" and "--backend auto" in result["end_to_end"][
        "command"]
    assert result["in_process"]["scorer"] == "OnnxScorer"  # auto on the CPU: the export
    assert result["end_to_end"]["cold_cache"]["exit_status"] == 0
    assert result["check"]["equals_torch"]["differing"] == 0
    assert result["end_to_end"]["essays_per_s"] > 0 and result["in_process"]["essays_per_s"] > 0
    assert "essays/s" in capsys.readouterr().out


def test_score_benchmark_names_its_results_by_device(tmp_path):
    bench = load_bench_script("benchmark_serve_score_cpu")
    day = datetime.date(2026, 11, 22)
    assert bench.resolve_out_path(str(tmp_path), day).name == "aes_serve_cpu_2026-11-22.json"
    assert bench.resolve_out_path(str(tmp_path), day, "cuda:0").name == \
        "aes_serve_cuda_2026-11-22.json"
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "tpu"])
