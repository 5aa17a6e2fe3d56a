"""A saved GED tagger behind ``transformers.pipeline("token-classification")``: the baseline.

This is what a user without :class:`~mhmla_fast.serve.engine.Engine` would write to tag
sentences with a :class:`~mhmla_fast.ged.model.GedTagger` through the Hugging Face pipeline:

    from mhmla_fast.serve.hf_pipeline import load_pipeline, pipeline_word_probs, word_labels

    pipe = load_pipeline("path/to/tagger")                      # transformers.pipeline(...)
    sentences = [["He", "go", "to", "school", "."], ...]        # pre-tokenised words
    outputs = pipe([list(s) for s in sentences], is_split_into_words=True,
                   aggregation_strategy="none", ignore_labels=[], batch_size=32)
    probs = pipeline_word_probs(sentences, outputs)            # P(error) per word
    labels = word_labels(probs, threshold=0.5)                  # "c" / "i" per word

:class:`GedTaggerForTokenClassification` is a ``PreTrainedModel`` holding the tagger; its
``forward`` returns ``TokenClassifierOutput(logits=...)`` and its config has
``id2label = {0: "c", 1: "i"}``. The pipeline does not list the class among its supported
models and logs an error saying so; :func:`load_pipeline` silences that one message (the
pipeline only needs ``logits`` and ``id2label``).

From pipeline outputs to word labels
------------------------------------

Words go in pre-tokenised (``is_split_into_words=True``; the pipeline joins them with single
spaces and reports every word piece's ``start``/``end`` in that joined string) with
``aggregation_strategy="none"`` and ``ignore_labels=[]``: one output per word piece, nothing
dropped. :func:`pipeline_word_probs` maps each piece to the word whose character span holds its
``start`` and takes a word's probability from its **first** piece, the tagger's convention
(labels are trained and read at a word's first piece). ``P(error)`` is the piece's ``score``
when its ``entity`` is ``"i"`` and ``1 - score`` when it is ``"c"`` (two classes, softmax).

Why not ``aggregation_strategy="first"``: it also takes the first piece's label, but then
merges runs of words with the same label into one ``entity_group`` whose ``score`` is the
mean over the run, so per-word probabilities (needed for any threshold other than the
argmax) are lost; and its word boundaries come from a sub-word heuristic rather than from
the words given. The per-piece output gives the same argmax labels without either problem.

A word the pipeline gives no piece for (a word the tokenizer drops, e.g. a lone control
character, or words past the tokenizer's truncation at ``model_max_length`` pieces) has
probability NaN, and label "c" from :func:`word_labels`.
"""

from __future__ import annotations

import bisect
import logging
import os
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import TokenClassifierOutput

from ..ged.model import GedTagger, load_tokenizer

__all__ = [
    "ID2LABEL", "GedTaggerForTokenClassification", "load_pipeline", "pipeline_word_probs",
    "tag_words", "word_labels",
]

ID2LABEL = {0: "c", 1: "i"}
_PIPELINE_LOGGER = "transformers.pipelines.base"


class GedTaggerForTokenClassification(PreTrainedModel):
    """A :class:`GedTagger` as a Hugging Face token-classification model.

    ``config`` is a copy of the encoder's Hugging Face config with ``id2label`` /
    ``label2id`` set to the tagger's labels (``{0: "c", 1: "i"}``) and ``ged_threshold`` set
    to the tagger's decision threshold (None = argmax). Build it with :meth:`from_tagger`.
    """

    base_model_prefix = "tagger"
    main_input_name = "input_ids"

    def __init__(self, config: Any, tagger: GedTagger):
        super().__init__(config)
        self.tagger = tagger
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Nothing to initialise: every weight comes from the saved tagger."""

    @classmethod
    def from_tagger(cls, model_dir: str | os.PathLike, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> GedTaggerForTokenClassification:
        """Load a saved tagger directory (:meth:`GedTagger.load`) and wrap it, in eval mode."""
        tagger = GedTagger.load(model_dir, device=device, dtype=dtype)
        config = tagger.encoder.config.__class__.from_dict(tagger.encoder.config.to_dict())
        labels = tagger.config.labels
        config.id2label = {k: v for k, v in enumerate(labels)}
        config.label2id = {v: k for k, v in enumerate(labels)}
        config.ged_threshold = tagger.config.threshold
        return cls(config, tagger).to(device=device).eval()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **unused: Any) -> TokenClassifierOutput:
        """Logits [B, T, 2] of the tagger (``token_type_ids`` and other extra inputs of the
        tokenizer are ignored: the tagger reads ids and mask only)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return TokenClassifierOutput(logits=self.tagger(input_ids, attention_mask))


