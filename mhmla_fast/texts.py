"""Checks of the texts the public API takes, shared by the tagging engine and the essay scorers."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["ONLY_STR", "text_list"]

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
