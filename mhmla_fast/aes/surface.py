"""Surface features of an essay: length and vocabulary counts that the windowed ``[CLS]``
vectors cannot see.

Averaging window predictions (or features) hides how long an essay is, and length is the
strongest single predictor of an ASAP score. :func:`surface_features` gives, per essay::

    log1p(words), log1p(characters), log1p(sentences), log1p(distinct words),
    distinct / words, mean word length, share of words of 7+ letters,
    log1p(commas), log1p(ASAP anonymisation tokens such as @CAPS1)

Words are maximal runs of letters, digits and apostrophes (lower-cased for "distinct");
sentences are runs of text ended by ``.``, ``!`` or ``?`` (at least one for a non-empty
essay). The text is read in Unicode's composed form (NFC), so that canonically equivalent
texts have the same features (a decomposed accent split a word in two; no ASAP essay changes).
The values are raw; models standardise them on their training split, and a ridge scorer
clips them to their training range (:func:`~.scoring.essay_offsets`).
"""

from __future__ import annotations

import functools
import math
import re
import unicodedata
from collections.abc import Sequence

import numpy as np

__all__ = ["SURFACE_FEATURES", "surface_features"]

SURFACE_FEATURES = ("log_words", "log_chars", "log_sentences", "log_distinct", "distinct_ratio",
                    "mean_word_length", "long_word_share", "log_commas", "log_anonymised")

_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*")
_SENTENCE_END = re.compile(r"[.!?]+")
_ANONYMISED = re.compile(r"@[A-Z]+\d*")


def surface_features(texts: Sequence[str]) -> np.ndarray:
    """Essays -> float64 [n_essays, len(SURFACE_FEATURES)] (see the module doc).

    The rows of the last :data:`CACHED_ESSAYS` distinct texts are kept: a scorer reads an
    essay's features for its score and again for its advisories (``mhmla-serve score``, HTTP),
    and the second read is then a look-up."""
    return np.array([_surface_row(text) for text in texts],
                    dtype=np.float64).reshape(len(texts), len(SURFACE_FEATURES))


# texts whose feature rows are kept (least recently used dropped): above the 64 essays of a
# `mhmla-serve score` batch and the few dozen of an HTTP batch (8,192 word pieces), so that a
# batch's second read hits; a larger batch reads as if nothing were kept
CACHED_ESSAYS = 512


@functools.lru_cache(maxsize=CACHED_ESSAYS)
def _surface_row(text: str) -> tuple[float, ...]:
    """One essay's features (:func:`surface_features`), a tuple (immutable: it is cached)."""
    if not isinstance(text, str):
        raise TypeError(f"an essay must be a str, not {type(text).__name__}")
    text = unicodedata.normalize("NFC", text)
    words = _WORD.findall(text)
    n = len(words)
    sentences = len([s for s in _SENTENCE_END.split(text) if s.strip()]) if text.strip() else 0
    distinct = len(set(map(str.lower, words)))  # (once: read by two features)
    lengths = list(map(len, words))
    return (
        math.log1p(n), math.log1p(len(text)), math.log1p(max(sentences, 1 if n else 0)),
        math.log1p(distinct),
        distinct / n if n else 0.0,
        sum(lengths) / n if n else 0.0,
        sum(k >= 7 for k in lengths) / n if n else 0.0,
        math.log1p(text.count(",")), math.log1p(len(_ANONYMISED.findall(text))),
    )
