"""Kill-safe resumable JSONL output of ``tag`` / ``score``, and its sidecar.

One JSON object per line (UTF-8, strict JSON: NaN/Infinity refused), written in input order; each
carries ``"index"`` and the writer refuses any index other than the next one. Lines are appended
through a buffer that is flushed and ``os.fsync``-ed at least every ``sync_every`` records and on
:meth:`~ResumableJsonlWriter.sync` / :meth:`~ResumableJsonlWriter.close`. A process killed at any
moment (``kill -9``, power loss after the last sync) therefore leaves complete lines ``1..k`` plus at
most one torn last line.

What an output was made from lives next to it, in the sidecar ``<output>.meta.json`` (the JSONL
itself stays one result per line, so every JSONL reader keeps working)::

    {"format": "mhmla-serve-output/1", "made_from": {...}, "input": {"records": m, "sha256": h}}

``made_from`` is the caller's description of everything that changes the records (the command,
a fingerprint of the model directory, threshold, options); ``input`` vouches for the first ``m``
input records: ``h`` is the :class:`InputFingerprint` of their content (ids, texts, tokens,
prompts, error reasons; not the file names). The sidecar is replaced atomically
(:func:`mhmla_fast.durable.atomic_write_text`: a temporary file of its own, fsync-ed, renamed,
directory fsync-ed) *before* any line past the ``m`` it vouches for is
written, so the output never holds a record its sidecar does not cover.

* The writer holds an exclusive ``fcntl.flock`` on the output file while it is open: a second
  writer (two ``--resume`` runs at once) gets :class:`OutputLockedError` and touches nothing.
* ``resume=False``: an existing non-empty output raises :class:`OutputExistsError`
  (``"<path> exists; pass --resume to continue or remove it"``); nothing is overwritten.
* ``resume=True`` on a non-empty output: the sidecar must exist and be ours, else
  :class:`OutputCorruptError` and the file is left untouched (a file we did not write, or an
  output of an older version, is never truncated); a ``made_from`` that differs from the
  caller's raises :class:`ResumeMismatchError` naming each difference, again untouched. Then the
  output is read; a last line that has no final newline or is not valid JSON is dropped (the file
  is truncated after the last complete line and synced); every remaining line must be a JSON
  object with ``"index"`` equal to its line number, else :class:`OutputCorruptError`. ``done`` is
  then the number of complete records ``k`` and writing continues with index ``k + 1``. A missing
  or empty output starts at 1 (a stale sidecar is replaced).
* ``path="-"`` writes to standard output (flushed, not synced), has no sidecar and cannot resume.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from .. import filelock
from ..durable import atomic_write_text, fsync_parent
from .inputs import InputRecord, WideInputError, is_int, location

__all__ = [
    "InputFingerprint",
    "encode_json",
    "encode_line",
    "OutputCorruptError",
    "OutputExistsError",
    "OutputLockedError",
    "ResumeMismatchError",
    "OutputUnusableError",
    "NotStartedError",
    "REFUSALS",
    "ResumableJsonlWriter",
    "check_made_from",
    "directory_fingerprint",
    "meta_path",
]

META_SUFFIX = ".meta.json"
META_FORMAT = "mhmla-serve-output/1"


class OutputExistsError(FileExistsError):
    """The output file exists and is not empty, and resuming was not asked for."""


class OutputCorruptError(ValueError):
    """The output file is damaged in more than its last line, or is not this program's output."""


class OutputLockedError(OSError):
    """Another process is writing the output (it holds the lock on it)."""


class ResumeMismatchError(ValueError):
    """The input or the options do not match what the output being resumed was made from."""


class OutputUnusableError(ValueError):
    """The output cannot be opened (its folder does not exist, it is a directory, ...)."""


class NotStartedError(RuntimeError):
    """A run failed before it produced anything, and removed the files it had created: the
    same command starts it again (a ``--resume`` would find nothing to resume)."""


# what refuses a run (the CLI's usage errors, exit 2): a resume would not help these
REFUSALS = (ResumeMismatchError, OutputExistsError, OutputLockedError, OutputCorruptError,
            OutputUnusableError, WideInputError)


def meta_path(path: str) -> str:
    """The sidecar of an output: ``<path>.meta.json``."""
    return path + META_SUFFIX


