"""ASAP-AES reader, Taghipour & Ng (2016) folds, and score scaling.

The ASAP ``training_set_rel3`` file is a tab-separated export of a spreadsheet, and it is
*not* valid CSV: it must be read **line by line, splitting on tab, with no quote handling**.
A quote-aware reader (pandas' default, Python's ``csv`` default) returns 12,976 essays instead
of 12,978 because essay 10534 opens a ``"`` that is never closed and swallows the next two
essays. See ``shared/data/asap_aes/PROVENANCE.md``.

Rules of :func:`read_asap`:

* the file is split on ``\\n`` only (never on a bare ``\\r``: a lone carriage return inside a
  field stays in the text); one trailing ``\\r`` is removed from each line, so CRLF and LF
  rows are both accepted (the shared copy has CRLF rows except essay 10534, which ends in LF);
* each line is decoded on its own (default UTF-8, strict), so an undecodable byte makes only
  that row bad; U+FFFD characters already in the text are ordinary characters;
* lines that are empty or only white space are skipped;
* the first non-blank line is the header when one of its fields is ``essay_id`` (names are
  compared after stripping white space, a UTF-8 BOM and case); columns are found by name.
  Without such a header the Kaggle column order :data:`ASAP_COLUMNS` is assumed and the
  first line is data;
* essay text: when ``unquote`` is true (default) and the field both starts and ends with a
  literal ``"`` (and is at least 2 characters long), exactly one leading and one trailing
  ``"`` are removed and the CSV-style doubled quotes inside (``""``) become one ``"``. A
  field that only starts (or only ends) with ``"``, like essay 10534, is left exactly as it
  is. No other change is made to the text (no white-space stripping).

Bad rows (wrong number of fields, non-integer or missing id, prompt or domain1 score,
non-integer rater score, unknown prompt, score outside :data:`SCORE_RANGES`, duplicate
essay id, undecodable bytes) raise :class:`DataFormatError` naming the file and the 1-based
line number, or, with ``errors="collect"``, are skipped and returned as :class:`BadRow`.
"""

from __future__ import annotations

import codecs
import hashlib
import math
import os
import re
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Iterable, Literal, Mapping, Sequence, Union, overload

import numpy as np

__all__ = [
    "ASAP_COLUMNS",
    "REQUIRED_COLUMNS",
    "SCORE_RANGES",
    "SPLITS",
    "BadRow",
    "DataFormatError",
    "Essay",
    "denormalise_score",
    "denormalise_scores",
    "digest_essays",
    "normalise_score",
    "read_asap",
    "read_folds",
    "split_essays",
]

PathLike = Union[str, "os.PathLike[str]"]

#: domain1 score range (inclusive) per ASAP prompt (``essay_set``), as used by Taghipour & Ng.
#: Observed ranges are narrower for prompts 7 (2-24) and 8 (10-60).
SCORE_RANGES: dict[int, tuple[int, int]] = {
    1: (2, 12),
    2: (1, 6),
    3: (0, 3),
    4: (0, 3),
    5: (0, 4),
    6: (0, 4),
    7: (0, 30),
    8: (0, 60),
}

#: The split names of a fold, in file order.
SPLITS: tuple[str, str, str] = ("train", "dev", "test")

#: Column order of Kaggle's ``training_set_rel3.tsv`` (28 columns), used when a file has no header.
ASAP_COLUMNS: tuple[str, ...] = (
    "essay_id", "essay_set", "essay",
    "rater1_domain1", "rater2_domain1", "rater3_domain1", "domain1_score",
    "rater1_domain2", "rater2_domain2", "domain2_score",
    *(f"rater{r}_trait{t}" for r in (1, 2, 3) for t in range(1, 7)),
)

#: Columns :func:`read_asap` needs.
REQUIRED_COLUMNS: tuple[str, ...] = (
    "essay_id", "essay_set", "essay", "rater1_domain1", "rater2_domain1", "domain1_score",
)

_INT = re.compile(r"[+-]?[0-9]+")


class DataFormatError(ValueError):
    """A malformed data file or row; ``str()`` is ``"<path>:<line>: <reason>"``."""

    def __init__(self, reason: str, path: PathLike | None = None, line: int | None = None) -> None:
        self.reason = reason
        self.path = None if path is None else str(path)
        self.line = line
        where = ""
        if self.path is not None:
            where = f"{self.path}:{line}: " if line is not None else f"{self.path}: "
        elif line is not None:
            where = f"line {line}: "
        super().__init__(where + reason)


@dataclass(frozen=True, slots=True)
class Essay:
    """One ASAP essay: ``score`` is ``domain1_score``; ``line`` is its 1-based line in the file."""

    essay_id: int
    prompt: int
    text: str
    score: int
    rater1: int | None
    rater2: int | None
    line: int


