"""bench/aes_paired_cells.py: paired per-cell comparison of AES models, against scipy and a
hand-computed Holm adjustment."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import stats

from bench_scripts import load_bench_script


def _result(qwk: dict[str, np.ndarray]) -> dict:
    return {"models": {m: {"qwk": {str(k): {str(p): float(v[k, i]) for i, p in enumerate((3, 4))}
                                   for k in range(v.shape[0])}} for m, v in qwk.items()},
            "ensembles": {}}


def test_pairs_match_scipy_and_holm(tmp_path, capsys):
    bench = load_bench_script("aes_paired_cells")
    rng = np.random.default_rng(0)
    base = rng.uniform(0.6, 0.8, size=(5, 2))
    better = base + rng.uniform(0.0, 0.03, size=(5, 2))
    same = base.copy()
    same[0, 0] += 0.01
    same[1, 1] -= 0.02
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_result({"base": base, "better": better, "same": same})))
    out = tmp_path / "pairs.json"
    assert bench.main([str(path), "--pair", "better:base", "--pair", "same:base",
                       "--out", str(out)]) == 0
    pairs = json.loads(out.read_text())["pairs"]
    d = (better - base).ravel()
    assert pairs[0]["mean_diff"] == pytest.approx(d.mean())
    assert pairs[0]["wins"] == 10 and pairs[0]["n"] == 10
    assert pairs[0]["p_wilcoxon"] == pytest.approx(stats.wilcoxon(d).pvalue)
    assert pairs[0]["per_prompt_diff"]["3"] == pytest.approx((better - base)[:, 0].mean())
    assert (pairs[1]["wins"], pairs[1]["losses"], pairs[1]["ties"]) == (1, 1, 8)
    p = sorted([pairs[0]["p_wilcoxon"], pairs[1]["p_wilcoxon"]])
    assert pairs[0]["p_holm"] == pytest.approx(min(1.0, 2 * p[0]))
    assert pairs[1]["p_holm"] == pytest.approx(max(min(1.0, 2 * p[0]), min(1.0, p[1])))
    assert bench.main([str(path), "--pair", "base:nope", "--out", str(out)]) == 2
    assert "no model 'nope'" in capsys.readouterr().err
    assert bench.main([str(path), "--pair", "base", "--out", str(out)]) == 2


def test_holm_is_monotone_and_capped():
    bench = load_bench_script("aes_paired_cells")
    assert bench.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert bench.holm([0.6, 0.9]) == [1.0, 1.0]


def test_models_of_several_files_and_ensemble_rows_pair_by_cell(tmp_path, capsys):
    """LABEL=FILE results (two protocol runs, and a file of aes_ensemble.py --fold all) pair
    LABEL/model by (fold, prompt) as one file would; other folds are refused."""
    bench = load_bench_script("aes_paired_cells")
    rng = np.random.default_rng(1)
    a, b, ens = (rng.uniform(0.6, 0.8, size=(5, 2)) for _ in range(3))
    for name, v in (("a", a), ("b", b)):
        r = {**_result({"ridge": v}), "folds": list(range(5)), "prompts": [3, 4]}
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    folds = {str(k): {"cells": {str(p): {"greedy-frozen": {"test_qwk": float(ens[k, i])},
                                         "members": {"x/ridge": {"test_qwk": 0.5}}}
                                for i, p in enumerate((3, 4))}} for k in range(5)}
    (tmp_path / "ens.json").write_text(json.dumps({"folds": folds}))
    one = tmp_path / "one.json"
    one.write_text(json.dumps(_result({"a": a, "b": b, "ens": ens})))
    out, want = tmp_path / "pairs.json", tmp_path / "want.json"
    files = [f"A={tmp_path / 'a.json'}", f"B={tmp_path / 'b.json'}", f"E={tmp_path / 'ens.json'}"]
    assert bench.main([*files, "--pair", "A/ridge:B/ridge", "--pair", "E/greedy-frozen:A/ridge",
                       "--out", str(out)]) == 0
    assert bench.main([str(one), "--pair", "a:b", "--pair", "ens:a", "--out", str(want)]) == 0
    got, expected = json.loads(out.read_text())["pairs"], json.loads(want.read_text())["pairs"]
    for g, w in zip(got, expected):
        for key in ("n", "mean_diff", "wins", "losses", "p_wilcoxon", "p_holm", "per_prompt_diff"):
            assert g[key] == w[key], key
    short = {**_result({"ridge": a[:4]}), "folds": list(range(4)), "prompts": [3, 4]}
    (tmp_path / "short.json").write_text(json.dumps(short))
    assert bench.main([files[0], f"S={tmp_path / 'short.json'}", "--pair", "A/ridge:S/ridge",
                       "--out", str(out)]) == 2
    assert "not those of the first file" in capsys.readouterr().err
    assert bench.main([files[0], str(tmp_path / "b.json"), "--pair", "x:y",
                       "--out", str(out)]) == 2


def test_seed_mean_files_average_each_cell_before_the_test(tmp_path, capsys):
    """LABEL=F1+F2+F3 pairs the per-cell mean over the three runs (as one file holding those
    means would); runs whose settings differ beyond the seed, or of other folds, are refused."""
    bench = load_bench_script("aes_paired_cells")
    rng = np.random.default_rng(2)
    a, b = rng.uniform(0.6, 0.8, size=(2, 3, 5, 2))  # model x seed x fold x prompt
    paths = []
    for s in range(3):
        r = {**_result({"a": a[s], "b": b[s]}), "folds": list(range(5)), "prompts": [3, 4]}
        for m in r["models"].values():
            m["settings"] = {"lr": 1e-3, "seed": s}
        paths.append(tmp_path / f"s{s}.json")
        paths[-1].write_text(json.dumps(r))
    mean = tmp_path / "mean.json"
    mean.write_text(json.dumps(_result({"a": a.mean(0), "b": b.mean(0)})))
    out, want = tmp_path / "pairs.json", tmp_path / "want.json"
    spec = "S=" + "+".join(map(str, paths))
    assert bench.main([spec, "--pair", "S/a:S/b", "--out", str(out)]) == 0
    assert bench.main([str(mean), "--pair", "a:b", "--out", str(want)]) == 0
    got = json.loads(out.read_text())["pairs"][0]
    expected = json.loads(want.read_text())["pairs"][0]
    assert got["mean_diff"] == pytest.approx((a - b).mean())
    for key in ("n", "wins", "losses", "p_wilcoxon", "per_prompt_diff"):
        assert got[key] == pytest.approx(expected[key]), key

    r = json.loads(paths[2].read_text())
    r["models"]["a"]["settings"]["lr"] = 1e-2
    paths[2].write_text(json.dumps(r))
    assert bench.main([spec, "--pair", "S/a:S/b", "--out", str(out)]) == 2
    assert "a: settings differ in more than the seed" in capsys.readouterr().err
    assert bench.main([f"S={paths[0]}+{paths[0]}", "--pair", "S/a:S/b", "--out", str(out)]) == 2
    assert "given twice" in capsys.readouterr().err
    short = {**_result({"a": a[0, :4], "b": b[0, :4]}), "folds": list(range(4)), "prompts": [3, 4]}
    (tmp_path / "short.json").write_text(json.dumps(short))
    assert bench.main([f"S={paths[0]}+{tmp_path / 'short.json'}", "--pair", "S/a:S/b",
                       "--out", str(out)]) == 2
    assert "not those of" in capsys.readouterr().err
