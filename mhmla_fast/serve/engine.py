"""The tagging engine: batches of texts or token lists in, per-word error labels out.

Throughput by construction:

* words are word-pieced by distinct word (``pieces.WordCache``: the tokenizer runs once per
  word never seen before, in one batched call; the rest is dictionary lookups and numpy
  gathers), and everything after, packing, merging and results, works on whole batches;
* inputs longer than the encoder's limit are cut into overlapping windows and never
  truncated: windows of ``long_window`` pieces (254 by default, at most the encoder's limit)
  overlapping by a quarter window, so a long text costs about 1.33x its pieces (not 2x, as
  half-window overlap did) and every window is short enough for attention's quadratic cost
  to stay small; each word takes its probability from the window in which its first piece
  sits farthest from a window edge (so at least an eighth of a window of context on each
  side). Texts that fit the encoder are one window, as before;
* a long input's pieces are kept as int32 arrays, and its windows are
  packed like any others, so memory grows with the batch, plus a few bytes per piece of the
  text (not with a Python object per piece); ``on_pieces`` reports progress as windows are
  encoded;
* windows are sorted by length and packed into batches of at most ``token_budget``
  padded pieces (and ``max_batch`` rows), so padding is minimal (``packing.py``, the packer
  that scoring uses too);
* results come back in input order.

The network itself is a *runner* (``runners.py``): eager torch on CPU or GPU, ONNX
Runtime, or TensorRT. Each maps ``input_ids, attention_mask`` [B, T] to error
probabilities [B, T].
"""

from __future__ import annotations

import gc
import json
import numbers
import os
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from itertools import chain
from typing import Any
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..encoder import max_input_length
from ..texts import ONLY_STR, raise_if_surrogate, text_list
from ..packing import pack_by_token_budget
from .options import default_token_budget
from .pieces import WordCache, WordPieces
from .tokenize import Token, token_boundary, word_tokenize, word_tokenize_lists

__all__ = ["TagResult", "WindowPlan", "Engine", "plan_windows", "load_tokenizer",
           "read_tagger_config", "default_tagger_path", "result_dicts", "round_probs"]

_LIST_TYPES = frozenset({list, tuple})
TAGGER_FORMAT = "mhmla-ged-tagger/1"  # config.json "format" of a tagger (ged.model)


class _LazyOffsets:
    """The ``offsets`` field of :class:`TagResult`: stored as given, a list of ``(start, end)``
    tuples or an int [n, 2] array, and read as the list (made from the array once, at the
    first read). Raises AttributeError on the class, so the dataclass field has no default."""

    def __set_name__(self, owner, name: str) -> None:
        self.key = "_" + name

    def __get__(self, obj, objtype=None):
        if obj is None:
            raise AttributeError(self.key[1:])
        value = getattr(obj, self.key)
        if isinstance(value, np.ndarray):
            value = list(map(tuple, value.tolist()))
            setattr(obj, self.key, value)
        return value

    def __set__(self, obj, value) -> None:
        # an ordinary attribute under another name (never ``obj.__dict__[...]``: reading the
        # instance's __dict__ makes CPython build a dict object for it, one more container per
        # result for the garbage collector to walk)
        setattr(obj, self.key, value)


@dataclass
class TagResult:
    """One input's tags: ``tokens``, their ``labels`` ("c"/"i") and error ``probs``;
    ``offsets`` ([start, end) code-point offsets into the text, raw text only) and
    ``spans``: the flagged errors, runs of consecutive "i" words, as
    ``{"start", "end", "text"}`` character spans for raw text or ``{"start", "end"}``
    token spans (end exclusive) for pre-tokenised input.

    ``offsets`` may be given as an int [n, 2] array (the host workers send them so): it is
    kept as the array and read as the list of tuples on first access, and :meth:`to_dict`
    reads the array itself. A tuple per word made up front, and walked by the garbage
    collector after every large call, was a quarter of the engine process's CPU per sentence
    with host workers (``bench/benchmark_host_path.py``)."""

    tokens: list[str]
    labels: list[str]
    probs: list[float]
    offsets: list[tuple[int, int]] | None = _LazyOffsets()  # (the descriptor: no default)
    spans: list[dict]

    def to_dict(self) -> dict:
        """The result as JSON-ready data: probabilities rounded to 6 decimals
        (:func:`round_probs`), offsets as lists."""
        return self._dict(round_probs(self.probs))

    def _dict(self, probs: list[float]) -> dict:
        d = {"tokens": self.tokens, "labels": self.labels, "probs": probs, "spans": self.spans}
        offsets = self._offsets  # as stored: the array itself if the workers sent one
        if isinstance(offsets, np.ndarray):
            d["offsets"] = offsets.tolist()
        elif offsets is not None:
            d["offsets"] = [list(o) for o in offsets]
        return d


