"""Ensembles of fine-tuned and frozen-feature essay scorers, chosen on dev, per (fold, prompt).

    python bench/aes_ensemble.py --units runs/aes-cpu/units \\
        --finetuned runs/aes-ft/mhmla-cls-finetuned --fold 0 --prompt 3,4,5,6,7 \\
        --out bench/results/aes_finetune_cpu_bf16/aes_ensemble_fold0.json

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
  protocol's ``ensemble-greedy``), and ``greedy-all``: over frozen and fine-tuned members.

A prompt without a fine-tuned cell still counts, with its frozen members only (its ``-all``
rows are then its ``-frozen`` rows); ``prompts_finetuned`` lists the prompts that have one.
A prompt without frozen members is skipped.

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
    p.add_argument("--units", required=True, help="the CPU protocol run's units folder")
    p.add_argument("--finetuned", nargs="+", required=True,
                   help="fine-tuned model folders (OUT/<model name> of aes --finetune)")
    p.add_argument("--fold", type=int, default=0)
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


def ensemble_cell(members: dict[str, dict], finetuned: set[str], dev_gold: np.ndarray,
                  dev_ids: list[int], prompt: int) -> dict:
    from mhmla_fast.aes.ensembles import greedy_ensemble, mean_ensemble
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
        picks = greedy_ensemble([np.array(members[n]["dev_pred"]) for n in pool], dev_gold,
                                prompt)
        pred = mean_ensemble([np.array(members[pool[i]]["pred"]) for i in picks], prompt)
        dev = mean_ensemble([np.array(members[pool[i]]["dev_pred"]) for i in picks], prompt)
        row[f"greedy-{label}"] = {"picks": [pool[i] for i in picks],
                                  "dev_qwk": qwk(dev_gold, dev, prompt),
                                  "test_qwk": qwk(gold, pred, prompt)}
    return row


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from mhmla_fast.aes.data import read_asap, read_folds, split_essays
    from mhmla_fast.aes.train import asap_files
    from mhmla_fast.provenance import provenance

    prompts = [int(x) for x in args.prompt.split(",")]
    joint = [int(x) for x in (args.joint_prompts or args.prompt).split(",")]
    tsv, folds_dir = asap_files(args.data_dir)
    essays, fold_ids = read_asap(tsv), read_folds(folds_dir)
    cells, with_ft = {}, []
    for p in prompts:
        dev = split_essays(essays, fold_ids, args.fold, prompt=p)["dev"]
        members, files = frozen_members(Path(args.units), args.fold, p, joint)
        finetuned = set()
        for folder in args.finetuned:
            got = finetuned_member(Path(folder), args.fold, p, joint)
            if got is not None:
                members[got[0]] = got[1]
                finetuned.add(got[0])
        if len(members) == len(finetuned):
            print(f"prompt {p}: skipped (no frozen member in {args.units})", file=sys.stderr)
            continue
        if finetuned:
            with_ft.append(p)
        else:
            print(f"prompt {p}: no fine-tuned cell; its rows are the frozen members'",
                  file=sys.stderr)
        cells[p] = ensemble_cell(members, finetuned, np.array([e.score for e in dev]),
                                 [e.essay_id for e in dev], p)
        cells[p]["unit_files"] = files
    if not cells:
        print("no prompt has frozen members", file=sys.stderr)
        return 1
    rows = ["best-by-dev-frozen", "greedy-frozen", "best-by-dev-all", "greedy-all"]
    names = sorted({n for c in cells.values() for n in c["members"]})
    means = {r: float(np.mean([c[r]["test_qwk"] for c in cells.values()])) for r in rows}
    for n in names:
        if all(n in c["members"] for c in cells.values()):
            means[n] = float(np.mean([c["members"][n]["test_qwk"] for c in cells.values()]))
    result = {"fold": args.fold, "prompts": list(cells), "prompts_finetuned": with_ft,
              "units": str(args.units), "finetuned": [str(f) for f in args.finetuned],
              "cells": cells, "mean_test_qwk": means, "provenance": provenance(),
              "note": "test QWK; members and ensembles chosen on the dev split only"}
    if args.out:  # written before the summary, so a closed standard output loses nothing
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"fold {args.fold}, prompts {list(cells)} (fine-tuned cells: {with_ft}): "
          "mean test QWK")
    for k, v in sorted(means.items(), key=lambda kv: -kv[1]):
        print(f"  {k:28s} {100 * v:.2f}")
    if args.out:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
