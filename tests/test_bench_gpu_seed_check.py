"""bench/ged_gpu_seed_check.py: the selected epoch, both sides' spread and Welch's test, checked
against numpy and a hand-written Welch statistic."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bench_scripts import load_bench_script


def _log(f05s: list[float], train_seconds: list[float]) -> list[dict]:
    return [{"epoch": k + 1, "dev": {"f05": f}, "seconds": t + 0.5, "train_seconds": t,
             "train_sentences_per_s": 1000.0 / t}
            for k, (f, t) in enumerate(zip(f05s, train_seconds))]


def _suite(seed: int, f05: float) -> dict:
    return {"device": "cpu", "commit": "c0",
            "training": {"config": {"seed": seed}, "epoch": 3, "dev": {"f05": f05}}}


def test_the_check_selects_the_first_best_epoch_and_compares_both_sides(tmp_path, capsys):
    check = load_bench_script("ged_gpu_seed_check")
    gpu = {0: [0.50, 0.57, 0.57, 0.56], 1: [0.52, 0.55, 0.58, 0.54], 2: [0.49, 0.56, 0.55, 0.57]}
    for seed, f in gpu.items():
        (tmp_path / f"run_seed{seed}_log.json").write_text(json.dumps(
            _log(f, [60.0, 5.0 + seed, 5.5, 6.0])))
    ref = [0.560, 0.571, 0.565, 0.552]
    for seed, f in enumerate(ref):
        (tmp_path / f"ged_seed{seed}.json").write_text(json.dumps(_suite(seed, f)))
    out = tmp_path / "check.json"
    assert check.main(["--runs", str(tmp_path / "run_seed*_log.json"),
                       "--reference", str(tmp_path / "ged_seed*.json"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())

    assert [r["selected_epoch"] for r in result["runs"]] == [2, 3, 4]  # ties: the earlier epoch
    a = np.array([57.0, 58.0, 57.0])
    b = 100 * np.array(ref)
    assert result["gpu_dev_f05"]["mean"] == pytest.approx(a.mean())
    assert result["gpu_dev_f05"]["std"] == pytest.approx(a.std(ddof=1))
    assert result["reference_dev_f05"]["per_seed"] == pytest.approx(list(b))
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    assert result["welch"]["t"] == pytest.approx((a.mean() - b.mean()) / math.sqrt(va + vb))
    assert 0 < result["welch"]["p"] < 1
    # the warm epochs only (the first compiles): 5, 6, 7 and 5.5, 6.0 three times
    warm = [5.0, 5.5, 6.0, 6.0, 5.5, 6.0, 7.0, 5.5, 6.0]
    assert result["warm_epoch_train_seconds"]["median"] == pytest.approx(np.median(warm))
    assert "no significant difference" in capsys.readouterr().out


def test_a_run_without_a_seed_in_its_name_is_refused(tmp_path):
    check = load_bench_script("ged_gpu_seed_check")
    (tmp_path / "run_log.json").write_text(json.dumps(_log([0.5], [5.0])))
    (tmp_path / "ged_seed0.json").write_text(json.dumps(_suite(0, 0.5)))
    with pytest.raises(SystemExit, match="no seed"):
        check.main(["--runs", str(tmp_path / "run_log.json"),
                    "--reference", str(tmp_path / "ged_seed0.json"),
                    "--out", str(tmp_path / "x.json")])