def round_probs(probs: Sequence[float] | np.ndarray) -> list[float]:
    """``probs`` rounded to 6 decimals, as Python floats: ``np.round`` in float64, which for
    the engine's probabilities (float32 values) equals ``round(p, 6)`` exactly (a float32
    times 10^6 is exact in float64, so both round the exact value half to even, and both then
    give the double nearest to the 6-decimal result), in one vectorised step."""
    return np.round(np.asarray(probs, dtype=np.float64), 6).tolist()


def result_dicts(results: Sequence[TagResult]) -> list[dict]:
    """``[r.to_dict() for r in results]``, the probabilities of all results rounded in one
    step (:func:`round_probs` over their concatenation) instead of once per result: the
    per-result rounding was about a third of ``to_dict``'s time on FCE-like sentences."""
    sizes = [len(r.probs) for r in results]
    flat = round_probs(np.fromiter(chain.from_iterable(r.probs for r in results),
                                   dtype=np.float64, count=sum(sizes)))
    out, start = [], 0
    for r, n in zip(results, sizes):
        out.append(r._dict(flat[start:start + n]))
        start += n
    return out


@dataclass
class WindowPlan:
    """One input word-pieced and cut into the windows :meth:`Engine.word_probs` would use, to be
    tagged window by window (:meth:`Engine.tag_windows`, in any batches) and then merged
    (:meth:`Engine.finish_plan`) into the same result as ``tag_texts``/``tag_tokens``; the HTTP
    server interleaves the windows of a long text with other requests this way."""

    tokens: list[str]
    offsets: list[tuple[int, int]] | None  # raw text only
    text: str | None  # raw text only
    ids: np.ndarray  # [P] piece ids, no special tokens
    first: np.ndarray  # [P] the word each piece starts, else -1
    windows: list[tuple[int, int]]  # [start, end) piece spans


def plan_windows(n_pieces: int, window: int, overlap: int | None = None
                 ) -> list[tuple[int, int]]:
    """[start, end) spans of at most ``window`` pieces covering [0, n), consecutive windows
    overlapping by ``overlap`` pieces (default: half a window); the last window ends at n
    (full length where n >= window)."""
    if n_pieces <= window:
        return [(0, n_pieces)]
    overlap = window // 2 if overlap is None else overlap
    if not 0 <= overlap < window:
        raise ValueError(f"overlap: expected 0 <= overlap < window ({window}), got {overlap}")
    stride = max(1, window - overlap)
    spans = []
    start = 0
    while True:
        end = start + window
        if end >= n_pieces:
            spans.append((n_pieces - window, n_pieces))
            break
        spans.append((start, end))
        start += stride
    return spans


def default_tagger_path() -> Path:
    """The shipped tagger's directory (``ged.predict.default_model_path``)."""
    from ..ged.predict import default_model_path

    return default_model_path()


def read_tagger_config(path: str | os.PathLike) -> dict:
    """``config.json`` of a tagger or export directory as a dict (ValueError when it is not a
    GED tagger's). Read without the model classes, so that loading an ONNX or TensorRT engine
    does not import torch."""
    file = Path(path) / "config.json"
    data = json.loads(file.read_text())
    if data.get("format") != TAGGER_FORMAT:
        raise ValueError(f"{file}: not an mhmla GED tagger (format {data.get('format')!r})")
    return data


def load_tokenizer(path: str | os.PathLike):
    """The word-piece tokenizer saved in a tagger or export directory (its ``tokenizer.json``,
    through transformers' fast tokenizer class, which needs no torch), else
    ``ged.model.load_tokenizer`` (the encoder's)."""
    path = Path(path)
    if (path / "tokenizer.json").is_file():
        from ..encoder import from_transformers

        (PreTrainedTokenizerFast,) = from_transformers("PreTrainedTokenizerFast")
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from ..ged.model import load_tokenizer as load_encoder_tokenizer

    return load_encoder_tokenizer(path)


def piece_tokenizer(tokenizer):
    """The word-piece ``tokenizers.Tokenizer`` behind a Hugging Face fast tokenizer, copied, with
    truncation and padding off (a saved ``tokenizer.json`` may carry either); the engine calls it
    directly, without transformers' per-call wrapping."""
    return WordPieces.from_hf(tokenizer).pieces