def digest_essays(h, essays: Iterable[Essay]) -> None:
    """Feed essays into the sha256 ``h``: each one's id and score, then the sha256 of its text."""
    for e in essays:
        h.update(f"\0{e.essay_id}\0{e.score}\0".encode())
        h.update(hashlib.sha256(e.text.encode("utf-8", "surrogatepass")).digest())


@dataclass(frozen=True, slots=True)
class BadRow:
    """A row skipped by ``read_asap(..., errors="collect")``; ``essay_id`` is None if unknown."""

    path: str
    line: int
    reason: str
    essay_id: int | None = None

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


def _parse_int(field: str) -> int | None:
    """ASCII integer with optional sign and surrounding white space, else None."""
    s = field.strip()
    return int(s) if _INT.fullmatch(s) else None


def _unquote(text: str) -> str:
    """Remove one wrapping pair of ``"`` and undouble ``""``, only if both ends are ``"``."""
    if len(text) >= 2 and text[0] == '"' and text[-1] == '"':
        return text[1:-1].replace('""', '"')
    return text


def _header_columns(fields: list[str]) -> dict[str, int] | None:
    names = [f.strip().lstrip("\ufeff").strip().lower() for f in fields]
    if "essay_id" not in names:
        return None
    columns: dict[str, int] = {}
    for i, name in enumerate(names):
        columns.setdefault(name, i)
    return columns


@overload
def read_asap(
    path: PathLike,
    *,
    errors: Literal["raise"] = "raise",
    encoding: str = "utf-8",
    unquote: bool = True,
) -> list[Essay]: ...


@overload
def read_asap(
    path: PathLike,
    *,
    errors: Literal["collect"],
    encoding: str = "utf-8",
    unquote: bool = True,
) -> tuple[list[Essay], list[BadRow]]: ...


def read_asap(
    path: PathLike,
    *,
    errors: Literal["raise", "collect"] = "raise",
    encoding: str = "utf-8",
    unquote: bool = True,
) -> list[Essay] | tuple[list[Essay], list[BadRow]]:
    """Read an ASAP essay TSV line by line (split on tab, no quote handling); see the module doc.

    Returns the essays in file order. With ``errors="raise"`` (default) the first bad row raises
    :class:`DataFormatError` ("file:line: reason"); with ``errors="collect"`` bad rows are
    skipped and ``(essays, bad_rows)`` is returned. Problems with the file as a whole (missing
    file, no rows, header without a required column or unreadable header) always raise.
    ``encoding="cp1252"`` reads Kaggle's original file.
    """
    if errors not in ("raise", "collect"):
        raise ValueError(f'errors must be "raise" or "collect", not {errors!r}')
    p = Path(path)
    lines = p.read_bytes().split(b"\n")
    if lines[0].startswith(codecs.BOM_UTF8) and codecs.lookup(encoding).name == "utf-8":
        lines[0] = lines[0][len(codecs.BOM_UTF8):]  # a header-less file's first essay too

    first = next((i for i, b in enumerate(lines) if b.strip()), None)
    if first is None:
        raise DataFormatError("no rows (empty file)", p)
    try:
        first_text = lines[first].rstrip(b"\r").decode(encoding)
    except UnicodeDecodeError as exc:
        raise DataFormatError(f"undecodable first line for {encoding}: {exc.reason}", p, first + 1) from None
    header = _header_columns(first_text.split("\t"))
    if header is None:
        columns = {name: i for i, name in enumerate(ASAP_COLUMNS)}
        n_fields = len(ASAP_COLUMNS)
        start = first
    else:
        missing = [c for c in REQUIRED_COLUMNS if c not in header]
        if missing:
            raise DataFormatError(f"header lacks column(s) {', '.join(missing)}", p, first + 1)
        columns = header
        n_fields = len(first_text.split("\t"))
        start = first + 1

    c_id, c_set, c_text = columns["essay_id"], columns["essay_set"], columns["essay"]
    c_r1, c_r2, c_score = columns["rater1_domain1"], columns["rater2_domain1"], columns["domain1_score"]

    essays: list[Essay] = []
    bad: list[BadRow] = []
    seen: dict[int, int] = {}

    for idx in range(start, len(lines)):
        lineno = idx + 1
        raw = lines[idx]
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        if not raw.strip():
            continue
        essay_id: int | None = None
        reason: str | None = None
        essay: Essay | None = None
        try:
            line = raw.decode(encoding)
        except UnicodeDecodeError as exc:
            reason = (
                f"undecodable bytes for {encoding} at byte {exc.start}: "
                f"{raw[exc.start:exc.end]!r} ({exc.reason})"
            )
        else:
            essay_id, reason, essay = _parse_row(
                line.split("\t"), n_fields, lineno, seen,
                c_id, c_set, c_text, c_r1, c_r2, c_score, unquote,
            )
        if reason is not None:
            if errors == "raise":
                raise DataFormatError(reason, p, lineno)
            bad.append(BadRow(str(p), lineno, reason, essay_id))
            continue
        assert essay is not None
        seen[essay.essay_id] = lineno
        essays.append(essay)

    if errors == "collect":
        return essays, bad
    return essays


