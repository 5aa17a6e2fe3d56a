"""The ONNX export cache behind ``backend="auto"`` on the CPU: export a model once, validated to
give exactly torch fp32's results, and reuse it on later runs without importing torch.

One cache for every kind of model (:class:`ExportKind`): :data:`TAGGER` (a GED tagger,
``onnx_export.export_onnx``: labels identical to torch's) and :data:`SCORER` (an essay scorer,
``score_onnx.export_scorer``: integer scores identical to torch's). The kind is read from the
model's ``config.json`` ("format"); it is part of every key, so the two never share an entry.

    <root>/onnx/<key>/                  a complete export (the kind's files: ``model.onnx``,
                                        export.json, ...) and cache.json; never changed once it
                                        exists
    <root>/onnx/<key>.failed.json       why the export of <key> failed (it is not retried)
    <root>/onnx/index/<quick>.json      {"entry": <key>, ...}: the quick key's entry
    <root>/onnx/<key>.lock              held (``flock``) while <key> is exported
    <root>/onnx/<key>.stamp.json        the stat of <key>'s files when their SHA-256 (in its
                                        cache.json) last matched (:func:`_intact`)
    <root>/onnx/.tmp-<key>-*/           a staging directory (ignored; removed by the next export
                                        of <key>)

Housekeeping, done by each new export (never on a start that finds its entry): staging and
set-aside folders a day old are removed, and so are entries and failure records not used for
:data:`UNUSED_S` (30 days), with the index records that named them. A start that uses an entry
sets its folder's mtime (or the record's); a user who cannot (a shared cache he does not own)
still reads ``model.onnx``, whose access time counts too. A model version nobody runs any more
does not keep its ~100 MB (nor, since 2026-12-07, its lock and stamp files). Starts take no
lock: a start that finds an entry in the instant between the evicting export's last look and
its rename loses it, and runs torch that once.

``<root>`` is ``$MHMLA_CACHE_DIR``, else ``$XDG_CACHE_HOME/mhmla-fast``, else
``~/.cache/mhmla-fast``. ``MHMLA_NO_CACHE=1`` (or ``cache=False``) turns the cache off; auto then
runs torch. :func:`auto_load` is the rule itself (cached export, else torch with one line);
:func:`auto_runner` applies it to a tagger, ``score_onnx.auto_scorer`` to a scorer.

Keys. ``<key>`` hashes the export kind, the content of the model's files (the model directory's
files and, when the model reads tensors or its tokenizer from its encoder's directory, that
directory's files: for the shipped tagger 25 MB + 91 MB, 0.25 s to hash here), the versions of
mhmla-fast, torch, transformers, onnx and onnxruntime, and the kind's export options
(:data:`EXPORT_OPTIONS`, :data:`SCORER_EXPORT_OPTIONS`).
Hashing on every start would cost that quarter second, so the start-up path first computes the
*quick key*: the same kind, versions and options with each file's path, size, mtime, ctime and inode
(a few ``stat`` calls). ``index/<quick>.json`` names the entry the content hash led to last
time; a changed file changes its stat, so the content is hashed again (and, when equal, the
same entry is found and a new index record written).

Atomicity. An export is staged in ``.tmp-<key>-*`` beside the entry, completed (cache.json
last), then renamed to ``<key>``: a reader sees a whole export or none. Exporters of one key
take ``<key>.lock`` in turn; the second one finds the first's entry when it gets the lock. Where
``flock`` does not exist, a rename onto an existing entry fails and the loser uses the winner's.

Failures. An export or validation that fails is recorded in ``<key>.failed.json`` (with the
versions in the key, a new version tries again); auto then runs torch and says why on stderr
once per run. Delete the record (or the cache) to try again. A failure to write (an OSError: a
full disk, a read-only cache) is not recorded: auto runs torch and the next run tries again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import filelock
from ..durable import atomic_write_text, current_umask, fsync_dir, fsync_file
from ..aes.scoring import FORMAT as SCORER_FORMAT
from .engine import TAGGER_FORMAT

__all__ = ["CACHE_ENV", "NO_CACHE_ENV", "EXPORT_OPTIONS", "SCORER_EXPORT_OPTIONS", "ExportKind",
           "TAGGER", "SCORER", "KINDS", "kind_of", "CacheEntry", "ExportUnavailable", "Lookup",
           "cache_root", "cache_enabled", "source_files", "runtime_versions", "quick_key",
           "content_key", "entry_key", "lookup", "ensure_export", "auto_load", "auto_runner",
           "auto_scorer"]

CACHE_ENV = "MHMLA_CACHE_DIR"
NO_CACHE_ENV = "MHMLA_NO_CACHE"
CACHE_FORMAT = "mhmla-onnx-cache/1"
CACHE_META = "cache.json"
LOCK_WAIT_S = 600.0  # the longest wait for another process's export of the same model
# What the cached export is made with (onnx_export.export_onnx's defaults): part of the key.
EXPORT_OPTIONS = {"opset": 17, "exporter": "torchscript", "atol": 1e-4, "seed": 0,
                  "graphs": ["fp32"], "labels": "identical to torch at the threshold and 0.5",
                  "head": "folded with the classifier (LayerAttentionLinear)",
                  "attention": "eager"}
# What a scorer's cached export is made with (score_onnx.export_scorer's defaults): its key.
SCORER_EXPORT_OPTIONS = {"opset": 17, "exporter": "torchscript", "atol": 1e-4, "seed": 0,
                         "graph": "encoder + head: every prompt's window outputs; the last "
                                  "layer at [CLS] only for cls pooling",
                         "attention": "eager",
                         "scores": "identical to torch on the validation essays"}
_VERSIONED = ("mhmla-fast", "torch", "transformers", "onnx", "onnxruntime")
_TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "tokenizer.model")

Log = Callable[..., None]


class ExportUnavailable(RuntimeError):
    """No validated export can be had (failed now or before, or the cache cannot be written):
    the message says why, for the one stderr line."""


@dataclass(frozen=True, eq=False)
class ExportKind:
    """What the cache exports for one kind of model: ``name`` (in the key), the ``format`` of the
    models' ``config.json``, the export ``options`` (in the key) and ``export(model_dir,
    out_dir, threads=None)``, which writes a validated export (``model.onnx`` and its side
    files) into ``out_dir`` on ``threads`` CPU threads and returns its metadata
    (``export.json``), raising when the validation fails."""

    name: str
    format: str
    options: dict
    export: Callable[..., dict]


@dataclass(frozen=True)
class CacheEntry:
    """A complete cached export: ``path`` (an engine directory with ``model.onnx``) and its
    ``key``."""

    path: Path
    key: str


def _stderr(*parts: str, end: str = "\n") -> None:
    print(*parts, end=end, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------- where and whether


def cache_root() -> Path:
    """``$MHMLA_CACHE_DIR``, else ``$XDG_CACHE_HOME/mhmla-fast`` (an absolute path only, as the
    XDG specification says), else ``~/.cache/mhmla-fast``. :class:`ExportUnavailable` when
    there is no home directory to find (no ``$HOME`` and no passwd entry)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or "").expanduser()
    if xdg.is_absolute():
        return xdg / "mhmla-fast"
    try:
        return Path.home() / ".cache" / "mhmla-fast"
    except RuntimeError as err:  # no $HOME and no passwd entry for this uid
        raise ExportUnavailable(f"there is no home directory for the export cache ({err}); "
                                f"set {CACHE_ENV}") from err


