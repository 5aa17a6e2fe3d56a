"""Grammatical-error features of essays, from a GED tagger (the shipped one by default).

An essay is cut into sentences and its words tagged (by an :class:`EssayTagger`, e.g. the
serving layer's :class:`~mhmla_fast.serve.essays.EngineEssayTagger`), and with ``q_w``
the error probability of word ``w`` (``n`` words, ``s`` sentences, ``t`` the tagger's
decision threshold, 0.5 where it stores none), :func:`ged_features` gives per essay::

    error_share           mean_w [q_w >= t]                 flagged words per word
    mean_error_prob       mean_w q_w
    log_errors            log1p(sum_w [q_w >= t])
    error_sentence_share  share of sentences with a flagged word
    errors_per_sentence   sum_w [q_w >= t] / s

(zeros for an essay without words). Error density is what the surface features
(:mod:`.surface`) and the windowed ``[CLS]`` vectors see least directly, and what AES
systems have long read off a grammar checker.

The tagger never saw an ASAP score (the shipped one was trained on FCE and on ASAP sentences
labelled by a teacher tagger, scores unseen): the features are the same function of an
essay's text whatever split it is in. :func:`ged_feature_cache` computes them once per
(tagger, essays) into ``<cache_dir>/ged-<digest>.safetensors`` (the digest covers the
tagger's files, the essays' ids and texts and :data:`GED_FEATURES`), so a changed tagger or
essay is never read from an old cache.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

__all__ = ["GED_FEATURES", "EssayTagger", "features_from_probs", "ged_features",
           "ged_feature_cache", "tagger_fingerprint"]

GED_FEATURES = ("error_share", "mean_error_prob", "log_errors", "error_sentence_share",
                "errors_per_sentence")


def features_from_probs(sentence_probs: Sequence[np.ndarray], threshold: float) -> np.ndarray:
    """One essay's :data:`GED_FEATURES` [F] from its sentences' word error probabilities."""
    n = sum(len(q) for q in sentence_probs)
    if n == 0:
        return np.zeros(len(GED_FEATURES))
    flagged = [int(np.count_nonzero(np.asarray(q) >= threshold)) for q in sentence_probs]
    errors = sum(flagged)
    s = len(sentence_probs)
    mean_prob = float(sum(float(np.sum(q, dtype=np.float64)) for q in sentence_probs) / n)
    return np.array([errors / n, mean_prob, math.log1p(errors),
                     sum(f > 0 for f in flagged) / s, errors / s])


def tagger_fingerprint(model_dir: str | os.PathLike) -> str:
    """sha256 of a tagger folder's files (names, sizes, contents); hashed once per process
    while the files' names, sizes and modification times stay the same."""
    root = Path(model_dir).resolve()
    stamp = tuple(sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns)
                         for f in root.iterdir() if f.is_file()))
    return _fingerprint(str(root), stamp)


@functools.lru_cache(maxsize=8)
def _fingerprint(model_dir: str, stamp: tuple) -> str:
    from .fingerprints import files_fingerprint

    return files_fingerprint(Path(model_dir))


class EssayTagger(Protocol):
    """What :func:`ged_feature_cache` needs of a tagger (the serving layer's
    :class:`~mhmla_fast.serve.essays.EngineEssayTagger` is one): its folder, its decision
    threshold, and per essay, per sentence, the words' error probabilities."""

    model_dir: Path
    threshold: float

    def __call__(self, texts: Sequence[str], progress: str | None = None
                 ) -> list[list[np.ndarray]]: ...


def ged_features(texts: Sequence[str], tagger: EssayTagger, progress: str | None = None
                 ) -> np.ndarray:
    """Essays -> float64 [E, len(GED_FEATURES)] through ``tagger``."""
    probs = tagger(texts, progress=progress)
    out = np.zeros((len(texts), len(GED_FEATURES)))
    for e, sentence_probs in enumerate(probs):
        out[e] = features_from_probs(sentence_probs, tagger.threshold)
    return out


def ged_feature_cache(essay_ids: Sequence[int], texts: Sequence[str],
                      cache_dir: str | os.PathLike, tagger: EssayTagger | Callable[[], EssayTagger],
                      *, model_dir: str | os.PathLike | None = None,
                      log: Callable[[str], None] | None = None) -> np.ndarray:
    """:func:`ged_features` of the essays, read from or written to the cache in
    ``cache_dir`` (see the module doc): float64 [E, F] in the order given. ``tagger`` may be
    a function that makes one (called only when the cache lacks the essays), ``model_dir``
    then naming its folder (default the shipped tagger)."""
    from safetensors.numpy import load_file, save

    from ..durable import atomic_write_bytes
    from ..ged.predict import default_model_path

    if len(essay_ids) != len(texts):
        raise ValueError(f"essay_ids and texts differ in length: {len(essay_ids)} vs {len(texts)}")
    if model_dir is None:
        model_dir = getattr(tagger, "model_dir", None) or default_model_path()
    model_dir = Path(model_dir)
    h = hashlib.sha256(tagger_fingerprint(model_dir).encode())
    h.update(repr(GED_FEATURES).encode())
    for i, t in zip(essay_ids, texts):
        h.update(f"\0{int(i)}\0".encode())
        h.update(t.encode())
    path = Path(cache_dir) / f"ged-{h.hexdigest()[:16]}.safetensors"
    if path.exists():
        return load_file(str(path))["features"].astype(np.float64)
    if log:
        log(f"GED features of {len(texts)} essays with the tagger {model_dir} -> {path}")
    if not hasattr(tagger, "threshold"):  # a maker
        tagger = tagger()
    if Path(tagger.model_dir).resolve() != model_dir.resolve():
        raise ValueError(f"the tagger's folder {tagger.model_dir} is not {model_dir}")
    feats = ged_features(texts, tagger, progress="GED features" if log else None)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, save({"features": feats,
                                   "essay_ids": np.asarray(essay_ids, dtype=np.int64)},
                                  metadata={"tagger": str(model_dir),
                                            "features": ",".join(GED_FEATURES)}))
    return feats
