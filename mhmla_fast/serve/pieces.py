"""The word-piece tokenizer as the tagging engine uses it, loadable without transformers.

:class:`WordPieces` holds a ``tokenizers.Tokenizer`` (truncation and padding off, called
without special tokens) and what the engine adds around it: the ids of the classification,
separator and padding tokens, and the unknown token's text. :meth:`WordPieces.from_dir` reads
a saved Hugging Face tokenizer directory (``tokenizer.json`` with ``tokenizer_config.json`` /
``special_tokens_map.json``) with the ``tokenizers`` library alone, which saves the 0.6 s
import of transformers at every start of ``mhmla-serve tag``; :meth:`WordPieces.from_hf`
takes a loaded Hugging Face fast tokenizer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["WordPieces"]

_ROLES = ("cls_token", "sep_token", "pad_token", "unk_token")


def _content(token: Any) -> str | None:
    """A special token's text: a string, or the "content" of an added-token dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


@dataclass(frozen=True)
class WordPieces:
    """pieces: the word-piece ``tokenizers.Tokenizer``; cls_id, sep_id, pad_id: the ids put
    around and after a sentence's pieces; unk: the text of the unknown token (a word that
    gives no pieces is tagged as this)."""

    pieces: Any
    cls_id: int
    sep_id: int
    pad_id: int
    unk: str

    @classmethod
    def from_hf(cls, tokenizer) -> WordPieces:
        """From a Hugging Face fast tokenizer (its backend ``tokenizers.Tokenizer`` copied, so
        that turning truncation and padding off leaves the caller's alone)."""
        from tokenizers import Tokenizer

        pieces = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        pieces.no_truncation()
        pieces.no_padding()
        return cls(pieces, tokenizer.cls_token_id, tokenizer.sep_token_id,
                   tokenizer.pad_token_id or 0, tokenizer.unk_token or "[UNK]")

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> WordPieces | None:
        """From a saved tokenizer directory, without transformers; None when the directory
        does not name a classification, separator and padding token that its vocabulary
        holds (the caller then loads it through transformers)."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            return None
        names: dict[str, str | None] = {}
        for file in ("tokenizer_config.json", "special_tokens_map.json"):  # the map wins
            if (path / file).is_file():
                data = json.loads((path / file).read_text(encoding="utf-8"))
                names.update({k: _content(data[k]) for k in _ROLES if k in data})
        from tokenizers import Tokenizer

        pieces = Tokenizer.from_file(str(path / "tokenizer.json"))
        ids = {k: pieces.token_to_id(names[k]) if names.get(k) else None for k in _ROLES}
        if any(ids[k] is None for k in ("cls_token", "sep_token", "pad_token")):
            return None
        pieces.no_truncation()
        pieces.no_padding()
        return cls(pieces, ids["cls_token"], ids["sep_token"], ids["pad_token"],
                   names.get("unk_token") or "[UNK]")
