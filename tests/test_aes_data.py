"""Tests for mhmla_fast.aes.data: ASAP reader, folds, score scaling.

All fixtures are synthetic and written by the tests; the real ASAP data is only read (never
copied) by the tests at the end, which skip when the shared data folder is absent.
"""

from __future__ import annotations

import csv
import io
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from mhmla_fast.aes.data import (
    ASAP_COLUMNS,
    SCORE_RANGES,
    SPLITS,
    BadRow,
    DataFormatError,
    Essay,
    denormalise_score,
    denormalise_scores,
    normalise_score,
    read_asap,
    read_folds,
    split_essays,
)
from mhmla_fast.paths import shared_data_dir

HEADER = "\t".join(ASAP_COLUMNS)


def row(essay_id: object, prompt: object, text: str, score: object, r1: object = "", r2: object = "",
        n_fields: int = 28) -> str:
    """A synthetic 28-field row in Kaggle column order (no line ending)."""
    fields = [""] * n_fields
    fields[0], fields[1], fields[2] = str(essay_id), str(prompt), text
    if n_fields > 6:
        fields[3], fields[4], fields[6] = str(r1), str(r2), str(score)
    return "\t".join(fields)


# Line numbers (1-based) of the good fixture.
GOOD_LINES = [
    HEADER + "\n",                                                             # 1 header, LF
    row(11, 1, '"Dear ""editor"", computers, help."', 8, 4, 4) + "\n",         # 2 LF row, wrapped
    row(12, 2, "A plain essay without quotes.", 3, 3, 3) + "\r\n",             # 3 CRLF
    row(13, 3, '"An unclosed quote that runs to the end', 2, 2, 2) + "\r\n",   # 4 unclosed "
    row(14, 3, '"Next essay, wrapped."', 1, 1, 1) + "\r\n",                     # 5
    row(15, 4, "Replacement \ufffd char and caf\u00e9 \u201cquotes\u201d", 0, 0, 0) + "\r\n",  # 6
    row(16, 8, "Rater two missing.", 60, 30, "") + "\r\n",                     # 7
    "\r\n",                                                                    # 8 blank, skipped
    row(17, 7, '"', 30, 15, 15) + "\r\n",                                      # 9 a lone quote
]


def write(tmp_path: Path, lines: list[str] | bytes, name: str = "asap.tsv") -> Path:
    p = tmp_path / name
    p.write_bytes(lines if isinstance(lines, bytes) else "".join(lines).encode("utf-8"))
    return p


def test_reader_on_synthetic_fixture(tmp_path: Path) -> None:
    p = write(tmp_path, GOOD_LINES)
    essays = read_asap(p)
    assert [e.essay_id for e in essays] == [11, 12, 13, 14, 15, 16, 17]
    by_id = {e.essay_id: e for e in essays}
    assert by_id[11] == Essay(11, 1, 'Dear "editor", computers, help.', 8, 4, 4, 2)
    assert by_id[12] == Essay(12, 2, "A plain essay without quotes.", 3, 3, 3, 3)
    # The unclosed quote is kept as is and does not swallow the next rows.
    assert by_id[13].text == '"An unclosed quote that runs to the end'
    assert by_id[13].line == 4
    assert (by_id[14].text, by_id[14].line, by_id[14].prompt) == ("Next essay, wrapped.", 5, 3)
    assert by_id[15].text == "Replacement \ufffd char and caf\u00e9 \u201cquotes\u201d"
    assert by_id[15].line == 6
    assert (by_id[16].rater1, by_id[16].rater2, by_id[16].score) == (30, None, 60)
    assert by_id[17].text == '"' and by_id[17].line == 9  # too short to be a wrapped pair
    assert not any(e.text.endswith("\r") or "\n" in e.text for e in essays)


def test_quote_aware_csv_would_merge_rows(tmp_path: Path) -> None:
    """Why the reader must not use quote handling: csv merges the rows after the unclosed quote."""
    text = "".join(GOOD_LINES)
    merged = [r for r in csv.reader(io.StringIO(text, newline=""), delimiter="\t") if r]
    assert [r[0] for r in merged[1:]] == ["11", "12", "13", "15", "16", "17"]  # 14 swallowed by 13
    assert [e.essay_id for e in read_asap(write(tmp_path, GOOD_LINES))] == [11, 12, 13, 14, 15, 16, 17]


def test_unquote_false_keeps_raw_text(tmp_path: Path) -> None:
    essays = read_asap(write(tmp_path, GOOD_LINES), unquote=False)
    assert essays[0].text == '"Dear ""editor"", computers, help."'
    assert essays[3].text == '"Next essay, wrapped."'


