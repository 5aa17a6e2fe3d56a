"""The CPU protocol's ensembles over its finished units: the mean and the vote of chosen
members, the greedy mean chosen on dev, and the stack of the cut models (``ensemble-mean``,
``ensemble-vote``, ``ensemble-greedy``, ``ensemble-stack``; :mod:`.protocol`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .cutpoints import apply_cutpoints
from .ensembles import blend_values, greedy_ensemble, majority_vote, mean_ensemble, stack_blend
from .metrics import exact_agreement
from .results import _aggregate
from .splits import qwk

__all__ = ["member_ensembles", "greedy_ensemble_entry", "stack_ensemble_entry"]


def member_ensembles(units: dict, members: list[str], folds: list[int], prompts: list[int]) -> dict:
    """``ensemble-mean`` and ``ensemble-vote`` of ``members`` per fold and prompt."""
    ens: dict[str, dict[int, dict[int, dict]]] = {"ensemble-mean": {}, "ensemble-vote": {}}
    for k in folds:
        for name in ens:
            ens[name][k] = {}
        for p in prompts:
            us = [units[m][k][p] for m in members]
            gold = np.array(us[0]["gold"])
            preds = [np.array(u["pred"]) for u in us]
            ens["ensemble-mean"][k][p] = {"qwk": qwk(gold, mean_ensemble(preds, p), p),
                                          "exact": exact_agreement(gold, mean_ensemble(preds, p))}
            vote = majority_vote(preds, [u["dev_qwk"] for u in us])
            ens["ensemble-vote"][k][p] = {"qwk": qwk(gold, vote, p),
                                          "exact": exact_agreement(gold, vote)}
    return {name: {"members": members, **_aggregate(cells, folds, prompts)}
            for name, cells in ens.items()}


def _selected_entry(models: list[str], description: str, folds: list[int],
                    prompts: list[int], cell: Callable[[int, int], tuple[np.ndarray, dict]],
                    gold: Callable[[int, int], np.ndarray]) -> dict:
    """An ensemble's results entry: ``cell(k, p)`` gives fold ``k``, prompt ``p``'s test
    scores and what was selected there, ``gold(k, p)`` the test gold scores."""
    cells: dict[int, dict[int, dict]] = {}
    for k in folds:
        cells[k] = {}
        for p in prompts:
            pred, selected = cell(k, p)
            g = gold(k, p)
            cells[k][p] = {"qwk": qwk(g, pred, p), "exact": exact_agreement(g, pred),
                           "selected": selected}
    return {"members": list(models), "description": description,
            **_aggregate(cells, folds, prompts),
            "selected": {str(k): {str(p): cells[k][p]["selected"] for p in prompts}
                         for k in folds}}


def greedy_ensemble_entry(units: dict, models: list[str], gold_dev: dict, folds: list[int],
                          prompts: list[int]) -> dict:
    """``ensemble-greedy``: members of a mean ensemble chosen per fold and prompt on dev."""
    def cell(k: int, p: int) -> tuple[np.ndarray, dict]:
        us = [units[m][k][p] for m in models]
        picks = greedy_ensemble([np.array(u["dev_pred"]) for u in us],
                                np.array(gold_dev[k][p]), p)
        pred = mean_ensemble([np.array(us[i]["pred"]) for i in picks], p)
        return pred, {"members": [models[i] for i in picks]}

    return _selected_entry(
        models, "greedy forward selection with replacement (Caruana et al. 2004) of the mean "
        "of members' scores, by dev QWK per fold and prompt", folds, prompts, cell,
        lambda k, p: np.array(units[models[0]][k][p]["gold"]))


def stack_ensemble_entry(units: dict, models: list[str], gold_train: dict, folds: list[int],
                         prompts: list[int]) -> dict:
    """``ensemble-stack``: the cut models ``models`` (ridges, trees) blended by
    :func:`stack_blend`."""
    def cell(k: int, p: int) -> tuple[np.ndarray, dict]:
        x = [units[m][k][p]["continuous"] for m in models]
        w, cuts = stack_blend([np.array(c["train_oof"]) for c in x],
                              np.array(gold_train[k][p]), p)
        pred = apply_cutpoints(blend_values([np.array(c["test"]) for c in x], w), cuts, p)
        return pred, {"weights": {m: float(v) for m, v in zip(models, w) if v > 0},
                      "cutpoints": cuts.tolist()}

    return _selected_entry(
        models, "the members' continuous predictions weighted by non-negative least squares "
        "on their out-of-fold training predictions, cut at cutpoints fitted on the stacked "
        "ones (per fold and prompt; dev and test unseen)", folds, prompts, cell,
        lambda k, p: np.array(units[models[0]][k][p]["gold"]))