def _parse_row(
    fields: list[str],
    n_fields: int,
    lineno: int,
    seen: Mapping[int, int],
    c_id: int,
    c_set: int,
    c_text: int,
    c_r1: int,
    c_r2: int,
    c_score: int,
    unquote: bool,
) -> tuple[int | None, str | None, Essay | None]:
    """Return ``(essay_id or None, reason or None, essay or None)`` for one split row."""
    if len(fields) != n_fields:
        return None, f"expected {n_fields} tab-separated fields, found {len(fields)}", None
    essay_id = _parse_int(fields[c_id])
    if essay_id is None:
        return None, f"essay_id {fields[c_id]!r} is not an integer", None
    if essay_id <= 0:
        return essay_id, f"essay_id {essay_id} is not positive", None
    prompt = _parse_int(fields[c_set])
    if prompt is None:
        return essay_id, f"essay_set {fields[c_set]!r} is not an integer", None
    if prompt not in SCORE_RANGES:
        return essay_id, f"unknown essay_set {prompt} (known: 1-8)", None
    score = _parse_int(fields[c_score])
    if score is None:
        return essay_id, f"domain1_score {fields[c_score]!r} is not an integer", None
    lo, hi = SCORE_RANGES[prompt]
    if not lo <= score <= hi:
        return essay_id, f"domain1_score {score} outside {lo}..{hi} for prompt {prompt}", None
    raters: list[int | None] = []
    for name, col in (("rater1_domain1", c_r1), ("rater2_domain1", c_r2)):
        field = fields[col]
        if not field.strip():
            raters.append(None)
            continue
        value = _parse_int(field)
        if value is None:
            return essay_id, f"{name} {field!r} is not an integer", None
        raters.append(value)
    if essay_id in seen:
        return essay_id, f"duplicate essay_id {essay_id} (first on line {seen[essay_id]})", None
    text = fields[c_text]
    if unquote:
        text = _unquote(text)
    return essay_id, None, Essay(essay_id, prompt, text, score, raters[0], raters[1], lineno)


# ---------------------------------------------------------------------------------------------
# Taghipour & Ng (2016) folds
# ---------------------------------------------------------------------------------------------

_FOLD_DIR = re.compile(r"fold_([0-9]+)")


def _read_id_file(path: Path) -> list[int]:
    """One integer essay id per line (CRLF/LF, blank lines skipped), no duplicates; file order kept."""
    ids: list[int] = []
    first_line: dict[int, int] = {}
    for lineno, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        text = raw.strip()
        if not text:
            continue
        try:
            value = _parse_int(text.decode("ascii"))
        except UnicodeDecodeError:
            value = None
        if value is None:
            raise DataFormatError(f"essay id {raw!r} is not an integer", path, lineno)
        if value in first_line:
            raise DataFormatError(f"duplicate essay id {value} (first on line {first_line[value]})", path, lineno)
        first_line[value] = lineno
        ids.append(value)
    return ids


def read_folds(folds_dir: PathLike) -> dict[int, dict[str, list[int]]]:
    """Read Taghipour & Ng's fold id lists: ``{fold: {"train"|"dev"|"test": [essay_id, ...]}}``.

    Layout (nusnlp/nea ``data/``): ``<folds_dir>/fold_<k>/{train,dev,test}_ids.txt``, one
    essay id per line (LF). Folders not named ``fold_<k>`` are ignored; the result is sorted
    by ``k``. Ids keep their file order, which is not numeric order. Raises
    :class:`DataFormatError` for a
    non-integer or duplicate id, or an id in two splits of one fold, and
    :class:`FileNotFoundError` for a missing folder, split file, or no fold at all.

    The shared copy (nea_folds) has 5 folds; per fold train 7,783-7,791, dev 2,593-2,598 and
    test 2,593-2,598 ids (60/20/20 of 12,978), the three disjoint and covering all essays.
    The 5 test sets partition the essays; fold k's dev set is fold k-1's test set (fold 0's
    dev is fold 4's test) and its train list is the concatenation of the test lists of folds
    k+1, k+2, k+3 (mod 5). Each test list groups ids by prompt in the order 1, 3, 2, 5, 4, 7,
    6, 8, ascending within a prompt; every prompt is split about 60/20/20.
    """
    root = Path(folds_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"folds folder {root} does not exist")
    folds: dict[int, dict[str, list[int]]] = {}
    for sub in root.iterdir():
        m = _FOLD_DIR.fullmatch(sub.name)
        if m is None or not sub.is_dir():
            continue
        k = int(m.group(1))
        splits: dict[str, list[int]] = {}
        for split in SPLITS:
            f = sub / f"{split}_ids.txt"
            if not f.is_file():
                raise FileNotFoundError(f"fold {k}: missing {f}")
            splits[split] = _read_id_file(f)
        for a, b in combinations(SPLITS, 2):
            common = sorted(set(splits[a]) & set(splits[b]))
            if common:
                raise DataFormatError(
                    f"fold {k}: {len(common)} essay ids in both {a} and {b} (e.g. {common[:5]})", sub
                )
        folds[k] = splits
    if not folds:
        raise FileNotFoundError(f"no fold_<k> folders in {root}")
    return dict(sorted(folds.items()))


