"""Input records, kill-safe resumable JSONL output, and the batching driver of ``tag`` / ``score``.

Input (:func:`iter_input_records`)
----------------------------------

Every line of every input (files in the order given, ``"-"`` = standard input) is one
:class:`InputRecord`, numbered by a global 1-based ``index`` in input order; ``source`` is the path
(``"<stdin>"`` for standard input) and ``line`` the 1-based line number in it. Lines are split on
``\\n`` only (a ``\\r`` before it is dropped, a missing final newline is fine, U+2028 and friends do
not split), each line is decoded as strict UTF-8 on its own, and a UTF-8 BOM at the start of an
input is skipped.

* A line whose first non-whitespace character is ``{`` is a JSON object. For ``kind="tag"`` it has
  ``"text"`` (string) **or** ``"tokens"`` (non-empty list of non-blank strings, used as they are),
  for ``kind="score"`` both ``"text"`` (string) and ``"prompt"`` (integer 1..8). ``"id"`` (string or
  integer) is optional everywhere; other fields are ignored.
* Any other line is plain text, one text per line, taken exactly as it is (no stripping); it is
  accepted for ``kind="tag"`` only.
* The default ``id`` is the record's global ``index``.

A malformed line never raises: it becomes a record with ``error`` set to
``"<source>: line <n>: <reason>"`` and ``text``/``tokens``/``prompt`` left ``None`` (its ``id`` is the
JSON ``"id"`` when that one is valid, else the index). Reasons: invalid UTF-8, empty (blank) line,
invalid JSON, a missing field, a field of the wrong type, an empty/blank ``"text"``, ``"text"`` and
``"tokens"`` both given, ``"tokens"`` empty or holding a non-string or blank string, ``"prompt"``
outside 1..8, a string with a lone surrogate (from a ``\\udXXX`` JSON escape), and for ``score`` a
plain-text line. A missing input file raises before anything is read.

Output (:class:`ResumableJsonlWriter`)
--------------------------------------

One JSON object per line (UTF-8, strict JSON: NaN/Infinity refused), written in input order; each
carries ``"index"`` and the writer refuses any index other than the next one. Lines are appended
through a buffer that is flushed and ``os.fsync``-ed at least every ``sync_every`` records and on
:meth:`~ResumableJsonlWriter.sync` / :meth:`~ResumableJsonlWriter.close`. A process killed at any
moment (``kill -9``, power loss after the last sync) therefore leaves complete lines ``1..k`` plus at
most one torn last line.

* ``resume=False``: an existing non-empty output raises :class:`OutputExistsError`
  (``"<path> exists; pass --resume to continue or remove it"``); nothing is overwritten.
* ``resume=True``: an existing output is read; a last line that has no final newline or is not valid
  JSON is dropped (the file is truncated after the last complete line and synced); every remaining
  line must be a JSON object with ``"index"`` equal to its line number, else
  :class:`OutputCorruptError`. ``done`` is then the number of complete records ``k`` (0 for a
  missing or empty file) and writing continues with index ``k + 1``.
* ``path="-"`` writes to standard output (flushed, not synced) and cannot resume.

Driver (:func:`run_records`)
----------------------------

Reads the records lazily, skips the first ``writer.done`` of them (checking that the last skipped
record's ``id`` equals the ``"id"`` of the last line in the output, so a resume against different
input fails loudly), hands the valid records in batches of ``batch_size`` to ``process_batch`` and
writes ``{"index", "id", **result}`` for them and ``{"index", "id", "error"}`` for malformed records,
strictly in input order. A batch is also processed early when ``8 * batch_size`` records (mostly
errors) wait behind its first record, which bounds memory. A tqdm bar with records/s (essays/s for
``score``) goes to stderr.
The returned :class:`RunSummary` counts the whole output file, the resumed part included; a record
counts as an error when its output line has an ``"error"`` key.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, BinaryIO

from tqdm import tqdm

__all__ = [
    "InputRecord",
    "OutputCorruptError",
    "OutputExistsError",
    "ResumeMismatchError",
    "ResumableJsonlWriter",
    "RunSummary",
    "iter_input_records",
    "run_records",
]

STDIN_SOURCE = "<stdin>"
KINDS = ("tag", "score")
PROMPT_RANGE = range(1, 9)

_BOM = b"\xef\xbb\xbf"
_SURROGATE = re.compile("[\ud800-\udfff]")


# ---------------------------------------------------------------------------------------------------
# input


@dataclass(frozen=True, slots=True)
class InputRecord:
    """One input line: either valid (``error is None``) or an error record.

    A valid ``tag`` record has exactly one of ``text`` / ``tokens``; a valid ``score`` record has
    ``text`` and ``prompt``. ``index`` is global and 1-based, ``line`` is 1-based within ``source``.
    """

    index: int
    source: str
    line: int
    id: str | int
    text: str | None = None
    tokens: tuple[str, ...] | None = None
    prompt: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True for a valid record, False for an error record."""
        return self.error is None


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Invalid(Exception):
    """Internal: a line is malformed; ``args[0]`` is the reason."""