def _check_sidecar_name(path: str) -> None:
    """ValueError when the file names the sidecar needs (``.<name>.meta.json.<random>.tmp``
    while it is written) are longer than the output's folder allows."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        limit = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):  # no such folder (an error of its own)
        return
    longest = len(os.fsencode(os.path.basename(meta_path(path)))) + 2 + 8 + 4  # ".", random, ".tmp"
    if longest > limit:
        raise ValueError(f"{path}: the name is too long for its sidecar "
                         f"{os.path.basename(meta_path(path))} (names in {folder} have at most "
                         f"{limit} bytes); give a shorter output name")


@functools.cache
def _orjson():
    """orjson (a dependency of the package) where it imports, else None (an install made with
    ``--no-deps``): then Python's json encodes every line."""
    try:
        import orjson
    except ImportError:
        return None
    return orjson


def encode_line(record: dict[str, Any]) -> bytes:
    """``record`` as one compact JSON line: :func:`encode_json` and a newline."""
    return encode_json(record) + b"\n"


def encode_json(value: Any) -> bytes:
    """``value`` as compact JSON: UTF-8, NaN and Infinity refused (ValueError).

    orjson encodes it: 2.2 against 11.8 us for a tagged FCE sentence with Python's json on a
    2-core EPYC, which bounds the ``tag`` command's own process on a GPU. Python's json
    encodes what orjson refuses or would change: a lone surrogate (an input file name that
    is not UTF-8, in an error message), written as its escape ``\\udcXX`` so that the bytes
    stay UTF-8; integers past 64 bits; keys that are not strings; and any value whose
    encoding holds ``null``, since orjson writes NaN and Infinity as null (re-encoded
    strictly, they are refused). Both give the same JSON values; a number may be spelt
    differently (``1e-6`` and ``1e-06``)."""
    fast = _orjson()
    if fast is not None:
        try:
            data = fast.dumps(value)
        except TypeError:  # orjson.JSONEncodeError is a TypeError
            data = b"null"
        if b"null" not in data:
            return data
    text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.encode("utf-8", "backslashreplace")