def split_essays(
    essays: Iterable[Essay],
    folds: Mapping[int, Mapping[str, Sequence[int]]],
    fold: int,
    prompt: int | None = None,
) -> dict[str, list[Essay]]:
    """Return ``{"train"|"dev"|"test": [Essay, ...]}`` for ``fold``, in the fold files' id order.

    Every id of the fold must be among ``essays`` (pass all essays and select with
    ``prompt``, not a pre-filtered list), else ValueError. ``prompt`` keeps only that prompt's
    essays. Essays in no split of the fold are left out.
    """
    if fold not in folds:
        raise ValueError(f"fold {fold} not in folds (have {sorted(folds)})")
    if prompt is not None and prompt not in SCORE_RANGES:
        raise ValueError(f"unknown prompt {prompt} (known: 1-8)")
    by_id: dict[int, Essay] = {}
    for e in essays:
        if e.essay_id in by_id:
            raise ValueError(f"essay_id {e.essay_id} appears twice in essays")
        by_id[e.essay_id] = e
    out: dict[str, list[Essay]] = {}
    for split in SPLITS:
        ids = folds[fold][split]
        missing = [i for i in ids if i not in by_id]
        if missing:
            raise ValueError(
                f"fold {fold} {split}: {len(missing)} essay ids not among the essays (e.g. {missing[:5]})"
            )
        chosen = [by_id[i] for i in ids]
        if prompt is not None:
            chosen = [e for e in chosen if e.prompt == prompt]
        out[split] = chosen
    return out


# ---------------------------------------------------------------------------------------------
# Score scaling
# ---------------------------------------------------------------------------------------------


def _range(prompt: int) -> tuple[int, int]:
    try:
        return SCORE_RANGES[int(prompt)]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"unknown prompt {prompt!r} (known: 1-8)") from None


def normalise_score(score: float, prompt: int) -> float:
    """``(score - lo) / (hi - lo)`` with ``(lo, hi) = SCORE_RANGES[prompt]``: a value in [0, 1].

    A score outside ``[lo, hi]`` (or NaN) raises ValueError.
    """
    lo, hi = _range(prompt)
    s = float(score)
    if not lo <= s <= hi:
        raise ValueError(f"score {score!r} outside {lo}..{hi} for prompt {prompt}")
    return (s - lo) / (hi - lo)


def denormalise_score(x: float, prompt: int) -> int:
    """``floor(lo + clip(x, 0, 1) * (hi - lo) + 0.5)``: clip, scale, round half up.

    Clipping first makes the scaled value non-negative, so "half up" is "half away from
    zero" (2.5 -> 3, 3.5 -> 4), unlike Python's ``round`` and ``numpy.rint`` (half to even).
    The result is always in ``[lo, hi]``. NaN raises ValueError. Ties are judged on the
    float value, so ``lo + x * (hi - lo)`` that lands a rounding error below .5 rounds down.
    Inverse of :func:`normalise_score` on integer scores.
    """
    lo, hi = _range(prompt)
    v = float(x)
    if math.isnan(v):
        raise ValueError("cannot denormalise NaN")
    v = min(max(v, 0.0), 1.0)
    return min(max(int(math.floor(lo + v * (hi - lo) + 0.5)), lo), hi)


def denormalise_scores(xs: object, prompt: int) -> np.ndarray:
    """Vectorised :func:`denormalise_score` on an array-like (numpy, list, CPU tensor): int64 array."""
    lo, hi = _range(prompt)
    a = np.asarray(xs, dtype=np.float64)
    if np.isnan(a).any():
        raise ValueError("cannot denormalise NaN")
    out = np.floor(lo + np.clip(a, 0.0, 1.0) * (hi - lo) + 0.5).astype(np.int64)
    return np.clip(out, lo, hi)
