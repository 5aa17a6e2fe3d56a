"""Ensembles of fine-tuned and frozen-feature essay scorers, chosen on dev, per (fold, prompt).

    python bench/aes_ensemble.py --units runs/aes-cpu/units \\
        --finetuned runs/aes-ft/mhmla-cls-finetuned --fold 0 --prompt 3,4,5,6,7 \\
        --out bench/results/aes_finetune_cpu_bf16/aes_ensemble_fold0.json
    # two encoders' frozen protocol runs, all five folds, no fine-tuned model
    python bench/aes_ensemble.py --units minilm=runs/aes-cpu/units \\
        mpnet=runs/aes-cpu-mpnet/units --fold all --out ens.json

Members of a cell: every unit of the CPU protocol's run folder for that fold and prompt
(``<units>/<model>-fold<k>-p<p>.json``; a joint model's unit ``<model>-fold<k>-p3_4_...json``
gives its prompt's share; where a joint model has units of several prompt sets, the one of
``--joint-prompts``, by default the prompts run; each cell's ``unit_files`` names the files)
and every fine-tuned model's cell (``<finetuned>/fold<k>-p<p>/test.json``, with the
predictions ``mhmla-train aes --finetune`` stores; a joint cell ``fold<k>-p3_4_.../test.json``
of ``--finetune --joint`` gives its prompt's share, chosen by ``--joint-prompts`` like the
joint units). All members must
predict the same test essays (ids and gold compared) and the same dev essays (the fine-tuned
cells' ``dev_ids`` against the split read from ``--data-dir``, whose dev scores are the gold the
selection uses). Rows per cell, test QWK of:

* every member alone, and the best member by dev QWK (frozen only, and all);
* ``greedy-frozen``: ``aes.ensembles.greedy_ensemble`` over the frozen members (the CPU
  protocol's ``ensemble-greedy``), and ``greedy-all``: over frozen and fine-tuned members;
* blends of the frozen members whose units keep continuous predictions (the cut ridges and trees,
  ``...-cuts``): a weighted mean of their continuous predictions cut at cutpoints fitted on the
  same mean of their out-of-fold training predictions. ``stack-blend``
  (``aes.ensembles.stack_blend``): the weights by non-negative least squares on those
  out-of-fold training predictions, so nothing is chosen on dev; ``greedy-blend``
  (``aes.ensembles.greedy_blend``): members picked on dev by forward selection. Only members
  made from the same essays in the same order blend (their units' data digests agree); a cell
  without two such members has neither row;
* ``greedy-stack-finetuned``: ``greedy_ensemble`` over the ``stack-blend`` (its scores as one
  member) and the fine-tuned members, in a cell that has both: fine-tuned cells keep no
  out-of-fold training predictions, so they join the stack this way, chosen on dev.

A prompt without a fine-tuned cell still counts, with its frozen members only (its ``-all``
rows are then its ``-frozen`` rows); ``prompts_finetuned`` lists the prompts that have one.
A prompt without frozen members is skipped.

Several ``--units`` folders (the frozen protocol run with other encoders) pool their members,
named ``LABEL/model`` (``--units LABEL=DIR``; a plain ``DIR`` is labelled by its run folder's
name). ``--fold all`` (or a list) runs every fold: the file then holds each fold's result under
``folds``, and ``mean_test_qwk`` / ``per_prompt_test_qwk`` average over the folds (a row missing
in a fold is left out of the means).

The test split is never used to choose. Means over the prompts run are reported for each row.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

UNIT = re.compile(r"^(?P<name>.+)-fold(?P<fold>\d+)-p(?P<prompts>\d+(?:_\d+)*)\.json$")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--units", nargs="+", required=True,
                   help="the CPU protocol run's units folder; several (LABEL=DIR) pool members")
    p.add_argument("--finetuned", nargs="*", default=[],
                   help="fine-tuned model folders (OUT/<model name> of aes --finetune)")
    p.add_argument("--fold", default="0", help="a fold, a list (0,1) or all")
    p.add_argument("--members", default=None,
                   help="comma-separated frozen members to pool (LABEL/model with several "
                   "--units; default: every unit found)")
    p.add_argument("--prompt", default="1,2,3,4,5,6,7,8")
    p.add_argument("--joint-prompts", default=None,
                   help="the prompt set of the joint units (and joint fine-tuned cells) to use "
                   "where a model has several (default: --prompt)")
    p.add_argument("--data-dir", default=None,
                   help="the shared data folder or its asap_aes folder (default: "
                   "$MHMLA_SHARED_DATA or ../shared/data)")
    p.add_argument("--out", default=None, help="results JSON (default: print only)")
    return p.parse_args(argv)


def frozen_members(units: Path, fold: int, prompt: int,
                   joint: Sequence[int]) -> tuple[dict[str, dict], dict[str, str]]:
    """``({model: {"pred", "dev_pred", "ids", "gold", ...}}, {model: unit file name})`` of the
    frozen units of ``prompt``. A model with units of several prompt sets (joint heads trained
    on different prompts) takes the one of the set ``joint``, or its only one; else ValueError."""
    found: dict[str, list[tuple[list[int], Path]]] = {}
    for path in sorted(units.glob(f"*-fold{fold}-p*.json")):
        m = UNIT.match(path.name)
        if m is None or int(m["fold"]) != fold:
            continue
        prompts = [int(x) for x in m["prompts"].split("_")]
        if prompt in prompts:
            found.setdefault(m["name"], []).append((prompts, path))
    out, files = {}, {}
    for name, candidates in found.items():
        if len(candidates) > 1:
            candidates = [c for c in candidates if sorted(c[0]) == sorted(joint)]
            if len(candidates) != 1:
                sets = ", ".join(",".join(map(str, c[0])) for c in found[name])
                raise ValueError(f"{units}: {name} has units of the prompt sets {sets} for "
                                 f"prompt {prompt}; pass --joint-prompts with one of them")
        prompts, path = candidates[0]
        unit = json.loads(path.read_text())
        if len(prompts) > 1 or "settings" not in unit:  # a joint unit: one entry per prompt
            unit = unit[str(prompt)]
        out[name], files[name] = unit, path.name
    return out, files


def finetuned_member(folder: Path, fold: int, prompt: int,
                     joint: Sequence[int]) -> tuple[str, dict] | None:
    """``(model name, the prompt's record)`` of the fine-tuned model in ``folder``: its cell
    ``fold<k>-p<p>``, or the share of a joint cell ``fold<k>-p3_4_...`` that holds ``prompt``
    (where several do, the one of the set ``joint``, else ValueError); None when it has none."""
    path = folder / f"fold{fold}-p{prompt}" / "test.json"
    if path.is_file():
        cell = json.loads(path.read_text())
    else:
        found = []
        for cell_dir in sorted(folder.glob(f"fold{fold}-p*_*")):
            prompts = [int(x) for x in cell_dir.name.split("-p", 1)[1].split("_")]
            if prompt in prompts and (cell_dir / "test.json").is_file():
                found.append((prompts, cell_dir / "test.json"))
        if len(found) > 1:
            found = [f for f in found if sorted(f[0]) == sorted(joint)]
            if len(found) != 1:
                raise ValueError(f"{folder}: joint cells of several prompt sets hold prompt "
                                 f"{prompt}; pass --joint-prompts with one of them")
        if not found:
            return None
        path = found[0][1]
        cell = json.loads(path.read_text())["prompts"][str(prompt)]
    if "pred" not in cell or "dev_pred" not in cell:
        raise ValueError(f"{path}: no predictions stored; run the same mhmla-train aes "
                         "--finetune command again to add them")
    return folder.name, cell


def blend_rows(members: dict[str, dict], train_gold: np.ndarray, dev_gold: np.ndarray,
               gold: np.ndarray, prompt: int) -> dict[str, dict]:
    """The ``stack-blend`` and ``greedy-blend`` rows of a cell from the members'
    ``continuous`` predictions."""
    from mhmla_fast.aes.cutpoints import apply_cutpoints
    from mhmla_fast.aes.ensembles import blend_values, greedy_blend, pick_weights, stack_blend
    from mhmla_fast.aes.train import qwk

    names = list(members)
    digests = {members[n].get("data") for n in names}
    if len(digests) != 1 or None in digests:
        raise ValueError(f"prompt {prompt}: the blended members {names} were not made from "
                         "the same essays (their units' data digests differ or are missing)")
    x = {split: [np.asarray(members[n]["continuous"][split], dtype=np.float64) for n in names]
         for split in ("train_oof", "dev", "test")}
    for split, want in (("train_oof", train_gold), ("dev", dev_gold), ("test", gold)):
        for n, v in zip(names, x[split]):
            if v.shape != want.shape:
                raise ValueError(f"prompt {prompt}: {n} has {v.size} continuous {split} "
                                 f"predictions for {want.size} essays")

    def row(weights: np.ndarray, cuts: np.ndarray, **extra) -> dict:
        dev = apply_cutpoints(blend_values(x["dev"], weights), cuts, prompt)
        test = apply_cutpoints(blend_values(x["test"], weights), cuts, prompt)
        return {**extra, "weights": {n: float(w) for n, w in zip(names, weights) if w > 0},
                "cutpoints": cuts.tolist(), "dev_qwk": qwk(dev_gold, dev, prompt),
                "test_qwk": qwk(gold, test, prompt), "dev_pred": dev.tolist(),
                "pred": test.tolist()}

    picks, cuts = greedy_blend(x["train_oof"], x["dev"], train_gold, dev_gold, prompt)
    return {"stack-blend": row(*stack_blend(x["train_oof"], train_gold, prompt)),
            "greedy-blend": row(pick_weights(picks, len(names)), cuts,
                                picks=[names[i] for i in picks])}


def greedy_row(pool: dict[str, dict], dev_gold: np.ndarray, gold: np.ndarray,
               prompt: int) -> dict:
    """``aes.ensembles.greedy_ensemble`` over ``pool`` (name -> ``dev_pred``, ``pred``): the
    picks in order, the dev and test QWK of their mean ensemble."""
    from mhmla_fast.aes.ensembles import greedy_ensemble, mean_ensemble
    from mhmla_fast.aes.train import qwk

    order = list(pool)
    picks = greedy_ensemble([np.array(pool[n]["dev_pred"]) for n in order], dev_gold, prompt)
    pred = mean_ensemble([np.array(pool[order[i]]["pred"]) for i in picks], prompt)
    dev = mean_ensemble([np.array(pool[order[i]]["dev_pred"]) for i in picks], prompt)
    return {"picks": [order[i] for i in picks], "dev_qwk": qwk(dev_gold, dev, prompt),
            "test_qwk": qwk(gold, pred, prompt)}


def ensemble_cell(members: dict[str, dict], finetuned: set[str], dev_gold: np.ndarray,
                  dev_ids: list[int], prompt: int, train_gold: np.ndarray | None = None) -> dict:
    """A cell's rows (module doc); ``train_gold``: the training essays' scores, which the
    blend rows need (None: no such rows)."""
    from mhmla_fast.aes.train import qwk

    names = list(members)
    first = members[names[0]]
    gold, ids = np.array(first["gold"]), first["ids"]
    for name, u in members.items():
        if u["ids"] != ids or u["gold"] != first["gold"]:
            raise ValueError(f"prompt {prompt}: {name} predicts other test essays than "
                             f"{names[0]}")
        if len(u["dev_pred"]) != len(dev_gold):
            raise ValueError(f"prompt {prompt}: {name} has {len(u['dev_pred'])} dev "
                             f"predictions for {len(dev_gold)} dev essays")
        if "dev_ids" in u and u["dev_ids"] != dev_ids:
            raise ValueError(f"prompt {prompt}: {name}'s dev essays are not the split's")
    dev_q = {n: qwk(dev_gold, np.array(u["dev_pred"]), prompt) for n, u in members.items()}
    test_q = {n: qwk(gold, np.array(u["pred"]), prompt) for n, u in members.items()}
    row = {"members": {n: {"dev_qwk": dev_q[n], "test_qwk": test_q[n],
                           "kind": "finetuned" if n in finetuned else "frozen"}
                       for n in names}}
    for label, pool in (("frozen", [n for n in names if n not in finetuned]), ("all", names)):
        if not pool:
            continue
        best = max(pool, key=lambda n: (dev_q[n], -pool.index(n)))
        row[f"best-by-dev-{label}"] = {"member": best, "test_qwk": test_q[best]}
        row[f"greedy-{label}"] = greedy_row({n: members[n] for n in pool}, dev_gold, gold,
                                            prompt)
    blendable = {n: u for n, u in members.items() if n not in finetuned and "continuous" in u}
    if train_gold is not None and len(blendable) >= 2:
        row.update(blend_rows(blendable, train_gold, dev_gold, gold, prompt))
        if finetuned:  # the stack as one member beside the fine-tuned ones, chosen on dev
            pool = {"stack-blend": row["stack-blend"],
                    **{n: members[n] for n in names if n in finetuned}}
            row["greedy-stack-finetuned"] = greedy_row(pool, dev_gold, gold, prompt)
    return row


class MissingMembers(ValueError):
    """A member asked for by ``--members`` has no unit in a cell."""


def units_folders(entries: Sequence[str]) -> dict[str, Path]:
    """``{label: folder}`` of ``--units``: one folder is unlabelled (members keep their model
    names); several are ``LABEL=DIR`` or labelled by the run folder's name, each label once."""
    if len(entries) == 1 and "=" not in entries[0]:
        return {"": Path(entries[0])}
    out: dict[str, Path] = {}
    for entry in entries:
        label, _, folder = entry.rpartition("=")
        path = Path(folder)
        label = label or path.resolve().parent.name
        if label in out:
            raise ValueError(f"--units: the label {label!r} is given twice; name them LABEL=DIR")
        out[label] = path
    return out


def fold_cells(units: dict[str, Path], finetuned_dirs: Sequence[str], essays, fold_ids,
               fold: int, prompts: Sequence[int], joint: Sequence[int],
               wanted: set[str] | None = None) -> tuple[dict, list[int]]:
    """``({prompt: ensemble_cell row}, prompts with a fine-tuned cell)`` of one fold;
    ``wanted``: the frozen members to pool (each must be found), None for every one."""
    from mhmla_fast.aes.data import split_essays

    cells, with_ft = {}, []
    for p in prompts:
        split = split_essays(essays, fold_ids, fold, prompt=p)
        dev = split["dev"]
        members, files = {}, {}
        for label, folder in units.items():
            got, names = frozen_members(folder, fold, p, joint)
            prefix = f"{label}/" if label else ""
            members.update({prefix + n: u for n, u in got.items()})
            files.update({prefix + n: f for n, f in names.items()})
        if wanted is not None:
            missing = sorted(wanted - set(members))
            if missing:
                raise MissingMembers(f"fold {fold} prompt {p}: no unit of {missing}")
            members = {n: u for n, u in members.items() if n in wanted}
            files = {n: f for n, f in files.items() if n in wanted}
        finetuned = set()
        for folder in finetuned_dirs:
            got = finetuned_member(Path(folder), fold, p, joint)
            if got is not None:
                members[got[0]] = got[1]
                finetuned.add(got[0])
        if len(members) == len(finetuned):
            print(f"fold {fold} prompt {p}: skipped (no frozen member in "
                  f"{', '.join(map(str, units.values()))})", file=sys.stderr)
            continue
        if finetuned:
            with_ft.append(p)
        elif finetuned_dirs:
            print(f"fold {fold} prompt {p}: no fine-tuned cell; its rows are the frozen "
                  "members'", file=sys.stderr)
        cells[p] = ensemble_cell(members, finetuned, np.array([e.score for e in dev]),
                                 [e.essay_id for e in dev], p,
                                 train_gold=np.array([e.score for e in split["train"]]))
        cells[p]["unit_files"] = files
    return cells, with_ft


ROWS = ("best-by-dev-frozen", "greedy-frozen", "best-by-dev-all", "greedy-all")
# in a cell with two blendable members (and, the last, a fine-tuned one)
OPTIONAL_ROWS = ("stack-blend", "greedy-blend", "greedy-stack-finetuned")


def cell_means(cells: dict) -> dict[str, float]:
    """Mean test QWK over the prompts of every ensemble row (an optional row where every
    prompt has it), and of every member that all prompts have."""
    rows = [*ROWS, *(r for r in OPTIONAL_ROWS if all(r in c for c in cells.values()))]
    means = {r: float(np.mean([c[r]["test_qwk"] for c in cells.values()])) for r in rows}
    for n in sorted({n for c in cells.values() for n in c["members"]}):
        if all(n in c["members"] for c in cells.values()):
            means[n] = float(np.mean([c["members"][n]["test_qwk"] for c in cells.values()]))
    return means


def _test_qwk(cell: dict, row: str) -> float | None:
    if row in ROWS or row in OPTIONAL_ROWS:
        return cell[row]["test_qwk"] if row in cell else None
    return cell["members"][row]["test_qwk"] if row in cell["members"] else None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from mhmla_fast.aes.train import read_asap_folds
    from mhmla_fast.provenance import provenance

    prompts = [int(x) for x in args.prompt.split(",")]
    joint = [int(x) for x in (args.joint_prompts or args.prompt).split(",")]
    try:
        units = units_folders(args.units)
    except ValueError as err:
        print(f"aes_ensemble: {err}", file=sys.stderr)
        return 2
    essays, fold_ids = read_asap_folds(args.data_dir)
    folds = (sorted(fold_ids) if args.fold == "all"
             else [int(x) for x in args.fold.split(",")])
    wanted = {m for m in args.members.split(",") if m} if args.members else None
    per_fold = {}
    for k in folds:
        try:
            cells, with_ft = fold_cells(units, args.finetuned, essays, fold_ids, k, prompts,
                                        joint, wanted)
        except MissingMembers as err:
            print(f"aes_ensemble: {err}", file=sys.stderr)
            return 2
        if not cells:
            print(f"fold {k}: no prompt has frozen members", file=sys.stderr)
            return 1
        per_fold[k] = {"fold": k, "prompts": list(cells), "prompts_finetuned": with_ft,
                       "cells": cells, "mean_test_qwk": cell_means(cells)}
    # one unlabelled folder as its path; labelled ones (even one: LABEL=DIR) by label
    common = {"units": str(units[""]) if "" in units
              else {label: str(f) for label, f in units.items()},
              "finetuned": [str(f) for f in args.finetuned],
              **({"members": sorted(wanted)} if wanted else {})}
    note = "test QWK; members and ensembles chosen on the dev split only"
    if len(folds) == 1:
        result = {**per_fold[folds[0]], **common, "provenance": provenance(), "note": note}
        means = result["mean_test_qwk"]
    else:
        rows = sorted({r for f in per_fold.values() for r in f["mean_test_qwk"]})
        means = {r: float(np.mean([f["mean_test_qwk"][r] for f in per_fold.values()
                                   if r in f["mean_test_qwk"]])) for r in rows}
        per_prompt = {}
        for r in rows:
            per_prompt[r] = {}
            for p in prompts:
                vals = [_test_qwk(f["cells"][p], r) for f in per_fold.values()
                        if p in f["cells"]]
                vals = [v for v in vals if v is not None]
                if vals:
                    per_prompt[r][str(p)] = float(np.mean(vals))
        result = {"folds": {str(k): v for k, v in per_fold.items()}, "prompts": prompts,
                  **common, "mean_test_qwk": means, "per_prompt_test_qwk": per_prompt,
                  "provenance": provenance(), "note": note + "; means over folds, then prompts"}
    if args.out:  # written before the summary, so a closed standard output loses nothing
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"folds {folds}, prompts {prompts}: mean test QWK")
    for k, v in sorted(means.items(), key=lambda kv: -kv[1]):
        print(f"  {k:28s} {100 * v:.2f}")
    if args.out:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
