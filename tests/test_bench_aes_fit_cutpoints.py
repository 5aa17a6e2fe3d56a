"""bench/aes_fit_cutpoints_cpu.py: this tree's fit_cutpoints against a git revision's."""

from __future__ import annotations

import json

import numpy as np

from bench_scripts import load_bench_script
from test_aes_train import write_asap

from mhmla_fast.aes.cutpoints import fit_cutpoints
from mhmla_fast.aes.data import read_asap, read_folds, split_essays
from mhmla_fast.aes.train import asap_files


def test_times_both_and_checks_they_agree(tmp_path):
    """Each cut unit of the fold is refitted by both (here HEAD's module against this tree's:
    the same algorithm) on its out-of-fold predictions and the fold's training gold; units of
    other folds, uncut units and units without continuous predictions are skipped."""
    bench = load_bench_script("aes_fit_cutpoints_cpu")
    data = write_asap(tmp_path / "data", n_per_prompt=40)
    tsv, folds = asap_files(data)
    essays, fold_ids = read_asap(tsv), read_folds(folds)
    units = tmp_path / "units"
    units.mkdir()
    rng = np.random.default_rng(0)
    oof = {}
    for p in (3, 4):
        gold = np.array([e.score for e in split_essays(essays, fold_ids, 0, prompt=p)["train"]])
        oof[p] = (1.5 + 0.4 * (gold - 1.5) + rng.normal(0, 0.3, gold.size), gold)
        (units / f"ridge-layers-cuts-fold0-p{p}.json").write_text(json.dumps(
            {"continuous": {"train_oof": oof[p][0].tolist()}}))
    (units / "ridge-layers-fold0-p3.json").write_text("{}")  # not cut: skipped
    (units / "ridge-layers-cuts-fold1-p3.json").write_text("{}")  # another fold: skipped
    (units / "tfidf-ridge-cuts-fold0-p3.json").write_text("{}")  # no continuous: skipped
    out = tmp_path / "bench.json"
    assert bench.main(["--units", str(units), "--fold", "0", "--reference-rev", "HEAD",
                       "--data-dir", str(data), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["unit"] for r in result["rows"]] == ["ridge-layers-cuts-fold0-p3.json",
                                                   "ridge-layers-cuts-fold0-p4.json"]
    assert result["all_identical"] and all(r["identical"] for r in result["rows"])
    assert [r["essays"] for r in result["rows"]] == [oof[3][1].size, oof[4][1].size]
    assert result["total_seconds"] > 0 and result["reference_total_seconds"] > 0
    assert {"device", "commit"} <= set(result["provenance"])
    # the rows' cutpoints are this tree's: the reference module is another object
    ref = bench.load_reference("HEAD")
    assert ref.fit_cutpoints is not fit_cutpoints
    np.testing.assert_array_equal(ref.fit_cutpoints(*oof[3], 3), fit_cutpoints(*oof[3], 3))
    assert bench.main(["--units", str(units), "--fold", "2", "--reference-rev", "HEAD",
                       "--data-dir", str(data)]) == 1  # no cut unit of that fold