def cache_enabled(cache: bool | None = None) -> bool:
    """``cache`` when given, else True unless ``$MHMLA_NO_CACHE`` is set (to anything but
    "", "0", "false", "no")."""
    if cache is not None:
        return bool(cache)
    return os.environ.get(NO_CACHE_ENV, "").strip().lower() in ("", "0", "false", "no")


# ---------------------------------------------------------------------------------- the keys


def _read_config(model_dir: Path) -> dict:
    """``config.json`` of a model directory as a dict ({} when it has none or it is not JSON:
    then :func:`kind_of` names the problem)."""
    return _read_json(model_dir / "config.json") or {}


def kind_of(model_dir: str | os.PathLike) -> ExportKind:
    """The export kind of the model in ``model_dir``, by its ``config.json``'s "format";
    ValueError naming the file when it is none of :data:`KINDS`."""
    config = _read_config(Path(model_dir))
    for kind in KINDS:
        if config.get("format") == kind.format:
            return kind
    raise ValueError(f"{Path(model_dir) / 'config.json'}: not a model the export cache knows "
                     f"(format {config.get('format')!r}; expected one of "
                     f"{[k.format for k in KINDS]})")


def source_files(model_dir: str | os.PathLike) -> list[Path]:
    """The files a model directory (tagger or scorer) is loaded from, in a fixed order: its
    regular files (but, beside the weights, an export's own: ``onnx_export.EXPORT_FILES``),
    then those of its encoder's local directory when it reads tensors (``base_tensors``) or
    its tokenizer from there."""
    from .onnx_export import EXPORT_FILES

    model_dir = Path(model_dir).resolve()
    files = sorted(p for p in model_dir.iterdir() if p.is_file())
    if (model_dir / "model.safetensors").is_file():  # an export in place is not the model
        files = [p for p in files if p.name not in EXPORT_FILES]
    encoder = encoder_source_dir(model_dir)
    if encoder is not None:
        files += sorted(p for p in encoder.iterdir() if p.is_file())
    return files


def encoder_source_dir(model_dir: str | os.PathLike) -> Path | None:
    """The local encoder directory a model directory reads from besides its own files (tensors
    named in ``base_tensors``, or its tokenizer when it has none), or None."""
    model_dir = Path(model_dir).resolve()
    config = _read_config(model_dir)
    own_tokenizer = any((model_dir / n).is_file() for n in _TOKENIZER_FILES)
    if not (config.get("base_tensors") or not own_tokenizer):
        return None
    spec = config.get("encoder_spec")  # the nested layout; "encoder" the flat one
    name = spec.get("name_or_path") if isinstance(spec, dict) else config.get("encoder")
    encoder = _encoder_dir(name)
    return encoder if encoder is not None and encoder != model_dir else None