def test_columns_found_by_header_name(tmp_path: Path) -> None:
    header = "domain1_score\tessay\tRATER2_DOMAIN1\tessay_set\t rater1_domain1 \tessay_id\textra"
    lines = [
        "\ufeff" + header + "\r\n",
        "\t".join(["5", "Shuffled columns.", "3", "2", "2", "42", "x"]) + "\r\n",
    ]
    (e,) = read_asap(write(tmp_path, lines))
    assert e == Essay(42, 2, "Shuffled columns.", 5, 2, 3, 2)


def test_headerless_file_uses_kaggle_order(tmp_path: Path) -> None:
    essays = read_asap(write(tmp_path, GOOD_LINES[1:3]))
    assert [(e.essay_id, e.line) for e in essays] == [(11, 1), (12, 2)]


def test_missing_column_and_empty_file(tmp_path: Path) -> None:
    with pytest.raises(DataFormatError, match=r"lacks column\(s\) domain1_score"):
        read_asap(write(tmp_path, ["essay_id\tessay_set\tessay\trater1_domain1\trater2_domain1\n"]))
    with pytest.raises(DataFormatError, match="empty"):
        read_asap(write(tmp_path, ["\r\n", "\n"], "empty.tsv"))


BAD_LINES = [
    HEADER + "\n",                                          # 1
    row(21, 1, "good one", 7, 3, 4) + "\r\n",               # 2
    row(22, 3, "score too high for prompt 3", 5, 2, 3) + "\r\n",  # 3 bad score
    row(23, 1, "too few fields", 7, n_fields=5) + "\r\n",   # 4 column count
    row("x24", 1, "id not an integer", 7) + "\r\n",         # 5
    row(25, 9, "unknown prompt", 1) + "\r\n",               # 6
    row(26, 2, "score 2.5", "2.5") + "\r\n",                # 7
    row(27, 2, "rater not int", 3, "three", 3) + "\r\n",    # 8
    row(21, 2, "duplicate id", 3) + "\r\n",                 # 9
    row(28, 2, "missing score", "") + "\r\n",               # 10
    row(29, 4, "good two", 1, 1, 1) + "\n",                 # 11
]


def bad_file(tmp_path: Path) -> Path:
    data = "".join(BAD_LINES).encode("utf-8")
    # line 12: invalid UTF-8 inside an otherwise fine row
    data += row(30, 5, "byte \x00 here", 2).encode("utf-8").replace(b"\x00", b"\xff\xfe") + b"\r\n"
    data += row(31, 6, "good three", 4, 4, 4).encode("utf-8") + b"\r\n"  # line 13
    return write(tmp_path, data, "bad.tsv")


def test_bad_score_raises_with_file_and_line(tmp_path: Path) -> None:
    p = bad_file(tmp_path)
    with pytest.raises(DataFormatError) as info:
        read_asap(p)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.line == 3 and err.path == str(p)
    assert str(err).startswith(f"{p}:3: ")
    assert "domain1_score 5 outside 0..3 for prompt 3" in str(err)


def test_collect_mode_lists_bad_rows(tmp_path: Path) -> None:
    p = bad_file(tmp_path)
    essays, bad = read_asap(p, errors="collect")
    assert [(e.essay_id, e.line) for e in essays] == [(21, 2), (29, 11), (31, 13)]
    assert all(isinstance(b, BadRow) and b.path == str(p) for b in bad)
    got = {b.line: (b.essay_id, b.reason) for b in bad}
    assert sorted(got) == [3, 4, 5, 6, 7, 8, 9, 10, 12]
    assert got[3][0] == 22 and "outside 0..3" in got[3][1]
    assert "expected 28 tab-separated fields, found 5" in got[4][1]
    assert got[5] == (None, "essay_id 'x24' is not an integer")
    assert "unknown essay_set 9" in got[6][1]
    assert "domain1_score '2.5' is not an integer" in got[7][1]
    assert "rater1_domain1 'three' is not an integer" in got[8][1]
    assert got[9] == (21, "duplicate essay_id 21 (first on line 2)")
    assert "domain1_score '' is not an integer" in got[10][1]
    assert got[12][0] is None and "undecodable bytes for utf-8" in got[12][1]
    assert str(bad[0]) == f"{p}:3: {got[3][1]}"
    with pytest.raises(ValueError, match="errors must be"):
        read_asap(p, errors="ignore")  # type: ignore[call-overload]


def test_cp1252_encoding(tmp_path: Path) -> None:
    data = (HEADER + "\r\n" + row(1, 1, "caf\u00e9 \u201cq\u201d", 6, 3, 3) + "\r\n").encode("cp1252")
    p = write(tmp_path, data)
    assert read_asap(p, encoding="cp1252")[0].text == "caf\u00e9 \u201cq\u201d"
    with pytest.raises(DataFormatError, match=r":2: undecodable bytes for utf-8"):
        read_asap(p)


