"""Checks of the texts the public API takes, shared by the tagging engine and the essay scorers."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["ONLY_STR", "SURROGATE", "raise_if_surrogate", "text_list"]

# a lone surrogate (U+D800-U+DFFF): no text (only a codec such as "surrogateescape" makes one),
# and the word-piece tokenizers cannot encode it
SURROGATE = re.compile("[\ud800-\udfff]")

# ``ONLY_STR.issuperset(map(type, values))``: every value exactly a str, in a C loop (str
# subclasses fail it and take the slower path that accepts them)
ONLY_STR = frozenset({str})


def text_list(texts: Iterable[str], unit: str = "string", one: str | None = None) -> list[str]:
    """``texts`` as a list of str.

    ValueError for one str or bytes (it would be read letter by letter: pass ``[text]``), for
    a value that is not iterable, and for an element that is not a str, named by its index.
    ``unit`` names an element in the messages ("string", "essay"), ``one`` what a single one
    is (default ``unit``)."""
    if isinstance(texts, (str, bytes)):
        raise ValueError(f"texts: expected a sequence of {unit}s, got a {type(texts).__name__}; "
                         f"pass [text] for one {one or unit}")
    try:
        texts = list(texts)
    except TypeError:
        raise ValueError(f"texts: expected a sequence of {unit}s, got {type(texts).__name__}") from None
    if not ONLY_STR.issuperset(map(type, texts)):
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise ValueError(f"texts[{i}]: expected a string, got {type(t).__name__}")
    return texts


def raise_if_surrogate(inputs: Sequence[Any], what: str, indexed: bool = True) -> None:
    """ValueError naming the first input (a text, or a sentence's word) holding a lone
    surrogate (:data:`SURROGATE`): the word-piece tokenizer failed a whole call on it with a
    TypeError naming none. ``what`` names the inputs (``texts`` gives ``texts[3]``; with
    ``indexed`` False, ``what`` alone)."""
    for i, item in enumerate(inputs):
        for value in (item,) if isinstance(item, str) else item:
            found = SURROGATE.search(value) if isinstance(value, str) else None
            if found:
                name = f"{what}[{i}]" if indexed else what
                raise ValueError(f"{name}: holds a lone surrogate U+{ord(found.group()):04X}, "
                                 "which is not text (decode with errors='replace' first)")