def _check_string(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _Invalid(f'field "{name}" must be a string, got {_json_type(value)}')
    bad = _SURROGATE.search(value)
    if bad:
        raise _Invalid(f'field "{name}" contains a lone surrogate U+{ord(bad.group()):04X}')
    return value


def _check_text(value: Any) -> str:
    text = _check_string("text", value)
    if not text.strip():
        raise _Invalid('field "text" is empty')
    return text


def _check_tokens(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise _Invalid(f'field "tokens" must be an array of strings, got {_json_type(value)}')
    if not value:
        raise _Invalid('field "tokens" is empty')
    for k, tok in enumerate(value):
        if not isinstance(tok, str):
            raise _Invalid(f'field "tokens": item {k} must be a string, got {_json_type(tok)}')
        if not tok.strip():
            raise _Invalid(f'field "tokens": item {k} is empty')
        bad = _SURROGATE.search(tok)
        if bad:
            raise _Invalid(f'field "tokens": item {k} contains a lone surrogate U+{ord(bad.group()):04X}')
    return tuple(value)


def _parse_line(raw: bytes, kind: str, index: int, source: str, line: int) -> InputRecord:
    """One raw line (without its line break) -> a valid or an error record."""
    rec_id: str | int = index

    def error(reason: str) -> InputRecord:
        return InputRecord(index, source, line, rec_id, error=f"{source}: line {line}: {reason}")

    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        bad = raw[err.start : err.end]
        return error(f"invalid UTF-8: byte(s) {bad!r} at byte {err.start + 1} of the line ({err.reason})")
    if not s.strip():
        return error("empty line")
    if not s.lstrip().startswith("{"):
        if kind != "tag":
            return error(f'plain-text line, but "{kind}" input must be JSON objects with "text" and "prompt"')
        return InputRecord(index, source, line, index, text=s)
    try:
        obj = json.loads(s)
    except json.JSONDecodeError as err:
        return error(f"invalid JSON: {err.msg} at column {err.colno}")
    except RecursionError:
        return error("invalid JSON: nested too deeply")
    except ValueError as err:  # e.g. an integer with more digits than int() accepts
        return error(f"invalid JSON: {err}")
    if not isinstance(obj, dict):  # unreachable for a line starting with "{", kept as a guard
        return error(f"JSON value must be an object, got {_json_type(obj)}")
    try:
        if "id" in obj:
            value = obj["id"]
            if not (_is_int(value) or isinstance(value, str)):
                raise _Invalid(f'field "id" must be a string or an integer, got {_json_type(value)}')
            rec_id = _check_string("id", value) if isinstance(value, str) else value
        if kind == "tag":
            if "text" in obj and "tokens" in obj:
                raise _Invalid('give either "text" or "tokens", not both')
            if "tokens" in obj:
                return InputRecord(index, source, line, rec_id, tokens=_check_tokens(obj["tokens"]))
            if "text" not in obj:
                raise _Invalid('missing field "text" (or "tokens")')
            return InputRecord(index, source, line, rec_id, text=_check_text(obj["text"]))
        if "text" not in obj:
            raise _Invalid('missing field "text"')
        text = _check_text(obj["text"])
        if "prompt" not in obj:
            raise _Invalid('missing field "prompt"')
        prompt = obj["prompt"]
        if not _is_int(prompt):
            raise _Invalid(f'field "prompt" must be an integer from 1 to 8, got {_json_type(prompt)}')
        if prompt not in PROMPT_RANGE:
            raise _Invalid(f'field "prompt" must be an integer from 1 to 8, got {prompt}')
        return InputRecord(index, source, line, rec_id, text=text, prompt=prompt)
    except _Invalid as err:
        return error(err.args[0])


def _raw_lines(stream: IO[bytes]) -> Iterator[bytes]:
    """Lines of a binary stream without ``\\n`` / ``\\r\\n``; a leading BOM is dropped."""
    first = True
    for raw in stream:
        if first:
            first = False
            if raw.startswith(_BOM):
                raw = raw[len(_BOM) :]
        if raw.endswith(b"\n"):
            raw = raw[:-1]
            if raw.endswith(b"\r"):
                raw = raw[:-1]
        elif raw.endswith(b"\r"):  # last line without "\n"
            raw = raw[:-1]
        yield raw


def iter_input_records(
    paths: Sequence[str] = ("-",),
    kind: str = "tag",
    *,
    stdin: BinaryIO | None = None,
) -> Iterator[InputRecord]:
    """Records of ``paths`` in order, by the input rules of the module docstring.

    ``"-"`` (at most once) is standard input, read from ``stdin`` or ``sys.stdin.buffer``; an empty
    ``paths`` means ``["-"]``. The paths are checked when this is called (a missing file or a
    directory raises ``FileNotFoundError`` / ``IsADirectoryError`` at once); the lines are read
    lazily, one at a time.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    paths = list(paths) or ["-"]
    if paths.count("-") > 1:
        raise ValueError('standard input ("-") can be given only once')
    for path in paths:
        if path == "-":
            continue
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no such input file")
        if os.path.isdir(path):
            raise IsADirectoryError(f"{path}: is a directory, not an input file")
    return _iter_records(paths, kind, stdin)


def _iter_records(paths: list[str], kind: str, stdin: BinaryIO | None) -> Iterator[InputRecord]:
    index = 0
    for path in paths:
        if path == "-":
            stream = stdin if stdin is not None else sys.stdin.buffer
            for line, raw in enumerate(_raw_lines(stream), 1):
                index += 1
                yield _parse_line(raw, kind, index, STDIN_SOURCE, line)
            continue
        with open(path, "rb") as f:
            for line, raw in enumerate(_raw_lines(f), 1):
                index += 1
                yield _parse_line(raw, kind, index, path, line)


# ---------------------------------------------------------------------------------------------------
# output


class OutputExistsError(FileExistsError):
    """The output file exists and is not empty, and resuming was not asked for."""


class OutputCorruptError(ValueError):
    """The output file is damaged in more than its last line, or is not this program's output."""


class ResumeMismatchError(ValueError):
    """The input does not match the output being resumed."""


def _fsync_dir(path: str) -> None:
    """Make a new file's directory entry durable (best effort; not possible on every platform)."""
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass
class _ScanResult:
    done: int = 0
    n_errors: int = 0
    good_bytes: int = 0
    last_id: Any = None


def _scan_output(path: str) -> _ScanResult:
    """Read an existing output: count its complete records, find where the torn tail starts."""
    res = _ScanResult()
    bad_line: int | None = None  # 1-based number of an unusable line, allowed only as the last one
    with open(path, "rb") as f:
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
            if not _is_int(found) or found != expected:
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
    """Append-only JSONL output that survives ``kill -9`` and resumes (rules: module docstring).

    Attributes after opening: ``done`` (complete records already in the file, 0 unless resuming),
    ``done_errors`` (how many of those are error records), ``last_id`` (the ``"id"`` of record
    ``done``, or None) and ``written`` (records written by this writer). Use as a context manager or
    call :meth:`close`.
    """

    def __init__(self, path: str, resume: bool = False, sync_every: int = 256) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        self.path = path
        self.sync_every = sync_every
        self.done = 0
        self.done_errors = 0
        self.last_id: Any = None
        self.written = 0
        self._unsynced = 0
        self._closed = False
        self._stdout = path == "-"
        if self._stdout:
            if resume:
                raise ValueError("cannot resume when writing to standard output; give an output file")
            self._f: BinaryIO = sys.stdout.buffer
            return
        exists = os.path.exists(path)
        if exists and os.path.isdir(path):
            raise IsADirectoryError(f"{path}: is a directory, not an output file")
        if exists and not resume and os.path.getsize(path) > 0:
            raise OutputExistsError(f"{path} exists; pass --resume to continue or remove it")
        if exists and resume:
            scan = _scan_output(path)
            self.done, self.done_errors, self.last_id = scan.done, scan.n_errors, scan.last_id
            if os.path.getsize(path) > scan.good_bytes:
                with open(path, "r+b") as f:
                    f.truncate(scan.good_bytes)
                    f.flush()
                    os.fsync(f.fileno())
            self._f = open(path, "ab")
        else:
            self._f = open(path, "wb")
            _fsync_dir(path)

    @property
    def next_index(self) -> int:
        """The ``"index"`` the next written record must carry."""
        return self.done + self.written + 1

    def write(self, record: dict[str, Any]) -> None:
        """Append one record; its ``"index"`` must be :attr:`next_index`."""
        if self._closed:
            raise ValueError(f"{self.path}: writer is closed")
        index = record.get("index")
        if not _is_int(index) or index != self.next_index:
            raise ValueError(f'{self.path}: expected a record with "index": {self.next_index}, got {index!r}')
        line = json.dumps(record, ensure_ascii=False, allow_nan=False)
        self._f.write(line.encode("utf-8") + b"\n")
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


# ---------------------------------------------------------------------------------------------------
# driver


@dataclass(frozen=True)
class RunSummary:
    """Counts over the whole output: ``n_ok`` + ``n_errors`` records, ``n_resumed`` of which were
    already in it before this run."""

    n_ok: int
    n_errors: int
    n_resumed: int

    @property
    def n_total(self) -> int:
        return self.n_ok + self.n_errors


ProcessBatch = Callable[[list[InputRecord]], list[dict[str, Any]]]


def run_records(
    records: Iterable[InputRecord],
    process_batch: ProcessBatch,
    writer: ResumableJsonlWriter,
    batch_size: int,
    progress: bool = True,
    *,
    total: int | None = None,
    desc: str | None = None,
    unit: str = "rec",
) -> RunSummary:
    """Process ``records`` into ``writer`` in input order, resuming after ``writer.done``.

    ``process_batch`` gets a list of 1..``batch_size`` valid records and must return one dict per
    record, in the same order; ``"index"`` and ``"id"`` in a result are replaced by the record's.
    Exceptions from ``process_batch`` propagate (what was written stays; resume continues from it).
    ``total`` (the number of input records, if known) only sets the progress bar's length; ``desc``
    and ``unit`` (what a record is, e.g. ``"essay"``: the bar shows ``<unit>s/s``) label it. The
    writer is synced, not closed, at the end.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    max_pending = 8 * batch_size
    it = iter(records)
    n_resumed = writer.done
    last: InputRecord | None = None
    for k in range(n_resumed):
        last = next(it, None)
        if last is None:
            raise ResumeMismatchError(
                f"{writer.path} already holds {n_resumed} records but the input has only {k}; "
                "is this the same input?"
            )
    if last is not None and writer.last_id is not None and last.id != writer.last_id:
        raise ResumeMismatchError(
            f"{writer.path}: record {n_resumed} has id {writer.last_id!r} but input record "
            f"{n_resumed} ({last.source}: line {last.line}) has id {last.id!r}; is this the same input?"
        )

    n_errors = writer.done_errors
    n_ok = n_resumed - n_errors
    pending: list[InputRecord] = []  # records waiting to be written, in input order
    batch: list[InputRecord] = []  # the valid ones among them
    bar = tqdm(
        total=total,
        initial=n_resumed,
        desc=desc,
        unit=unit,
        unit_scale=True,
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    )

    def emit(out: dict[str, Any]) -> None:
        nonlocal n_ok, n_errors
        writer.write(out)
        if "error" in out:
            n_errors += 1
        else:
            n_ok += 1

    def flush() -> None:
        results = process_batch(list(batch)) if batch else []
        if not isinstance(results, list) or len(results) != len(batch):
            got = len(results) if isinstance(results, list) else type(results).__name__
            raise RuntimeError(f"process_batch returned {got} results for {len(batch)} records")
        res_iter = iter(results)
        for rec in pending:
            if rec.error is not None:
                emit({"index": rec.index, "id": rec.id, "error": rec.error})
                continue
            res = next(res_iter)
            if not isinstance(res, dict):
                raise RuntimeError(
                    f"process_batch returned a {type(res).__name__}, not a dict, for record {rec.index}"
                )
            out: dict[str, Any] = {"index": rec.index, "id": rec.id}
            out.update((k, v) for k, v in res.items() if k not in ("index", "id"))
            emit(out)
        bar.update(len(pending))
        if n_errors:
            bar.set_postfix(errors=n_errors, refresh=False)
        pending.clear()
        batch.clear()

    try:
        for rec in it:
            if rec.error is not None and not pending:
                emit({"index": rec.index, "id": rec.id, "error": rec.error})
                bar.update(1)
                continue
            pending.append(rec)
            if rec.error is None:
                batch.append(rec)
            if len(batch) >= batch_size or len(pending) >= max_pending:
                flush()
        flush()
        writer.sync()
    finally:
        bar.close()
    return RunSummary(n_ok=n_ok, n_errors=n_errors, n_resumed=n_resumed)
