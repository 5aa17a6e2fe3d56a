"""Readers that turn GED evaluation files into token-labelled sentences.

Every reader returns a list of :class:`Sentence`: whitespace-free tokens with one binary label per
token, ``1`` = the token is part of an error (FCE ``i``), ``0`` = correct (FCE ``c``).

Formats and labelling rules
---------------------------

**FCE TSV** (:func:`read_fce_tsv`, Rei & Yannakoudakis 2016): one ``TOKEN<TAB>LABEL`` line per token,
``LABEL`` is ``c`` or ``i``, a blank line between sentences. The labels are taken as they are.

**M2** (:func:`read_m2`, CoNLL-2014 and BEA style): an ``S tok tok ...`` line, then zero or more
``A start end|||type|||correction|||REQUIRED|||-NONE-|||annotator`` lines, then a blank line. Labels
follow the FCE convention:

* every token in an edit span ``[start, end)`` is an error;
* an insertion (``start == end``) marks the token that follows it, i.e. token ``start``, or the last
  token when the insertion is at the end of the sentence (``start == len(tokens)``);
* ``noop`` edits (type ``noop``, or span ``-1 -1``) are ignored;
* only edits of the chosen annotator id are used (``annotator=None``: the union of all annotators).

**JFLEG** (:func:`read_jfleg`, :func:`read_jfleg_split`): a source file and N reference files, one
pre-tokenised sentence per line, line *k* of each file aligned. JFLEG has no edit annotation, so labels
are derived by aligning the source tokens with each reference separately, using token-level Levenshtein
distance (unit cost for insert, delete and replace; the alignment is the one
``rapidfuzz.distance.Levenshtein.opcodes`` returns when several have the same cost). Then:

* a source token is an error if **any** reference replaces or deletes it;
* an insertion before source token ``i`` marks token ``i``; an insertion after the last source token
  marks the last token;
* a source sentence identical to every reference is all-correct.

Tokens are compared exactly (case-sensitive). Tokenisation is ``str.split()`` on whitespace (the files
are pre-tokenised).

**Unlabelled sentences** (:func:`read_unlabelled`): one pre-tokenised sentence per line and no
labels, the transfer set of knowledge distillation (a teacher's probabilities are their only
targets). It returns token tuples, not :class:`Sentence`.

Files are read as bytes and decoded as strict UTF-8 (a leading UTF-8 BOM is dropped); LF and CRLF line
endings are both accepted. Malformed input raises :class:`DataFormatError` with ``<path>:<line>:`` in
the message; nothing is silently skipped. Sentences with zero tokens can only come from an ``S`` line
with no tokens (M2) or a blank source line (JFLEG); they are returned with empty ``tokens``/``labels``.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Union

__all__ = [
    "DataFormatError",
    "Sentence",
    "corpus_stats",
    "read_fce_tsv",
    "read_ged",
    "read_jfleg",
    "read_jfleg_split",
    "read_m2",
    "read_unlabelled",
    "require_rapidfuzz",
    "sentences_digest",
]

PathLike = Union[str, os.PathLike]

_BOM = b"\xef\xbb\xbf"
_FCE_LABELS = {"c": 0, "i": 1}


class DataFormatError(ValueError):
    """A data file does not follow its format. ``str(err)`` is ``"<path>:<line>: <what is wrong>"``.

    ``line`` is 1-based; it is ``None`` for problems that concern a whole file (then the message is
    ``"<path>: <what is wrong>"``).
    """

    def __init__(self, path: PathLike, line: int | None, message: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = message
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class Sentence:
    """One tokenised sentence with per-token error labels.

    ``labels[k]`` is 1 if ``tokens[k]`` is (part of) an error and 0 if it is correct;
    ``len(labels) == len(tokens)``. ``source`` is the path of the file the sentence was read from and
    ``line`` the 1-based line where the sentence starts in it (the ``S`` line for M2, the line in the
    ``.src`` file for JFLEG).
    """

    tokens: tuple[str, ...]
    labels: tuple[int, ...]
    source: str
    line: int

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.labels):
            raise ValueError(
                f"{self.source}:{self.line}: {len(self.tokens)} tokens but {len(self.labels)} labels"
            )

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def has_error(self) -> bool:
        """True when at least one token is labelled as an error."""
        return any(self.labels)


def corpus_stats(sentences: Iterable[Sentence]) -> dict[str, float]:
    """Counts of a labelled corpus: sentences, tokens, error tokens, error-token rate (error/tokens,
    0 for no tokens) and sentences with at least one error."""
    n_sent = n_tok = n_err = n_err_sent = 0
    for s in sentences:
        n_sent += 1
        n_tok += len(s.labels)
        e = sum(s.labels)
        n_err += e
        n_err_sent += e > 0
    return {
        "sentences": n_sent,
        "tokens": n_tok,
        "error_tokens": n_err,
        "error_rate": n_err / n_tok if n_tok else 0.0,
        "sentences_with_error": n_err_sent,
    }


# ---------------------------------------------------------------------------------------------------
# shared file reading


def sentences_digest(sentences: Iterable[Sentence]) -> str:
    """A sha256 fingerprint of sentences as read: every token and label, in order (not the file
    they came from, so a moved or re-encoded file with the same content has the same digest)."""
    h = hashlib.sha256()
    for s in sentences:
        h.update(hashlib.sha256("\0".join(s.tokens).encode("utf-8", "surrogatepass")).digest())
        h.update(bytes(s.labels) + b"\xff")
    return h.hexdigest()


def _read_lines(path: Path) -> list[str]:
    """Lines of a strict-UTF-8 file, without their ``\\n`` / ``\\r\\n`` ends.

    Split only on ``\\n`` (not ``str.splitlines``, which also splits on form feeds, U+2028 etc. and
    would shift line numbers). A final line break does not start an extra empty line. An undecodable
    byte raises :class:`DataFormatError` with the line that holds it.
    """
    data = path.read_bytes()
    offset = 0
    if data.startswith(_BOM):
        data = data[len(_BOM) :]
        offset = len(_BOM)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        bad = data[err.start : err.end]
        raise DataFormatError(
            path,
            line,
            f"invalid UTF-8 byte(s) {bad!r} at byte offset {err.start + offset} ({err.reason})",
        ) from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [ln[:-1] if ln.endswith("\r") else ln for ln in lines]


# ---------------------------------------------------------------------------------------------------
# FCE TSV


def read_fce_tsv(path: PathLike) -> list[Sentence]:
    """Read an FCE error-detection TSV: ``TOKEN<TAB>c|i`` per line, blank line between sentences.

    ``c`` -> 0, ``i`` -> 1. A blank (empty or whitespace-only, no tab) line ends a sentence; several
    blank lines in a row are allowed, and the last sentence need not be followed by one.
    Raises :class:`DataFormatError` for: a line without a tab (missing label column), more than two
    columns, an empty or whitespace-only token, a label other than ``c``/``i`` (exact, case-sensitive),
    and invalid UTF-8.
    """
    p = Path(path)
    src = str(p)
    sentences: list[Sentence] = []
    tokens: list[str] = []
    labels: list[int] = []
    start = 0
    for lineno, line in enumerate(_read_lines(p), start=1):
        if "\t" not in line and not line.strip():
            if tokens:
                sentences.append(Sentence(tuple(tokens), tuple(labels), src, start))
                tokens, labels = [], []
            continue
        cols = line.split("\t")
        if len(cols) < 2:
            raise DataFormatError(p, lineno, f"missing label column (no tab) in {line!r}")
        if len(cols) > 2:
            raise DataFormatError(p, lineno, f"expected 2 tab-separated columns, got {len(cols)}")
        token, label = cols
        if not token.strip():
            raise DataFormatError(p, lineno, "empty token")
        if label not in _FCE_LABELS:
            raise DataFormatError(p, lineno, f"label must be 'c' or 'i', got {label!r}")
        if not tokens:
            start = lineno
        tokens.append(token)
        labels.append(_FCE_LABELS[label])
    if tokens:
        sentences.append(Sentence(tuple(tokens), tuple(labels), src, start))
    return sentences


# ---------------------------------------------------------------------------------------------------
# M2


def _int_field(p: Path, lineno: int, text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise DataFormatError(p, lineno, f"{what} is not an integer: {text!r}") from None


def _mark_edit(labels: list[int], start: int, end: int) -> None:
    """FCE convention: tokens in ``[start, end)`` are errors; an insertion (start == end) marks token
    ``start``, or the last token when ``start == len(labels)``."""
    n = len(labels)
    if start == end:
        if n:
            labels[min(start, n - 1)] = 1
    else:
        for k in range(start, end):
            labels[k] = 1


def read_m2(path: PathLike, annotator: int | None = 0) -> list[Sentence]:
    """Read an M2 file and derive token labels from the edits of one annotator (FCE convention).

    Tokens inside an edit span ``[start, end)`` are errors; an insertion (``start == end``) marks the
    token that follows it (the last token if the insertion is at sentence end); ``noop`` edits (type
    ``noop`` or span ``-1 -1``) are ignored. ``annotator``: keep only edits whose last field equals this
    id; ``None`` keeps the union of all annotators. In the CoNLL-14 per-annotator files
    ``official-2014.0.m2`` / ``official-2014.1.m2`` each annotator has id 0.

    Every ``A`` line is validated, whatever its annotator. Raises :class:`DataFormatError` for: an ``A``
    line with no preceding ``S`` line in the same block, a line that is neither ``S``, ``A`` nor blank,
    a field count other than 6, a span that is not two integers, a bad span (``start > end``, a negative
    index other than noop ``-1 -1``), a span past the sentence end, a non-integer annotator id, and
    invalid UTF-8. A new ``S`` line directly after an ``A`` line (no blank line) starts a new sentence.
    ValueError when the file has ``A`` lines but none of ``annotator``'s.
    """
    p = Path(path)
    src = str(p)
    sentences: list[Sentence] = []
    tokens: list[str] | None = None
    labels: list[int] = []
    start_line = 0
    annotators: set[int] = set()

    def flush() -> None:
        if tokens is not None:
            sentences.append(Sentence(tuple(tokens), tuple(labels), src, start_line))

    for lineno, line in enumerate(_read_lines(p), start=1):
        if not line.strip():
            flush()
            tokens = None
            continue
        if line == "S" or line.startswith("S "):
            flush()
            tokens = line[1:].split()
            labels = [0] * len(tokens)
            start_line = lineno
            continue
        if not line.startswith("A "):
            raise DataFormatError(
                p, lineno, f"expected an 'S ' or 'A ' line or a blank line, got {line[:40]!r}"
            )
        if tokens is None:
            raise DataFormatError(p, lineno, "'A' line before any 'S' line of its sentence")
        fields = line.split("|||")
        if len(fields) != 6:
            raise DataFormatError(p, lineno, f"expected 6 '|||'-separated fields, got {len(fields)}")
        span = fields[0].split()
        if len(span) != 3:
            raise DataFormatError(p, lineno, f"span must be 'A <start> <end>', got {fields[0]!r}")
        start = _int_field(p, lineno, span[1], "span start")
        end = _int_field(p, lineno, span[2], "span end")
        ann = _int_field(p, lineno, fields[5].strip(), "annotator id")
        annotators.add(ann)
        etype = fields[1].strip()
        if start == -1 and end == -1:
            is_noop = True
        else:
            if start < 0 or end < start:
                raise DataFormatError(p, lineno, f"bad span {start} {end}")
            if end > len(tokens):
                raise DataFormatError(
                    p, lineno, f"span {start} {end} out of range for a sentence of {len(tokens)} tokens"
                )
            is_noop = etype.lower() == "noop"
        if is_noop or (annotator is not None and ann != annotator):
            continue
        _mark_edit(labels, start, end)
    flush()
    if annotator is not None and annotators and annotator not in annotators:
        # every label would be "correct": a clean-looking 0 rather than an error
        raise ValueError(f"{p}: no edit is by annotator {annotator}; its annotator ids are "
                         f"{', '.join(map(str, sorted(annotators)))}")
    return sentences


# ---------------------------------------------------------------------------------------------------
# JFLEG


def require_rapidfuzz():
    """Return ``rapidfuzz.distance.Levenshtein``, which labels JFLEG; ImportError saying how
    to install rapidfuzz when it is missing (a caller can check this before slower work)."""
    try:
        from rapidfuzz.distance import Levenshtein
    except ImportError as err:
        raise ImportError("JFLEG labels need rapidfuzz (it aligns the source with the "
                          "references), which is not installed: pip install rapidfuzz "
                          "(or pip install 'mhmla-fast[data]')") from err
    return Levenshtein


def _jfleg_labels(src: Sequence[int], refs: Iterable[Sequence[int]]) -> list[int]:
    """Labels of one source sentence against its references (rule in the module docstring)."""
    Levenshtein = require_rapidfuzz()

    n = len(src)
    labels = [0] * n
    for ref in refs:
        if ref == src:
            continue
        for op in Levenshtein.opcodes(src, ref):
            tag = op.tag
            if tag == "equal":
                continue
            if tag == "insert":
                if n:
                    labels[min(op.src_start, n - 1)] = 1
            else:  # "replace" or "delete"
                for k in range(op.src_start, op.src_end):
                    labels[k] = 1
    return labels


def read_jfleg(source_path: PathLike, reference_paths: Sequence[PathLike]) -> list[Sentence]:
    """Read JFLEG-style parallel files and label source tokens by alignment with every reference.

    A source token is an error if any reference replaces or deletes it in the token-level Levenshtein
    alignment; an insertion before source token ``i`` marks token ``i`` (after the last token: the last
    token). Identical sentences are all-correct. One sentence per line; tokens are ``line.split()``.
    Raises :class:`DataFormatError` if a reference file has a different number of lines than the
    source (the message names the file and both counts), and ``ValueError`` if no reference is given.
    """
    sp = Path(source_path)
    if not reference_paths:
        raise ValueError(f"{sp}: read_jfleg needs at least one reference file")
    src_lines = _read_lines(sp)
    ref_lines: list[list[str]] = []
    for rp in map(Path, reference_paths):
        lines = _read_lines(rp)
        if len(lines) != len(src_lines):
            raise DataFormatError(
                rp, None, f"reference has {len(lines)} lines but source {sp} has {len(src_lines)} lines"
            )
        ref_lines.append(lines)

    sentences: list[Sentence] = []
    for k, line in enumerate(src_lines):
        tokens = line.split()
        # Map tokens to integer ids so the alignment compares tokens exactly (no hashing of strings).
        vocab: dict[str, int] = {}
        src_ids = [vocab.setdefault(t, len(vocab)) for t in tokens]
        ref_ids = ([vocab.setdefault(t, len(vocab)) for t in refs[k].split()] for refs in ref_lines)
        labels = _jfleg_labels(src_ids, ref_ids)
        sentences.append(Sentence(tuple(tokens), tuple(labels), str(sp), k + 1))
    return sentences


_REF_RE = re.compile(r"\.ref(\d+)$")


def _jfleg_files(split: PathLike) -> tuple[Path, Path]:
    """(source file, reference prefix) for a split directory, a ``<split>`` prefix or a ``.src`` path."""
    p = Path(split)
    if p.is_dir():
        src = p / f"{p.name}.src"
        if not src.is_file():
            cands = sorted(c for c in p.glob("*.src") if not c.name.endswith(".spellchecked.src"))
            if len(cands) != 1:
                raise FileNotFoundError(
                    f"{p}: expected {p.name}.src or exactly one *.src file, found {[c.name for c in cands]}"
                )
            src = cands[0]
    elif p.name.endswith(".src"):
        src = p
    else:
        src = p.with_name(p.name + ".src")
    if not src.is_file():
        raise FileNotFoundError(f"JFLEG source file not found: {src}")
    stem = src.name[: -len(".src")]
    if stem.endswith(".spellchecked"):
        stem = stem[: -len(".spellchecked")]
    return src, src.with_name(stem)


def read_jfleg_split(split_dir_or_prefix: PathLike, *, expect_refs: int | None = 4) -> list[Sentence]:
    """Read one JFLEG split with :func:`read_jfleg`, finding its files.

    Accepts the split directory (``jfleg/test``, reads ``test/test.src``), the prefix
    (``jfleg/test/test``) or a source file (``jfleg/test/test.src``; also ``test.spellchecked.src``,
    which is then aligned with the same ``test.ref*`` files). References are all files
    ``<prefix>.ref<N>`` beside the source, in numeric order of N. ``expect_refs`` (default 4, as in
    JFLEG): raise ``FileNotFoundError`` unless exactly that many are found; ``None`` accepts any
    number >= 1.

    Caution: in the official JFLEG release ``test.spellchecked.src`` is entirely lower-cased (``dev``'s
    is not), and the comparison is case-sensitive, so with it every capitalised token of the test set
    counts as an error. Use ``test.src`` (the default) for GED labels.
    """
    src, prefix = _jfleg_files(split_dir_or_prefix)
    refs: list[tuple[int, Path]] = []
    for c in src.parent.glob(prefix.name + ".ref*"):
        m = _REF_RE.search(c.name)
        if m and c.name == f"{prefix.name}.ref{m.group(1)}" and c.is_file():
            refs.append((int(m.group(1)), c))
    refs.sort()
    if not refs or (expect_refs is not None and len(refs) != expect_refs):
        want = f"{expect_refs}" if expect_refs is not None else "at least 1"
        raise FileNotFoundError(f"{prefix}.ref*: expected {want} reference files, found {len(refs)}")
    return read_jfleg(src, [c for _, c in refs])


# ---------------------------------------------------------------------------------------------------
# unlabelled sentences (a distillation transfer set)


def read_unlabelled(path: PathLike) -> list[tuple[str, ...]]:
    """Unlabelled sentences: one per line, tokens separated by whitespace (``str.split``), as in a
    JFLEG ``.src`` file. For sentences whose only targets are a teacher's probabilities
    (``mhmla-train ged --transfer``). A line with no token raises :class:`DataFormatError`:
    nothing is skipped."""
    p = Path(path)
    out = []
    for lineno, line in enumerate(_read_lines(p), 1):
        tokens = tuple(line.split())
        if not tokens:
            raise DataFormatError(p, lineno, "an empty line (expected one sentence per line)")
        out.append(tokens)
    return out


# ---------------------------------------------------------------------------------------------------
# dispatch


def _detect_format(p: Path) -> str:
    if p.is_dir():
        return "jfleg"
    suffix = p.suffix.lower()
    if suffix == ".tsv":
        return "fce"
    if suffix == ".m2":
        return "m2"
    if suffix == ".src" or (not p.exists() and p.with_name(p.name + ".src").is_file()):
        return "jfleg"
    raise ValueError(
        f"{p}: cannot tell the GED format from the name (.tsv = FCE, .m2 = M2, .src / split folder / "
        "split prefix = JFLEG); give the file such a name (from Python, read_ged(..., fmt='fce', "
        "'m2' or 'jfleg') reads any name)"
    )


def read_ged(path: PathLike, *, annotator: int | None = 0, fmt: str = "auto") -> list[Sentence]:
    """Read any supported GED evaluation file into labelled sentences.

    ``fmt="auto"`` chooses by name: ``*.tsv`` -> :func:`read_fce_tsv`, ``*.m2`` -> :func:`read_m2`
    (with ``annotator``), a ``*.src`` file, a split folder or a split prefix -> :func:`read_jfleg_split`.
    ``fmt`` may also be ``"fce"``, ``"m2"`` or ``"jfleg"``. ``annotator`` is used only for M2
    (another id than 0 for other data raises ValueError).
    """
    p = Path(path)
    kind = _detect_format(p) if fmt == "auto" else fmt
    if kind in ("fce", "jfleg") and annotator not in (0, None):
        raise ValueError(f"annotator: {annotator} given, but {p} is read as {kind.upper()} "
                         "data, which has no annotators (annotator ids are for M2 files)")
    if kind == "fce":
        return read_fce_tsv(p)
    if kind == "m2":
        return read_m2(p, annotator=annotator)
    if kind == "jfleg":
        return read_jfleg_split(p)
    raise ValueError(f"unknown GED format {fmt!r} (expected 'auto', 'fce', 'm2' or 'jfleg')")
