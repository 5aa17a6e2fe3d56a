"""Worker processes for the tagging engine's host path: word tokenisation and word-piecing of
large calls, in parallel, off the process that drives the model.

One Python thread runs the whole host path of ``tag_texts`` for about 30,000 FCE sentences/s
on a 2-core EPYC (``bench/results/host_path_epyc_apostrophe_ab_2026-11-23.json``), word
tokenisation a large part of it, which caps the engine on a GPU that could tag more. With ``host_workers=N``
(:class:`~mhmla_fast.serve.engine.Engine`) a call of at least ``2 * CHUNK`` inputs is cut into
chunks of ``CHUNK`` that N spawned processes tokenise and word-piece, each returning its chunk
packed into a few arrays (cheap to pickle); the engine then packs, runs and merges as usual.
The results are identical to the engine's own (the same functions run; tested).

Workers import only numpy, ``tokenizers`` and this package's tokeniser (no torch), and get the
word-piece tokenizer as its JSON. Spawned, never forked: forking a process that holds a CUDA
context or a running tokenizers thread pool is unsafe. As with any spawned pool, a script that
uses ``host_workers`` must start its work under ``if __name__ == "__main__":`` (the workers
import the script's main module); ``mhmla-serve`` does.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["HostPool", "CHUNK"]

CHUNK = 128  # inputs per task

_STATE: dict[str, Any] = {}  # in a worker: the word-piece tokenizer and the unknown token


READY_TIMEOUT = 300.0  # seconds HostPool waits for its workers to start


def _init(tokenizer_json: str, unk: str, ready) -> None:
    from tokenizers import Tokenizer

    pieces = Tokenizer.from_str(tokenizer_json)
    pieces.no_truncation()
    pieces.no_padding()
    from .engine import word_tokenize_texts  # noqa: F401 - imported now, not in the first task
    from .pieces import WordCache

    _STATE.update(words=WordCache(pieces, unk))
    ready.put(os.getpid())


def _pack(encoded: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, ...]:
    """Per-sentence (ids, first) arrays -> (piece counts, all ids, all firsts)."""
    counts = np.array([len(ids) for ids, _ in encoded], dtype=np.int64)
    ids = np.concatenate([i for i, _ in encoded]) if encoded else np.zeros(0, np.int32)
    first = np.concatenate([f for _, f in encoded]) if encoded else np.zeros(0, np.int64)
    return counts, ids.astype(np.int32, copy=False), first


def _unpack(counts: np.ndarray, ids: np.ndarray, first: np.ndarray
            ) -> list[tuple[np.ndarray, np.ndarray]]:
    edges = [0, *np.cumsum(counts).tolist()]
    return [(ids[a:b], first[a:b]) for a, b in zip(edges[:-1], edges[1:])]


def _texts_task(texts: Sequence[str]):
    """A worker's chunk of raw texts: words, offsets (as one [n, 2] array per chunk) and the
    word-piece encoding of each text."""
    from .engine import word_tokenize_texts

    words, spans = word_tokenize_texts(texts)
    n_tokens = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
    offsets = np.array([o for os in spans for o in os], dtype=np.int64).reshape(-1, 2)
    encoded = _STATE["words"].encode(words)
    return words, n_tokens, offsets, _pack(encoded)


def _tokens_task(sentences: Sequence[Sequence[str]]):
    return _pack(_STATE["words"].encode(sentences))


class HostPool:
    """``workers`` spawned processes that tokenise and word-piece chunks of inputs, in order.

    All workers start at once and the pool returns when every one has imported what it runs
    and built its tokenizer (a pool that spawned on demand, like ``ProcessPoolExecutor``
    under spawn, starts most of its workers inside the first large call, which then waits for
    their imports)."""

    def __init__(self, workers: int, tokenizer_json: str, unk: str) -> None:
        if workers < 1:
            raise ValueError(f"host_workers: expected >= 1, got {workers}")
        self.workers = int(workers)
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Queue()
        self._pool = ctx.Pool(self.workers, initializer=_init,
                              initargs=(tokenizer_json, unk, ready))
        try:
            for _ in range(self.workers):
                ready.get(timeout=READY_TIMEOUT)
        except queue.Empty:
            self.close()
            raise RuntimeError(f"host_workers: {self.workers} worker processes did not start "
                               f"within {READY_TIMEOUT:.0f} s") from None

    def texts(self, texts: Sequence[str]
              ) -> tuple[list[list[str]], list[list[tuple[int, int]]], list[tuple[np.ndarray, np.ndarray]]]:
        """Words, code-point offsets and word-piece encoding of each text, in input order."""
        words: list[list[str]] = []
        offsets: list[list[tuple[int, int]]] = []
        encoded: list[tuple[np.ndarray, np.ndarray]] = []
        chunks = [list(texts[a:a + CHUNK]) for a in range(0, len(texts), CHUNK)]
        for w, n_tokens, offs, packed in self._pool.imap(_texts_task, chunks):
            words.extend(w)
            pairs = list(zip(offs[:, 0].tolist(), offs[:, 1].tolist()))
            a = 0
            for n in n_tokens.tolist():
                offsets.append(pairs[a:a + n])
                a += n
            encoded.extend(_unpack(*packed))
        return words, offsets, encoded

    def tokens(self, sentences: Sequence[Sequence[str]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """The word-piece encoding of each pre-tokenised sentence, in input order."""
        chunks = [list(sentences[a:a + CHUNK]) for a in range(0, len(sentences), CHUNK)]
        encoded: list[tuple[np.ndarray, np.ndarray]] = []
        for packed in self._pool.imap(_tokens_task, chunks):
            encoded.extend(_unpack(*packed))
        return encoded

    def close(self) -> None:
        self._pool.terminate()  # the workers hold no state worth a clean exit
        self._pool.join()
