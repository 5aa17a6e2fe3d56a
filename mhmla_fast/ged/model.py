"""The GED token tagger: encoder hidden states -> layer attention -> linear classifier.

    hidden_states = encoder(x)                 L + 1 tensors [B, T, H]
    c = FusedLayerAttention(hidden_states)     [B, T, H]   (MHMLA, SHMLA, AvgL or last layer)
    y = softmax(c W_o + b_o)                   [B, T, 2]   (Eq. 10; class 1 = error "i")

A word's label is predicted at its first word piece. A saved model is a directory with
``config.json`` (everything needed to rebuild it offline: the tagger's settings, the
encoder's Hugging Face config, the decision threshold) and ``model.safetensors``, plus the
tokenizer files. Tensors left frozen during training can be left out of the file and
taken from the base encoder package at load time (``base_tensors`` in the config), which
keeps the shipped model small.

For inference, :meth:`GedTagger.folded` gives the same logits with the head and the classifier
folded into one op (:class:`~mhmla_fast.modules.layer_attention_linear.LayerAttentionLinear`):
the engine's torch runner on the CPU and the ONNX export use it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from itertools import chain
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from ..configs import EncoderSpec, LayerAttentionConfig, accepts_flat_keywords
from ..encoder import EMBEDDED_ENCODER, freeze_encoder_parts, load_encoder, load_tokenizer, resolve_encoder
from ..model_dir import ModelDirMixin
from ..modules.layer_attention import FusedLayerAttention
from ..modules.layer_attention_linear import LayerAttentionLinear

__all__ = [
    "TaggerConfig", "GedTagger", "FoldedTagger", "resolve_encoder", "EMBEDDED_ENCODER",
    "encode_sentences", "collate", "PackedSentences", "encode_words", "load_tokenizer",
]

LABELS = ("c", "i")
IGNORE = -100
FORMAT = "mhmla-ged-tagger/1"


def _ged_encoder() -> EncoderSpec:
    return EncoderSpec(max_length=128)


@accepts_flat_keywords
@dataclass
class TaggerConfig:
    """Settings of a tagger; stored as ``config.json``.

    encoder_spec: the encoder it was initialised from, the word pieces per input at training
    time (``max_length``, default 128) and what stayed frozen
    (:class:`~mhmla_fast.configs.EncoderSpec`); layer_attention: the head
    (:class:`~mhmla_fast.configs.LayerAttentionConfig`); threshold: error-probability decision
    threshold chosen on dev (None = argmax); encoder_config: the encoder's Hugging Face
    config; base_tensors: state-dict keys not stored in ``model.safetensors`` but read from
    the base encoder's weights (key in the tagger -> key in the base file), plus the row delta
    the file stores for a key, if any (:func:`~mhmla_fast.model_dir.row_delta`); training: how
    it was trained.

    Files and keyword arguments in the flat layout of before (``encoder``, ``head``,
    ``num_heads``, ``key_size``, ``dropout``, ``max_length``) are read into the groups
    (:func:`~mhmla_fast.configs.nest_flat`); ``encoder``, ``head`` and ``num_heads`` remain
    as read-only views for code that reads that layout.
    """

    encoder_spec: EncoderSpec = field(default_factory=_ged_encoder)
    layer_attention: LayerAttentionConfig = field(default_factory=LayerAttentionConfig)
    labels: tuple[str, ...] = LABELS
    threshold: float | None = None
    encoder_config: dict = field(default_factory=dict)
    base_tensors: dict[str, str] = field(default_factory=dict)
    training: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        t = self.threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                              or not 0.0 <= t <= 1.0):
            raise ValueError(f"threshold: expected a probability in [0, 1] or None (argmax), "
                             f"got {t!r}")

    @property
    def encoder(self) -> str:
        """Read-only view: ``encoder_spec.name_or_path``."""
        return self.encoder_spec.name_or_path

    @property
    def head(self) -> str:
        """Read-only view: ``layer_attention.mode``."""
        return self.layer_attention.mode

    @property
    def num_heads(self) -> int:
        """Read-only view: ``layer_attention.num_heads``."""
        return self.layer_attention.num_heads

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> TaggerConfig:
        data = json.loads(text)
        fmt = data.pop("format", None)
        if fmt != FORMAT:
            raise ValueError(f"config.json: not an mhmla GED tagger (format {fmt!r})")
        data["labels"] = tuple(data.get("labels", LABELS))
        if "encoder_spec" not in data and "freeze_word_embeddings" not in data:
            # the flat layout kept the freeze in the training config only
            trained = (data.get("training") or {}).get("config") or {}
            data["freeze_word_embeddings"] = bool(trained.get("freeze_word_embeddings"))
        return cls(**data)


class GedTagger(ModelDirMixin, nn.Module):
    """Encoder + layer attention + linear classifier over word pieces (see module doc).
    ``save``/``load``: :class:`~mhmla_fast.model_dir.ModelDirMixin`."""

    config_class = TaggerConfig
    model_kind = "tagger"

    def __init__(self, config: TaggerConfig, *, pretrained: bool = True, backend: str = "auto"):
        super().__init__()
        self.config = config
        self.encoder, config.encoder_config = load_encoder(
            config.encoder_spec, None if pretrained else config.encoder_config)
        hf = self.encoder.config
        self.head = FusedLayerAttention(hf.hidden_size, hf.num_hidden_layers,
                                        config=config.layer_attention, backend=backend)
        self.classifier = nn.Linear(hf.hidden_size, len(config.labels))
        freeze_encoder_parts(self.encoder, config.encoder_spec.freeze)

    def train(self, mode: bool = True) -> GedTagger:
        super().train(mode)
        if self.config.encoder_spec.freeze == "all":
            self.encoder.eval()  # a fixed feature extractor: no encoder dropout
        return self

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor | None]:
        """Logits [B, T, 2] (and the layer weights p [B, T, L, J] with ``return_weights``)."""
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                           output_hidden_states=True)
        c, p = self.head(out.hidden_states, return_weights=True)
        logits = self.classifier(c)
        return (logits, p) if return_weights else logits

    def folded(self) -> FoldedTagger:
        """This tagger for inference with the head and classifier folded into one op (a
        snapshot of the current head and classifier weights; the encoder is shared)."""
        return FoldedTagger(self)

    def freeze_word_embeddings(self) -> None:
        """Keep the input word-piece embeddings fixed (they are then not saved)."""
        self.config.encoder_spec.freeze = "word_embeddings"
        freeze_encoder_parts(self.encoder, "word_embeddings")


class FoldedTagger(nn.Module):
    """Inference logits of a :class:`GedTagger`, ``(input_ids, attention_mask) -> [B, T, 2]``, with
    the head and classifier folded (:class:`LayerAttentionLinear`: the same function up to
    rounding, about half the head's multiply-adds for J = 12). Shares the tagger's encoder;
    eval mode."""

    def __init__(self, tagger: GedTagger) -> None:
        super().__init__()
        self.encoder = tagger.encoder
        self.head = LayerAttentionLinear(tagger.head, tagger.classifier)
        self.eval()

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                           output_hidden_states=True)
        return self.head(out.hidden_states)


def encode_sentences(
    tokenizer, sentences: Sequence[Sequence[str]], max_length: int,
) -> list[tuple[list[int], list[int]]]:
    """Word-piece pre-tokenised sentences: per sentence (piece ids, word index per piece).

    The word index is the word a piece starts, -1 for special tokens and non-first
    pieces. Words past ``max_length`` pieces are cut off (their index never appears). A
    word the tokenizer maps to no pieces (e.g. a lone control character) is encoded as
    the unknown token, so that every word keeps a position.
    """
    if not sentences:
        return []
    enc = tokenizer([list(s) for s in sentences], is_split_into_words=True, truncation=True,
                    max_length=max_length)
    unk = tokenizer.unk_token or "[UNK]"
    out = []
    for b, words in enumerate(sentences):
        ids, wids = enc["input_ids"][b], enc.word_ids(b)
        seen = {w for w in wids if w is not None}
        top = max(seen, default=-1)
        if len(seen) < min(len(words), top + 1) or (len(ids) < max_length and len(seen) < len(words)):
            fixed = [w if tokenizer.tokenize(w) else unk for w in words]
            one = tokenizer(fixed, is_split_into_words=True, truncation=True, max_length=max_length)
            ids, wids = one["input_ids"], one.word_ids()
        index, prev = [], None
        for w in wids:
            index.append(w if (w is not None and w != prev) else -1)
            prev = w
        out.append((list(ids), index))
    return out


class PackedSentences:
    """Encoded sentences (:func:`encode_sentences`) and their word labels, stored flat once, so
    that a batch is a few array operations: ``packed.collate(idx, rows=, length=)`` equals
    ``collate([encoded[i] for i in idx], pad_id, [labels[i] for i in idx], rows=, length=)``
    (without ``labels``, the batch has no ``"labels"``), without a Python pass over every
    piece of the batch at every step (a training step's host time bounds it on a GPU).

    Arrays: ``lengths`` [S] pieces per sentence; ``ids``, ``word_index`` and, with labels,
    ``labels`` [total pieces] (each word's label at its first piece, IGNORE elsewhere), the
    sentences one after another from ``starts`` [S]. With ``targets`` (a float per word, as
    ``labels``: the probability of an error that the loss aims at, e.g. a teacher's mixed with
    the gold label), ``targets`` [total pieces] float32 too (0 off first pieces), and a batch
    has ``"targets"`` [B, T] float32 (0 off first pieces and on padding)."""

    def __init__(self, encoded: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int,
                 labels: Sequence[Sequence[int]] | None = None,
                 targets: Sequence[Sequence[float]] | None = None) -> None:
        n = len(encoded)
        self.pad_id = pad_id
        self.lengths = np.fromiter((len(ids) for ids, _ in encoded), dtype=np.int64, count=n)
        self.starts = np.cumsum(self.lengths) - self.lengths
        total = int(self.lengths.sum())
        self.ids = np.fromiter(chain.from_iterable(ids for ids, _ in encoded), dtype=np.int64,
                               count=total)
        self.word_index = np.fromiter(chain.from_iterable(ix for _, ix in encoded),
                                      dtype=np.int64, count=total)
        self.labels = self._at_first_pieces(labels, "labels", np.int64, IGNORE)
        self.targets = self._at_first_pieces(targets, "targets", np.float32, 0.0)
        if targets is not None and labels is None:
            raise ValueError("targets: given without labels (the labels say which pieces count)")

    def _at_first_pieces(self, per_word, name: str, dtype, fill) -> np.ndarray | None:
        """[total pieces] of ``dtype``: word w's value of ``per_word`` (one sequence per
        sentence) at its first piece, ``fill`` elsewhere; None for None."""
        if per_word is None:
            return None
        n = len(self.lengths)
        if len(per_word) != n:
            raise ValueError(f"{name}: {len(per_word)} sentences, {n} encoded")
        counts = np.fromiter(map(len, per_word), dtype=np.int64, count=n)
        words = np.fromiter(chain.from_iterable(per_word), dtype=dtype, count=int(counts.sum()))
        sentence = np.repeat(np.arange(n), self.lengths)  # each piece's sentence
        first = self.word_index >= 0
        out = np.full(len(self.ids), fill, dtype=dtype)
        out[first] = words[(np.cumsum(counts) - counts)[sentence[first]] + self.word_index[first]]
        return out

    def __len__(self) -> int:
        return len(self.lengths)

    def collate(self, idx: Sequence[int], *, rows: int = 0, length: int = 0
                ) -> dict[str, Tensor]:
        """The padded batch of sentences ``idx`` (in that order, repeats allowed), as
        :func:`collate` describes it."""
        idx = np.asarray(idx, dtype=np.int64)
        n = len(idx)
        lens = self.lengths[idx]
        B, T = max(n, rows), max(length, int(lens.max()))
        col = np.arange(T)
        filled = col < lens[:, None]
        src = np.where(filled, self.starts[idx][:, None] + col, 0)  # a valid index everywhere

        def grid(flat: np.ndarray, fill) -> Tensor:
            out = np.full((B, T), fill, dtype=flat.dtype)
            out[:n] = np.where(filled, flat[src], fill)
            return torch.from_numpy(out)

        mask = np.zeros((B, T), dtype=np.int64)
        mask[:n] = filled
        mask[n:, 0] = 1
        batch = {"input_ids": grid(self.ids, self.pad_id), "attention_mask": torch.from_numpy(mask),
                 "word_index": grid(self.word_index, -1)}
        if self.labels is not None:
            batch["labels"] = grid(self.labels, IGNORE)
        if self.targets is not None:
            batch["targets"] = grid(self.targets, 0.0)
        return batch


def collate(
    encoded: Sequence[tuple[list[int], list[int]]], pad_id: int,
    labels: Sequence[Sequence[int]] | None = None, *, rows: int = 0, length: int = 0,
) -> dict[str, Tensor]:
    """Pad encoded sentences into ``input_ids``, ``attention_mask``, ``word_index`` [B, T]
    and, with word ``labels``, ``labels`` [B, T] (the word's label at its first piece,
    -100 elsewhere).

    B is at least ``rows`` and T at least ``length`` (for static shapes): each filler row is
    padding whose first piece alone is attended (so attention stays defined) and carries no
    label."""
    return PackedSentences(encoded, pad_id, labels).collate(range(len(encoded)), rows=rows,
                                                             length=length)


def encode_words(
    tokenizer, sentences: Sequence[Sequence[str]], max_length: int,
    labels: Sequence[Sequence[int]] | None = None,
) -> dict[str, Tensor]:
    """:func:`encode_sentences` then :func:`collate`: one padded batch."""
    return collate(encode_sentences(tokenizer, sentences, max_length), tokenizer.pad_token_id,
                   labels)
