"""Fingerprints of model folders: what a cache made from a model records, so that a cache
made with other weights under the same name is never read for this one (the AES feature
caches, :mod:`.features`, and the grammatical-error features, :mod:`.ged_features`)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

__all__ = ["encoder_fingerprint", "files_fingerprint", "local_encoder_fingerprint"]


@functools.lru_cache(maxsize=8)
def encoder_fingerprint(encoder: str) -> str:
    """sha256 of the encoder's files as loaded (:func:`files_fingerprint` of its folder), so
    that a cache made with other weights under the same name is never taken for this
    encoder's. Once per process and encoder."""
    from ..encoder import resolve_encoder

    return files_fingerprint(Path(resolve_encoder(encoder)))


def local_encoder_fingerprint(encoder: str) -> str | None:
    """:func:`encoder_fingerprint` of an encoder in a local folder (the embedded one, a path);
    None for a Hugging Face hub name, whose files are not checked (fine-tuning takes one)."""
    from ..encoder import resolve_encoder

    return encoder_fingerprint(encoder) if Path(resolve_encoder(encoder)).is_dir() else None


def files_fingerprint(root: Path) -> str:
    """sha256 of a model folder's config, tokenizer and weight files (``.json``,
    ``.safetensors``, ``.bin``, ``.txt``, ``.model``): their names, sizes and contents."""
    h = hashlib.sha256()
    files = sorted(p for p in root.iterdir() if p.is_file() and (
        p.suffix in (".json", ".safetensors", ".bin", ".txt", ".model")))
    for f in files:
        h.update(f"\0{f.name}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as src:
            for chunk in iter(lambda: src.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()