@contextmanager
def _quiet_unsupported_model_message():
    """Hide the pipeline's "model ... is not supported for token-classification" error log."""
    log = logging.getLogger(_PIPELINE_LOGGER)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def load_pipeline(model_dir: str | os.PathLike, *, batch_size: int = 1,
                  device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """``transformers.pipeline("token-classification")`` on a saved tagger and its tokenizer."""
    from transformers import pipeline

    model = GedTaggerForTokenClassification.from_tagger(model_dir, device=device, dtype=dtype)
    with _quiet_unsupported_model_message():
        return pipeline("token-classification", model=model, tokenizer=load_tokenizer(model_dir),
                        batch_size=batch_size, device=torch.device(device))


def pipeline_word_probs(sentences: Sequence[Sequence[str]],
                        outputs: Sequence[Sequence[dict]]) -> list[np.ndarray]:
    """P(error) of every word from per-piece pipeline outputs (module docstring): one float64
    array per sentence, NaN for a word that no piece starts in.

    ``outputs[k]`` is the pipeline's result for ``sentences[k]`` called with
    ``is_split_into_words=True, aggregation_strategy="none", ignore_labels=[]``.
    """
    if len(outputs) != len(sentences):
        raise ValueError(f"{len(sentences)} sentences but {len(outputs)} pipeline outputs")
    probs = []
    for k, (words, pieces) in enumerate(zip(sentences, outputs)):
        starts, pos = [], 0
        for w in words:
            starts.append(pos)
            pos += len(w) + 1  # the pipeline joins words with one space
        p = np.full(len(words), np.nan)
        for piece in pieces:
            if "entity" not in piece or piece.get("start") is None:
                raise ValueError(f"outputs[{k}]: expected per-piece outputs with offsets "
                                 "(aggregation_strategy='none', a fast tokenizer)")
            w = bisect.bisect_right(starts, int(piece["start"])) - 1
            if w < 0 or not np.isnan(p[w]):
                continue  # not the word's first piece
            score = float(piece["score"])
            p[w] = score if piece["entity"] == ID2LABEL[1] else 1.0 - score
        probs.append(p)
    return probs


def tag_words(pipe, sentences: Sequence[Sequence[str]], *, batch_size: int | None = None
              ) -> list[np.ndarray]:
    """Run the pipeline on pre-tokenised sentences; P(error) per word (:func:`pipeline_word_probs`)."""
    if not sentences:
        return []
    words = [list(s) for s in sentences]
    outputs = pipe(words, is_split_into_words=True, aggregation_strategy="none",
                   ignore_labels=[], batch_size=batch_size)
    if len(words) == 1 and (not outputs or isinstance(outputs[0], dict)):
        outputs = [outputs]  # a single sentence may come back unnested
    return pipeline_word_probs(sentences, outputs)


def word_labels(probs: Sequence[np.ndarray], threshold: float = 0.5) -> list[list[str]]:
    """Per word, "i" where P(error) >= threshold, else "c" (also NaN: no prediction)."""
    return [[ID2LABEL[1] if p >= threshold else ID2LABEL[0] for p in row] for row in probs]
