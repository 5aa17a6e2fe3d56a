"""Worker processes for the tagging engine's host path: word tokenisation and word-piecing of
large calls, in parallel, off the process that drives the model.

One Python thread runs the whole host path of ``tag_texts`` for about 30,000 FCE sentences/s
on a 2-core EPYC (``bench/results/host_path_epyc_apostrophe_ab_2026-11-23.json``), word
tokenisation a large part of it, which caps the engine on a GPU that could tag more. With ``host_workers=N``
(:class:`~mhmla_fast.serve.engine.Engine`) a call of at least ``2 * CHUNK`` inputs is cut into
chunks of ``CHUNK`` that N spawned processes tokenise and word-piece, each returning its chunk
packed into a few arrays (cheap to pickle); the engine then packs, runs and merges as usual.
The results are identical to the engine's own (the same functions run; tested).

The pool is two queues and the processes, without ``multiprocessing.Pool``: its worker-handler
thread woke at every finished task and took 4-6 us of the engine process's CPU per sentence,
a quarter of it (``tag_texts`` on FCE with one worker and a runner that costs nothing: 17.6 us per
sentence in all, 4.3 in that thread; the caller's thread now reads the results itself). Tasks go
on one queue that every worker takes from, results come back tagged with their chunk and are
put in order; a worker that dies makes the next wait raise instead of hanging (a Pool waits
for the lost task forever), and an error in a task is raised in the caller.

Workers import only numpy, ``tokenizers`` and this package's tokeniser (no torch), and get the
word-piece tokenizer as its JSON. Spawned, never forked: forking a process that holds a CUDA
context or a running tokenizers thread pool is unsafe. As with any spawned pool, a script that
uses ``host_workers`` must start its work under ``if __name__ == "__main__":`` (the workers
import the script's main module); ``mhmla-serve`` does.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..texts import ONLY_STR

__all__ = ["HostPool", "CHUNK"]

CHUNK = 128  # inputs per task

_STATE: dict[str, Any] = {}  # in a worker: the word-piece tokenizer and the unknown token


READY_TIMEOUT = 300.0  # seconds HostPool waits for its workers to start
_READY = ("ready",)  # the key of a worker's start-up report
_POLL_S = 1.0  # how often a wait for results checks that the workers are alive
_EXIT_S = 2.0  # how long close() lets the workers finish before terminating them


def _init(tokenizer_json: str, unk: str) -> None:
    from tokenizers import Tokenizer

    pieces = Tokenizer.from_str(tokenizer_json)
    pieces.no_truncation()
    pieces.no_padding()
    from .engine import word_tokenize_texts  # noqa: F401 - imported now, not in the first task
    from .pieces import WordCache

    _STATE.update(words=WordCache(pieces, unk))


def exit_with_parent(how=lambda: os._exit(1)) -> None:
    """In a spawned child process: call ``how`` (by default, exit at once) when the parent
    process is gone, from a daemon thread that waits on the parent's sentinel. A parent killed
    with ``kill -9`` or a plain ``kill`` (SIGTERM ends a Python process without its atexit
    handlers, so multiprocessing never stops its daemon children) left its children waiting
    for ever."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        how()

    threading.Thread(target=watch, daemon=True, name="mhmla-parent-watch").start()


def _serve(setup, tasks, results) -> None:
    """A worker: take ``(tokenizer_json, unk)`` from ``setup``, build the tokenizer, report
    ready, then answer ``(key, kind, chunk)`` tasks with ``(key, True, result)`` (or
    ``(key, False, "<error>")``) until a None task, or until the parent process is gone."""
    exit_with_parent()
    results.cancel_join_thread()  # exiting never waits for a caller who stopped reading
    _init(*setup.get())
    results.put((_READY, True, os.getpid()))
    run = {"texts": _texts_task, "tokens": _tokens_task}
    while (task := tasks.get()) is not None:
        key, kind, chunk = task
        try:
            results.put((key, True, run[kind](chunk)))
        except Exception as err:  # reported to the caller, who raises it
            results.put((key, False, f"{type(err).__name__}: {err}"))


def _pack(encoded: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, ...]:
    """Per-sentence (ids, first) arrays -> (piece counts, all ids, all firsts)."""
    counts = np.array([len(ids) for ids, _ in encoded], dtype=np.int64)
    ids = np.concatenate([i for i, _ in encoded]) if encoded else np.zeros(0, np.int32)
    first = np.concatenate([f for _, f in encoded]) if encoded else np.zeros(0, np.int64)
    return counts, ids.astype(np.int32, copy=False), first


def _spans(counts: np.ndarray) -> list[tuple[int, int]]:
    """[a, b) row ranges of consecutive items of ``counts`` rows each."""
    edges = [0, *np.cumsum(counts).tolist()]
    return list(zip(edges[:-1], edges[1:]))


