"""The tagging engine: batches of texts or token lists in, per-word error labels out.

Throughput by construction:

* every input is word-pieced once, in one batched tokenizer call;
* inputs longer than the encoder's limit are cut into overlapping windows (half a window
  of overlap) and never truncated: each word takes its probability from the window in
  which its first piece sits farthest from a window edge;
* windows are sorted by length and packed into batches of at most ``token_budget``
  padded pieces (and ``max_batch`` rows), so padding is minimal (``packing.py``, the packer
  that scoring uses too);
* results come back in input order.

The network itself is a *runner* (``runners.py``): eager torch on CPU or GPU, ONNX
Runtime, or TensorRT. Each maps ``input_ids, attention_mask`` [B, T] to error
probabilities [B, T].
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..packing import pack_by_token_budget
from .tokenize import word_tokenize

__all__ = ["TagResult", "Engine", "plan_windows", "load_tokenizer", "read_tagger_config",
           "default_tagger_path"]

TAGGER_FORMAT = "mhmla-ged-tagger/1"  # config.json "format" of a tagger (ged.model)


@dataclass
class TagResult:
    """One input's tags: ``tokens``, their ``labels`` ("c"/"i") and error ``probs``;
    ``offsets`` ([start, end) code-point offsets into the text, raw text only) and
    ``spans``: the flagged errors, runs of consecutive "i" words, as
    ``{"start", "end", "text"}`` character spans for raw text or ``{"start", "end"}``
    token spans (end exclusive) for pre-tokenised input."""

    tokens: list[str]
    labels: list[str]
    probs: list[float]
    offsets: list[tuple[int, int]] | None
    spans: list[dict]

    def to_dict(self) -> dict:
        d = {"tokens": self.tokens, "labels": self.labels,
             "probs": [round(p, 6) for p in self.probs], "spans": self.spans}
        if self.offsets is not None:
            d["offsets"] = [list(o) for o in self.offsets]
        return d


def plan_windows(n_pieces: int, window: int) -> list[tuple[int, int]]:
    """[start, end) spans of at most ``window`` pieces covering [0, n) with half-window
    overlap; the last window ends at n (full length where n >= window)."""
    if n_pieces <= window:
        return [(0, n_pieces)]
    stride = max(1, window // 2)
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
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from ..ged.model import load_tokenizer as load_encoder_tokenizer

    return load_encoder_tokenizer(path)


class Engine:
    """Tag texts with a GED tagger through a runner.

    Args:
        runner: maps (input_ids, attention_mask) int64 arrays [B, T] to error
            probabilities [B, T] (see ``runners.py``).
        tokenizer: the tagger's Hugging Face tokenizer.
        max_pieces: the encoder's limit including the two special tokens (512 for BERT).
        threshold: error-probability decision threshold (the model's dev-tuned one by
            default; 0.5 is the paper's argmax).
        token_budget: padded pieces per batch; max_batch: rows per batch.
        max_padding: a batch of 8 rows or more is closed before its padded pieces exceed
            ``1 + max_padding`` times its real ones (None: only the budget and max_batch
            cut; see ``packing.pack_by_token_budget``).
    """

    def __init__(self, runner, tokenizer, *, max_pieces: int = 512, threshold: float = 0.5,
                 token_budget: int = 8192, max_batch: int = 256,
                 max_padding: float | None = 0.2):
        if max_pieces < 4:
            raise ValueError(f"max_pieces: expected at least 4, got {max_pieces}")
        self.runner, self.tokenizer = runner, tokenizer
        self.max_pieces, self.threshold = max_pieces, float(threshold)
        self.token_budget, self.max_batch = int(token_budget), int(max_batch)
        self.max_padding = max_padding
        self.cls_id, self.sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
        self.pad_id = tokenizer.pad_token_id or 0
        self._unk = tokenizer.unk_token or "[UNK]"

    @classmethod
    def load(cls, model_dir: str | os.PathLike | None = None, *, backend: str = "torch",
             device: str | None = None, dtype: str | None = None, kernels: str = "auto",
             threads: int | None = None, threshold: float | None = None, **kw) -> Engine:
        """An engine on a tagger directory (default: the shipped model) and a runtime.

        The one load contract of serving (:mod:`.options`): ``backend`` "torch" (CPU or GPU),
        "onnx" (a directory holding ``model.onnx``, made by ``mhmla-serve export --onnx DIR``)
        or "tensorrt" (a directory with a built plan); ``device`` (default: CUDA when the
        backend can use it), ``dtype`` (default: bfloat16 for torch on CUDA, else float32),
        ``kernels`` (the head: "auto", "torch", "triton"), ``threads`` (CPU threads of the
        runtime). An option the backend cannot honour raises ValueError naming it, before
        anything is loaded. Other keywords go to :class:`Engine`."""
        from . import runners
        from .options import resolve_options

        opts = resolve_options(backend, device, dtype, kernels)
        path = Path(model_dir) if model_dir else default_tagger_path()
        config = read_tagger_config(path)
        tokenizer = load_tokenizer(path)
        runner = runners.make_runner(path, backend=opts.backend, device=opts.device,
                                     dtype=opts.dtype, kernels=opts.kernels, threads=threads)
        if threshold is None:
            threshold = config.get("threshold")
            threshold = 0.5 if threshold is None else threshold
        kw.setdefault("max_pieces",
                      int(config.get("encoder_config", {}).get("max_position_embeddings", 512)))
        return cls(runner, tokenizer, threshold=threshold, **kw)

    # ------------------------------------------------------------------ encoding

    def _encode(self, sentences: Sequence[Sequence[str]]) -> list[tuple[list[int], np.ndarray]]:
        """Per sentence: piece ids (no special tokens) and the word each piece starts (-1)."""
        if not sentences:
            return []
        tok = self.tokenizer
        enc = tok([list(s) for s in sentences], is_split_into_words=True,
                  add_special_tokens=False)
        out = []
        for b, words in enumerate(sentences):
            ids, wids = enc["input_ids"][b], enc.word_ids(b)
            if len({w for w in wids if w is not None}) < len(words):
                fixed = [w if tok.tokenize(w) else self._unk for w in words]
                one = tok(fixed, is_split_into_words=True, add_special_tokens=False)
                ids, wids = one["input_ids"], one.word_ids()
            first, prev = np.full(len(wids), -1, dtype=np.int64), None
            for q, w in enumerate(wids):
                if w is not None and w != prev:
                    first[q] = w
                prev = w
            out.append((list(ids), first))
        return out

    # ------------------------------------------------------------------- tagging

    def word_probs(self, sentences: Sequence[Sequence[str]]) -> list[np.ndarray]:
        """Error probability of every word of every sentence, in input order."""
        encoded = self._encode(sentences)
        window = self.max_pieces - 2
        rows = []  # (sentence, start, end)
        for s, (ids, _) in enumerate(encoded):
            if not ids:
                continue
            for start, end in plan_windows(len(ids), window):
                rows.append((s, start, end))
        probs = [np.zeros(len(words), dtype=np.float32) for words in sentences]
        margin = [np.full(len(words), -1, dtype=np.int64) for words in sentences]
        lengths = [end - start + 2 for _, start, end in rows]  # with [CLS] and [SEP]
        for picked in pack_by_token_budget(lengths, self.token_budget, self.max_batch,
                                           max_padding=self.max_padding):
            batch = [rows[k] for k in picked]
            T = max(e - s for _, s, e in batch) + 2
            input_ids = np.full((len(batch), T), self.pad_id, dtype=np.int64)
            mask = np.zeros((len(batch), T), dtype=np.int64)
            for r, (s, start, end) in enumerate(batch):
                ids = encoded[s][0][start:end]
                input_ids[r, : len(ids) + 2] = [self.cls_id, *ids, self.sep_id]
                mask[r, : len(ids) + 2] = 1
            out = np.asarray(self.runner(input_ids, mask), dtype=np.float32)
            for r, (s, start, end) in enumerate(batch):
                first = encoded[s][1][start:end]
                pos = np.nonzero(first >= 0)[0]  # window positions of first pieces
                words = first[pos]
                edge = np.minimum(pos, end - start - 1 - pos)  # distance to the window's edge
                better = edge > margin[s][words]
                margin[s][words[better]] = edge[better]
                probs[s][words[better]] = out[r, pos[better] + 1]
        return probs

    def _result(self, tokens, probs, offsets=None, text=None) -> TagResult:
        labels = ["i" if p >= self.threshold else "c" for p in probs]
        spans, k = [], 0
        while k < len(labels):
            if labels[k] == "i":
                e = k
                while e + 1 < len(labels) and labels[e + 1] == "i":
                    e += 1
                if offsets is not None:
                    a, b = offsets[k][0], offsets[e][1]
                    spans.append({"start": a, "end": b, "text": text[a:b]})
                else:
                    spans.append({"start": k, "end": e + 1})
                k = e + 1
            else:
                k += 1
        return TagResult(list(tokens), labels, [float(p) for p in probs], offsets, spans)

    def tag_tokens(self, sentences: Sequence[Sequence[str]]) -> list[TagResult]:
        """Tag pre-tokenised sentences (lists of words)."""
        for i, s in enumerate(sentences):
            if isinstance(s, str) or not all(isinstance(w, str) and w for w in s):
                raise ValueError(f"sentences[{i}]: expected a list of non-empty strings")
        probs = self.word_probs(sentences)
        return [self._result(s, p) for s, p in zip(sentences, probs)]

    def tag_texts(self, texts: Iterable[str]) -> list[TagResult]:
        """Tokenise raw texts (``tokenize.word_tokenize``, code-point offsets) and tag them."""
        texts = list(texts)
        toks = [word_tokenize(t) for t in texts]
        probs = self.word_probs([[t.text for t in ts] for ts in toks])
        return [
            self._result([t.text for t in ts], p, [(t.start, t.end) for t in ts], text)
            for text, ts, p in zip(texts, toks, probs)
        ]