def test_a_byte_order_mark_on_a_header_less_file_keeps_its_first_essay(tmp_path: Path) -> None:
    data = ("\ufeff" + row(1, 1, "first", 6, 3, 3) + "\n" + row(2, 1, "second", 5) + "\n")
    p = write(tmp_path, data.encode("utf-8"))
    assert [(e.essay_id, e.text) for e in read_asap(p)] == [(1, "first"), (2, "second")]


def test_kaggles_original_file_is_read_as_cp1252(tmp_path: Path) -> None:
    """The folder holding Kaggle's training_set_rel3.tsv (cp1252), not NEA's UTF-8 copy: the
    protocols read it in its own encoding (they stopped at its first curly quote before)."""
    from mhmla_fast.aes.splits import read_asap_essays, read_asap_folds

    d = tmp_path / "asap_aes"
    d.mkdir()
    (d / "training_set_rel3.tsv").write_bytes(
        (HEADER + "\r\n" + row(1, 1, "it\u2019s caf\u00e9", 6, 3, 3) + "\r\n").encode("cp1252"))
    for split, ids in {"train": "1", "dev": "", "test": ""}.items():
        (d / "nea_folds" / "fold_0").mkdir(parents=True, exist_ok=True)
        (d / "nea_folds" / "fold_0" / f"{split}_ids.txt").write_text(ids + "\n")
    assert [e.text for e in read_asap_essays(tmp_path)] == ["it\u2019s caf\u00e9"]
    essays, folds = read_asap_folds(tmp_path)
    assert len(essays) == 1 and folds[0]["train"] == [1]


# --------------------------------------------------------------------------------------------
# Folds
# --------------------------------------------------------------------------------------------


def make_folds(root: Path, folds: dict[int, dict[str, list[int]]]) -> Path:
    for k, splits in folds.items():
        d = root / f"fold_{k}"
        d.mkdir(parents=True)
        for split, ids in splits.items():
            (d / f"{split}_ids.txt").write_text("".join(f"{i}\n" for i in ids))
    return root


def synthetic_essays() -> list[Essay]:
    return [Essay(i, 1 if i <= 5 else 2, f"essay {i}", 5 if i <= 5 else 3, None, None, i + 1)
            for i in range(1, 11)]


FOLDS = {
    0: {"train": [5, 1, 2, 6, 7, 8], "dev": [3, 9], "test": [4, 10]},
    1: {"train": [3, 9, 4, 10, 1, 6], "dev": [2, 7], "test": [5, 8]},
}


def test_read_folds_and_split(tmp_path: Path) -> None:
    root = make_folds(tmp_path / "folds", FOLDS)
    (root / "notes").mkdir()  # ignored
    (root / "README.txt").write_text("ignored")
    folds = read_folds(root)
    assert folds == FOLDS and list(folds) == [0, 1]
    essays = synthetic_essays()
    sp = split_essays(essays, folds, 0)
    assert list(sp) == list(SPLITS)
    assert [e.essay_id for e in sp["train"]] == [5, 1, 2, 6, 7, 8]  # fold-file order
    sp2 = split_essays(essays, folds, 0, prompt=2)
    assert {k: [e.essay_id for e in v] for k, v in sp2.items()} == {
        "train": [6, 7, 8], "dev": [9], "test": [10]}
    with pytest.raises(ValueError, match="not among the essays"):
        split_essays([e for e in essays if e.prompt == 1], folds, 0)
    with pytest.raises(ValueError, match="fold 7 not in folds"):
        split_essays(essays, folds, 7)
    with pytest.raises(ValueError, match="unknown prompt"):
        split_essays(essays, folds, 0, prompt=9)