def _unpack(counts: np.ndarray, ids: np.ndarray, first: np.ndarray
            ) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(ids[a:b], first[a:b]) for a, b in _spans(counts)]


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
        self._tasks, self._results = ctx.Queue(), ctx.Queue()
        # a task the tasks queue's feeder thread cannot pickle is dropped there with a printed
        # traceback, and its call would wait for ever: kept here, raised by the waiting call
        self._unsent: BaseException | None = None
        self._tasks._on_queue_feeder_error = self._task_not_sent
        # The tokenizer (about a megabyte of JSON) goes to the workers on a queue, one copy
        # each, not in the Process arguments: those are written to the child's pipe by the
        # starting thread itself, which then blocks for good if the child dies before it has
        # read them all (a script that starts the engine without the __main__ guard: its
        # spawned children re-run it and exit); a queue's feeder thread writes instead.
        # (Put after the starts: in such a child the start raises first, and the child exits
        # instead of waiting at exit for its feeder thread to hand the copies to nobody.)
        self._setup = ctx.Queue()
        self._calls = 0  # tags each call's tasks: results of an abandoned call are dropped
        self._lock = threading.Lock()  # one call at a time: the results queue is shared
        self.closed = False
        self._procs = [ctx.Process(target=_serve, args=(self._setup, self._tasks, self._results),
                                   daemon=True, name=f"mhmla-host-{i}")
                       for i in range(self.workers)]
        for proc in self._procs:
            proc.start()
        for _ in self._procs:
            self._setup.put((tokenizer_json, unk))
        ready, deadline = 0, time.monotonic() + READY_TIMEOUT
        while ready < self.workers:
            left = deadline - time.monotonic()
            try:
                key, _, _ = self._results.get(timeout=max(0.0, min(_POLL_S, left)))
            except queue.Empty:
                dead = [p.exitcode for p in self._procs if p.exitcode is not None]
                if left <= 0 or dead:
                    self.close()
                    why = (f"{len(dead)} exited (exit codes {sorted(set(dead))}; their errors "
                           "are printed above; a script must start host workers under "
                           "if __name__ == '__main__':)" if dead
                           else f"not ready within {READY_TIMEOUT:g} s")
                    raise RuntimeError(f"host_workers: {self.workers} worker processes did not "
                                       f"start: {why}") from None
                continue
            ready += key == _READY

    def texts(self, texts: Sequence[str]
              ) -> tuple[list[list[str]], list[np.ndarray], list[tuple[np.ndarray, np.ndarray]]]:
        """Words, code-point offsets (an int64 [n, 2] array per text: ``TagResult`` takes them
        so) and word-piece encoding of each text, in input order."""
        words: list[list[str]] = []
        offsets: list[np.ndarray] = []
        encoded: list[tuple[np.ndarray, np.ndarray]] = []
        if not ONLY_STR.issuperset(map(type, texts)):  # a str subclass may not pickle
            texts = [str(t) if isinstance(t, str) else t for t in texts]  # (others fail there)
        chunks = [list(texts[a:a + CHUNK]) for a in range(0, len(texts), CHUNK)]
        with self._lock:
            for w, n_tokens, offs, packed in self._map("texts", chunks):
                words.extend(w)
                offsets.extend(offs[a:b] for a, b in _spans(n_tokens))
                encoded.extend(_unpack(*packed))
        return words, offsets, encoded

    def tokens(self, sentences: Sequence[Sequence[str]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """The word-piece encoding of each pre-tokenised sentence, in input order."""
        chunks = [list(sentences[a:a + CHUNK]) for a in range(0, len(sentences), CHUNK)]
        encoded: list[tuple[np.ndarray, np.ndarray]] = []
        with self._lock:
            for packed in self._map("tokens", chunks):
                encoded.extend(_unpack(*packed))
        return encoded

    def _map(self, kind: str, chunks: list) -> Iterator[Any]:
        """The workers' results of task ``kind`` on each chunk, in the chunks' order."""
        self._check_alive()
        self._calls += 1
        call = self._calls
        for i, chunk in enumerate(chunks):
            self._tasks.put(((call, i), kind, chunk))
        done: dict[int, Any] = {}
        for i in range(len(chunks)):
            while i not in done:
                key, ok, out = self._get()
                if key == _READY or key[0] != call:  # a late answer of an abandoned call
                    continue
                if not ok:
                    raise RuntimeError(f"host_workers: a worker failed on chunk {key[1]} of "
                                       f"{len(chunks)}: {out}")
                done[key[1]] = out
            yield done.pop(i)

    def _get(self):
        """The next result, checking every ``_POLL_S`` that no worker has died meanwhile."""
        while True:
            try:
                return self._results.get(timeout=_POLL_S)
            except queue.Empty:
                self._check_alive()

    def _task_not_sent(self, err: BaseException, obj) -> None:
        """(The tasks queue's feeder thread, on a task it could not pickle.)"""
        self._unsent = err

    def _check_alive(self) -> None:
        if self._unsent is not None:
            err, self._unsent = self._unsent, None
            raise RuntimeError(f"host_workers: a chunk could not be sent to the workers "
                               f"({type(err).__name__}: {err}); pass plain str words and "
                               "texts") from err
        dead = [p for p in self._procs if p.exitcode is not None]
        if dead:
            codes = sorted({p.exitcode for p in dead})
            self.close()
            raise RuntimeError(f"host_workers: {len(dead)} of {self.workers} worker processes "
                               f"exited (exit codes {codes}); the pool is closed, and the next "
                               "large call starts a new one")

    def close(self) -> None:
        """Stop the workers: each takes a None task and exits (within ``_EXIT_S``; one still
        busy, say with an abandoned call's chunks, is terminated), then the queues."""
        self.closed = True
        alive = [p for p in self._procs if p.exitcode is None]
        for _ in alive:
            self._tasks.put(None)
        deadline = time.monotonic() + _EXIT_S
        for proc in alive:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.exitcode is None:
                proc.terminate()
                proc.join()
        if any(proc.exitcode != 0 for proc in self._procs):
            # a worker that died or was terminated may leave tasks nobody will read: not waited
            # for (the feeder thread would wait for a reader forever)
            self._tasks.cancel_join_thread()
        self._tasks.close()
        self._tasks.join_thread()
        self._setup.cancel_join_thread()  # copies of dead workers are never read
        self._setup.close()
        self._results.close()
