"""Input records of ``tag`` / ``score``: text and JSONL lines, Parquet rows, error records.

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
  any other line is plain text (so ``[1, 2]`` or ``"x"`` is plain text here); but every line of
  a ``tag`` input named ``*.jsonl`` or ``*.ndjson`` (any case; :func:`line_format`) is read as
  in ``"jsonl"``, so that a damaged line of a JSONL file is an error record, not a text to tag;
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
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import json
import os
import stat
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, BinaryIO

from ..texts import SURROGATE

__all__ = [
    "FORMATS",
    "InputRecord",
    "check_encoding",
    "check_parquet",
    "is_parquet",
    "iter_input_records",
    "line_format",
    "limit_length",
    "location",
    "over_long_line",
    "read_bound",
    "parquet_records",
]

STDIN_SOURCE = "<stdin>"
KINDS = ("tag", "score")
FORMATS = ("auto", "text", "jsonl")
PROMPT_RANGE = range(1, 9)

_BOM = b"\xef\xbb\xbf"


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


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Invalid(Exception):
    """Internal: a line is malformed; ``args[0]`` is the reason."""


def _check_string(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _Invalid(f'field "{name}" must be a string, got {_json_type(value)}')
    bad = SURROGATE.search(value)
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
        bad = SURROGATE.search(tok)
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


JSONL_SUFFIXES = (".jsonl", ".ndjson")


def line_format(source: str, fmt: str, kind: str = "tag") -> str:
    """The format the ``kind`` lines of ``source`` (a path, a URI or ``"<stdin>"``) are read
    in: "jsonl" where ``kind`` is "tag", ``fmt`` is "auto" and the name ends with ``.jsonl``
    or ``.ndjson`` (any case), else ``fmt`` ("score" reads JSON objects only either way, and
    its message for a plain-text line says so)."""
    if kind == "tag" and fmt == "auto" and source.lower().endswith(JSONL_SUFFIXES):
        return "jsonl"
    return fmt


def _parse_line(raw: bytes, kind: str, index: int, source: str, line: int,
                fmt: str = "auto", encoding: str = "utf-8", by_name: bool = False
                ) -> InputRecord:
    """One raw line (without its line break) -> a valid or an error record. ``by_name``:
    ``fmt`` is "jsonl" because of the input's name (:func:`line_format`), which the message
    of an invalid line says."""
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
        bad = SURROGATE.search(s)  # only possible with a codec such as "surrogateescape"
        if bad:
            return error(f"contains a lone surrogate U+{ord(bad.group()):04X}")
        return InputRecord(index, source, line, index, text=s)
    hint = ""
    if kind == "tag" and fmt == "auto":
        hint = " (--format text reads such lines as plain text)"
    elif kind == "tag" and by_name:
        hint = (" (a file named *.jsonl or *.ndjson is read as JSON lines; --format text reads "
                "its lines as plain text)")
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
            if not (is_int(value) or isinstance(value, str)):
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
        if not is_int(prompt):
            raise _Invalid(f'field "prompt" must be an integer from 1 to 8, got {_json_type(prompt)}')
        if prompt not in PROMPT_RANGE:
            raise _Invalid(f'field "prompt" must be an integer from 1 to 8, got {prompt}')
        return InputRecord(index, source, line, rec_id, text=text, prompt=prompt)
    except _Invalid as err:
        return InputRecord(index, source, line, rec_id, error=f"{where}: {err.args[0]}")


_WIDE_BOMS = {b"\xff\xfe\x00\x00": "utf-32", b"\x00\x00\xfe\xff": "utf-32",
              b"\xff\xfe": "utf-16", b"\xfe\xff": "utf-16"}


class WideInputError(ValueError):
    """An input that starts with a UTF-16/32 byte-order mark (:func:`check_not_wide`): raised
    before any record of it, also where it is found only when read (standard input, a pipe)."""


def check_not_wide(start: bytes, source: str) -> None:
    """:class:`WideInputError` when ``start`` (an input's first bytes) is a UTF-16/32
    byte-order mark: such text cannot be split into lines on the byte \\n (Windows
    PowerShell's ``>`` writes it)."""
    for bom, name in _WIDE_BOMS.items():
        if start.startswith(bom):
            raise WideInputError(f"{source}: starts with a {name.upper()} byte-order mark; convert it "
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
    (standard input or a pipe, which cannot be checked before they are read) a UTF-16/32 BOM
    raises :class:`WideInputError`; regular files are checked when opened."""
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
            if stdin is None and sys.stdin is None:
                raise ValueError("standard input is closed; give the input files")
            continue
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no such input file")
        if os.path.isdir(path):
            raise IsADirectoryError(f"{path}: is a directory, not an input file")
        if is_parquet(path):
            check_parquet(path, format)
            continue
        if not _is_regular(path):
            # a pipe or FIFO (`<(cmd)`, /dev/stdin) is read once: a peek here would take its
            # first buffer with it (and a FIFO's second open waits for a writer that is gone);
            # its first line is checked as it is read
            if not os.access(path, os.R_OK):
                raise PermissionError(f"{path}: cannot be read (permission denied)")
            continue
        with open(path, "rb") as f:  # unreadable: PermissionError now, not part-way through
            check_not_wide(f.read(4), path)
    if max_chars is not None and max_chars < 1:
        raise ValueError(f"max_chars: expected a positive integer or None, got {max_chars}")
    return _iter_records(paths, kind, stdin, format, encoding, max_chars)


def _is_regular(path: str | int) -> bool:
    """Whether ``path`` (or an open file descriptor) is a regular file, which can be read more
    than once (not a pipe, a FIFO or a device)."""
    return stat.S_ISREG(os.stat(path).st_mode)


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
                f = stack.enter_context(open(path, "rb"))
                lines = _raw_lines(f, None if _is_regular(f.fileno()) else path,
                                   read_bound(max_chars))
            read_as = line_format(source, fmt, kind)  # once per input, not per line
            for line, raw in enumerate(lines, 1):
                index += 1
                yield parse_line(raw, kind, index, source, line, fmt, encoding, max_chars,
                                 read_as=read_as)


def parse_line(raw: bytes | OverLong, kind: str, index: int, source: str, line: int,
               fmt: str, encoding: str, max_chars: int | None, *, read_as: str | None = None
               ) -> InputRecord:
    """A line from :func:`_raw_lines` (stripped, or :class:`OverLong`) -> its record.
    ``read_as``: ``line_format(source, fmt, kind)``, computed here when None (a caller reading
    many lines of one source passes it once)."""
    if isinstance(raw, OverLong):
        assert max_chars is not None  # only a bounded read gives one
        return over_long_line(index, source, line, raw.size, max_chars)
    if read_as is None:
        read_as = line_format(source, fmt, kind)
    return _parse_line(raw, kind, index, source, line, read_as, encoding, read_as != fmt)


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