class InputFingerprint:
    """Running SHA-256 over the content of input records, in order: each record's ``id``,
    ``text``, ``tokens``, ``prompt`` and error reason (without the ``"<source>: line <n>: "``
    prefix), so the same lines under another file name have the same fingerprint. ``count`` is
    the number of records seen."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self.count = 0

    def update(self, rec: InputRecord) -> None:
        reason = rec.error
        if reason is not None:
            prefix = f"{location(rec.source, rec.line)}: "
            reason = reason[len(prefix):] if reason.startswith(prefix) else reason
        data = json.dumps([rec.id, rec.text, rec.tokens, rec.prompt, reason], ensure_ascii=False,
                          separators=(",", ":"))
        self._h.update(data.encode("utf-8", "surrogatepass") + b"\n")
        self.count += 1

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def directory_fingerprint(path: str | os.PathLike) -> str:
    """SHA-256 over the names and contents of the regular files directly in ``path`` (a model
    directory: config, weights, tokenizer), in name order; in a tagger's folder that also
    holds an export of it (``model.safetensors`` beside ``model.onnx``), the export's own files
    (``onnx_export.EXPORT_FILES``) are left out: exporting in place changes no model."""
    from .onnx_export import EXPORT_FILES

    h = hashlib.sha256()
    entries = sorted(os.scandir(path), key=lambda e: e.name)
    skip = EXPORT_FILES if any(e.name == "model.safetensors" for e in entries) else ()
    for entry in entries:
        if not entry.is_file() or entry.name in skip:
            continue
        h.update(entry.name.encode("utf-8", "surrogateescape") + b"\0")
        with open(entry.path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def _json_roundtrip(value: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{what} must be JSON data: {err}") from None


def _read_meta(path: str) -> dict[str, Any]:
    """The sidecar of a non-empty output; OutputCorruptError when it is missing or not ours."""
    meta = meta_path(path)
    hint = ("so what it was made from cannot be checked; refusing to resume it (nothing was "
            "changed). Remove it or write to another output")
    try:
        with open(meta, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise OutputCorruptError(
            f"{path} is not a resumable output of this version of mhmla-serve: it has no "
            f"{os.path.basename(meta)} (it is an older version's output, or a file mhmla-serve "
            f"did not write), {hint}") from None
    except (OSError, ValueError, RecursionError) as err:
        raise OutputCorruptError(f"{meta}: unreadable ({err}), {hint}") from None
    ok = (isinstance(data, dict) and data.get("format") == META_FORMAT
          and isinstance(data.get("made_from"), dict) and isinstance(data.get("input"), dict)
          and is_int(data["input"].get("records")) and data["input"]["records"] >= 0
          and isinstance(data["input"].get("sha256"), str))
    if not ok:
        raise OutputCorruptError(f"{meta}: not a {META_FORMAT} sidecar, {hint}")
    return data


LATER_KEYS = frozenset({"encoder_sha256"})  # made_from keys recorded since a later version


def check_made_from(path: str, then: Mapping[str, Any], now: Mapping[str, Any]) -> None:
    """ResumeMismatchError naming every key whose value differs between ``then`` (what an
    existing output, or a Ray job folder, was made from) and ``now``; ``path`` names it. A key
    of :data:`LATER_KEYS` that ``then`` lacks is not compared: that output was made before
    the key was recorded (its resume records it from then on)."""
    keys = (set(then) | set(now)) - (LATER_KEYS - set(then))
    diffs = [f"{k}: {then.get(k)!r} then, {now.get(k)!r} now"
             for k in sorted(keys) if then.get(k) != now.get(k)]
    if diffs:
        raise ResumeMismatchError(
            f"{path} was made with other settings ({'; '.join(diffs)}); refusing to mix outputs. "
            "Resume with the settings it was made with, or write to another output")


@dataclass
class _ScanResult:
    done: int = 0
    n_errors: int = 0
    good_bytes: int = 0
    last_id: Any = None


def _scan_output(f: BinaryIO, path: str) -> _ScanResult:
    """Read an existing output from its start: count its complete records, find where the torn
    tail starts."""
    res = _ScanResult()
    bad_line: int | None = None  # 1-based number of an unusable line, allowed only as the last one
    f.seek(0)
    for n, raw in enumerate(f, 1):
        if bad_line is not None:
            raise OutputCorruptError(
                f"{path}: line {bad_line}: not a complete JSON record, and more lines follow it; "
                "the output is damaged beyond a torn last line"
            )
        if not raw.endswith(b"\n"):
            bad_line = n
            continue
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            bad_line = n
            continue
        expected = res.done + 1
        found = obj.get("index") if isinstance(obj, dict) else None
        if not is_int(found) or found != expected:
            raise OutputCorruptError(
                f"{path}: line {n}: expected a record with \"index\": {expected}, found "
                f"{found!r}; not a resumable output of this program"
            )
        res.done = expected
        res.n_errors += "error" in obj
        res.good_bytes += len(raw)
        res.last_id = obj.get("id")
    return res


class ResumableJsonlWriter:
    """Append-only JSONL output that survives ``kill -9``, resumes, and records what it was made
    from in its sidecar (rules: module docstring).

    ``made_from`` (JSON data) describes everything that changes the records; on resume it must
    equal the sidecar's. Attributes after opening: ``done`` (complete records already in the
    file, 0 unless resuming), ``done_errors`` (how many of those are error records), ``last_id``
    (the ``"id"`` of record ``done``, or None), ``written`` (records written by this writer),
    ``vouched`` / ``vouched_sha256`` (the input records the sidecar covers and their
    :class:`InputFingerprint`). Use as a context manager or call :meth:`close`.
    """

    def __init__(self, path: str, resume: bool = False, sync_every: int = 256,
                 made_from: Mapping[str, Any] | None = None) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        self.path = path
        self.sync_every = sync_every
        self.made_from = _json_roundtrip(dict(made_from or {}), "made_from")
        self.done = 0
        self.done_errors = 0
        self.last_id: Any = None
        self.written = 0
        self.vouched = 0
        self.vouched_sha256 = InputFingerprint().hexdigest()
        self._unsynced = 0
        self._closed = False
        self._stdout = path == "-"
        if self._stdout:
            if resume:
                raise ValueError("cannot resume when writing to standard output; give an output file")
            if sys.stdout is None:  # started with standard output closed (`>&-`)
                raise ValueError("standard output is closed; give an output file with -o")
            self._f: BinaryIO = sys.stdout.buffer
            return
        if os.path.isdir(path):
            raise IsADirectoryError(f"{path}: is a directory, not an output file")
        _check_sidecar_name(path)  # before the output is made
        created = not os.path.exists(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # never truncates here
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO, a device: no seek, no fsync
            os.close(fd)
            raise ValueError(f"{path}: not a regular file, so it cannot be written resumably; "
                             "for standard output leave out -o (or give -o -)")
        self._f = os.fdopen(fd, "r+b")
        try:
            self._lock()
            if os.fstat(fd).st_size > 0:
                if not resume:
                    raise OutputExistsError(f"{path} exists; pass --resume to continue or remove it")
                self._open_for_resume()
            else:
                self._write_meta(0, self.vouched_sha256)
            if created:
                fsync_parent(path)
            self._f.seek(0, os.SEEK_END)
        except BaseException:
            self._f.close()
            raise

    def _lock(self) -> None:
        if not filelock.try_lock(self._f.fileno()):
            raise OutputLockedError(
                f"{self.path} is being written by another process (it holds the lock on it); "
                "wait for that run to finish, or write to another output")

    def _open_for_resume(self) -> None:
        meta = _read_meta(self.path)
        check_made_from(self.path, meta["made_from"], self.made_from)
        scan = _scan_output(self._f, self.path)
        vouched = meta["input"]["records"]
        if scan.done > vouched:
            raise OutputCorruptError(
                f"{self.path} holds {scan.done} records but {meta_path(self.path)} vouches for "
                f"{vouched} input records only; refusing to resume it")
        self.done, self.done_errors, self.last_id = scan.done, scan.n_errors, scan.last_id
        self.vouched, self.vouched_sha256 = vouched, meta["input"]["sha256"]
        if set(self.made_from) - set(meta["made_from"]):  # a key of LATER_KEYS: record it now
            self._write_meta(vouched, self.vouched_sha256)
        if os.fstat(self._f.fileno()).st_size > scan.good_bytes:
            self._f.truncate(scan.good_bytes)
            self._f.flush()
            os.fsync(self._f.fileno())

    def _write_meta(self, records: int, sha256: str) -> None:
        meta = meta_path(self.path)
        data = {"format": META_FORMAT, "output": os.path.basename(self.path),
                "made_from": self.made_from, "input": {"records": records, "sha256": sha256}}
        atomic_write_text(meta, json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n")

    def vouch(self, records: int, sha256: str) -> None:
        """Record in the sidecar (atomically, durably) that the output is made from ``records``
        input records of fingerprint ``sha256``; call it before writing records past
        :attr:`vouched`. A no-op for standard output."""
        if self._closed:
            raise ValueError(f"{self.path}: writer is closed")
        if self._stdout:
            return
        if records < self.vouched:
            raise ValueError(f"{self.path}: cannot vouch for {records} records after {self.vouched}")
        self._write_meta(records, sha256)
        self.vouched, self.vouched_sha256 = records, sha256

    @property
    def next_index(self) -> int:
        """The ``"index"`` the next written record must carry."""
        return self.done + self.written + 1

    def write(self, record: dict[str, Any]) -> None:
        """Append one record; its ``"index"`` must be :attr:`next_index`."""
        if self._closed:
            raise ValueError(f"{self.path}: writer is closed")
        index = record.get("index")
        if not is_int(index) or index != self.next_index:
            raise ValueError(f'{self.path}: expected a record with "index": {self.next_index}, got {index!r}')
        self._f.write(encode_line(record))
        self.written += 1
        self._unsynced += 1
        if self._unsynced >= self.sync_every:
            self.sync()

    def sync(self) -> None:
        """Flush the buffer and ``fsync`` the file (only flush for standard output)."""
        self._f.flush()
        if not self._stdout:
            os.fsync(self._f.fileno())
        self._unsynced = 0

    def close(self) -> None:
        """Sync and close (standard output is synced but left open). Closing twice is a no-op."""
        if self._closed:
            return
        try:
            self.sync()
        finally:
            self._closed = True
            if not self._stdout:
                self._f.close()

    def __enter__(self) -> ResumableJsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

