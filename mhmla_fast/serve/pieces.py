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
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

__all__ = ["WordPieces", "WordCache"]

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


class WordCache:
    """Word-piecing by distinct word: each word's piece ids are computed once (one batched
    tokenizer call over the words not seen before) and kept, so a batch of sentences is
    word-pieced by dictionary lookups and numpy gathers instead of the tokenizer re-running on
    every word. Pre-tokenised words are pieced one by one (the tokenizer never looks across a
    word's edges), so the result equals :func:`mhmla_fast.serve.engine.encode_words` (tested).
    A word that gives no pieces is stored as ``unk``'s pieces. At most ``max_words`` words are
    kept; past that the cache starts again. Thread-safe.

    Args:
        pieces: the word-piece ``tokenizers.Tokenizer`` (truncation and padding off).
        unk: the unknown token's text.
    """

    def __init__(self, pieces: Any, unk: str, max_words: int = 1 << 18):
        import threading

        import numpy as np

        self.pieces, self.unk, self.max_words = pieces, unk, int(max_words)
        self._np = np
        self._lock = threading.Lock()
        self._unk_ids = pieces.encode([unk], is_pretokenized=True, add_special_tokens=False).ids
        self._clear()

    def _clear(self) -> None:
        np = self._np
        self._index: dict[str, int] = {}
        self._chunks: list[list[int]] = []
        self._start = np.zeros(0, dtype=np.int64)  # word -> its first piece in _ids
        self._count = np.zeros(0, dtype=np.int64)  # word -> its number of pieces
        self._ids = np.zeros(0, dtype=np.int32)

    def __len__(self) -> int:
        return len(self._index)

    def _add(self, words: list[str]) -> None:
        np = self._np
        encodings = self.pieces.encode_batch([[w] for w in words], is_pretokenized=True,
                                             add_special_tokens=False)
        lists = [e.ids or self._unk_ids for e in encodings]
        count = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
        start = len(self._ids) + np.cumsum(count) - count
        base = len(self._index)
        self._index.update(zip(words, range(base, base + len(words))))
        self._start = np.concatenate([self._start, start])
        self._count = np.concatenate([self._count, count])
        self._ids = np.concatenate([self._ids, np.fromiter(
            (i for ids in lists for i in ids), dtype=np.int32, count=int(count.sum()))])

    def encode(self, sentences: Sequence[Sequence[str]]) -> list[tuple[Any, Any]]:
        """Per sentence: its piece ids (int32 [P]) and, per piece, the index of the word it
        starts, else -1 (int64 [P]), as :func:`~mhmla_fast.serve.engine.encode_words`."""
        np = self._np
        flat = list(chain.from_iterable(sentences))

        def lookup() -> Any:  # each word's row (KeyError for a word not seen before)
            return np.fromiter(map(self._index.__getitem__, flat), dtype=np.int64,
                               count=len(flat))

        with self._lock:
            try:  # every word seen before (the usual case): no set of the call's words made
                word = lookup()
            except KeyError:
                new = set(flat).difference(self._index)
                if len(self._index) + len(new) > self.max_words:
                    self._clear()
                    new = set(flat)
                self._add(sorted(new))
                word = lookup()
            count, start, table = self._count[word], self._start[word], self._ids
        n_words = np.fromiter(map(len, sentences), dtype=np.int64, count=len(sentences))
        at = np.cumsum(count) - count  # each word's first piece in the output
        total = int(count.sum())
        piece = np.arange(total) - np.repeat(at, count)  # piece's rank within its word
        ids = table[np.repeat(start, count) + piece]
        sentence_at = np.cumsum(n_words) - n_words  # each sentence's first word
        first = np.full(total, -1, dtype=np.int64)
        first[at] = np.arange(len(flat)) - np.repeat(sentence_at, n_words)
        word_edges = np.append(sentence_at, len(flat))
        piece_edges = np.append(at, total)[word_edges].tolist()
        return [(ids[a:b], first[a:b]) for a, b in zip(piece_edges[:-1], piece_edges[1:])]
