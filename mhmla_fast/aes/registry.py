"""The models of the CPU protocol, by name (``mhmla-train aes --models``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .heads import HeadTrainConfig

__all__ = ["ModelSpec", "MODELS", "DEFAULT_MODELS", "DEFAULT_MEMBERS", "HEAD_LRS", "poolings_of"]

HEAD_LRS = (1e-3, 3e-3, 1e-2, 3e-2)


@dataclass
class ModelSpec:
    """A model of the protocol: ``kind`` "head" | "joint" | "ridge" | "tfidf" | "surface" |
    "gbdt" (:mod:`.trees`) | "krr" (:mod:`.kernel_ridge`).

    ``lrs``: for head models, learning rates tried per (fold, prompt), the best by dev QWK
    kept (None: ``head.lr`` only); ``surface``: ridge models append the surface features
    (tree models read them); ``features``: the per-layer vectors a ridge (or kernel ridge)
    model reads, "cls", "mean" or "cls+mean" (head models read "cls"); ``ged``: ridge,
    surface and tree models append the essay's grammatical-error features
    (:mod:`.ged_features`, from the shipped GED tagger); ``cuts``: a ridge, kernel ridge,
    surface, TF-IDF, tree or joint regression model's scores are cut at cutpoints fitted for
    QWK on out-of-fold training predictions (:mod:`.cutpoints`) instead of rounded.
    """

    kind: str
    description: str
    head: HeadTrainConfig | None = None
    lrs: tuple[float, ...] | None = None
    surface: bool = False
    features: str = "cls"
    ged: bool = False
    cuts: bool = False


def _head(**kw) -> HeadTrainConfig:
    return HeadTrainConfig(**kw)


MODELS: dict[str, ModelSpec] = {
    "mhmla-cls": ModelSpec("head", "MHMLA (J=12, dropout 0.3) over frozen per-layer [CLS] + "
                           "classification over the prompt's labels; one model per prompt",
                           _head(mode="mhmla", objective="classification")),
    "mhmla-reg": ModelSpec("head", "MHMLA (J=12) over frozen per-layer [CLS] + sigmoid "
                           "regression on normalised scores; one model per prompt",
                           _head(mode="mhmla", objective="regression")),
    "last-cls": ModelSpec("head", "last-layer [CLS] of the frozen encoder + classification "
                          "(plain BERT classifier, frozen; a linear model, so the lr is chosen "
                          "from 1e-3..3e-2 by dev QWK); one model per prompt",
                          _head(mode="last", objective="classification"), lrs=HEAD_LRS),
    "avgl-cls": ModelSpec("head", "AvgL (average of linearly transformed layers) at [CLS] + "
                          "classification; one model per prompt",
                          _head(mode="avgl", objective="classification")),
    "last-reg": ModelSpec("head", "last-layer [CLS] of the frozen encoder + sigmoid regression "
                          "(lr chosen from 1e-3..3e-2 by dev QWK, as last-cls); one model per "
                          "prompt", _head(mode="last", objective="regression"), lrs=HEAD_LRS),
    "avgl-reg": ModelSpec("head", "AvgL at [CLS] + sigmoid regression; one model per prompt",
                          _head(mode="avgl", objective="regression")),
    "mhmla-joint-cls": ModelSpec("joint", "one MHMLA (J=12) shared by the 8 prompts, an "
                                 "output layer per prompt, trained on all prompts (the shipped "
                                 "scorer's configuration)",
                                 _head(mode="mhmla", objective="classification")),
    "mhmla-joint-reg": ModelSpec("joint", "one MHMLA (J=12) shared by the 8 prompts, a sigmoid "
                                 "regression output per prompt, trained on all prompts",
                                 _head(mode="mhmla", objective="regression")),
    "mhmla-joint-reg-cuts": ModelSpec("joint", "mhmla-joint-reg with its scores cut at "
                                      "cutpoints fitted for QWK on out-of-fold training "
                                      "predictions (five more joint heads per fold) instead "
                                      "of rounded: the configuration of the scorer "
                                      "shipped until 2026-12-06",
                                      _head(mode="mhmla", objective="regression"), cuts=True),
    "ridge-layers": ModelSpec("ridge", "ridge regression on the concatenated [CLS] vectors of "
                              "layers 1..L (standardised), alpha by dev QWK"),
    "ridge-layers-cuts": ModelSpec("ridge", "ridge-layers with its scores cut at cutpoints "
                                   "fitted for QWK on out-of-fold training predictions instead "
                                   "of rounded: a linear map of the per-layer [CLS] vectors "
                                   "that the essay scorer can serve (head 'ridge')", cuts=True),
    "ridge-layers-surface": ModelSpec("ridge", "ridge regression on the concatenated [CLS] "
                                      "vectors of layers 1..L and the essay's surface features "
                                      "(length, vocabulary; standardised), alpha by dev QWK",
                                      surface=True),
    "ridge-layers-mean": ModelSpec("ridge", "ridge regression on the concatenated token-mean "
                                   "vectors of layers 1..L (standardised), alpha by dev QWK",
                                   features="mean"),
    "ridge-layers-mean-surface": ModelSpec("ridge", "ridge regression on the concatenated "
                                           "token-mean vectors of layers 1..L and the surface "
                                           "features, alpha by dev QWK",
                                           surface=True, features="mean"),
    "ridge-layers-both-surface": ModelSpec("ridge", "ridge regression on the [CLS] and the "
                                           "token-mean vectors of layers 1..L and the surface "
                                           "features, alpha by dev QWK",
                                           surface=True, features="cls+mean"),
    "ridge-layers-both-surface-cuts": ModelSpec(
        "ridge", "ridge-layers-both-surface with its scores cut at cutpoints fitted for QWK on "
        "out-of-fold training predictions instead of rounded", surface=True,
        features="cls+mean", cuts=True),
    "ridge-layers-both-surface-ged": ModelSpec(
        "ridge", "ridge-layers-both-surface and the essay's grammatical-error features (error "
        "density from the shipped GED tagger)", surface=True, features="cls+mean", ged=True),
    "ridge-layers-both-surface-ged-cuts": ModelSpec(
        "ridge", "ridge-layers-both-surface-ged with cutpoints fitted for QWK, as "
        "ridge-layers-both-surface-cuts", surface=True, features="cls+mean", ged=True,
        cuts=True),
    "ridge-layers-surface-cuts": ModelSpec(
        "ridge", "ridge-layers-surface with cutpoints fitted for QWK, as "
        "ridge-layers-both-surface-cuts", surface=True, cuts=True),
    "ridge-layers-mean-surface-cuts": ModelSpec(
        "ridge", "ridge-layers-mean-surface with cutpoints fitted for QWK, as "
        "ridge-layers-both-surface-cuts", surface=True, features="mean", cuts=True),
    "tfidf-ridge": ModelSpec("tfidf", "TF-IDF word 1-2 grams + ridge regression, alpha by dev QWK"),
    "tfidf-ridge-cuts": ModelSpec("tfidf", "tfidf-ridge with cutpoints fitted for QWK on "
                                  "out-of-fold training predictions (each fold's vocabulary "
                                  "from its own training essays)", cuts=True),
    "surface-ridge": ModelSpec("surface", "ridge regression on the surface features alone "
                               "(length, vocabulary counts; no encoder), alpha by dev QWK"),
    "surface-ged-ridge": ModelSpec("surface", "ridge regression on the surface and the "
                                   "grammatical-error features (no encoder), alpha by dev QWK",
                                   ged=True),
    "surface-ridge-cuts": ModelSpec("surface", "surface-ridge with cutpoints fitted for QWK on "
                                    "out-of-fold training predictions", cuts=True),
    "surface-ged-ridge-cuts": ModelSpec("surface", "surface-ged-ridge with cutpoints fitted for "
                                        "QWK on out-of-fold training predictions", ged=True,
                                        cuts=True),
    "surface-gbdt-cuts": ModelSpec("gbdt", "gradient-boosted trees on the surface features "
                                   "(no encoder), setting by dev QWK, cut at cutpoints fitted "
                                   "for QWK on out-of-fold training predictions",
                                   surface=True, cuts=True),
    "surface-ged-gbdt-cuts": ModelSpec("gbdt", "surface-gbdt-cuts on the surface and the "
                                       "grammatical-error features", surface=True, ged=True,
                                       cuts=True),
    "krr-layers-both-surface-cuts": ModelSpec(
        "krr", "kernel ridge (Gaussian kernel) on the rows of ridge-layers-both-surface, "
        "(gamma, alpha) by dev QWK, cut at cutpoints fitted for QWK on out-of-fold training "
        "predictions: a non-linear member over the encoder's features", surface=True,
        features="cls+mean", cuts=True),
}
DEFAULT_MODELS = ("mhmla-cls", "mhmla-reg", "last-cls", "avgl-cls", "last-reg", "avgl-reg",
                  "mhmla-joint-cls", "mhmla-joint-reg", "mhmla-joint-reg-cuts", "ridge-layers",
                  "ridge-layers-cuts", "ridge-layers-surface", "ridge-layers-mean",
                  "ridge-layers-mean-surface", "ridge-layers-both-surface",
                  "ridge-layers-both-surface-cuts", "ridge-layers-both-surface-ged",
                  "ridge-layers-both-surface-ged-cuts", "tfidf-ridge", "surface-ridge",
                  "surface-ged-ridge", "ridge-layers-surface-cuts",
                  "ridge-layers-mean-surface-cuts", "surface-ridge-cuts", "surface-ged-ridge-cuts",
                  "tfidf-ridge-cuts", "surface-gbdt-cuts", "surface-ged-gbdt-cuts")
DEFAULT_MEMBERS = ("mhmla-cls", "mhmla-reg", "last-cls", "avgl-cls", "mhmla-joint-cls",
                   "mhmla-joint-reg", "ridge-layers")


def poolings_of(models: Sequence[str]) -> list[str]:
    """The feature caches (poolings) that ``models`` need: "cls" always (it defines the
    splits every model is scored on), then "mean" if a model reads mean vectors."""
    wanted = {p for m in models if m in MODELS for p in MODELS[m].features.split("+")}
    return ["cls", *(p for p in ("mean",) if p in wanted)]
