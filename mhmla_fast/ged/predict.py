"""Running a trained tagger over data: word error probabilities and layer weights."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # importing this module must stay cheap: default_model_path needs no torch
    from .model import GedTagger

__all__ = ["default_model_path", "layer_weight_stats"]


def default_model_path() -> Path:
    """The tagger shipped inside the package (MHMLA J = 12 on all-MiniLM-L6-v2, FCE)."""
    return Path(__file__).resolve().parents[1] / "models" / "ged-minilm-mhmla12"


def layer_weight_stats(model: GedTagger, tokenizer, sentences: Sequence[Sequence[str]], *,
                       batch_size: int = 64, max_length: int | None = None) -> np.ndarray:
    """Average layer weight p [L, J] over the first word piece of every word (of the first
    ``max_length`` pieces of a sentence; default: as many as the encoder has positions, at
    most 512).

    Fig. 2 of the paper (per head) and the workshop paper's per-layer averages (the
    row means of this matrix) are read off it.
    """
    import torch

    from .train import eval_max_length

    if max_length is None:
        max_length = eval_max_length(model)
    with torch.no_grad():
        return _layer_weight_stats(model, tokenizer, sentences, batch_size, max_length)


def _layer_weight_stats(model, tokenizer, sentences, batch_size, max_length) -> np.ndarray:
    from .model import collate, encode_sentences

    model.eval()
    encoded = encode_sentences(tokenizer, sentences, max_length)
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]))
    total, count = None, 0
    for k in range(0, len(order), batch_size):
        batch = collate([encoded[i] for i in order[k:k + batch_size]], tokenizer.pad_token_id)
        _, p = model(batch["input_ids"], batch["attention_mask"], return_weights=True)
        if p is None:
            raise ValueError(f"head {model.config.head!r} has no layer weights")
        sel = p[batch["word_index"] >= 0].double()  # [words, L, J]
        total = sel.sum(0) if total is None else total + sel.sum(0)
        count += sel.shape[0]
    if total is None or count == 0:
        raise ValueError("no words to average over")
    return (total / count).numpy()
