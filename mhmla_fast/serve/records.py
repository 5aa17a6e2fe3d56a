"""Input records, kill-safe resumable JSONL output, and the batching driver of ``tag`` / ``score``.

Input (:func:`iter_input_records`)
----------------------------------

Every line of every input (files in the order given, ``"-"`` = standard input) is one
:class:`InputRecord`, numbered by a global 1-based ``index`` in input order; ``source`` is the path
(``"<stdin>"`` for standard input) and ``line`` the 1-based line number in it. Lines are split on
``\\n`` only (a ``\\r`` before it is dropped, a missing final newline is fine, U+2028 and friends do
not split), each line is decoded on its own, strictly, as ``encoding`` (UTF-8 by default; any
codec in which ``\\n`` is the byte 0x0A and ASCII is ASCII: Latin-1, cp1252, Shift_JIS, GB18030,
...; UTF-16/32 are refused as an encoding, and an input starting with their byte-order mark is
refused as a whole, ValueError), a UTF-8 BOM at the start of an input is skipped, and so is a
U+FEFF that starts a line (files joined by ``cat``). A line holding a NUL character is an error
record (UTF-16 without a byte-order mark, or binary data). An unreadable file is refused when
:func:`iter_input_records` is called (PermissionError), before any record.

``format`` says what a line is:

* ``"auto"`` (default): a line whose first non-whitespace character is ``{`` is a JSON object,
  any other line is plain text (so ``[1, 2]`` or ``"x"`` is plain text here);
* ``"jsonl"``: every line is a JSON value that must be an object (``[1,2,3]`` or ``"string"`` is
  an error record: "JSON value must be an object, got array");
* ``"text"``: every line is plain text, even one that starts with ``{`` (``kind="tag"`` only).

* A JSON object line: for ``kind="tag"`` it has
  ``"text"`` (string) **or** ``"tokens"`` (non-empty list of non-blank strings, used as they are),
  for ``kind="score"`` both ``"text"`` (string) and ``"prompt"`` (integer 1..8). ``"id"`` (string or
  integer) is optional everywhere; other fields are ignored.
* A plain-text line is one text, taken exactly as it is (no stripping); it is accepted for
  ``kind="tag"`` only.
* The default ``id`` is the record's global ``index``.

A malformed line never raises: it becomes a record with ``error`` set to
``"<source>: line <n>: <reason>"`` and ``text``/``tokens``/``prompt`` left ``None`` (its ``id`` is the
JSON ``"id"`` when that one is valid, else the index). Reasons: invalid UTF-8 (or invalid bytes of
``encoding``), empty (blank) line, invalid JSON (in ``"auto"`` the message says ``--format text``
reads the line as plain text), a JSON value that is not an object (``"jsonl"``), a missing field, a field of the wrong type, an empty/blank ``"text"``, ``"text"`` and
``"tokens"`` both given, ``"tokens"`` empty or holding a non-string or blank string, ``"prompt"``
outside 1..8, a string with a lone surrogate (from a ``\\udXXX`` JSON escape), and for ``score`` a
plain-text line. (A ``"text"`` that gives no word pieces is refused later, with the scorer's own
tokenizer: :func:`mhmla_fast.serve.score.essay_pieces_check`.) A missing input file raises
before anything is read.

With ``max_chars`` (``--max-chars N``) a line is read whole only up to :func:`read_bound` bytes
(16 per allowed character, plus 64 MiB): a longer one is read in pieces, never held, and becomes
the error record ``"<source>: line <n>: <size> bytes, over the <bound> read for --max-chars N;
skipped"`` (:func:`over_long_line`), whatever ``--over-long`` says. Such a line holds more than N
characters as plain text (no encoding takes more than 4 bytes a character), and as a JSON object
more than 64 MiB besides even a fully escaped text of N characters (12 bytes a character). A
file without line breaks therefore cannot exhaust memory; without ``max_chars`` a line of any
size is read.

An input whose name ends with ``.parquet`` (:func:`is_parquet`) is a Parquet file
(:func:`parquet_records`, needs pyarrow): each row, in file order, is one record, read exactly
as the JSON object line of its fields would be (``text``/``tokens``/``id`` for ``tag``,
``text``/``prompt``/``id`` for ``score``; other columns are not read, a null is an absent
field, binary values are decoded as ``encoding``), with ``line`` its 1-based row number and
error messages ``"<source>: row <n>: <reason>"`` (:func:`location`). ``format`` "auto" and
"jsonl" read it alike; "text" is refused, as is a file that is not Parquet (ValueError, before
anything is read).

Output (:class:`ResumableJsonlWriter`)
--------------------------------------

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

Driver (:func:`run_records`)
----------------------------

Reads the records lazily and fingerprints each one. On resume it first reads the ``m`` input
records the sidecar vouches for and compares their fingerprint with the sidecar's (fewer records,
or another fingerprint: :class:`ResumeMismatchError`, nothing written), then carries on after
record ``writer.done``. It hands the valid records in batches of ``batch_size`` to
``process_batch`` and writes ``{"index", "id", **result}`` for them and ``{"index", "id",
"error"}`` for malformed records, strictly in input order. A batch is also processed early when
``8 * batch_size`` records (mostly errors) wait, which bounds memory. A tqdm bar with records/s
(essays/s for ``score``) goes to stderr; with ``count_pieces`` it also shows the word pieces
encoded so far, which move within one long record.
The returned :class:`RunSummary` counts the whole output file, the resumed part included; a record
counts as an error when its output line has an ``"error"`` key.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import re
import stat
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, BinaryIO

from tqdm import tqdm

from .. import filelock
from ..durable import atomic_write_text, fsync_parent
from ..progress import progress_bar

__all__ = [
    "FORMATS",
    "InputFingerprint",
    "InputRecord",
    "OutputCorruptError",
    "OutputExistsError",
    "OutputLockedError",
    "ResumeMismatchError",
    "ResumableJsonlWriter",
    "RunSummary",
    "check_encoding",
    "directory_fingerprint",
    "is_parquet",
    "iter_input_records",
    "limit_length",
    "location",
    "meta_path",
    "over_long_line",
    "read_bound",
    "parquet_records",
    "run_records",
]

STDIN_SOURCE = "<stdin>"
KINDS = ("tag", "score")
FORMATS = ("auto", "text", "jsonl")
PROMPT_RANGE = range(1, 9)
META_SUFFIX = ".meta.json"
META_FORMAT = "mhmla-serve-output/1"

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
    capped_from: int | None = None  # the original length in characters, when cut by limit_length

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
    if isinstance(value, dict):
        return "object"
    return type(value).__name__  # only from Parquet: date, datetime, Decimal, ...


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


def check_encoding(encoding: str) -> str:
    """The codec name of ``encoding`` when lines of it can be split on the byte ``\\n`` (ValueError
    naming it otherwise: unknown, or not ASCII-compatible like UTF-16/32)."""
    try:
        name = codecs.lookup(encoding).name
    except LookupError:
        raise ValueError(f"encoding: unknown encoding {encoding!r}") from None
    try:
        ascii_compatible = "a\n{".encode(name) == b"a\n{"
    except (UnicodeError, LookupError, TypeError):  # e.g. a bytes-to-bytes codec
        ascii_compatible = False
    if not ascii_compatible:
        raise ValueError(f"encoding: {encoding!r} is not ASCII-compatible, so lines cannot be split "
                         f"on the byte \\n; convert the input first (iconv -f {encoding} -t utf-8)")
    return name


def _parse_line(raw: bytes, kind: str, index: int, source: str, line: int,
                fmt: str = "auto", encoding: str = "utf-8") -> InputRecord:
    """One raw line (without its line break) -> a valid or an error record."""
    rec_id: str | int = index

    def error(reason: str) -> InputRecord:
        return InputRecord(index, source, line, rec_id, error=f"{source}: line {line}: {reason}")

    try:
        s = raw.decode(encoding)
    except UnicodeDecodeError as err:
        bad = raw[err.start : err.end]
        what = "UTF-8" if encoding == "utf-8" else encoding
        return error(f"invalid {what}: byte(s) {bad!r} at byte {err.start + 1} of the line ({err.reason})")
    if "\x00" in s:
        return error("contains a NUL character (UTF-16 or binary input? convert text to UTF-8 "
                     "first, e.g. iconv -f utf-16 -t utf-8)")
    s = s.removeprefix("\ufeff")  # a byte-order mark inside the input (files joined by cat)
    if not s.strip():
        return error("empty line")
    if fmt == "text" or (fmt == "auto" and not s.lstrip().startswith("{")):
        if kind != "tag":
            return error(f'plain-text line, but "{kind}" input must be JSON objects with "text" and "prompt"')
        bad = _SURROGATE.search(s)  # only possible with a codec such as "surrogateescape"
        if bad:
            return error(f"contains a lone surrogate U+{ord(bad.group()):04X}")
        return InputRecord(index, source, line, index, text=s)
    hint = " (--format text reads such lines as plain text)" if fmt == "auto" and kind == "tag" else ""
    try:
        obj = json.loads(s)
    except json.JSONDecodeError as err:
        return error(f"invalid JSON: {err.msg} at column {err.colno}{hint}")
    except RecursionError:
        return error("invalid JSON: nested too deeply")
    except ValueError as err:  # e.g. an integer with more digits than int() accepts
        return error(f"invalid JSON: {err}")
    if not isinstance(obj, dict):  # "jsonl" only: in "auto" such a line is plain text
        return error(f"JSON value must be an object, got {_json_type(obj)}")
    return _object_record(obj, kind, index, source, line, f"{source}: line {line}")


def _object_record(obj: Mapping[str, Any], kind: str, index: int, source: str, line: int,
                   where: str) -> InputRecord:
    """The record of one JSON object (a JSONL line, a Parquet row); an error record's message
    is ``"<where>: <reason>"``."""
    rec_id: str | int = index
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
        return InputRecord(index, source, line, rec_id, error=f"{where}: {err.args[0]}")


_WIDE_BOMS = {b"\xff\xfe\x00\x00": "utf-32", b"\x00\x00\xfe\xff": "utf-32",
              b"\xff\xfe": "utf-16", b"\xfe\xff": "utf-16"}


def check_not_wide(start: bytes, source: str) -> None:
    """ValueError when ``start`` (an input's first bytes) is a UTF-16/32 byte-order mark: such
    text cannot be split into lines on the byte \\n (Windows PowerShell's ``>`` writes it)."""
    for bom, name in _WIDE_BOMS.items():
        if start.startswith(bom):
            raise ValueError(f"{source}: starts with a {name.upper()} byte-order mark; convert it "
                             f"to UTF-8 first (iconv -f {name} -t utf-8)")


READ_BOUND_PER_CHAR = 16  # bytes read per allowed character: 4 (any codec) x 3 (JSON escapes)
READ_BOUND_SLACK = 64 << 20  # and 64 MiB for a JSON line's other fields and whitespace


def read_bound(max_chars: int | None) -> int | None:
    """The most bytes of one line read whole for ``--max-chars max_chars`` (module docstring);
    None (no bound) without it."""
    return None if max_chars is None else READ_BOUND_PER_CHAR * max_chars + READ_BOUND_SLACK


@dataclasses.dataclass(frozen=True)
class OverLong:
    """A line longer than the reading bound, read in pieces and dropped: ``size`` its bytes
    without the line break, ``read`` with it."""

    size: int
    read: int


def _break_length(raw: bytes) -> int:
    """Bytes of the line break ending ``raw``, by :func:`strip_line`'s rule: ``\r\n``, ``\n``
    or (a last line's) ``\r``."""
    return len(raw) - len(raw.removesuffix(b"\n").removesuffix(b"\r"))


def bounded_lines(stream: IO[bytes], bound: int | None = None,
                  piece: int = 1 << 20) -> Iterator[bytes | OverLong]:
    """The lines of a binary stream with their ``\n`` (as iterating it gives them); with
    ``bound``, a line of more than ``bound`` bytes (its line break not counted) is read
    ``piece`` bytes at a time and given as :class:`OverLong`, so no more than about ``bound``
    bytes are held at once."""
    if bound is None:
        yield from stream
        return
    readline, limit = stream.readline, bound + 2
    while raw := readline(limit):
        if len(raw) <= bound or len(raw) - _break_length(raw) <= bound:
            yield raw
            continue
        read, tail = len(raw), raw[-2:]  # the last two bytes hold any line break
        del raw
        while not tail.endswith(b"\n") and (more := readline(piece)):
            read += len(more)
            tail = (tail + more)[-2:]
        yield OverLong(read - _break_length(tail), read)


def strip_line(raw: bytes, first: bool) -> bytes:
    """A line without ``\n`` / ``\r\n`` (or a last ``\r``), and without the UTF-8 BOM when
    it is an input's ``first`` line."""
    if first and raw.startswith(_BOM):
        raw = raw[len(_BOM):]
    return raw.removesuffix(b"\n").removesuffix(b"\r")  # "\r" alone: a last line's


def over_long_line(index: int, source: str, line: int, size: int, max_chars: int) -> InputRecord:
    """The error record of a line of ``size`` bytes, over :func:`read_bound` of ``max_chars``."""
    return InputRecord(index, source, line, index, error=(
        f"{location(source, line)}: {size} bytes, over the {read_bound(max_chars)} read for "
        f"--max-chars {max_chars}; skipped"))


def _raw_lines(stream: IO[bytes], source: str | None = None,
               bound: int | None = None) -> Iterator[bytes | OverLong]:
    """Lines of a binary stream by :func:`bounded_lines`, as :func:`strip_line` makes them
    (after the first line inlined: this loop runs once per input line). With ``source``
    (standard input, which cannot be checked before it is read) a UTF-16/32 BOM raises
    ValueError (:func:`check_not_wide`); files are checked when opened."""
    first = True
    for raw in stream if bound is None else bounded_lines(stream, bound):
        if type(raw) is OverLong:
            first = False
            yield raw
        elif first:
            first = False
            if source is not None:
                check_not_wide(raw, source)
            yield strip_line(raw, True)
        else:
            yield raw.removesuffix(b"\n").removesuffix(b"\r")


# Parquet input: rows are records, as JSON object lines

PARQUET_SUFFIX = ".parquet"
PARQUET_FIELDS = {"tag": ("id", "text", "tokens"), "score": ("id", "text", "prompt")}
_PARQUET_BATCH_ROWS = 4096


def is_parquet(path: str) -> bool:
    """Whether the input ``path`` (a local path or a URI) is read as Parquet: its name ends
    with ``.parquet`` (any case)."""
    return path.lower().endswith(PARQUET_SUFFIX)


def location(source: str, line: int) -> str:
    """Where a record is, as its error message starts: ``"<source>: line <n>"``, or
    ``"<source>: row <n>"`` for a Parquet input (``line`` is then the 1-based row number)."""
    return f"{source}: {'row' if is_parquet(source) else 'line'} {line}"


def open_parquet(path: str) -> Any:
    """A ``pyarrow.parquet.ParquetFile`` on a local path or a URI of pyarrow's filesystems
    (``s3://``, ``gs://``, ``file://``...); only its footer is read. ValueError when pyarrow is
    missing or the file is not Parquet. Use it as a context manager."""
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ValueError(f"{path}: Parquet input needs pyarrow (pip install pyarrow): {err}"
                         ) from None
    try:
        if "://" in path:
            import pyarrow.fs

            fs, inner = pyarrow.fs.FileSystem.from_uri(path)
            return pq.ParquetFile(inner, filesystem=fs)  # closed with the ParquetFile
        return pq.ParquetFile(path)
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"{path}: not a readable Parquet file ({err})") from None


def _from_arrow(name: str, value: Any, encoding: str) -> Any:
    """A Parquet value as the JSON decoder would give it: binary decoded (strictly) as
    ``encoding``, inside lists and structs too; _Invalid naming the field otherwise."""
    if isinstance(value, bytes):
        try:
            return value.decode(encoding)
        except UnicodeDecodeError as err:
            what = "UTF-8" if encoding == "utf-8" else encoding
            raise _Invalid(f'field "{name}": invalid {what}: byte(s) '
                           f"{value[err.start:err.end]!r} at byte {err.start + 1}") from None
    if isinstance(value, list):
        return [_from_arrow(name, v, encoding) for v in value]
    if isinstance(value, dict):
        return {k: _from_arrow(name, v, encoding) for k, v in value.items()}
    return value


def _row_record(values: dict[str, Any], kind: str, index: int, source: str, row: int,
                encoding: str) -> InputRecord:
    """One Parquet row (its fields; null = absent) -> the record of the JSON object with the
    same fields."""
    where = location(source, row)
    try:
        obj = {k: _from_arrow(k, v, encoding) for k, v in values.items() if v is not None}
    except _Invalid as err:
        return InputRecord(index, source, row, index, error=f"{where}: {err.args[0]}")
    return _object_record(obj, kind, index, source, row, where)


def parquet_records(path: str, kind: str, *, source: str | None = None, start: int = 0,
                    stop: int | None = None, first_index: int = 1,
                    encoding: str = "utf-8") -> Iterator[InputRecord]:
    """The records of rows ``start .. stop - 1`` (0-based; ``stop`` None: to the end) of the
    Parquet file ``path`` (local or a URI, :func:`open_parquet`): row ``r`` is record
    ``first_index + r - start`` with ``line = r + 1`` and ``source`` (default ``path``). A row
    is read as the JSON object of its fields ``id``, ``text``, ``tokens`` (tag) or ``id``,
    ``text``, ``prompt`` (score): other columns are not read, a null is an absent field,
    binary is decoded as ``encoding``. Only the row groups that hold the rows are read, in
    slices of a few thousand rows."""
    source = path if source is None else source
    index = first_index
    with open_parquet(path) as pf:
        names = pf.schema_arrow.names
        columns = [c for c in PARQUET_FIELDS[kind] if c in names]
        meta = pf.metadata
        stop = meta.num_rows if stop is None else min(stop, meta.num_rows)
        row0 = 0  # first row of group g
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            lo, hi = max(start, row0), min(stop, row0 + n)
            if lo < hi:
                table = pf.read_row_group(g, columns=columns)
                for a in range(lo, hi, _PARQUET_BATCH_ROWS):
                    b = min(hi, a + _PARQUET_BATCH_ROWS)
                    part = table.slice(a - row0, b - a)
                    cols = {c: part.column(c).to_pylist() for c in columns}
                    for k in range(b - a):
                        yield _row_record({c: v[k] for c, v in cols.items()}, kind, index,
                                          source, a + k + 1, encoding)
                        index += 1
            row0 += n
            if row0 >= stop:
                break


def iter_input_records(
    paths: Sequence[str] = ("-",),
    kind: str = "tag",
    *,
    stdin: BinaryIO | None = None,
    format: str = "auto",
    encoding: str = "utf-8",
    max_chars: int | None = None,
) -> Iterator[InputRecord]:
    """Records of ``paths`` in order, by the input rules of the module docstring.

    ``"-"`` (at most once) is standard input, read from ``stdin`` or ``sys.stdin.buffer``; an empty
    ``paths`` means ``["-"]``. ``format`` is "auto", "text" (``kind="tag"`` only) or "jsonl";
    ``encoding`` a codec (:func:`check_encoding`). ``max_chars`` bounds the bytes of a line read
    whole (:func:`read_bound`; the characters are :func:`limit_length`'s to check). The arguments
    and paths are checked when this is
    called (ValueError; a missing file or a directory raises ``FileNotFoundError`` /
    ``IsADirectoryError`` at once); the lines are read lazily, one at a time.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if format not in FORMATS:
        raise ValueError(f"format: expected one of {FORMATS}, got {format!r}")
    if format == "text" and kind != "tag":
        raise ValueError(f'format: "{kind}" input is JSON objects; "text" is for tag only')
    encoding = check_encoding(encoding)
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
        if is_parquet(path):
            check_parquet(path, format)
            continue
        with open(path, "rb") as f:  # unreadable: PermissionError now, not part-way through
            check_not_wide(f.read(4), path)
    if max_chars is not None and max_chars < 1:
        raise ValueError(f"max_chars: expected a positive integer or None, got {max_chars}")
    return _iter_records(paths, kind, stdin, format, encoding, max_chars)


def check_parquet(path: str, format: str = "auto") -> None:
    """ValueError unless ``path`` opens as Parquet and ``format`` can read it (a Parquet row is
    a record with fields, never a plain-text line: ``"text"`` is refused)."""
    if format == "text":
        raise ValueError(f'format: "text" reads lines as plain text, but {path} is Parquet '
                         "(its rows are records with fields); use --format auto or jsonl")
    with open_parquet(path):
        pass


def _iter_records(paths: list[str], kind: str, stdin: BinaryIO | None, fmt: str,
                  encoding: str, max_chars: int | None) -> Iterator[InputRecord]:
    index = 0
    for path in paths:
        if is_parquet(path):
            for rec in parquet_records(path, kind, first_index=index + 1, encoding=encoding):
                index += 1
                yield rec
            continue
        with contextlib.ExitStack() as stack:
            if path == "-":
                source = STDIN_SOURCE
                lines = _raw_lines(stdin if stdin is not None else sys.stdin.buffer, source,
                                   read_bound(max_chars))
            else:
                source = path
                lines = _raw_lines(stack.enter_context(open(path, "rb")), None,
                                   read_bound(max_chars))
            for line, raw in enumerate(lines, 1):
                index += 1
                yield parse_line(raw, kind, index, source, line, fmt, encoding, max_chars)


def parse_line(raw: bytes | OverLong, kind: str, index: int, source: str, line: int,
               fmt: str, encoding: str, max_chars: int | None) -> InputRecord:
    """A line from :func:`_raw_lines` (stripped, or :class:`OverLong`) -> its record."""
    if isinstance(raw, OverLong):
        assert max_chars is not None  # only a bounded read gives one
        return over_long_line(index, source, line, raw.size, max_chars)
    return _parse_line(raw, kind, index, source, line, fmt, encoding)


def _length(rec: InputRecord) -> int:
    """Characters of a record: its text, or its tokens joined by single spaces."""
    if rec.text is not None:
        return len(rec.text)
    return sum(len(t) for t in rec.tokens or ()) + max(0, len(rec.tokens or ()) - 1)


def limit_length(records: Iterable[InputRecord], max_chars: int | None, over_long: str = "skip",
                 option: str = "--max-chars") -> Iterator[InputRecord]:
    """``records`` with every valid one longer than ``max_chars`` characters (text, or tokens
    joined by spaces) either made an error record (``over_long="skip"``: ``"<source>: line <n>:
    <N> characters, over <option> <max_chars>; skipped"``) or cut (``"cap"``: the text's first
    ``max_chars`` characters, or the tokens that fit, at least one, cut to ``max_chars``) with
    ``capped_from`` set to its original length. None: no limit. Lazy, order kept."""
    if over_long not in ("skip", "cap"):
        raise ValueError(f"over_long: expected 'skip' or 'cap', got {over_long!r}")
    if max_chars is not None and max_chars < 1:
        raise ValueError(f"max_chars: expected a positive integer or None, got {max_chars}")
    for rec in records:
        n = _length(rec) if rec.error is None and max_chars is not None else 0
        if n <= (max_chars or 0):
            yield rec
        elif over_long == "skip":
            where = location(rec.source, rec.line)
            yield dataclasses.replace(
                rec, text=None, tokens=None, prompt=None,
                error=f"{where}: {n} characters, over {option} {max_chars}; skipped")
        elif rec.text is not None:
            yield dataclasses.replace(rec, text=rec.text[:max_chars], capped_from=n)
        else:
            kept, size = [], -1
            for tok in rec.tokens or ():
                if kept and size + 1 + len(tok) > max_chars:
                    break
                kept.append(tok[:max_chars])
                size += 1 + len(tok)
            yield dataclasses.replace(rec, tokens=tuple(kept), capped_from=n)


# ---------------------------------------------------------------------------------------------------
# output


class OutputExistsError(FileExistsError):
    """The output file exists and is not empty, and resuming was not asked for."""


class OutputCorruptError(ValueError):
    """The output file is damaged in more than its last line, or is not this program's output."""


class OutputLockedError(OSError):
    """Another process is writing the output (it holds the lock on it)."""


class ResumeMismatchError(ValueError):
    """The input or the options do not match what the output being resumed was made from."""


def meta_path(path: str) -> str:
    """The sidecar of an output: ``<path>.meta.json``."""
    return path + META_SUFFIX


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
    directory: config, weights, tokenizer), in name order."""
    h = hashlib.sha256()
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if not entry.is_file():
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
          and _is_int(data["input"].get("records")) and data["input"]["records"] >= 0
          and isinstance(data["input"].get("sha256"), str))
    if not ok:
        raise OutputCorruptError(f"{meta}: not a {META_FORMAT} sidecar, {hint}")
    return data


def _check_made_from(path: str, then: Mapping[str, Any], now: Mapping[str, Any]) -> None:
    """ResumeMismatchError naming every key whose value differs between the sidecar and now."""
    diffs = [f"{k}: {then.get(k)!r} then, {now.get(k)!r} now"
             for k in sorted(set(then) | set(now)) if then.get(k) != now.get(k)]
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
            self._f: BinaryIO = sys.stdout.buffer
            return
        if os.path.isdir(path):
            raise IsADirectoryError(f"{path}: is a directory, not an output file")
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
        _check_made_from(self.path, meta["made_from"], self.made_from)
        scan = _scan_output(self._f, self.path)
        vouched = meta["input"]["records"]
        if scan.done > vouched:
            raise OutputCorruptError(
                f"{self.path} holds {scan.done} records but {meta_path(self.path)} vouches for "
                f"{vouched} input records only; refusing to resume it")
        self.done, self.done_errors, self.last_id = scan.done, scan.n_errors, scan.last_id
        self.vouched, self.vouched_sha256 = vouched, meta["input"]["sha256"]
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
        if not _is_int(index) or index != self.next_index:
            raise ValueError(f'{self.path}: expected a record with "index": {self.next_index}, got {index!r}')
        line = json.dumps(record, ensure_ascii=False, allow_nan=False)
        # a lone surrogate (an input file name that is not UTF-8, in an error message) is
        # written as its JSON escape \udcXX: the line stays UTF-8 and JSON
        self._f.write(line.encode("utf-8", "backslashreplace") + b"\n")
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


ProcessBatch = Callable[..., list[dict[str, Any]]]


def _verify_resumed_input(it: Iterator[InputRecord], writer: Any, fp: InputFingerprint
                          ) -> list[InputRecord]:
    """Read the input records the writer's sidecar vouches for into ``fp`` and compare; return
    those past ``writer.done`` (to be processed). ResumeMismatchError on any difference."""
    vouched, done = getattr(writer, "vouched", 0), writer.done
    ahead: list[InputRecord] = []
    for rec in itertools.islice(it, vouched):
        fp.update(rec)
        if fp.count > done:
            ahead.append(rec)
    if fp.count < vouched:
        raise ResumeMismatchError(
            f"{writer.path} was made from {vouched} input records but the input has only "
            f"{fp.count}; is this the same input? Refusing to mix outputs")
    if vouched and fp.hexdigest() != writer.vouched_sha256:
        raise ResumeMismatchError(
            f"{writer.path} was made from other input: the first {vouched} input records differ "
            "from the ones it was made from (by their fingerprint, see "
            f"{os.path.basename(meta_path(writer.path))}); refusing to mix outputs. Resume with "
            "the same input, or write to another output")
    if fp.count < done:  # only with a writer that vouches for nothing (tests, PrettyWriter)
        for rec in itertools.islice(it, done - fp.count):
            fp.update(rec)
        if fp.count < done:
            raise ResumeMismatchError(
                f"{writer.path} already holds {done} records but the input has only {fp.count}; "
                "is this the same input?")
    return ahead


class _PieceCounter:
    """The ``report(n)`` handed to ``process_batch`` with ``count_pieces``: adds ``n`` word pieces
    to the bar's postfix (refreshed at most twice a second)."""

    def __init__(self, bar: tqdm) -> None:
        self.bar, self.total, self.t0, self.shown = bar, 0, time.monotonic(), 0.0

    def __call__(self, n: int) -> None:
        self.total += int(n)
        now = time.monotonic()
        if now - self.shown >= 0.5:
            self.shown = now
            rate = self.total / max(now - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{self.total:,} pieces, {rate:,.0f} pieces/s")


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
    count_pieces: bool = False,
    first_batch: int | None = None,
) -> RunSummary:
    """Process ``records`` into ``writer`` in input order, resuming after ``writer.done``.

    ``process_batch`` gets a list of 1..``batch_size`` valid records and must return one dict per
    record, in the same order; ``"index"`` and ``"id"`` in a result are replaced by the record's.
    With ``count_pieces`` it is called as ``process_batch(batch, report)`` and calls ``report(n)``
    as it encodes ``n`` more word pieces (the bar shows them). Exceptions from ``process_batch``
    propagate (what was written stays; resume continues from it). On resume the input is first
    checked against the writer's sidecar (:class:`ResumeMismatchError`). Before records past what
    the sidecar vouches for are written, ``writer.vouch`` records the fingerprint of all input
    records read so far. ``total`` (the number of input records, if known) only sets the progress
    bar's length; ``desc`` and ``unit`` (what a record is, e.g. ``"essay"``: the bar shows
    ``<unit>s/s``) label it. ``first_batch``: the first batch holds at most this many valid
    records and each next one twice the last, up to ``batch_size``, so that the first results
    are written soon after start (None: every batch ``batch_size``). The writer is synced, not
    closed, at the end.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if first_batch is not None and first_batch < 1:
        raise ValueError(f"first_batch must be >= 1, got {first_batch}")
    max_pending = 8 * batch_size
    limit = batch_size if first_batch is None else min(first_batch, batch_size)
    fp = InputFingerprint()
    source = iter(records)
    n_resumed = writer.done
    ahead = _verify_resumed_input(source, writer, fp)

    def fingerprinted() -> Iterator[InputRecord]:
        for rec in source:
            fp.update(rec)
            yield rec

    vouch = getattr(writer, "vouch", None)
    n_errors = writer.done_errors
    n_ok = n_resumed - n_errors
    pending: list[InputRecord] = []  # records waiting to be written, in input order
    batch: list[InputRecord] = []  # the valid ones among them
    bar = progress_bar(total=total, initial=n_resumed, desc=desc, unit=unit, unit_scale=True,
                       disable=not progress)
    report = _PieceCounter(bar) if count_pieces else None

    def emit(out: dict[str, Any]) -> None:
        nonlocal n_ok, n_errors
        writer.write(out)
        if "error" in out:
            n_errors += 1
        else:
            n_ok += 1

    def flush() -> None:
        nonlocal limit
        if not pending:
            return
        limit = min(2 * limit, batch_size)
        if batch:
            results = process_batch(list(batch), report) if count_pieces else process_batch(list(batch))
        else:
            results = []
        if not isinstance(results, list) or len(results) != len(batch):
            got = len(results) if isinstance(results, list) else type(results).__name__
            raise RuntimeError(f"process_batch returned {got} results for {len(batch)} records")
        if vouch is not None and pending[-1].index > getattr(writer, "vouched", 0):
            vouch(fp.count, fp.hexdigest())  # before any line it does not cover is written
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
        for rec in itertools.chain(ahead, fingerprinted()):
            pending.append(rec)
            if rec.error is None:
                batch.append(rec)
            if len(batch) >= limit or len(pending) >= max_pending:
                flush()
        flush()
        writer.sync()
    finally:
        bar.close()
    return RunSummary(n_ok=n_ok, n_errors=n_errors, n_resumed=n_resumed)
