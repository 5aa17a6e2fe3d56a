"""bench/aes_ensemble.py: dev-chosen ensembles of fine-tuned and frozen scorers, checked
against the ensembles computed here, and its refusals of members of other essays."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench_scripts import load_bench_script
from test_aes_train import write_asap

from mhmla_fast.aes.data import read_asap, read_folds, split_essays
from mhmla_fast.aes.ensembles import greedy_ensemble, mean_ensemble
from mhmla_fast.aes.train import asap_files, qwk


def _noisy(gold, rng, flip: float) -> list[int]:
    """``gold`` with a share ``flip`` of the scores moved by one (clipped to prompt 3's 0..3)."""
    moved = np.clip(np.asarray(gold) + rng.choice([-1, 1], size=len(gold)), 0, 3)
    return np.where(rng.random(len(gold)) < flip, moved, gold).astype(int).tolist()


@pytest.fixture()
def run(tmp_path):
    data = write_asap(tmp_path / "data", n_per_prompt=40)
    tsv, folds = asap_files(data)
    essays, fold_ids = read_asap(tsv), read_folds(folds)
    rng = np.random.default_rng(0)
    units, ft = tmp_path / "units", tmp_path / "ft" / "mhmla-cls-finetuned"
    units.mkdir()
    splits = {p: split_essays(essays, fold_ids, 0, prompt=p) for p in (3, 4)}
    joint = {}
    for p, sp in splits.items():
        test_gold = [e.score for e in sp["test"]]
        dev_gold = [e.score for e in sp["dev"]]
        base = {"ids": [e.essay_id for e in sp["test"]], "gold": test_gold, "settings": {}}
        for name, flip in (("ridge-layers", 0.5), ("mhmla-cls", 0.3)):
            unit = {**base, "pred": _noisy(test_gold, rng, flip),
                    "dev_pred": _noisy(dev_gold, rng, flip)}
            (units / f"{name}-fold0-p{p}.json").write_text(json.dumps(unit))
        joint[str(p)] = {**base, "pred": _noisy(test_gold, rng, 0.6),
                         "dev_pred": _noisy(dev_gold, rng, 0.6)}
        cell = ft / f"fold0-p{p}"
        cell.mkdir(parents=True)
        (cell / "test.json").write_text(json.dumps({
            **base, "pred": _noisy(test_gold, rng, 0.2), "dev_pred": _noisy(dev_gold, rng, 0.2),
            "dev_ids": [e.essay_id for e in sp["dev"]], "qwk": 0.0}))
    (units / "mhmla-joint-cls-fold0-p3_4.json").write_text(json.dumps(joint))
    (units / "mhmla-cls-fold1-p3.json").write_text("{}")  # another fold: not read
    return data, units, ft, splits


def test_ensembles_match_an_independent_computation(run, tmp_path):
    bench = load_bench_script("aes_ensemble")
    data, units, ft, splits = run
    out = tmp_path / "ens.json"
    assert bench.main(["--units", str(units), "--finetuned", str(ft), "--fold", "0",
                       "--prompt", "3,4", "--data-dir", str(data), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["prompts"] == [3, 4] and result["prompts_finetuned"] == [3, 4]
    for p, sp in splits.items():
        cell = result["cells"][str(p)]
        assert set(cell["members"]) == {"ridge-layers", "mhmla-cls", "mhmla-joint-cls",
                                        "mhmla-cls-finetuned"}
        assert cell["members"]["mhmla-cls-finetuned"]["kind"] == "finetuned"
        members = {n: json.loads((units / f"{n}-fold0-p{p}.json").read_text())
                   for n in ("mhmla-cls", "ridge-layers")}
        members["mhmla-joint-cls"] = json.loads(
            (units / "mhmla-joint-cls-fold0-p3_4.json").read_text())[str(p)]
        members["mhmla-cls-finetuned"] = json.loads((ft / f"fold0-p{p}" / "test.json").read_text())
        dev_gold = np.array([e.score for e in sp["dev"]])
        test_gold = np.array([e.score for e in sp["test"]])
        names = sorted(cell["members"])  # the script's order: frozen units by file name, then ft
        order = [n for n in ("mhmla-cls", "mhmla-joint-cls", "ridge-layers")] + \
                ["mhmla-cls-finetuned"]
        assert sorted(order) == names
        picks = greedy_ensemble([np.array(members[n]["dev_pred"]) for n in order], dev_gold, p)
        want = qwk(test_gold, mean_ensemble([np.array(members[order[i]]["pred"])
                                             for i in picks], p), p)
        assert cell["greedy-all"]["test_qwk"] == pytest.approx(want, abs=1e-12)
        assert cell["greedy-all"]["picks"] == [order[i] for i in picks]
        frozen = order[:3]
        picks = greedy_ensemble([np.array(members[n]["dev_pred"]) for n in frozen], dev_gold, p)
        want = qwk(test_gold, mean_ensemble([np.array(members[frozen[i]]["pred"])
                                             for i in picks], p), p)
        assert cell["greedy-frozen"]["test_qwk"] == pytest.approx(want, abs=1e-12)
        best = max(order, key=lambda n: qwk(dev_gold, np.array(members[n]["dev_pred"]), p))
        assert cell["best-by-dev-all"]["member"] == best
    means = result["mean_test_qwk"]
    assert means["greedy-all"] == pytest.approx(
        np.mean([result["cells"][p]["greedy-all"]["test_qwk"] for p in ("3", "4")]))


def test_members_of_other_essays_are_refused(run):
    bench = load_bench_script("aes_ensemble")
    data, units, ft, _ = run
    args = ["--units", str(units), "--finetuned", str(ft), "--fold", "0", "--prompt", "3",
            "--data-dir", str(data)]
    path = ft / "fold0-p3" / "test.json"
    cell = json.loads(path.read_text())
    path.write_text(json.dumps({**cell, "dev_ids": cell["dev_ids"][::-1]}))
    with pytest.raises(ValueError, match="dev essays are not the split's"):
        bench.main(args)
    path.write_text(json.dumps({**cell, "ids": cell["ids"][::-1]}))
    with pytest.raises(ValueError, match="other test essays"):
        bench.main(args)
    path.write_text(json.dumps({k: v for k, v in cell.items() if k != "pred"}))
    with pytest.raises(ValueError, match="no predictions stored"):
        bench.main(args)


def test_a_prompt_without_a_fine_tuned_cell_counts_with_its_frozen_members(run, tmp_path):
    bench = load_bench_script("aes_ensemble")
    data, units, ft, _ = run
    (ft / "fold0-p4" / "test.json").unlink()
    out = tmp_path / "ens.json"
    assert bench.main(["--units", str(units), "--finetuned", str(ft), "--fold", "0",
                       "--prompt", "3,4", "--data-dir", str(data), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["prompts"] == [3, 4] and result["prompts_finetuned"] == [3]
    cell = result["cells"]["4"]
    assert {m["kind"] for m in cell["members"].values()} == {"frozen"}
    assert cell["greedy-all"] == cell["greedy-frozen"]
    assert cell["best-by-dev-all"] == cell["best-by-dev-frozen"]
    assert "mhmla-cls-finetuned" not in result["mean_test_qwk"]  # not a member of every cell
    for p in (3, 4):  # no frozen member: the prompt is skipped
        for unit in units.glob(f"*-fold0-p{p}.json"):
            unit.unlink()
    (units / "mhmla-joint-cls-fold0-p3_4.json").unlink()
    assert bench.main(["--units", str(units), "--finetuned", str(ft), "--fold", "0",
                       "--prompt", "3,4", "--data-dir", str(data)]) == 1


def test_joint_units_of_several_prompt_sets_are_chosen_not_mixed(run, tmp_path):
    bench = load_bench_script("aes_ensemble")
    data, units, ft, _ = run
    first = json.loads((units / "mhmla-joint-cls-fold0-p3_4.json").read_text())
    other = {p: {**u, "pred": u["pred"][::-1]} for p, u in first.items()}  # another joint model
    (units / "mhmla-joint-cls-fold0-p3_4_5.json").write_text(json.dumps(other))
    args = ["--units", str(units), "--finetuned", str(ft), "--fold", "0",
            "--data-dir", str(data)]

    def joint_test_qwk(out, p, unit):
        cell = json.loads(out.read_text())["cells"][str(p)]
        assert cell["unit_files"]["mhmla-joint-cls"] == unit
        return cell["members"]["mhmla-joint-cls"]["test_qwk"]

    out = tmp_path / "a.json"
    assert bench.main([*args, "--prompt", "3,4", "--out", str(out)]) == 0  # the run's own set
    a = joint_test_qwk(out, 3, "mhmla-joint-cls-fold0-p3_4.json")
    with pytest.raises(ValueError, match="prompt sets 3,4, 3,4,5 for prompt 3"):
        bench.main([*args, "--prompt", "3"])
    out = tmp_path / "b.json"
    assert bench.main([*args, "--prompt", "3", "--joint-prompts", "3,4,5", "--out",
                       str(out)]) == 0
    b = joint_test_qwk(out, 3, "mhmla-joint-cls-fold0-p3_4_5.json")
    gold = np.array(first["3"]["gold"])
    assert a == pytest.approx(qwk(gold, np.array(first["3"]["pred"]), 3), abs=1e-12)
    assert b == pytest.approx(qwk(gold, np.array(other["3"]["pred"]), 3), abs=1e-12)


def test_joint_fine_tuned_cells_give_each_prompt_its_share(run, tmp_path):
    """A ``--finetune --joint`` cell (``fold0-p3_4/test.json``, one record per prompt) is a
    member of each of its prompts; cells of several prompt sets are chosen by
    ``--joint-prompts``, never mixed."""
    bench = load_bench_script("aes_ensemble")
    data, units, ft, splits = run
    joint_ft = ft.parent / "mhmla-joint-cls-finetuned"
    rng = np.random.default_rng(1)

    def write_cell(prompts, flip):
        records = {}
        for p in prompts:
            sp = splits[p]
            test_gold = [e.score for e in sp["test"]]
            records[str(p)] = {"ids": [e.essay_id for e in sp["test"]], "gold": test_gold,
                               "pred": _noisy(test_gold, rng, flip),
                               "dev_ids": [e.essay_id for e in sp["dev"]],
                               "dev_pred": _noisy([e.score for e in sp["dev"]], rng, flip)}
        cell = joint_ft / f"fold0-p{'_'.join(map(str, prompts))}"
        cell.mkdir(parents=True)
        (cell / "test.json").write_text(json.dumps({"settings": {}, "prompts": records}))
        return records

    records = write_cell((3, 4), 0.25)
    args = ["--units", str(units), "--finetuned", str(ft), str(joint_ft), "--fold", "0",
            "--data-dir", str(data)]
    out = tmp_path / "ens.json"
    assert bench.main([*args, "--prompt", "3,4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for p in (3, 4):
        member = result["cells"][str(p)]["members"]["mhmla-joint-cls-finetuned"]
        assert member["kind"] == "finetuned"
        want = qwk(np.array(records[str(p)]["gold"]), np.array(records[str(p)]["pred"]), p)
        assert member["test_qwk"] == pytest.approx(want, abs=1e-12)
    assert "mhmla-joint-cls-finetuned" in result["mean_test_qwk"]
    # prompt 3 alone has no cell of its own set: the joint cell holding it is its member
    assert bench.main([*args, "--prompt", "3"]) == 0
    # a joint cell of another prompt set holding prompt 3 too
    (joint_ft / "fold0-p3_4_5").mkdir()
    reversed_preds = {p: {**r, "pred": r["pred"][::-1]} for p, r in records.items()}
    (joint_ft / "fold0-p3_4_5" / "test.json").write_text(
        json.dumps({"settings": {}, "prompts": reversed_preds}))
    with pytest.raises(ValueError, match="joint cells of several prompt sets hold prompt 3"):
        bench.main([*args, "--prompt", "3"])
    out = tmp_path / "b.json"
    assert bench.main([*args, "--prompt", "3", "--joint-prompts", "3,4,5", "--out",
                       str(out)]) == 0
    got = json.loads(out.read_text())["cells"]["3"]["members"]["mhmla-joint-cls-finetuned"]
    gold = np.array(records["3"]["gold"])
    assert got["test_qwk"] == pytest.approx(qwk(gold, np.array(records["3"]["pred"][::-1]), 3),
                                            abs=1e-12)


def test_units_of_two_encoders_over_all_folds(tmp_path):
    """Several --units folders pool their members as LABEL/model; --fold all holds each fold's
    result (equal to a run of that fold alone) and means over the folds; a label twice is
    refused."""
    bench = load_bench_script("aes_ensemble")
    data = write_asap(tmp_path / "data", n_per_prompt=40, folds=2)
    tsv, folds = asap_files(data)
    essays, fold_ids = read_asap(tsv), read_folds(folds)
    rng = np.random.default_rng(1)
    dirs = {"minilm": tmp_path / "a" / "units", "mpnet": tmp_path / "b" / "units"}
    for d in dirs.values():
        d.mkdir(parents=True)
    for k in (0, 1):
        for p in (3, 4):
            sp = split_essays(essays, fold_ids, k, prompt=p)
            test_gold, dev_gold = [e.score for e in sp["test"]], [e.score for e in sp["dev"]]
            for label, d in dirs.items():
                for name, flip in (("ridge-layers", 0.4), ("surface-ridge", 0.6)):
                    unit = {"ids": [e.essay_id for e in sp["test"]], "gold": test_gold,
                            "settings": {}, "pred": _noisy(test_gold, rng, flip),
                            "dev_pred": _noisy(dev_gold, rng, flip)}
                    (d / f"{name}-fold{k}-p{p}.json").write_text(json.dumps(unit))
    units = [f"{label}={d}" for label, d in dirs.items()]
    out = tmp_path / "all.json"
    assert bench.main(["--units", *units, "--fold", "all", "--prompt", "3,4", "--data-dir",
                       str(data), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["folds"]) == {"0", "1"} and result["units"]["mpnet"] == str(dirs["mpnet"])
    for k in ("0", "1"):
        one = tmp_path / f"fold{k}.json"
        assert bench.main(["--units", *units, "--fold", k, "--prompt", "3,4", "--data-dir",
                           str(data), "--out", str(one)]) == 0
        alone = json.loads(one.read_text())
        assert result["folds"][k]["cells"] == alone["cells"]
        assert set(alone["cells"]["3"]["members"]) == {
            "minilm/ridge-layers", "minilm/surface-ridge", "mpnet/ridge-layers",
            "mpnet/surface-ridge"}
    for row in ("greedy-frozen", "mpnet/ridge-layers"):
        cells = [result["folds"][k]["cells"][p] for k in ("0", "1") for p in ("3", "4")]
        want = np.mean([c[row]["test_qwk"] if row in c else c["members"][row]["test_qwk"]
                        for c in cells])
        assert result["mean_test_qwk"][row] == pytest.approx(want, abs=1e-12)
        assert result["per_prompt_test_qwk"][row]["3"] == pytest.approx(np.mean(
            [cells[0][row]["test_qwk"] if row in cells[0] else
             cells[0]["members"][row]["test_qwk"],
             cells[2][row]["test_qwk"] if row in cells[2] else
             cells[2]["members"][row]["test_qwk"]]), abs=1e-12)
    assert bench.main(["--units", f"x={dirs['minilm']}", f"x={dirs['mpnet']}", "--fold", "0",
                       "--prompt", "3", "--data-dir", str(data)]) == 2
    chosen = tmp_path / "chosen.json"  # --members pools only those named
    assert bench.main(["--units", *units, "--fold", "all", "--prompt", "3,4", "--data-dir",
                       str(data), "--members", "minilm/ridge-layers,mpnet/surface-ridge",
                       "--out", str(chosen)]) == 0
    picked = json.loads(chosen.read_text())
    assert picked["members"] == ["minilm/ridge-layers", "mpnet/surface-ridge"]
    for fold in picked["folds"].values():
        for cell in fold["cells"].values():
            assert set(cell["members"]) == {"minilm/ridge-layers", "mpnet/surface-ridge"}
    assert bench.main(["--units", *units, "--fold", "0", "--prompt", "3", "--data-dir",
                       str(data), "--members", "minilm/ridge-layers,mpnet/tfidf-ridge"]) == 2


def test_greedy_blend_of_two_encoders_cut_ridges(run, tmp_path):
    """Units that keep continuous predictions (the cut ridges) blend across --units folders:
    the rows equal ``stack_blend`` and ``greedy_blend`` computed here on the split's gold
    scores; members of other essays (data digests) or of other lengths are refused; one such
    member gives no row."""
    from mhmla_fast.aes.cutpoints import apply_cutpoints
    from mhmla_fast.aes.ensembles import blend_values, greedy_blend, pick_weights, stack_blend

    bench = load_bench_script("aes_ensemble")
    data, units, ft, splits = run
    other = tmp_path / "mpnet" / "units"
    other.mkdir(parents=True)
    rng = np.random.default_rng(2)
    written = {}
    for p, sp in splits.items():
        gold = {s: np.array([e.score for e in sp[s]]) for s in ("train", "dev", "test")}
        for folder in (units, other):
            x = {key: (1.5 + 0.5 * (gold[s] - 1.5) + rng.normal(0, 0.4, gold[s].size)).tolist()
                 for key, s in (("train_oof", "train"), ("dev", "dev"), ("test", "test"))}
            cuts = np.arange(3) + 0.5
            unit = {"ids": [e.essay_id for e in sp["test"]], "gold": gold["test"].tolist(),
                    "settings": {}, "data": f"digest-p{p}", "continuous": x,
                    "pred": apply_cutpoints(np.array(x["test"]), cuts, p).tolist(),
                    "dev_pred": apply_cutpoints(np.array(x["dev"]), cuts, p).tolist()}
            path = folder / f"ridge-layers-both-surface-cuts-fold0-p{p}.json"
            path.write_text(json.dumps(unit))
            written[(folder, p)] = (path, unit)
    args = ["--units", f"minilm={units}", f"mpnet={other}", "--fold", "0", "--prompt", "3,4",
            "--data-dir", str(data)]
    out = tmp_path / "blend.json"
    assert bench.main([*args, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for p, sp in splits.items():
        row = result["cells"][str(p)]["greedy-blend"]
        names = ["minilm/ridge-layers-both-surface-cuts", "mpnet/ridge-layers-both-surface-cuts"]
        x = {key: [np.array(written[(f, p)][1]["continuous"][key]) for f in (units, other)]
             for key in ("train_oof", "dev", "test")}
        train_gold = np.array([e.score for e in sp["train"]])
        test_gold = np.array([e.score for e in sp["test"]])
        picks, cuts = greedy_blend(x["train_oof"], x["dev"], train_gold,
                                   np.array([e.score for e in sp["dev"]]), p)
        assert row["picks"] == [names[i] for i in picks]
        assert row["cutpoints"] == pytest.approx(cuts.tolist())
        want = qwk(test_gold, apply_cutpoints(blend_values(x["test"], pick_weights(
            picks, 2)), cuts, p), p)
        assert row["test_qwk"] == pytest.approx(want, abs=1e-12)
        stack = result["cells"][str(p)]["stack-blend"]
        w, cuts = stack_blend(x["train_oof"], train_gold, p)
        assert stack["weights"] == pytest.approx({n: v for n, v in zip(names, w) if v > 0})
        want = qwk(test_gold, apply_cutpoints(blend_values(x["test"], w), cuts, p), p)
        assert stack["test_qwk"] == pytest.approx(want, abs=1e-12)
    for name in ("greedy-blend", "stack-blend"):
        assert result["mean_test_qwk"][name] == pytest.approx(np.mean(
            [result["cells"][p][name]["test_qwk"] for p in ("3", "4")]))
    assert "greedy-stack-finetuned" not in result["cells"]["3"]  # no fine-tuned member given
    assert result["units"] == {"minilm": str(units), "mpnet": str(other)}
    # one labelled folder: its members are named LABEL/model, and the file records it so
    # (this once failed with a KeyError after every cell was computed)
    one = ["--units", f"minilm={units}", *args[3:]]
    assert bench.main([*one, "--out", str(out)]) == 0
    single = json.loads(out.read_text())
    assert single["units"] == {"minilm": str(units)}
    names = set(single["cells"]["3"]["members"])
    assert "minilm/ridge-layers-both-surface-cuts" in names
    assert all(n.startswith("minilm/") for n in names)
    # with a fine-tuned member: the stack's scores join it as one member, chosen on dev
    assert bench.main([*args, "--finetuned", str(ft), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for p, sp in splits.items():
        cell = result["cells"][str(p)]
        stack = cell["stack-blend"]
        tuned = json.loads((ft / f"fold0-p{p}" / "test.json").read_text())
        dev_gold = np.array([e.score for e in sp["dev"]])
        picks = greedy_ensemble([np.array(stack["dev_pred"]), np.array(tuned["dev_pred"])],
                                dev_gold, p)
        names = ["stack-blend", "mhmla-cls-finetuned"]
        pred = mean_ensemble([np.array([stack["pred"], tuned["pred"]][i]) for i in picks], p)
        assert cell["greedy-stack-finetuned"]["picks"] == [names[i] for i in picks]
        assert cell["greedy-stack-finetuned"]["test_qwk"] == pytest.approx(
            qwk(np.array([e.score for e in sp["test"]]), pred, p), abs=1e-12)
        assert cell["stack-blend"]["test_qwk"] == pytest.approx(qwk(
            np.array([e.score for e in sp["test"]]), np.array(stack["pred"]), p), abs=1e-12)
    path, unit = written[(other, 3)]
    path.write_text(json.dumps({**unit, "data": "another digest"}))
    with pytest.raises(ValueError, match="not made from the same essays"):
        bench.main(args)
    short = {**unit["continuous"], "train_oof": unit["continuous"]["train_oof"][:-1]}
    path.write_text(json.dumps({**unit, "continuous": short}))
    with pytest.raises(ValueError, match="continuous train_oof predictions"):
        bench.main(args)
    path.unlink()  # one blendable member left for prompt 3: no blend row there, nor a mean
    assert bench.main([*args, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for name in ("greedy-blend", "stack-blend"):
        assert name not in result["cells"]["3"] and name in result["cells"]["4"]
        assert name not in result["mean_test_qwk"]
