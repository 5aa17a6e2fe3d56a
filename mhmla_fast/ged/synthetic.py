"""Artificial errors for GED training: error-free sentences copied with rule-made errors.

``with_synthetic_errors(sentences, rate, seed)`` returns ``sentences`` followed by one corrupted
copy of every error-free sentence of two words or more among them (no word labelled 1). A copy of ``n`` words takes
``max(1, Binomial(n, rate))`` edits, each at a word still labelled 0, of one kind drawn with
the weights of :data:`EDIT_WEIGHTS` (a kind that does not apply at the drawn word is drawn
again):

* ``spelling``: one character of an alphabetic word of >= 3 letters swapped with its
  neighbour, dropped, doubled or replaced (a letter-level typo);
* ``confusion``: a word of a confusion set (articles, prepositions, auxiliaries, determiners,
  pronouns, modals, ...: :data:`CONFUSIONS`) replaced by another member;
* ``inflection``: an alphabetic word given or stripped of -s, -ed or -ing;
* ``delete``: a function word (:data:`FUNCTION_WORDS`) removed;
* ``insert``: a function word inserted before the word (not the first);
* ``comma``: a comma removed, or one inserted before the word (not the first);
* ``swap``: the word and the next exchanged (both alphabetic and different).

Labels follow the FCE convention of :func:`mhmla_fast.ged.data.read_m2`: a changed or inserted
word is 1, both words of a swap are 1, and a deletion marks the word after the gap (deletions
are only made where one follows). Capitalisation of the first letter is kept.

The copies depend only on the sentences, ``rate`` and ``seed`` (Python's ``random.Random``), so
a resumed training run rebuilds the same ones. The data come from the training set itself, so
their licence is the training set's (the FCE's for the shipped tagger); the test sets are never
read.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from .data import Sentence

__all__ = ["with_synthetic_errors", "corrupt", "check_rate", "EDIT_WEIGHTS", "CONFUSIONS", "FUNCTION_WORDS"]

EDIT_WEIGHTS: dict[str, float] = {
    "spelling": 0.20, "confusion": 0.30, "inflection": 0.15, "delete": 0.13,
    "insert": 0.12, "swap": 0.05, "comma": 0.05,
}

_SETS = (
    ("a", "an", "the"),
    ("in", "on", "at", "for", "to", "of", "with", "by", "from", "about", "into", "during"),
    ("is", "are", "was", "were", "be", "been", "being"),
    ("have", "has", "had", "having"),
    ("do", "does", "did", "doing"),
    ("this", "that", "these", "those"),
    ("much", "many"), ("few", "little"), ("some", "any"), ("other", "another", "others"),
    ("their", "there", "they"), ("then", "than"), ("so", "too", "very"),
    ("who", "which", "what"), ("will", "would"), ("can", "could"), ("may", "might"),
    ("he", "him", "his"), ("they", "them"), ("i", "me", "my"), ("we", "us", "our"),
    ("make", "do", "take", "get"), ("say", "tell"), ("good", "well"), ("since", "for"),
    ("and", "but", "or"), ("because", "so"), ("when", "while", "if"), ("all", "every", "each"),
)
CONFUSIONS: dict[str, tuple[str, ...]] = {}
for _members in _SETS:
    for _w in _members:
        CONFUSIONS[_w] = tuple(sorted(set(CONFUSIONS.get(_w, ())) | (set(_members) - {_w})))
del _members, _w

FUNCTION_WORDS = ("the", "a", "an", "to", "of", "in", "on", "at", "for", "with", "is", "are",
                  "be", "have", "that", "it", "will", "about")

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _same_case(word: str, like: str) -> str:
    return word[:1].upper() + word[1:] if like[:1].isupper() else word


def _typo(word: str, rng: random.Random) -> str:
    k = rng.randrange(len(word) - 1)
    kind = rng.randrange(4)
    if kind == 0 and word[k] != word[k + 1]:
        return word[:k] + word[k + 1] + word[k] + word[k + 2:]
    if kind == 1:
        return word[:k] + word[k + 1:]
    if kind == 2:
        return word[:k + 1] + word[k] + word[k + 1:]
    c = rng.choice(_LETTERS.replace(word[k].lower(), ""))
    return word[:k] + c + word[k + 1:]


def _inflections(word: str) -> list[str]:
    w = word.lower()
    out = {w + "s", w + "ed", w + "ing"}
    for suffix in ("s", "ed", "ing"):
        if w.endswith(suffix) and len(w) > len(suffix) + 2:
            stem = w[: -len(suffix)]
            out |= {stem, stem + "s", stem + "ed", stem + "ing"}
    out.discard(w)
    return sorted(out)


def _edit(tokens: list[str], labels: list[int], k: int, kind: str, rng: random.Random) -> bool:
    """Apply one edit of ``kind`` at word ``k`` in place; False when it does not apply there."""
    word = tokens[k]
    low = word.lower()
    nxt = k + 1 < len(tokens)
    if kind == "spelling":
        if not (word.isalpha() and len(word) >= 3):
            return False
        new = _typo(word, rng)
        if new == word:
            return False
        tokens[k], labels[k] = new, 1
    elif kind == "confusion":
        if low not in CONFUSIONS:
            return False
        tokens[k], labels[k] = _same_case(rng.choice(CONFUSIONS[low]), word), 1
    elif kind == "inflection":
        if not (word.isalpha() and len(word) >= 3 and low not in CONFUSIONS):
            return False
        tokens[k], labels[k] = _same_case(rng.choice(_inflections(word)), word), 1
    elif kind == "delete" or (kind == "comma" and word == ","):
        if (kind == "delete" and low not in FUNCTION_WORDS) or not nxt or labels[k + 1]:
            return False
        del tokens[k], labels[k]
        labels[k] = 1  # the word after the gap
    elif kind in ("insert", "comma"):  # a comma inserted before a word that is not one
        new = rng.choice(FUNCTION_WORDS) if kind == "insert" else ","
        if k == 0 or tokens[k - 1].lower() == new:
            return False
        tokens.insert(k, new)
        labels.insert(k, 1)
    elif kind == "swap":
        if not (nxt and labels[k + 1] == 0 and word.isalpha() and tokens[k + 1].isalpha()
                and low != tokens[k + 1].lower()):
            return False
        tokens[k], tokens[k + 1] = tokens[k + 1], word
        labels[k] = labels[k + 1] = 1
    else:
        raise ValueError(f"unknown edit kind {kind!r}; expected one of {sorted(EDIT_WEIGHTS)}")
    return True


def corrupt(sentence: Sentence, rate: float, rng: random.Random, *, tries: int = 20) -> Sentence:
    """A copy of ``sentence`` with ``max(1, Binomial(len, rate))`` artificial errors (fewer when
    no edit applies within ``tries`` draws each); see the module docstring."""
    tokens, labels = list(sentence.tokens), list(sentence.labels)
    kinds, weights = list(EDIT_WEIGHTS), list(EDIT_WEIGHTS.values())
    edits = max(1, sum(rng.random() < rate for _ in tokens))
    for _ in range(edits):
        for _ in range(tries):
            free = [i for i, y in enumerate(labels) if y == 0]
            if not free:
                break
            if _edit(tokens, labels, rng.choice(free), rng.choices(kinds, weights)[0], rng):
                break
    return Sentence(tuple(tokens), tuple(labels), f"{sentence.source} (synthetic)", sentence.line)


def check_rate(rate: float) -> None:
    """Refuse an edit rate per word outside [0, 1) (``TrainConfig.synthetic_errors``)."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"synthetic_errors: expected an edit rate per word in [0, 1), got {rate!r}")


def with_synthetic_errors(sentences: Sequence[Sentence], rate: float, seed: int) -> list[Sentence]:
    """``sentences`` plus a corrupted copy of each error-free one of two words or more
    (``rate``: edits per word, at least one per copy); ``rate == 0`` returns them unchanged."""
    check_rate(rate)
    out = list(sentences)
    if rate == 0:
        return out
    rng = random.Random(f"mhmla-synthetic-{seed}")
    out += [corrupt(s, rate, rng) for s in sentences if len(s) >= 2 and not s.has_error]
    return out