def encode_words(pieces, unk: str, sentences: Sequence[Sequence[str]]
                 ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per sentence (a list of words): its piece ids (int32, no special tokens) and, per piece,
    the index of the word it starts (-1 for a word's later pieces), by the word-piece tokenizer
    ``pieces`` (:func:`piece_tokenizer`). A word that gives no pieces (e.g. only invisible
    characters) is replaced by ``unk``, so every word has a first piece.

    The plain definition, sentence by sentence; the engine gets the same arrays faster from
    :class:`~mhmla_fast.serve.pieces.WordCache` (tested against this)."""
    if not sentences:
        return []
    encodings = pieces.encode_batch([list(s) for s in sentences], is_pretokenized=True,
                                    add_special_tokens=False)
    out = []
    for words, enc in zip(sentences, encodings):
        ids, wids = enc.ids, enc.word_ids
        if len({w for w in wids if w is not None}) < len(words):
            fixed = [w if pieces.encode(w, add_special_tokens=False).ids else unk for w in words]
            enc = pieces.encode(fixed, is_pretokenized=True, add_special_tokens=False)
            ids, wids = enc.ids, enc.word_ids
        first, prev = np.full(len(wids), -1, dtype=np.int64), None
        for q, w in enumerate(wids):
            if w is not None and w != prev:
                first[q] = w
            prev = w
        out.append((np.asarray(ids, dtype=np.int32), first))
    return out


ENCODE_CHUNK = 2048  # words per step of Engine.plan_steps


def word_tokenize_chunked(text: str, chunk: int = 1 << 16) -> list[Token]:
    """``word_tokenize(text)``, computed on pieces of about ``chunk`` characters cut where no
    token can span the cut (``tokenize.token_boundary``: at separators, and between characters
    such as two CJK ones or a letter and a non-joining symbol), so the tokens are the same; it
    bounds the tokenizer's working memory and time per piece on a long text. A piece with no
    such cut (one long word) grows to the next one."""
    if len(text) <= chunk:
        return word_tokenize(text)
    return [t for part in iter_word_tokenize(text, chunk) for t in part]


def word_tokenize_texts(texts: Sequence[str], chunk: int = 1 << 16
                        ) -> tuple[list[list[str]], list[list[tuple[int, int]]]]:
    """Per text, the words and ``(start, end)`` offsets of :func:`word_tokenize_chunked` (by
    ``tokenize.word_tokenize_lists`` for texts of at most ``chunk`` characters)."""
    words: list[list[str]] = []
    offsets: list[list[tuple[int, int]]] = []
    for text in texts:
        if len(text) <= chunk:
            w, o = word_tokenize_lists(text)
        else:
            toks = word_tokenize_chunked(text, chunk)
            w, o = [t.text for t in toks], [(t.start, t.end) for t in toks]
        words.append(w)
        offsets.append(o)
    return words, offsets


def iter_word_tokenize(text: str, chunk: int = 1 << 16) -> Iterator[list[Token]]:
    """The tokens of :func:`word_tokenize_chunked`, one list per piece of the text."""
    a, n = 0, len(text)
    while a < n:
        b = min(a + chunk, n)
        if b < n:
            c = b
            while c > a and not token_boundary(text, c):
                c -= 1
            if c == a:
                c = b
                while c < n and not token_boundary(text, c):
                    c += 1
            b = c
        yield [Token(t.text, t.start + a, t.end + a) for t in word_tokenize(text[a:b])]
        a = b


@contextmanager
def gc_paused():
    """Pause Python's cyclic garbage collector for a block, then restore it as it was.

    A tagging call builds a few objects per word (tokens, labels, offsets, results) and no
    reference cycles; with the collector on, every few hundred new containers trigger a
    collection that walks the growing results again, which took 30-70% of the host time of
    building results in ``bench/benchmark_host_path.py``. Reference counting still frees
    everything the block drops. Left off if it was off; re-enabled only by the block that
    turned it off."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def _as_sequence(value: Any, what: str, expected: str) -> Sequence[Any]:
    """``value`` itself when it is a sequence other than a str or bytes, else a list of it (an
    iterator, read once); ValueError naming ``what`` for anything else."""
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{what}: expected {expected}, got a {type(value).__name__}")
    if isinstance(value, Sequence):
        return value
    try:
        return list(value)
    except TypeError:
        raise ValueError(f"{what}: expected {expected}, got {type(value).__name__}") from None


def _check_sentences(sentences: Sequence[Sequence[str]]) -> None:
    """ValueError naming the first sentence that is not a list of non-empty strings.

    Fast path for the usual call, in C loops over all words at once (a Python loop per
    sentence took about 1.5 us of the engine process's CPU per FCE sentence, which bounds a
    GPU engine with host workers): every sentence exactly a list or tuple, every word exactly
    a str and none empty. Otherwise (other sequences, str subclasses, or a bad input)
    sentence by sentence."""
    words = chain.from_iterable
    try:
        if (_LIST_TYPES.issuperset(map(type, sentences)) and all(words(sentences))
                and ONLY_STR.issuperset(map(type, words(sentences)))):
            return
    except TypeError:  # a sentence that is not iterable: found below
        pass
    for i, s in enumerate(sentences):
        if isinstance(s, str) or not isinstance(s, Sequence) or \
                not all(isinstance(w, str) and w for w in s):
            raise ValueError(f"sentences[{i}]: expected a list of non-empty strings")


class Engine:
    """Tag texts with a GED tagger through a runner.

    Args:
        runner: maps (input_ids, attention_mask) int64 arrays [B, T] to error
            probabilities [B, T] (see ``runners.py``).
        tokenizer: the tagger's Hugging Face fast tokenizer, or its
            :class:`~mhmla_fast.serve.pieces.WordPieces` (what ``Engine.load`` passes: read
            without importing transformers).
        max_pieces: the encoder's limit including the two special tokens (512 for BERT).
        threshold: error-probability decision threshold (the model's dev-tuned one by
            default; 0.5 is the paper's argmax).
        token_budget: padded pieces per batch (default: ``options.default_token_budget`` of
            the runner's device, 1024 on the CPU, 8192 on a GPU); max_batch: rows per batch.
        max_padding: a batch of 8 rows or more is closed before its padded pieces exceed
            ``1 + max_padding`` times its real ones (None: only the budget and max_batch
            cut; see ``packing.pack_by_token_budget``).
        long_window: pieces per window of an input longer than ``max_pieces - 2`` (capped at
            ``max_pieces - 2``); consecutive windows overlap by a quarter of it.
        host_workers: processes that tokenise and word-piece calls of at least
            ``2 * hostpool.CHUNK`` inputs in parallel (:mod:`.hostpool`; 0: this thread does);
            the results are the same. :meth:`close` stops them.
    """

    ENCODE_CHUNK = ENCODE_CHUNK  # words per step of plan_steps

    def __init__(self, runner, tokenizer, *, max_pieces: int = 512, threshold: float = 0.5,
                 token_budget: int | None = None, max_batch: int = 256,
                 max_padding: float | None = 0.2, long_window: int = 254,
                 host_workers: int = 0):
        if max_pieces < 4:
            raise ValueError(f"max_pieces: expected at least 4, got {max_pieces}")
        if long_window < 4:
            raise ValueError(f"long_window: expected at least 4, got {long_window}")
        self.long_window = min(int(long_window), max_pieces - 2)
        if isinstance(tokenizer, WordPieces):
            vocab = tokenizer
        else:
            # the engine windows long inputs itself: transformers' "Token indices sequence
            # length is longer than the specified maximum ..." warning is false here
            tokenizer.model_max_length = int(1e30)
            vocab = WordPieces.from_hf(tokenizer)
        self.runner, self.tokenizer = runner, tokenizer
        self.max_pieces, self.threshold = max_pieces, threshold
        if token_budget is None:
            token_budget = default_token_budget(getattr(runner, "device", "cpu"))
        if int(token_budget) < 1:
            raise ValueError(f"token_budget: expected a positive integer, got {token_budget}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch: expected a positive integer, got {max_batch!r}")
        if max_padding is not None and not (isinstance(max_padding, numbers.Real)
                                            and max_padding >= 0):
            raise ValueError(f"max_padding: expected a share >= 0 or None, got {max_padding!r}")
        self.token_budget, self.max_batch = int(token_budget), int(max_batch)
        self.max_padding = max_padding
        self.cls_id, self.sep_id, self.pad_id = vocab.cls_id, vocab.sep_id, vocab.pad_id
        self._unk = vocab.unk
        self.pieces = vocab.pieces
        self._words = WordCache(vocab.pieces, vocab.unk)
        if host_workers < 0:
            raise ValueError(f"host_workers: expected >= 0, got {host_workers}")
        self.host_workers = int(host_workers)
        self._pool = None  # a HostPool, started at the first call large enough
        self._pool_lock = threading.Lock()  # (calls from several threads start one pool)

    @property
    def threshold(self) -> float:
        """The decision threshold; setting it also moves a checked runner's
        (:class:`.runners.CheckedRunner`: its rows near the threshold are re-run exactly)."""
        return self._threshold

    @threshold.setter
    def threshold(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                or not 0.0 <= value <= 1.0:  # (NaN or 2 would label every word correct)
            raise ValueError(f"threshold: expected a probability from 0 to 1, got {value!r}")
        self._threshold = float(value)
        follow = getattr(self.runner, "set_threshold", None)
        if follow is not None:
            follow(self._threshold)

    @classmethod
    def load(cls, model_dir: str | os.PathLike | None = None, *, backend: str = "auto",
             device: str | None = None, dtype: str | None = None, kernels: str = "auto",
             threads: int | None = None, threshold: float | None = None,
             cache: bool | None = None, cuda_graphs: bool = False, lanes: int = 1,
             check_margin: float | None = None, **kw) -> Engine:
        """An engine on a tagger directory (default: the shipped model) and a runtime.

        The one load contract of serving (:mod:`.options`): ``backend`` "auto" (default: torch
        on CUDA or when an option needs torch; on the CPU in float32 ONNX Runtime on the
        model's cached export, validated to give torch's labels, made on first use, see
        :mod:`.export_cache`; torch when onnxruntime is missing or no export can be had),
        "torch" (CPU or GPU), "onnx" (a directory holding ``model.onnx``, made by
        ``mhmla-serve export --onnx DIR``) or "tensorrt" (a directory with a built plan);
        ``device`` (default: CUDA when the backend can use it), ``dtype`` (default: bfloat16
        for torch on CUDA, else float32), ``kernels`` (the head: "auto", "torch", "triton"),
        ``threads`` (CPU threads of the runtime; for torch ``torch.set_num_threads``, which
        holds for every torch model of the process), ``cache`` (auto's export cache; None: on
        unless ``$MHMLA_NO_CACHE`` is set), ``cuda_graphs`` (torch on CUDA: passes replayed
        from CUDA graphs at a few padded shapes, :class:`.runners.CapturedForward`; default
        off), ``lanes`` (CPU only: forward passes at a time, ``threads`` split between them,
        :class:`.runners.Lanes`; default 1, the lowest latency of a lone pass; ``mhmla-serve
        tag`` uses one lane per thread), ``check_margin`` (the checked bf16 pass of backend
        "openvino", and of "auto" on a CPU with AMX: rows with a piece whose bf16 probability
        lies within it of the threshold run again in fp32; default
        :data:`.openvino_runner.CHECK_MARGIN`, 0 for bf16 alone). An option the backend cannot
        honour raises ValueError naming it, before anything is loaded. Other keywords go to
        :class:`Engine`."""
        from . import runners
        from .options import resolve_options

        opts = resolve_options(backend, device, dtype, kernels, cuda_graphs=cuda_graphs,
                               lanes=lanes)
        runners.check_margin_option(check_margin, opts)
        if model_dir is not None and not str(model_dir):  # ("$UNSET": not the shipped model)
            raise ValueError("model_dir: empty path; None means the shipped model")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                    or threads < 1):
            raise ValueError(f"threads: expected a positive integer or None, got {threads!r}")
        path = Path(model_dir) if model_dir is not None else default_tagger_path()
        if backend == "auto" and opts.backend == "torch":
            runners.check_auto_torch(path, dtype=dtype, device=device, kernels=kernels)
        config = read_tagger_config(path)
        tokenizer = WordPieces.from_dir(path) or load_tokenizer(path)
        if threshold is None:
            threshold = config.get("threshold")
            threshold = 0.5 if threshold is None else threshold
        runner = runners.make_runner(path, backend=opts.backend, device=opts.device,
                                     dtype=opts.dtype, kernels=opts.kernels, threads=threads,
                                     cache=cache, cuda_graphs=cuda_graphs, lanes=lanes,
                                     threshold=float(threshold), check_margin=check_margin)
        kw.setdefault("max_pieces", max_input_length(config.get("encoder_config", {})))
        return cls(runner, tokenizer, threshold=threshold, **kw)

    # ------------------------------------------------------------------ encoding

    def _encode(self, sentences: Sequence[Sequence[str]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """:func:`encode_words` of every sentence, through the engine's word cache."""
        return self._words.encode(sentences)

    # ------------------------------------------------------------------- tagging

    def window_spans(self, n_pieces: int) -> list[tuple[int, int]]:
        """[start, end) piece spans of the windows an input of ``n_pieces`` is tagged in: one
        when it fits the encoder, else windows of ``long_window`` overlapping by a quarter."""
        if n_pieces <= self.max_pieces - 2:
            return [(0, n_pieces)] if n_pieces else []
        return plan_windows(n_pieces, self.long_window, self.long_window // 4)

    def _forward(self, rows: Sequence[np.ndarray], on_pieces=None,
                 firsts: Sequence[np.ndarray] | None = None):
        """Run piece-id rows (no special tokens) packed by ``token_budget``: yields, per forward
        pass, the row indices and the probabilities [B, T] (piece r of a row at r + 1).
        ``firsts``: per row, the word each piece starts, else -1 (the pieces whose probability
        the caller reads); a runner that takes ``read`` (the checked bf16 pass) gets them as a
        mask and re-checks only rows near the threshold at those pieces.

        Passes are pipelined: with a runner of ``lanes`` passes at a time (1 unless it says
        otherwise) up to ``lanes + 1`` are packed and submitted (``runners.submit``) before the
        oldest is yielded, so with a runner that returns at once (torch on CUDA, lanes on the
        CPU) the caller's merging of pass k and the packing of the next overlap the device's
        work, and every lane has a pass queued when it finishes one."""
        from .runners import submit

        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        depth = getattr(self.runner, "lanes", 1) + 1
        if not getattr(self.runner, "takes_read", False):
            firsts = None
        pending: deque = deque()
        for picked in pack_by_token_budget((lengths + 2).tolist(), self.token_budget,
                                           self.max_batch, max_padding=self.max_padding):
            n = lengths[picked]
            T = int(n.max()) + 2  # with [CLS] and [SEP]
            col = np.arange(T)
            mask = (col < (n + 2)[:, None]).astype(np.int64)
            input_ids = np.full((len(picked), T), self.pad_id, dtype=np.int64)
            inner = (col >= 1) & (col <= n[:, None])  # each row's pieces after its [CLS]
            input_ids[inner] = np.concatenate([rows[k] for k in picked])  # row-major
            input_ids[:, 0] = self.cls_id
            input_ids[np.arange(len(picked)), n + 1] = self.sep_id
            more = ()
            if firsts is not None:
                read = np.zeros((len(picked), T), dtype=bool)
                read[inner] = np.concatenate([firsts[k] for k in picked]) >= 0
                more = (read,)
            pending.append((picked, int(n.sum()), submit(self.runner, input_ids, mask, *more)))
            if len(pending) == depth:
                yield self._finish(pending.popleft(), on_pieces)
        while pending:
            yield self._finish(pending.popleft(), on_pieces)

    @staticmethod
    def _finish(pending, on_pieces):
        picked, n_pieces, job = pending
        out = job.result()
        if on_pieces is not None:
            on_pieces(n_pieces)
        return picked, out

    @staticmethod
    def _merge_window(first: np.ndarray, out: np.ndarray, probs: np.ndarray,
                      margin: np.ndarray) -> None:
        """Take a window's word probabilities (``first`` [W]: the word each piece starts, else
        -1; ``out`` [>= W + 2]) for the words whose first piece sits farther from its edge than
        in the windows merged so far (ties: the earlier window)."""
        pos = np.nonzero(first >= 0)[0]  # window positions of first pieces
        words = first[pos]
        edge = np.minimum(pos, len(first) - 1 - pos)  # distance to the window's edge
        better = edge > margin[words]
        margin[words[better]] = edge[better]
        probs[words[better]] = out[pos[better] + 1]

    def word_probs(self, sentences: Sequence[Sequence[str]], on_pieces=None,
                   encoded: Sequence[tuple[np.ndarray, np.ndarray]] | None = None
                   ) -> list[np.ndarray]:
        """Error probability of every word of every sentence, in input order (``on_pieces(n)``:
        called after each forward pass with its ``n`` real word pieces; ``encoded``: the
        sentences' word-piece encoding, if already made).

        The probabilities of all sentences live in one array (the returned arrays are views of
        it, :meth:`_flat_word_probs`)."""
        flat, word_start = self._flat_word_probs(sentences, on_pieces, encoded)
        edges = word_start.tolist()
        return [flat[a:b] for a, b in zip(edges[:-1], edges[1:])]

    def _flat_word_probs(self, sentences: Sequence[Sequence[str]], on_pieces=None,
                         encoded: Sequence[tuple[np.ndarray, np.ndarray]] | None = None
                         ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`word_probs` as one array: (probabilities [W] float32 of all words, sentence
        after sentence; word_start [S + 1], sentence s's words at ``word_start[s]:word_start[s +
        1]``). A sentence that fits the encoder is one window holding all its words, so a
        forward pass's such rows are merged in one gather; only windows of long inputs go
        through :meth:`_merge_window`."""
        if encoded is None:
            encoded = self._encode(sentences)
        n_words = np.fromiter(map(len, sentences), dtype=np.int64, count=len(sentences))
        word_start = np.zeros(len(sentences) + 1, dtype=np.int64)
        np.cumsum(n_words, out=word_start[1:])
        flat = np.zeros(int(word_start[-1]), dtype=np.float32)
        n_pieces = np.fromiter((len(ids) for ids, _ in encoded), dtype=np.int64,
                               count=len(encoded))
        whole = np.flatnonzero((n_pieces > 0) & (n_pieces <= self.max_pieces - 2)).tolist()
        rows = [encoded[s][0] for s in whole]
        firsts = [encoded[s][1] for s in whole]  # then each window's, as ``rows``
        offset = word_start[whole]  # a whole row's first word in ``flat``
        long_rows: dict[int, tuple[int, int, int]] = {}  # row -> (sentence, start, end)
        for s in np.flatnonzero(n_pieces > self.max_pieces - 2).tolist():
            ids, first = encoded[s]
            for start, end in self.window_spans(len(ids)):
                long_rows[len(rows)] = (s, start, end)
                rows.append(ids[start:end])
                firsts.append(first[start:end])
        margin = {s: np.full(int(n_words[s]), -1, dtype=np.int64)
                  for s, _, _ in long_rows.values()}
        for picked, out in self._forward(rows, on_pieces, firsts):
            local = [r for r, k in enumerate(picked) if k < len(whole)]
            if local:
                ks = [picked[r] for r in local]
                first = np.concatenate([firsts[k] for k in ks])
                size = n_pieces[[whole[k] for k in ks]]
                row = np.repeat(np.asarray(local), size)
                piece = np.arange(len(first)) - np.repeat(np.cumsum(size) - size, size)
                at = first >= 0
                flat[(first + np.repeat(offset[ks], size))[at]] = out[row[at], piece[at] + 1]
            for r, k in enumerate(picked):
                if k >= len(whole):
                    s, start, end = long_rows[k]
                    self._merge_window(encoded[s][1][start:end], out[r],
                                       flat[word_start[s]:word_start[s + 1]], margin[s])
        return flat, word_start

    # ------------------------------------------------------- tagging window by window

    def plan_text(self, text: str) -> WindowPlan:
        """Tokenise and word-piece a raw text and plan its windows (see :class:`WindowPlan`)."""
        *_, plan = self.plan_steps(text=text)
        return plan

    def plan_tokens(self, words: Sequence[str]) -> WindowPlan:
        """Word-piece a pre-tokenised sentence and plan its windows (see :class:`WindowPlan`)."""
        *_, plan = self.plan_steps(words=words)
        return plan

    def plan_steps(self, *, text: str | None = None, words: Sequence[str] | None = None,
                   chunk_chars: int = 4096) -> Iterator[WindowPlan | None]:
        """:meth:`plan_text` (``text``) or :meth:`plan_tokens` (``words``) in small steps, for a
        caller that interleaves them with other work: yields None after each piece of about
        ``chunk_chars`` characters tokenised or ``ENCODE_CHUNK`` words word-pieced, and the
        :class:`WindowPlan` last. (Words are pieced one by one, so chunks change nothing.)
        ValueError, before the first step, for anything :meth:`tag_texts` or :meth:`tag_tokens`
        refuses, and unless exactly one of ``text`` and ``words`` is given."""
        if (text is None) == (words is None):
            raise ValueError("plan_steps: give text or words, not both or neither")
        if text is not None:
            if not isinstance(text, str):
                raise ValueError(f"text: expected a string, got {type(text).__name__}")
            raise_if_surrogate([text], "text", indexed=False)
        else:
            words = _as_sequence(words, "words", "a list of non-empty strings")
            try:
                _check_sentences([words])
            except ValueError:
                raise ValueError("words: expected a list of non-empty strings") from None
            raise_if_surrogate([words], "words", indexed=False)
        return self._plan_steps(text, words, chunk_chars)

    def _plan_steps(self, text: str | None, words: Sequence[str] | None,
                    chunk_chars: int) -> Iterator[WindowPlan | None]:
        offsets = None
        if text is not None:
            toks: list[Token] = []
            for part in iter_word_tokenize(text, chunk_chars):
                toks.extend(part)
                yield None
            words, offsets = [t.text for t in toks], [(t.start, t.end) for t in toks]
        ids, first = [np.zeros(0, dtype=np.int32)], [np.zeros(0, dtype=np.int64)]
        for a in range(0, len(words), self.ENCODE_CHUNK):
            (i, f), = self._encode([words[a:a + self.ENCODE_CHUNK]])
            ids.append(i)
            first.append(np.where(f >= 0, f + a, -1))
            yield None
        ids, first = np.concatenate(ids), np.concatenate(first)
        yield WindowPlan(list(words), offsets, text, ids, first, self.window_spans(len(ids)))

    def tag_windows(self, windows: Sequence[tuple[WindowPlan, int]]) -> list[np.ndarray]:
        """Error probabilities [W + 2] of window ``k`` of each ``(plan, k)`` (position r + 1
        is the window's piece r), packed into forward passes like any inputs."""
        rows = [plan.ids[slice(*plan.windows[k])] for plan, k in windows]
        firsts = [plan.first[slice(*plan.windows[k])] for plan, k in windows]
        out: list[Any] = [None] * len(rows)
        for picked, probs in self._forward(rows, firsts=firsts):
            for r, k in enumerate(picked):
                out[k] = probs[r, : len(rows[k]) + 2].copy()
        return out

    def finish_plan(self, plan: WindowPlan, window_probs: Sequence[np.ndarray]) -> TagResult:
        """The result of a planned input from the probabilities of all its windows (in window
        order): the same as ``tag_texts``/``tag_tokens`` on it."""
        probs = np.zeros(len(plan.tokens), dtype=np.float32)
        margin = np.full(len(plan.tokens), -1, dtype=np.int64)
        for (start, end), out in zip(plan.windows, window_probs, strict=True):
            self._merge_window(plan.first[start:end], out, probs, margin)
        texts = None if plan.text is None else [plan.text]
        offsets = None if plan.offsets is None else [plan.offsets]
        result, = self._flat_results([plan.tokens], probs, np.array([0, len(probs)]), offsets,
                                     texts)
        return result

    _LABELS = np.array(["c", "i"], dtype=object)

    def _flat_results(self, tokens: Sequence[Sequence[str]], flat: np.ndarray, bounds: np.ndarray,
                      offsets: Sequence[list[tuple[int, int]] | np.ndarray] | None = None,
                      texts: Sequence[str] | None = None, own_tokens: bool = False
                      ) -> list[TagResult]:
        """A :class:`TagResult` per input from its words' error probabilities, all inputs' in one
        array ``flat`` [W] (input s's at ``bounds[s]:bounds[s + 1]``, as
        :meth:`_flat_word_probs` gives them): label "i" where ``p >= threshold`` (compared in
        float32, the probabilities' type), spans the runs of "i" words, found for all inputs at
        once; with ``offsets`` and ``texts`` (raw text) spans are character spans, else token
        spans."""
        sizes = np.diff(bounds)
        flags = flat >= self.threshold
        labels = self._LABELS[flags.view(np.int8)].tolist()
        values = flat.tolist()
        spans: dict[int, list[dict]] = {}
        if flags.any():
            opens = flags.copy()  # a run of "i" opens where the previous word is not "i"
            opens[1:] &= ~flags[:-1]
            closes = flags.copy()  # and closes where the next word is not "i"
            closes[:-1] &= ~flags[1:]
            inner = bounds[1:-1][(sizes[1:] > 0) & (bounds[1:-1] > 0)]  # inputs' first words:
            # runs never cross them
            opens[inner] = flags[inner]
            closes[inner - 1] = flags[inner - 1]
            starts, ends = np.flatnonzero(opens), np.flatnonzero(closes) + 1
            owner = np.searchsorted(bounds, starts, side="right") - 1
            for s, a, e in zip(owner.tolist(), (starts - bounds[owner]).tolist(),
                               (ends - bounds[owner]).tolist()):
                if offsets is not None:
                    c, d = int(offsets[s][a][0]), int(offsets[s][e - 1][1])
                    span = {"start": c, "end": d, "text": texts[s][c:d]}
                else:
                    span = {"start": a, "end": e}
                spans.setdefault(s, []).append(span)
        edges = bounds.tolist()
        return [TagResult(tokens[s] if own_tokens else list(tokens[s]),  # the caller's: copied
                          labels[edges[s]:edges[s + 1]],
                          values[edges[s]:edges[s + 1]],
                          None if offsets is None else offsets[s], spans.get(s) or [])
                for s in range(len(bounds) - 1)]

    def tag_tokens(self, sentences: Sequence[Sequence[str]], on_pieces=None) -> list[TagResult]:
        """Tag pre-tokenised sentences (lists of words); ``on_pieces``: see :meth:`word_probs`.
        ValueError names the first sentence that is not a list of non-empty strings, or whose
        word holds a lone surrogate."""
        sentences = _as_sequence(sentences, "sentences", "a list of sentences (lists of words)")
        _check_sentences(sentences)
        with gc_paused():
            try:
                pool = self._host_pool(len(sentences))
                encoded = pool.tokens(sentences) if pool is not None else None
                probs = self._flat_word_probs(sentences, on_pieces, encoded)
            except (TypeError, RuntimeError):  # the tokenizer's, or a host worker's
                raise_if_surrogate(sentences, "sentences")
                raise
            return self._flat_results(sentences, *probs)

    def tag_texts(self, texts: Iterable[str], on_pieces=None) -> list[TagResult]:
        """Tokenise raw texts (``tokenize.word_tokenize``, code-point offsets) and tag them;
        ``on_pieces``: see :meth:`word_probs`."""
        texts = text_list(texts, one="text")  # (a str would be tagged letter by letter)
        with gc_paused():
            try:
                pool = self._host_pool(len(texts))
                if pool is not None:
                    words, offsets, encoded = pool.texts(texts)
                else:
                    words, offsets = word_tokenize_texts(texts)
                    encoded = None
                probs = self._flat_word_probs(words, on_pieces, encoded)
            except (TypeError, RuntimeError):  # the tokenizer's, or a host worker's
                raise_if_surrogate(texts, "texts")
                raise
            return self._flat_results(words, *probs, offsets, texts,
                                      own_tokens=True)  # the call's own word lists

    def _host_pool(self, n_inputs: int):
        """The host workers for a call of ``n_inputs`` inputs, or None (none asked for, or too
        small a call to pay for the transfer)."""
        from . import hostpool

        if not self.host_workers or n_inputs < 2 * hostpool.CHUNK:
            return None
        with self._pool_lock:
            if self._pool is None or self._pool.closed:  # (a pool closes itself when a worker dies)
                self._pool = hostpool.HostPool(self.host_workers, self.pieces.to_str(), self._unk)
            return self._pool

    def close(self) -> None:
        """Stop the host workers, if any were started, and the runner's lane threads (the
        engine still works: without them until the next call that needs them starts them)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
        close = getattr(self.runner, "close", None)
        if close is not None:  # the runner's lane threads, if any
            close()
