"""ASAP for the protocols: the data files, cached windows of essays (:class:`FeatureSplit`),
feature caches per prompt, and QWK per prompt."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .data import SCORE_RANGES, Essay
from .metrics import quadratic_weighted_kappa

__all__ = ["PROTOCOL", "PROMPTS", "Log", "asap_files", "read_asap_essays", "read_asap_folds",
           "FeatureSplit", "feature_split", "joined_features", "qwk", "split_qwk",
           "load_prompt_caches"]

PROTOCOL = "cpu-frozen-encoder"
PROMPTS = tuple(sorted(SCORE_RANGES))
Log = Callable[[str], None]
KAGGLE_TSV = "training_set_rel3.tsv"  # Kaggle's original file name (cp1252)


NEA_TSV = "training_set_rel3.nea_utf8.tsv"  # the UTF-8 copy the folds were made from


def asap_files(data_dir: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """(essay TSV, folds folder) under the shared data folder or an ``asap_aes`` folder: the
    UTF-8 TSV, else Kaggle's original where only that one is there. Neither need exist
    (:func:`read_asap_essays` says so)."""
    from ..paths import shared_data_dir

    root = Path(data_dir) if data_dir else shared_data_dir()
    if (root / "asap_aes").is_dir():
        root = root / "asap_aes"
    tsv = root / NEA_TSV
    if not tsv.is_file() and (root / KAGGLE_TSV).is_file():
        tsv = root / KAGGLE_TSV
    return tsv, root / "nea_folds"


def read_asap_essays(data_dir: str | os.PathLike | None = None) -> list[Essay]:
    """The essays of the TSV :func:`asap_files` finds (:func:`~.data.read_asap`): UTF-8, or
    cp1252 for Kaggle's original ``training_set_rel3.tsv`` (the encoding it was published in).
    FileNotFoundError naming the file looked for, ``--data-dir`` and ``$MHMLA_SHARED_DATA``
    when there is neither; NotADirectoryError when ``data_dir`` is a file."""
    from ..paths import missing_data, shared_data_dir
    from .data import read_asap

    tsv = asap_files(data_dir)[0]
    if tsv.parent.is_file():  # --data-dir named a file (the TSV itself)
        raise NotADirectoryError(f"{tsv.parent}: Not a directory; --data-dir takes the shared "
                                 "data folder or its asap_aes folder")
    if not tsv.is_file():
        # the default: the shared data folder's asap_aes/ (the folder a user would make)
        where = tsv if data_dir or tsv.parent.name == "asap_aes" else (
            shared_data_dir() / "asap_aes" / NEA_TSV)
        raise missing_data(where, "--data-dir (the shared data folder or its asap_aes folder; "
                           f"it holds {NEA_TSV} or Kaggle's {KAGGLE_TSV})")
    return read_asap(tsv, encoding="cp1252" if tsv.name == KAGGLE_TSV else "utf-8")


def read_asap_folds(data_dir: str | os.PathLike | None = None
                    ) -> tuple[list[Essay], dict[int, dict[str, list[int]]]]:
    """The essays (:func:`read_asap_essays`) and the Taghipour & Ng fold ids
    (:func:`~.data.read_folds`) of the data under ``data_dir`` (:func:`asap_files`)."""
    from .data import read_folds

    return read_asap_essays(data_dir), read_folds(asap_files(data_dir)[1])


def joined_features(splits: dict[str, FeatureSplit], features: str) -> FeatureSplit:
    """The split whose per-layer vectors are ``features`` ("cls", "mean" or "cls+mean":
    both concatenated along the hidden axis, [W, L+1, 2H]) from ``{pooling: split}``."""
    parts = [splits[p] for p in features.split("+")]
    first = parts[0]
    for other in parts[1:]:
        if not np.array_equal(other.essay_index, first.essay_index) or not np.array_equal(
                other.ids, first.ids):
            raise ValueError("feature caches of different poolings hold different windows")
    if len(parts) == 1:
        return first
    return FeatureSplit(torch.cat([x.features for x in parts], -1), first.essay_index,
                        first.scores, first.prompts, first.ids)


@dataclass
class FeatureSplit:
    """Cached windows of some essays: features [W, L+1, H], essay_index [W] (0..E-1),
    gold scores, prompts and ids [E]."""

    features: Tensor
    essay_index: np.ndarray
    scores: np.ndarray
    prompts: np.ndarray
    ids: np.ndarray

    @property
    def window_prompts(self) -> np.ndarray:
        return self.prompts[self.essay_index]

    def of_essays(self, essays: np.ndarray) -> FeatureSplit:
        """The split of the essays ``essays`` (sorted indices) with all their windows."""
        keep = np.flatnonzero(np.isin(self.essay_index, essays))
        return FeatureSplit(self.features[torch.as_tensor(keep)],
                            np.searchsorted(essays, self.essay_index[keep]), self.scores[essays],
                            self.prompts[essays], self.ids[essays])

    @classmethod
    def concat(cls, parts: Sequence[FeatureSplit]) -> FeatureSplit:
        offsets = np.cumsum([0] + [len(p.ids) for p in parts])
        return cls(torch.cat([p.features for p in parts]),
                   np.concatenate([p.essay_index + o for p, o in zip(parts, offsets)]),
                   np.concatenate([p.scores for p in parts]),
                   np.concatenate([p.prompts for p in parts]),
                   np.concatenate([p.ids for p in parts]))


def feature_split(cache, essays: Sequence[Essay]) -> FeatureSplit:
    """The cached windows of ``essays`` (a :class:`~.features.CachedFeatures`)."""
    feats, index = cache.select([e.essay_id for e in essays])
    return FeatureSplit(feats, index, np.array([e.score for e in essays], dtype=np.int64),
                        np.array([e.prompt for e in essays], dtype=np.int64),
                        np.array([e.essay_id for e in essays], dtype=np.int64))


def qwk(gold: np.ndarray, pred: np.ndarray, prompt: int) -> float:
    lo, hi = SCORE_RANGES[int(prompt)]
    return quadratic_weighted_kappa(gold, pred, lo, hi)


def split_qwk(split: FeatureSplit, pred: np.ndarray) -> dict[int, float]:
    """QWK per prompt of the split."""
    return {int(p): qwk(split.scores[split.prompts == p], pred[split.prompts == p], int(p))
            for p in np.unique(split.prompts)}


def load_prompt_caches(essays: Sequence[Essay], prompts: Sequence[int], cache_dir: str | os.PathLike,
                       encoder: str, *, token_budget: int = 8192,
                       poolings: Sequence[str] = ("cls",), log: Log | None = print,
                       precision: str = "fp32") -> dict:
    """The feature caches of each prompt, one per pooling (built or resumed as needed, the
    missing poolings of a prompt from one encoder pass): ``{pooling: {prompt: CachedFeatures}}``.
    ``precision``: of the encoder's pass (:func:`~.features.build_feature_caches`)."""
    from .features import build_feature_caches

    caches: dict[str, dict] = {q: {} for q in poolings}
    for p in prompts:
        chosen = [e for e in essays if e.prompt == p]
        if log:
            log(f"prompt {p}: {' + '.join(poolings)} feature cache of {len(chosen)} essays"
                + (f" ({precision})" if precision != "fp32" else ""))
        built = build_feature_caches(cache_dir, [e.essay_id for e in chosen],
                                     [e.text for e in chosen], encoder=encoder,
                                     token_budget=token_budget, poolings=poolings, progress=log,
                                     precision=precision)
        for q in poolings:
            caches[q][p] = built[q]
    return caches
