"""Essays through the tagging engine: sentences cut from an essay's words, and their word
error probabilities (the grammatical-error features of essay scoring,
:mod:`mhmla_fast.aes.ged_features`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .tokenize import word_tokenize_lists

__all__ = ["essay_sentences", "EngineEssayTagger"]

_ENDS = frozenset(".!?")
_CLOSERS = frozenset("”’»)")


def essay_sentences(text: str) -> list[list[str]]:
    """``text``'s tokens (:func:`~.tokenize.word_tokenize_lists`), cut after each token made
    only of ``.``, ``!`` and ``?`` (a closing quote or bracket right after the cut stays with
    the sentence it closes)."""
    tokens, _ = word_tokenize_lists(text)
    out: list[list[str]] = []
    current: list[str] = []
    for tok in tokens:
        if not current and out and tok in _CLOSERS:  # a closing quote ends the last sentence
            out[-1].append(tok)
            continue
        current.append(tok)
        if set(tok) <= _ENDS:
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out


class EngineEssayTagger:
    """Word error probabilities of essays, sentence by sentence, from a tagger through
    :class:`~.engine.Engine` (the load contract's defaults: on the CPU ONNX Runtime fp32 on
    the validated export, whose labels are torch fp32's).

    ``tagger(texts)`` -> per essay, per sentence, float32 [words]; ``threshold`` is the
    engine's decision threshold and ``model_dir`` the tagger's folder (its files are the
    cache key of the features made from it).
    """

    def __init__(self, model_dir: str | os.PathLike | None = None, *, chunk: int = 4096, **load):
        from ..ged.predict import default_model_path
        from .engine import Engine

        self.model_dir = Path(model_dir) if model_dir is not None else default_model_path()
        self.engine = Engine.load(self.model_dir, **load)
        self.threshold = float(self.engine.threshold)
        self.chunk = chunk

    def __call__(self, texts: Sequence[str], progress: str | None = None
                 ) -> list[list[np.ndarray]]:
        from ..progress import progress_bar

        per_essay = [essay_sentences(t) for t in texts]
        flat = [s for sents in per_essay for s in sents]
        probs: list[np.ndarray] = []
        with progress_bar(total=len(flat), desc=progress, unit="sentence",
                          disable=progress is None) as bar:
            for k in range(0, len(flat), self.chunk):
                results = self.engine.tag_tokens(flat[k:k + self.chunk])
                probs += [np.asarray(r.probs, dtype=np.float32) for r in results]
                bar.update(len(results))
        out, k = [], 0
        for sents in per_essay:
            out.append(probs[k:k + len(sents)])
            k += len(sents)
        return out