def _chain(err: BaseException | None) -> Iterator[BaseException]:
    """``err`` and what it was raised from (``__cause__``, else ``__context__``), once each."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _raise_interrupt(err: BaseException) -> None:
    """KeyboardInterrupt if ``err`` came of one: Ctrl-C while an extension module initialises
    surfaces as ``ImportError: initialization failed``, which is not "cannot be imported" (a
    fallback to torch would swallow the user's interrupt)."""
    if any(isinstance(e, KeyboardInterrupt) for e in _chain(err)):
        raise KeyboardInterrupt from err


def _encoder_dir(name) -> Path | None:
    """The encoder's local directory (the embedded MiniLM's package folder), or None for a hub
    name (then only its name is in the model's config, which is hashed)."""
    from ..encoder import resolve_encoder

    if not name:
        return None
    path = Path(resolve_encoder(name))
    return path.resolve() if path.is_dir() else None


def runtime_versions() -> dict[str, str | None]:
    """Installed versions of mhmla-fast, torch, transformers, onnx and onnxruntime (None: not
    installed), from the packages' metadata: nothing is imported."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in _VERSIONED:
        candidates = [name] + (["onnxruntime-gpu"] if name == "onnxruntime" else [])
        out[name] = None
        for dist in candidates:
            try:
                out[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def quick_key(files: list[Path], versions: dict, kind: ExportKind | None = None) -> str:
    """The start-up key: kind, versions, options and each file's path, size, mtime, ctime and
    inode (``kind`` default: :data:`TAGGER`)."""
    kind = kind or TAGGER
    stats = []
    for p in files:
        st = p.stat()
        stats.append([str(p), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
    return _digest({"format": CACHE_FORMAT, "kind": kind.name, "files": stats,
                    "versions": versions, "options": kind.options})[:32]


def content_key(files: list[Path]) -> str:
    """SHA-256 over the names (relative to their folder) and contents of ``files``."""
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode("utf-8", "surrogateescape") + b"\0")
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def entry_key(content: str, versions: dict, kind: ExportKind | None = None) -> str:
    """The entry's name: export kind (default :data:`TAGGER`), content hash, versions, the
    kind's export options and the cache format."""
    kind = kind or TAGGER
    return _digest({"format": CACHE_FORMAT, "kind": kind.name, "content": content,
                    "versions": versions, "options": kind.options})[:32]


# ------------------------------------------------------------------------------ the lookup


@dataclass
class Lookup:
    """Where a model stands in the cache: ``entry`` (a complete export) or ``failed`` (the
    record of a failed one) or neither; ``key`` (None when only the quick key was computed and
    the index had nothing) and ``quick``."""

    entry: CacheEntry | None
    failed: dict | None
    key: str | None
    quick: str
    files: list[Path]
    versions: dict
    content: str | None = None
    kind: ExportKind | None = None


def _onnx_dir(root: Path) -> Path:
    return root / "onnx"


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _complete(entry: Path) -> bool:
    """``entry`` has its ``cache.json`` and ``model.onnx``, and every file ``cache.json`` lists
    (``"files"``: name -> size in bytes; entries from before it list none) at its size."""
    meta = _read_json(entry / CACHE_META)
    if meta is None or not (entry / "model.onnx").is_file():
        return False
    try:
        return all((entry / name).stat().st_size == size
                   for name, size in (meta.get("files") or {}).items())
    except OSError:
        return False


def _files_sha256(folder: Path, names) -> dict[str, str]:
    """``{name: sha256 of its content}`` for the files ``names`` of ``folder``."""
    from .onnx_export import file_sha256

    return {name: file_sha256(folder / name) for name in names}


def _stamp(folder: Path, names) -> dict[str, list[int]]:
    """Each file's size, mtime, ctime and inode: a write to a file changes its ctime."""
    out = {}
    for name in names:
        st = (folder / name).stat()
        out[name] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    return out


def _intact(base: Path, key: str) -> bool:
    """The complete entry ``base/key`` holds the contents it was made with: ``cache.json``
    lists each file's SHA-256 (entries from before it list none: sizes only, as
    :func:`_complete` checks). Hashing them costs about 0.17 s for the shipped tagger's, so
    a start compares the files' stat with ``<key>.stamp.json`` (written when they last hashed
    right) and hashes only when it differs: after a write to a file (which changes its
    ctime), a copy of the cache, or where the stamp cannot be written (then at every start).
    A change that leaves the stat alone (the disk's own decay) is not seen."""
    entry = base / key
    sums = (_read_json(entry / CACHE_META) or {}).get("files_sha256")
    if not isinstance(sums, dict):
        return True
    stamp_file = base / f"{key}.stamp.json"
    try:
        stamp = _stamp(entry, sums)
        if _read_json(stamp_file) == {"files": stamp}:
            return True
        if _files_sha256(entry, sums) != sums:
            return False
    except OSError:
        return False
    try:
        _write_json_atomic(stamp_file, {"files": stamp})
    except OSError:
        pass
    return True


def _state(base: Path, key: str) -> tuple[CacheEntry | None, dict | None]:
    entry = base / key
    if _complete(entry) and _intact(base, key):
        return CacheEntry(entry, key), None
    failed = _read_json(base / f"{key}.failed.json")
    return None, failed


def _set_aside(entry: Path) -> bool:
    """Move a damaged or incomplete entry out of the way (renamed, then removed); whether it
    is gone (False: a cache this process cannot write)."""
    if not entry.exists():
        return True
    aside = entry.with_name(f".bad-{entry.name}-{os.getpid()}-{time.time_ns()}")
    try:
        os.rename(entry, aside)
    except OSError:
        aside = entry
    shutil.rmtree(aside, ignore_errors=True)
    return not entry.exists()


def _fsync_tree(stage: Path) -> None:
    """Every file of ``stage`` and ``stage`` itself on disk, before it is renamed into place
    (a crash then leaves either no entry or a whole one)."""
    for path in stage.iterdir():
        fsync_file(path)
    fsync_dir(stage)


def lookup(model_dir: str | os.PathLike, root: str | os.PathLike | None = None, *,
           hash_content: bool = True, kind: ExportKind | None = None) -> Lookup:
    """The cache's state for ``model_dir`` (of ``kind``; default: :func:`kind_of` it, and
    ValueError when it is another kind): by the quick key's index record when there is one (no
    hashing), else (``hash_content``) by the content hash."""
    found = kind_of(model_dir)
    if kind is not None and kind is not found:
        raise ValueError(f"{Path(model_dir) / 'config.json'}: a {found.name} ({found.format}), "
                         f"not a {kind.name} ({kind.format})")
    kind = found
    base = _onnx_dir(Path(root) if root is not None else cache_root())
    files = source_files(model_dir)
    versions = runtime_versions()
    quick = quick_key(files, versions, kind)
    record = _read_json(base / "index" / f"{quick}.json")
    key = record.get("entry") if record else None
    if isinstance(key, str) and key:
        entry, failed = _state(base, key)
        if entry is not None or failed is not None:
            _mark_used(base, key, entry)
            return Lookup(entry, failed, key, quick, files, versions,
                          record.get("content_sha256"), kind)
    if not hash_content:
        return Lookup(None, None, None, quick, files, versions, kind=kind)
    content = content_key(files)
    key = entry_key(content, versions, kind)
    entry, failed = _state(base, key)
    if entry is not None or failed is not None:
        _mark_used(base, key, entry)
        _write_index(base, quick, key, content, model_dir, kind)
    return Lookup(entry, failed, key, quick, files, versions, content, kind)


def _mark_used(base: Path, key: str, entry: CacheEntry | None) -> None:
    """Best effort (a read-only cache still works): the entry's folder, or the failure record,
    gets the time now as its mtime, which :func:`_remove_unused` reads as its last use."""
    try:
        os.utime(entry.path if entry is not None else base / f"{key}.failed.json")
    except OSError:
        pass


def _write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def _write_index(base: Path, quick: str, key: str, content: str, model_dir,
                 kind: ExportKind) -> None:
    """Best effort: a cache that cannot be written still works, by content hash."""
    try:
        _write_json_atomic(base / "index" / f"{quick}.json",
                           {"entry": key, "kind": kind.name, "content_sha256": content,
                            "model_dir": str(Path(model_dir).resolve())})
    except OSError:
        pass


# ------------------------------------------------------------------------------ the export


@contextmanager
def _locked(path: Path, on_wait: Callable[[], None], limit_s: float | None = None
            ) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created); ``on_wait()`` is called once when another
    process holds it, and :class:`ExportUnavailable` is raised when it still does after
    ``limit_s`` seconds (default :data:`LOCK_WAIT_S`: a stopped or hung exporter must not stop
    every later start). Without locks (Windows) nothing is locked: the rename decides."""
    limit_s = LOCK_WAIT_S if limit_s is None else limit_s
    with open(path, "a+b") as f:
        if not filelock.try_lock(f.fileno()):
            on_wait()
            t0 = time.monotonic()
            while not filelock.try_lock(f.fileno()):
                if time.monotonic() - t0 > limit_s:
                    raise ExportUnavailable(f"another process has held the export lock {path} "
                                            f"for over {limit_s:.0f} s")
                time.sleep(0.2)
        try:
            yield
        finally:
            filelock.unlock(f.fileno())


def _default_export(model_dir: Path, out_dir: Path, threads: int | None = None) -> dict:
    """``onnx_export.export_onnx`` with :data:`EXPORT_OPTIONS`, torch and the validation's ONNX
    Runtime on ``threads`` CPU threads (None: their defaults); returns its export.json."""
    from .onnx_export import EXPORT_META, export_onnx
    from .runners import set_torch_threads

    set_torch_threads(threads)
    export_onnx(model_dir, out_dir, opset=EXPORT_OPTIONS["opset"],
                exporter=EXPORT_OPTIONS["exporter"], atol=EXPORT_OPTIONS["atol"],
                seed=EXPORT_OPTIONS["seed"], threads=threads)
    return json.loads((out_dir / EXPORT_META).read_text(encoding="utf-8"))


def _scorer_export(model_dir: Path, out_dir: Path, threads: int | None = None) -> dict:
    """``score_onnx.export_scorer`` with :data:`SCORER_EXPORT_OPTIONS`, on ``threads`` like
    :func:`_default_export`; returns its export.json."""
    from .onnx_export import EXPORT_META
    from .runners import set_torch_threads
    from .score_onnx import export_scorer

    set_torch_threads(threads)
    export_scorer(model_dir, out_dir, opset=SCORER_EXPORT_OPTIONS["opset"],
                  exporter=SCORER_EXPORT_OPTIONS["exporter"], atol=SCORER_EXPORT_OPTIONS["atol"],
                  seed=SCORER_EXPORT_OPTIONS["seed"], threads=threads)
    return json.loads((out_dir / EXPORT_META).read_text(encoding="utf-8"))


# The kinds (looked up at call time, so that a test may replace the module's functions).
TAGGER = ExportKind("tagger", TAGGER_FORMAT, EXPORT_OPTIONS,
                    lambda model_dir, out_dir, threads=None:
                    _default_export(model_dir, out_dir, threads))
SCORER = ExportKind("scorer", SCORER_FORMAT, SCORER_EXPORT_OPTIONS,
                    lambda model_dir, out_dir, threads=None:
                    _scorer_export(model_dir, out_dir, threads))
KINDS = (TAGGER, SCORER)


def ensure_export(model_dir: str | os.PathLike, root: str | os.PathLike | None = None, *,
                  log: Log = _stderr, exporter: Callable[[Path, Path], dict] | None = None,
                  kind: ExportKind | None = None, threads: int | None = None) -> CacheEntry:
    """The cached, validated export of the model in ``model_dir`` (a tagger or a scorer:
    ``kind``, default :func:`kind_of` it): found (quick key, else content hash), or made now
    (one line on stderr through ``log``: what, where, how long).

    ``exporter(model_dir, out_dir)`` writes the export into ``out_dir`` and returns its
    metadata (default: the kind's, e.g. ``export_onnx`` with :data:`EXPORT_OPTIONS`, on
    ``threads`` CPU threads). Raises
    :class:`ExportUnavailable` with the reason when the export failed, now or in an earlier
    run (recorded; a failure to write is not recorded), or the cache directory cannot be
    written."""
    root = Path(root) if root is not None else cache_root()
    found = lookup(model_dir, root, kind=kind)
    kind = found.kind
    if found.entry is not None:
        return found.entry
    base = _onnx_dir(root)
    if found.failed is not None:
        raise ExportUnavailable(_failed_reason(found.failed, base / f"{found.key}.failed.json"))
    key, content = found.key, found.content
    assert key is not None and content is not None
    try:
        base.mkdir(parents=True, exist_ok=True)
        lock = base / f"{key}.lock"
        lock.touch()
    except OSError as err:
        raise ExportUnavailable(f"the cache {base} cannot be written ({err})") from err
    with _locked(lock, lambda: log(f"mhmla-fast: waiting for another process exporting "
                                   f"{Path(model_dir).name} to ONNX into {base / key}")):
        entry, failed = _state(base, key)  # made (or failed) while we waited
        if failed is not None:
            raise ExportUnavailable(_failed_reason(failed, base / f"{key}.failed.json"))
        if entry is None:
            for old in base.glob(f".tmp-{key}-*"):  # dead: their exporter held this lock
                shutil.rmtree(old, ignore_errors=True)
            _remove_stale(base)
            _remove_unused(base, keep=key)
            _set_aside(base / key)  # incomplete (a file missing or cut short): made again
            if exporter is None:
                def exporter(model_dir, out_dir, export=kind.export):
                    return export(model_dir, out_dir, threads=threads)
            entry = _export_entry(Path(model_dir), base, key, content, found.versions,
                                  kind, exporter, log)
    _write_index(base, found.quick, key, content, model_dir, kind)
    return entry


def _export_entry(model_dir: Path, base: Path, key: str, content: str, versions: dict,
                  kind: ExportKind, exporter: Callable[[Path, Path], dict], log: Log
                  ) -> CacheEntry:
    """Export into a staging directory, complete it, rename it to ``base/key``; on failure
    record it (a failure of the model's own) and raise :class:`ExportUnavailable`. An export
    during which the model's files changed is neither kept nor recorded: ``key`` names the
    content read before it."""
    final = base / key
    log(f"mhmla-fast: exporting {model_dir.name} to ONNX once, for fast CPU runs (backend "
        f"auto; --backend torch or MHMLA_NO_CACHE=1 to skip), into {final} ...", end="")
    t0 = time.perf_counter()

    def unavailable(reason: str) -> ExportUnavailable:
        log(f" failed after {time.perf_counter() - t0:.1f} s")
        return ExportUnavailable(reason)

    changed = (f"the model in {model_dir} changed during its export (nothing kept; it is "
               "exported again on the next run)")
    try:
        stage = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=base))
    except OSError as err:
        raise unavailable(f"the cache {base} cannot be written ({err})") from err
    try:
        try:
            meta = exporter(model_dir, stage)
        except OSError as err:  # the disk, not the model (e.g. full): tried again next run
            raise unavailable(f"its ONNX export could not be written to {base} "
                              f"({type(err).__name__}: {err})") from err
        except Exception as err:  # noqa: BLE001 - the model's failures are recorded, not others
            reason = f"{type(err).__name__}: {err}"
            if isinstance(err, (ImportError, MemoryError)) or _out_of_memory(err):
                raise unavailable(f"its ONNX export could not be made here ({reason})") from err
            if not _unchanged(model_dir, content):
                raise unavailable(changed) from err
            record = {"format": CACHE_FORMAT, "kind": kind.name, "key": key, "error": reason,
                      "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                      "model_dir": str(model_dir.resolve()), "content_sha256": content,
                      "versions": versions, "options": kind.options}
            failed = base / f"{key}.failed.json"
            try:
                _write_json_atomic(failed, record)
            except OSError:
                pass
            raise unavailable(_failed_reason(record, failed)) from err
        if not _unchanged(model_dir, content):
            raise unavailable(changed)
        seconds = time.perf_counter() - t0
        try:
            names = sorted(f.name for f in stage.iterdir()
                           if f.is_file() and f.name != CACHE_META)
            _write_json_atomic(stage / CACHE_META, {
                "format": CACHE_FORMAT, "kind": kind.name, "key": key, "content_sha256": content,
                "model_dir": str(model_dir.resolve()), "versions": versions,
                "options": kind.options, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "seconds": round(seconds, 2),
                "validation": (meta or {}).get("validation"),
                "files": {name: (stage / name).stat().st_size for name in names},
                "files_sha256": _files_sha256(stage, names)})
            _fsync_tree(stage)
            os.chmod(stage, 0o777 & ~current_umask())  # mkdtemp's 0700 would hide it from others
            try:
                os.rename(stage, final)
            except OSError:
                if not _complete(final):  # neither a lost race nor a whole entry: a real failure
                    raise
            fsync_dir(base)
            _intact(base, key)  # its stamp: the next start compares stat, hashes nothing
        except OSError as err:
            raise unavailable(f"its ONNX export could not be written to {base} "
                              f"({type(err).__name__}: {err})") from err
        log(f" done in {seconds:.1f} s")
        return CacheEntry(final, key)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


STALE_S = 86400.0  # a staging or set-aside folder this old is a killed run's: removed


def _remove_stale(base: Path, now: float | None = None) -> None:
    """Remove staging (``.tmp-*``) and set-aside (``.bad-*``) folders of any key last changed
    more than :data:`STALE_S` ago (a run killed mid-export of a model since changed leaves its
    staging folder under a key nobody exports again). Best effort."""
    now = time.time() if now is None else now
    for old in [*base.glob(".tmp-*"), *base.glob(".bad-*")]:
        try:
            if old.is_dir() and now - old.stat().st_mtime > STALE_S:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass


UNUSED_S = 30 * 86400.0  # an entry or failure record unused this long is removed


def _remove_unused(base: Path, keep: str, now: float | None = None) -> None:
    """Remove the entries and failure records of ``base`` (other than ``keep``'s) last used
    more than :data:`UNUSED_S` ago, then the index records naming neither an entry nor a
    failure. An entry whose lock another process holds (it is being made again) is left.
    Best effort: what cannot be removed stays."""
    now = time.time() if now is None else now

    def unused(path: Path) -> bool:
        # last use: the mtime a start sets, or (where the start could not: a user who does
        # not own the entry) the model file's access time, which reading it updates (daily,
        # under the usual relatime mount option)
        try:
            last = path.stat().st_mtime
            if path.is_dir():
                last = max(last, (path / "model.onnx").stat().st_atime)
        except OSError:
            return False
        return now - last > UNUSED_S

    for path in list(base.iterdir()):
        name = path.name
        if name.startswith(".") or name == "index" or name.startswith(keep):
            continue
        if name.endswith(".failed.json") and unused(path):
            path.unlink(missing_ok=True)
        elif path.is_dir() and unused(path):
            try:
                with open(base / f"{name}.lock", "a+b") as lock:
                    if filelock.try_lock(lock.fileno()):
                        try:
                            if unused(path) and _set_aside(path):  # again: a start may have
                                (base / f"{name}.stamp.json").unlink(missing_ok=True)  # found it
                                (base / f"{name}.lock").unlink(missing_ok=True)
                        finally:
                            filelock.unlock(lock.fileno())
            except OSError:
                pass
    # a lock or stamp whose entry and failure record are gone (older versions left the locks)
    for path in [*base.glob("*.lock"), *base.glob("*.stamp.json")]:
        key = path.name.split(".", 1)[0]
        if key == keep or (base / key).exists() or (base / f"{key}.failed.json").exists():
            continue
        try:
            if now - path.stat().st_mtime > STALE_S:
                path.unlink()
        except OSError:
            pass
    for record in list((base / "index").glob("*.json")):
        key = (_read_json(record) or {}).get("entry")
        if isinstance(key, str) and key and not (base / key).exists() \
                and not (base / f"{key}.failed.json").exists():
            record.unlink(missing_ok=True)


def _out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` (or what it was raised from) is an allocation failure: a MemoryError, or
    an error whose message says so, as torch's RuntimeErrors and ONNX Runtime's own exception
    classes (not RuntimeErrors: ``Fail``, ``RuntimeException``) do. The machine's state, not
    the model's: never recorded as its failure, nor taken for a damaged entry."""
    return any(isinstance(e, MemoryError) or (isinstance(e, Exception) and any(
        word in str(e) for word in ("allocate", "bad_alloc", "out of memory")))
        for e in _chain(err))


def _unchanged(model_dir: Path, content: str) -> bool:
    """Whether the files of ``model_dir`` still hash to ``content``."""
    try:
        return content_key(source_files(model_dir)) == content
    except (OSError, ValueError):
        return False


def _failed_reason(record: dict, path: Path) -> str:
    return (f"its ONNX export failed on {record.get('when', '?')}: {record.get('error', '?')} "
            f"(recorded in {path}; delete it to try again)")


# --------------------------------------------------------------------------- the runner


def auto_load(model_dir: str | os.PathLike, kind: ExportKind, *,
              onnx: Callable[[Path], Any], torch: Callable[[], Any], cache: bool | None = None,
              root: str | os.PathLike | None = None, log: Log = _stderr,
              threads: int | None = None):
    """The rule of ``backend="auto"`` on the CPU in float32, for any kind of model:
    ``onnx(export_dir)`` on ``model_dir`` itself when it is an export (``model.onnx``, no
    ``model.safetensors``); else, with the cache on, ``onnx`` on the cached export of ``kind``
    (made now if needed, on ``threads`` CPU threads); else, or when no export can be had (one line on stderr says why),
    ``torch()``."""
    model_dir = Path(model_dir)
    if (model_dir / "model.onnx").is_file() and not (model_dir / "model.safetensors").is_file():
        return onnx(model_dir)
    if not cache_enabled(cache):
        return torch()
    try:
        entry = ensure_export(model_dir, root, log=log, kind=kind, threads=threads)
    except ExportUnavailable as err:
        log(f"mhmla-fast: backend auto runs torch for {model_dir.name}: {err}")
    except OSError as err:  # the cache's disk (staging, index): not recorded
        log(f"mhmla-fast: backend auto runs torch for {model_dir.name}: the export cache "
            f"failed ({type(err).__name__}: {err})")
    except ImportError as err:  # onnxruntime found but not importable
        _raise_interrupt(err)
        log(f"mhmla-fast: backend auto runs torch: onnxruntime cannot be imported ({err})")
    else:
        try:
            return onnx(entry.path)
        except ImportError as err:
            _raise_interrupt(err)
            log(f"mhmla-fast: backend auto runs torch: onnxruntime cannot be imported ({err})")
        except Exception as err:  # noqa: BLE001 - a damaged entry: set aside, made again next run
            if _out_of_memory(err):  # the machine's memory, not the entry: keep it (shared)
                log(f"mhmla-fast: backend auto runs torch for {model_dir.name}: not enough "
                    f"memory to load its cached ONNX export ({type(err).__name__}: {err})")
                return torch()
            fate = ("it was removed and is made again on the next run" if _set_aside(entry.path)
                    else f"it could not be removed (delete {entry.path} to have it made again)")
            log(f"mhmla-fast: backend auto runs torch for {model_dir.name}: its cached ONNX "
                f"export would not load ({type(err).__name__}: {err}); {fate}")
    return torch()


def auto_runner(model_dir: str | os.PathLike, *, threads: int | None = None,
                kernels: str = "auto", cache: bool | None = None,
                root: str | os.PathLike | None = None, log: Log = _stderr, lanes: int = 1,
                dtype: str = "float32", threshold: float = 0.5,
                check_margin: float | None = None):
    """The tagging runner of ``backend="auto"`` on the CPU (the options already resolved to
    "auto" by :func:`.options.resolve_options`), by :func:`auto_load`: on ``model_dir`` itself
    when it is an export, else on the cached export, ONNX Runtime fp32 (``dtype`` "float32")
    or the checked bf16 pass (``dtype`` "bfloat16": :func:`.openvino_runner.checked_runner`
    at ``threshold`` and ``check_margin``; ONNX Runtime fp32 when OpenVINO fails, one line on
    stderr saying why); else eager torch in float32 with ``kernels`` (fp32's labels either
    way). Each runs ``lanes`` passes at a time."""
    from .runners import TorchRunner

    def torch():
        return TorchRunner(model_dir, device="cpu", dtype="float32", kernels=kernels,
                           threads=threads, lanes=lanes)

    def onnx(path: Path):
        if dtype == "bfloat16":
            return _checked_runner(path, threads, lanes, threshold, check_margin, log, root)
        return _onnx_runner(path, threads, lanes)

    return auto_load(model_dir, TAGGER, onnx=onnx, torch=torch, cache=cache, root=root, log=log,
                     threads=threads)


def _checked_runner(export_dir: Path, threads: int | None, lanes: int, threshold: float,
                    margin: float | None, log: Log, root: str | os.PathLike | None = None):
    from .openvino_runner import checked_runner

    return _openvino_or(
        lambda cache_dir: checked_runner(export_dir, threshold=threshold, threads=threads,
                                         lanes=lanes, margin=margin, cache_dir=cache_dir),
        lambda: _onnx_runner(export_dir, threads, lanes), export_dir, root, log)


def _openvino_or(checked: Callable[[Path | None], Any], fp32: Callable[[], Any],
                 export_dir: Path, root: str | os.PathLike | None, log: Log):
    """``checked(cache_dir)`` (an OpenVINO checked pass on ``export_dir``), else, when OpenVINO
    fails, ``fp32()`` with one line through ``log`` saying why. ``cache_dir``: OpenVINO's
    compiled model beside the cached export it was compiled from (removed with it), where this
    process may write; never inside a user's own export directory (None there). The cache is
    the one :func:`auto_load` used (``root``, else the default)."""
    base = Path(root) if root is not None else cache_root()
    cached = export_dir.resolve().is_relative_to(base.resolve())
    cache_dir = export_dir / "openvino" if cached and os.access(export_dir, os.W_OK) else None
    try:
        return checked(cache_dir)
    except Exception as err:  # noqa: BLE001 - OpenVINO's failure, not the export's
        log(f"mhmla-fast: backend auto runs ONNX Runtime fp32: OpenVINO's checked bf16 pass "
            f"failed ({type(err).__name__}: {err})")
        return fp32()


def auto_scorer(model_dir: str | os.PathLike, *, torch: Callable[[], Any],
                threads: int | None = None, cache: bool | None = None,
                root: str | os.PathLike | None = None, log: Log = _stderr,
                dtype: str = "float32", check_margin: float | None = None):
    """The essay scorer of ``backend="auto"`` on the CPU, by :func:`auto_load`: on ``model_dir``
    itself when it is an export, else on the cached export, ONNX Runtime fp32
    (:class:`.score_onnx.OnnxScorer`; ``dtype`` "float32") or the checked bf16 scorer (``dtype``
    "bfloat16": :func:`.openvino_runner.checked_scorer` at ``check_margin``; ONNX Runtime fp32
    when OpenVINO fails, or when a ridge scorer without margins of its own is given none: the
    default margin was measured on a layer-attention scorer, whose sigmoid keeps its bf16 errors
    smaller than an unbounded linear output's; one line on stderr saying why); else
    ``torch()`` (fp32's scores every way)."""
    from .score_onnx import OnnxScorer

    def onnx(path: Path):
        if dtype != "bfloat16":
            return OnnxScorer(path, threads=threads)
        if check_margin is None and _ridge_without_margins(path):
            log(f"{path}: a ridge scorer without measured bf16 margins (bf16_check.json): "
                "scoring with ONNX Runtime float32")
            return OnnxScorer(path, threads=threads)
        from .openvino_runner import checked_scorer

        return _openvino_or(
            lambda cache_dir: checked_scorer(path, margin=check_margin, threads=threads,
                                             cache_dir=cache_dir),
            lambda: OnnxScorer(path, threads=threads), path, root, log)

    return auto_load(model_dir, SCORER, onnx=onnx, torch=torch, cache=cache, root=root, log=log,
                     threads=threads)


def _ridge_without_margins(export_dir: Path) -> bool:
    """Whether the scorer export ``export_dir`` is a ridge scorer (``head_kind`` "ridge" in its
    config.json) lacking its own bf16 margins for some prompt (:data:`.score_onnx.CHECK_FILE`)."""
    from .score_onnx import read_check_margins

    try:
        config = json.loads((export_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if config.get("head_kind") != "ridge":
        return False
    own = read_check_margins(export_dir)
    return any(int(p) not in own for p in config.get("prompts", []))


def _onnx_runner(export_dir: Path, threads: int | None, lanes: int = 1):
    from .onnx_export import OnnxRunner

    return OnnxRunner.from_model_dir(export_dir, device="cpu", dtype="float32", threads=threads,
                                     lanes=lanes)