def test_read_folds_errors(tmp_path: Path) -> None:
    root = make_folds(tmp_path / "a", {0: {"train": [1, 2], "dev": [3], "test": [4]}})
    (root / "fold_0" / "dev_ids.txt").write_text("3\r\n\nx7\n")
    with pytest.raises(DataFormatError, match=r"dev_ids.txt:3: essay id b'x7' is not an integer"):
        read_folds(root)
    (root / "fold_0" / "dev_ids.txt").write_text("3\n2\n")
    with pytest.raises(DataFormatError, match="fold 0: 1 essay ids in both train and dev"):
        read_folds(root)
    (root / "fold_0" / "dev_ids.txt").write_text("3\n3\n")
    with pytest.raises(DataFormatError, match=r":2: duplicate essay id 3"):
        read_folds(root)
    (root / "fold_0" / "dev_ids.txt").unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        read_folds(root)
    with pytest.raises(FileNotFoundError):
        read_folds(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no fold_"):
        read_folds(tmp_path / "empty")


# --------------------------------------------------------------------------------------------
# Score scaling
# --------------------------------------------------------------------------------------------


def test_normalise_roundtrip_every_score() -> None:
    for prompt, (lo, hi) in SCORE_RANGES.items():
        assert normalise_score(lo, prompt) == 0.0 and normalise_score(hi, prompt) == 1.0
        for s in range(lo, hi + 1):
            x = normalise_score(s, prompt)
            assert 0.0 <= x <= 1.0
            assert denormalise_score(x, prompt) == s
        xs = [normalise_score(s, prompt) for s in range(lo, hi + 1)]
        assert denormalise_scores(np.array(xs), prompt).tolist() == list(range(lo, hi + 1))


def test_denormalise_rounds_half_up_and_clips() -> None:
    assert denormalise_score(0.25, 1) == 5      # 2 + 2.5 -> 5 (rint would give 4)
    assert denormalise_score(0.5, 2) == 4       # 1 + 2.5 -> 4
    assert denormalise_score(0.5, 3) == 2       # 1.5 -> 2
    assert denormalise_score(0.125, 8) == 8     # 7.5 -> 8
    assert denormalise_score(0.24, 1) == 4      # 4.4 -> 4
    assert denormalise_score(-3.0, 1) == 2 and denormalise_score(7.0, 1) == 12
    assert denormalise_scores([0.25, -1, 2, 0.5], 1).tolist() == [5, 2, 12, 7]
    rng = np.random.default_rng(0)
    xs = rng.uniform(-0.2, 1.2, size=500)
    for prompt in SCORE_RANGES:
        assert denormalise_scores(xs, prompt).tolist() == [denormalise_score(x, prompt) for x in xs]
    with pytest.raises(ValueError):
        denormalise_score(float("nan"), 1)
    with pytest.raises(ValueError):
        normalise_score(13, 1)
    with pytest.raises(ValueError, match="unknown prompt"):
        normalise_score(1, 0)


# --------------------------------------------------------------------------------------------
# Real data (read in place; skipped when the shared folder is absent)
# --------------------------------------------------------------------------------------------

ASAP_DIR = shared_data_dir() / "asap_aes"
ASAP_TSV = ASAP_DIR / "training_set_rel3.nea_utf8.tsv"
FOLDS_DIR = ASAP_DIR / "nea_folds"
needs_data = pytest.mark.skipif(
    not (ASAP_TSV.is_file() and FOLDS_DIR.is_dir()),
    reason=f"ASAP data not found at {ASAP_DIR} (set MHMLA_SHARED_DATA to the shared data folder)",
)


@pytest.fixture(scope="module")
def real_essays() -> list[Essay]:
    return read_asap(ASAP_TSV)


@needs_data
def test_real_asap_counts(real_essays: list[Essay]) -> None:
    essays = real_essays
    assert len(essays) == 12_978
    counts = Counter(e.prompt for e in essays)
    assert [counts[p] for p in range(1, 9)] == [1783, 1800, 1726, 1772, 1805, 1800, 1569, 723]
    assert len({e.essay_id for e in essays}) == 12_978
    _, bad = read_asap(ASAP_TSV, errors="collect")
    assert bad == []
    by_id = {e.essay_id: e for e in essays}
    # The unclosed quote of essay 10534 does not swallow 10535 and 10536.
    assert by_id[10535].line == by_id[10534].line + 1 == by_id[10536].line - 1
    assert by_id[10534].text.startswith('"') and not by_id[10534].text.endswith('"')
    with_fffd = [e for e in essays if "\ufffd" in e.text]
    assert len(with_fffd) == 20 and sum(e.text.count("\ufffd") for e in with_fffd) == 78
    assert all(e.rater1 is not None and e.rater2 is not None for e in essays)


@needs_data
def test_real_folds(real_essays: list[Essay]) -> None:
    folds = read_folds(FOLDS_DIR)
    ids = {e.essay_id for e in real_essays}
    assert list(folds) == [0, 1, 2, 3, 4]
    n = len(ids)
    for k, splits in folds.items():
        union = set()
        for split, ratio in zip(SPLITS, (0.6, 0.2, 0.2)):
            assert set(splits[split]) <= ids, f"fold {k} {split} has ids missing from the TSV"
            assert abs(len(splits[split]) / n - ratio) < 0.005
            union |= set(splits[split])
        assert union == ids
        assert splits["dev"] == folds[(k - 1) % 5]["test"]
        parts = split_essays(real_essays, folds, k)
        assert sum(len(v) for v in parts.values()) == n
        for prompt in SCORE_RANGES:
            sp = split_essays(real_essays, folds, k, prompt=prompt)
            total = sum(len(v) for v in sp.values())
            assert abs(len(sp["test"]) / total - 0.2) < 0.01
    tests = [set(folds[k]["test"]) for k in folds]
    assert sum(len(t) for t in tests) == n and set().union(*tests) == ids
