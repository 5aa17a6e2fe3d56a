"""Tests of the GED readers (mhmla_fast.ged.data).

All fixtures are hand-made and written into ``tmp_path``; no research data is copied here. The
checks against the real files under the shared data folder skip when it is absent.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mhmla_fast.ged.data import (
    DataFormatError,
    Sentence,
    corpus_stats,
    read_fce_tsv,
    read_ged,
    read_jfleg,
    read_jfleg_split,
    read_m2,
)
from mhmla_fast.paths import shared_data_dir


def write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return path


def labels_of(sentences: list[Sentence]) -> list[list[int]]:
    return [list(s.labels) for s in sentences]


def raises_at(path: Path, line: int | None, match: str):
    """``pytest.raises`` for a DataFormatError whose message starts with ``<path>:<line>:``."""
    where = f"{path}:{line}: " if line is not None else f"{path}: "
    return pytest.raises(DataFormatError, match="^" + re.escape(where) + ".*" + re.escape(match))


# ---------------------------------------------------------------------------------------------------
# Sentence / DataFormatError


def test_sentence_rejects_length_mismatch() -> None:
    with pytest.raises(ValueError):
        Sentence(("a", "b"), (0,), "x", 1)


def test_data_format_error_is_value_error_with_location() -> None:
    err = DataFormatError("f.tsv", 7, "bad thing")
    assert isinstance(err, ValueError)
    assert str(err) == "f.tsv:7: bad thing"
    assert (err.path, err.line, err.reason) == ("f.tsv", 7, "bad thing")
    assert str(DataFormatError("f.tsv", None, "whole file")) == "f.tsv: whole file"


# ---------------------------------------------------------------------------------------------------
# FCE TSV

FCE_TEXT = "The\tc\ncats\ti\nsleeps\ti\n.\tc\n\nHello\tc\n£5\ti\n\n"


def test_fce_basic(tmp_path: Path) -> None:
    p = write(tmp_path / "a.tsv", FCE_TEXT)
    sents = read_fce_tsv(p)
    assert [s.tokens for s in sents] == [("The", "cats", "sleeps", "."), ("Hello", "£5")]
    assert labels_of(sents) == [[0, 1, 1, 0], [0, 1]]
    assert [s.line for s in sents] == [1, 6]
    assert all(s.source == str(p) for s in sents)
    assert corpus_stats(sents) == {
        "sentences": 2,
        "tokens": 6,
        "error_tokens": 3,
        "error_rate": 0.5,
        "sentences_with_error": 2,
    }


def test_fce_missing_final_blank_line(tmp_path: Path) -> None:
    p = write(tmp_path / "a.tsv", FCE_TEXT.rstrip("\n"))
    assert labels_of(read_fce_tsv(p)) == [[0, 1, 1, 0], [0, 1]]


def test_fce_crlf_bom_and_repeated_blank_lines(tmp_path: Path) -> None:
    text = "\n\n" + FCE_TEXT.replace("\n\nHello", "\n\n\n\nHello")
    p = write(tmp_path / "a.tsv", b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    sents = read_fce_tsv(p)
    assert [s.tokens for s in sents] == [("The", "cats", "sleeps", "."), ("Hello", "£5")]
    assert labels_of(sents) == [[0, 1, 1, 0], [0, 1]]
    assert [s.line for s in sents] == [3, 10]


def test_fce_empty_file(tmp_path: Path) -> None:
    assert read_fce_tsv(write(tmp_path / "a.tsv", "")) == []


@pytest.mark.parametrize(
    ("text", "line", "match"),
    [
        ("a\tc\nb\tx\n", 2, "label must be 'c' or 'i'"),
        ("a\tc\n\nb\tC\n", 3, "label must be 'c' or 'i'"),
        ("a\tc\nb\tc\n\nc\n", 4, "missing label column"),
        ("a\tc\nb\t\n", 2, "label must be 'c' or 'i'"),
        ("a\tc\n\ti\n", 2, "empty token"),
        ("a\tc\n \ti\n", 2, "empty token"),
        ("a\tc\nb\tc\ti\n", 2, "expected 2 tab-separated columns"),
    ],
)
def test_fce_malformed(tmp_path: Path, text: str, line: int, match: str) -> None:
    p = write(tmp_path / "bad.tsv", text)
    with raises_at(p, line, match):
        read_fce_tsv(p)


@pytest.mark.parametrize("crlf", [False, True])
def test_fce_invalid_utf8_line_number(tmp_path: Path, crlf: bool) -> None:
    nl = b"\r\n" if crlf else b"\n"
    # Multi-byte characters before the bad byte, so a char/byte offset confusion would show.
    lines = ["£\tc", "é\ti", "", "ok\tc"]
    data = nl.join(x.encode() for x in lines) + nl + b"b\xffd\tc" + nl + b"e\tc" + nl
    p = write(tmp_path / "bad.tsv", data)
    with raises_at(p, 5, "invalid UTF-8"):
        read_fce_tsv(p)


def test_fce_truncated_utf8_at_end(tmp_path: Path) -> None:
    p = write(tmp_path / "bad.tsv", b"a\tc\n\nb\tc\n\xc2")
    with raises_at(p, 4, "invalid UTF-8"):
        read_fce_tsv(p)


# ---------------------------------------------------------------------------------------------------
# M2


def m2(*blocks: str) -> str:
    return "\n\n".join(blocks) + "\n"


def A(start: int, end: int, etype: str = "X", corr: str = "y", ann: int = 0) -> str:
    return f"A {start} {end}|||{etype}|||{corr}|||REQUIRED|||-NONE-|||{ann}"


@pytest.mark.parametrize(
    ("edits", "expected"),
    [
        ([], [0, 0, 0, 0]),
        ([A(4, 4, "ins", ".")], [0, 0, 0, 1]),  # insertion at the end -> last token
        ([A(2, 2, "ins", "the")], [0, 0, 1, 0]),  # insertion in the middle -> next token
        ([A(0, 0, "ins", "So")], [1, 0, 0, 0]),  # insertion at the start -> first token
        ([A(1, 2, "del", "")], [0, 1, 0, 0]),  # deletion
        ([A(1, 2, "rep", "is")], [0, 1, 0, 0]),  # replacement
        ([A(1, 3, "multi", "is a")], [0, 1, 1, 0]),  # multi-token edit
        ([A(0, 4, "all", "x")], [1, 1, 1, 1]),
        ([A(-1, -1, "noop", "-NONE-")], [0, 0, 0, 0]),  # noop
        ([A(1, 2, "noop", "-NONE-")], [0, 0, 0, 0]),  # noop by type
        ([A(-1, -1, "X", "-NONE-")], [0, 0, 0, 0]),  # noop by span
        ([A(0, 1), A(3, 4), A(2, 2)], [1, 0, 1, 1]),
    ],
)
def test_m2_labels(tmp_path: Path, edits: list[str], expected: list[int]) -> None:
    p = write(tmp_path / "a.m2", m2("\n".join(["S a b c d", *edits])))
    (s,) = read_m2(p)
    assert s.tokens == ("a", "b", "c", "d")
    assert list(s.labels) == expected
    assert s.line == 1


def test_m2_annotators(tmp_path: Path) -> None:
    block = "\n".join(["S a b c d e", A(0, 1, ann=0), A(2, 2, ann=1), A(4, 5, ann=1), A(1, 1, ann=0)])
    p = write(tmp_path / "a.m2", m2(block))
    assert labels_of(read_m2(p)) == [[1, 1, 0, 0, 0]]
    assert labels_of(read_m2(p, annotator=0)) == [[1, 1, 0, 0, 0]]
    assert labels_of(read_m2(p, annotator=1)) == [[0, 0, 1, 0, 1]]
    assert labels_of(read_m2(p, annotator=None)) == [[1, 1, 1, 0, 1]]
    # an id no A line has would label every word correct: refused, naming the ids there
    with pytest.raises(ValueError, match="no edit is by annotator 2; its annotator ids are 0, 1"):
        read_m2(p, annotator=2)
    assert labels_of(read_m2(write(tmp_path / "b.m2", m2("S a b")), annotator=2)) == [[0, 0]]


def test_m2_several_sentences_crlf_no_final_blank(tmp_path: Path) -> None:
    text = "\n".join(["S a b", A(0, 1), "", "S c", "", "", "S d e f", A(3, 3, corr=".")])
    p = write(tmp_path / "a.m2", text.replace("\n", "\r\n"))
    sents = read_m2(p)
    assert [s.tokens for s in sents] == [("a", "b"), ("c",), ("d", "e", "f")]
    assert labels_of(sents) == [[1, 0], [0], [0, 0, 1]]
    assert [s.line for s in sents] == [1, 4, 7]


def test_m2_s_line_without_blank_starts_new_sentence(tmp_path: Path) -> None:
    p = write(tmp_path / "a.m2", "S a b\n" + A(1, 2) + "\nS c d\n" + A(0, 0) + "\n")
    assert labels_of(read_m2(p)) == [[0, 1], [1, 0]]


def test_m2_empty_sentence_kept(tmp_path: Path) -> None:
    p = write(tmp_path / "a.m2", m2("S", "S a"))
    sents = read_m2(p)
    assert [s.tokens for s in sents] == [(), ("a",)]


@pytest.mark.parametrize(
    ("text", "line", "match"),
    [
        (A(0, 1) + "\n\nS a b\n", 1, "'A' line before any 'S' line"),
        ("S a b\n\n" + A(0, 1) + "\n", 3, "'A' line before any 'S' line"),
        ("S a b\n" + A(2, 1) + "\n", 2, "bad span 2 1"),
        ("S a b\n" + A(-1, 1) + "\n", 2, "bad span -1 1"),
        ("S a b\n\nS a b c\n" + A(0, 1) + "\n" + A(2, 4) + "\n", 5, "out of range"),
        ("S a b\n" + A(3, 3) + "\n", 2, "out of range"),
        ("S a b\n" + A(5, 6, ann=3) + "\n", 2, "out of range"),  # other annotator: still checked
        ("S a b\nA 0 1|||X|||y|||REQUIRED|||0\n", 2, "expected 6 '|||'-separated fields, got 5"),
        ("S a b\nA 0 1|||X|||y|||REQUIRED|||-NONE-|||0|||z\n", 2, "got 7"),
        ("S a b\nA x 1|||X|||y|||REQUIRED|||-NONE-|||0\n", 2, "span start is not an integer"),
        ("S a b\nA 0 1.5|||X|||y|||REQUIRED|||-NONE-|||0\n", 2, "span end is not an integer"),
        ("S a b\nA 0|||X|||y|||REQUIRED|||-NONE-|||0\n", 2, "span must be"),
        ("S a b\nA 0 1|||X|||y|||REQUIRED|||-NONE-|||one\n", 2, "annotator id is not an integer"),
        ("S a b\n\nT what\n", 3, "expected an 'S ' or 'A ' line"),
    ],
)
def test_m2_malformed(tmp_path: Path, text: str, line: int, match: str) -> None:
    p = write(tmp_path / "bad.m2", text)
    with raises_at(p, line, match):
        read_m2(p, annotator=None)


def test_m2_invalid_utf8(tmp_path: Path) -> None:
    p = write(tmp_path / "bad.m2", b"S a b\n\nS c \xe9 d\n")
    with raises_at(p, 3, "invalid UTF-8"):
        read_m2(p)


# ---------------------------------------------------------------------------------------------------
# JFLEG


def jfleg_files(tmp_path: Path, src: list[str], refs: list[list[str]], name: str = "test") -> Path:
    d = tmp_path / name
    d.mkdir()
    write(d / f"{name}.src", "".join(line + " \n" for line in src))  # JFLEG dev has trailing spaces
    for k, ref in enumerate(refs):
        write(d / f"{name}.ref{k}", "".join(line + "\n" for line in ref))
    return d


@pytest.mark.parametrize(
    ("src", "ref", "expected"),
    [
        ("He goes home .", "He goes home .", [0, 0, 0, 0]),  # identical
        ("I like it", "I like it .", [0, 0, 1]),  # insertion at the end -> last token
        ("I like cats", "I really like cats", [0, 1, 0]),  # insertion in the middle -> next token
        ("like cats", "I like cats", [1, 0]),  # insertion at the start
        ("I do like the cats", "I like the cats", [0, 1, 0, 0, 0]),  # deletion
        ("He go home", "He goes home", [0, 1, 0]),  # replacement
        ("He go to to home .", "He goes home .", [0, 1, 1, 1, 0, 0]),  # multi-token
        ("a b c", "x y z", [1, 1, 1]),
        ("a b c", "", [1, 1, 1]),  # everything deleted
        ("The cat", "the cat", [1, 0]),  # case-sensitive
    ],
)
def test_jfleg_single_reference(tmp_path: Path, src: str, ref: str, expected: list[int]) -> None:
    d = jfleg_files(tmp_path, [src], [[ref]])
    (s,) = read_jfleg(d / "test.src", [d / "test.ref0"])
    assert s.tokens == tuple(src.split())
    assert list(s.labels) == expected
    assert (s.source, s.line) == (str(d / "test.src"), 1)


def test_jfleg_any_of_four_references(tmp_path: Path) -> None:
    src = ["a b c d e", "same here ."]
    refs = [
        ["a b c d e", "same here ."],  # identical: marks nothing
        ["a B c d e", "same here ."],  # replaces b
        ["a b c d", "same here ."],  # deletes e
        ["a b c x d e", "same here !"],  # inserts before d; replaces '.'
    ]
    d = jfleg_files(tmp_path, src, refs)
    sents = read_jfleg_split(d)
    assert labels_of(sents) == [[0, 1, 0, 1, 1], [0, 0, 1]]
    assert [s.line for s in sents] == [1, 2]
    # The same files through the prefix, the .src path and read_ged.
    assert labels_of(read_jfleg_split(d / "test")) == labels_of(sents)
    assert labels_of(read_jfleg_split(d / "test.src")) == labels_of(sents)
    assert labels_of(read_ged(d)) == labels_of(sents)
    assert labels_of(read_ged(d / "test")) == labels_of(sents)


def test_jfleg_spellchecked_source_uses_same_refs(tmp_path: Path) -> None:
    d = jfleg_files(tmp_path, ["a b c"], [["a b c"]] * 4)
    write(d / "test.spellchecked.src", "a b d\n")
    (s,) = read_jfleg_split(d / "test.spellchecked.src")
    assert s.tokens == ("a", "b", "d") and list(s.labels) == [0, 0, 1]
    (s,) = read_jfleg_split(d)  # the folder reads test.src, not the spellchecked one
    assert s.tokens == ("a", "b", "c")


def test_jfleg_reference_count_mismatch(tmp_path: Path) -> None:
    d = jfleg_files(tmp_path, ["a b", "c d", "e f"], [["a b", "c d", "e f"], ["a b", "c d"]])
    with raises_at(d / "test.ref1", None, f"reference has 2 lines but source {d / 'test.src'} has 3 lines"):
        read_jfleg(d / "test.src", [d / "test.ref0", d / "test.ref1"])


def test_jfleg_missing_references(tmp_path: Path) -> None:
    d = jfleg_files(tmp_path, ["a b"], [["a b"]] * 3)
    with pytest.raises(FileNotFoundError, match="expected 4 reference files, found 3"):
        read_jfleg_split(d)
    assert len(read_jfleg_split(d, expect_refs=None)) == 1
    with pytest.raises(ValueError, match="at least one reference"):
        read_jfleg(d / "test.src", [])
    with pytest.raises(FileNotFoundError):
        read_jfleg_split(tmp_path / "nothere")


# ---------------------------------------------------------------------------------------------------
# read_ged dispatch


def test_read_ged_dispatch(tmp_path: Path) -> None:
    tsv = write(tmp_path / "a.tsv", FCE_TEXT)
    assert labels_of(read_ged(tsv)) == [[0, 1, 1, 0], [0, 1]]
    mm = write(tmp_path / "a.m2", m2("\n".join(["S a b", A(0, 1, ann=0), A(1, 2, ann=1)])))
    assert labels_of(read_ged(mm)) == [[1, 0]]
    assert labels_of(read_ged(mm, annotator=1)) == [[0, 1]]
    assert labels_of(read_ged(mm, annotator=None)) == [[1, 1]]
    txt = write(tmp_path / "a.txt", FCE_TEXT)
    with pytest.raises(ValueError, match="cannot tell the GED format"):
        read_ged(txt)
    assert labels_of(read_ged(txt, fmt="fce")) == [[0, 1, 1, 0], [0, 1]]
    with pytest.raises(ValueError, match="unknown GED format"):
        read_ged(txt, fmt="conll")


# ---------------------------------------------------------------------------------------------------
# the real files (skipped when the shared data folder is absent)


def _data(*parts: str) -> Path:
    root = shared_data_dir()
    p = root.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"research data not found: {p} (set $MHMLA_SHARED_DATA to the shared data folder)")
    return p


@pytest.mark.parametrize(
    ("split", "sentences", "tokens", "errors", "with_error"),
    [
        ("train", 28_731, 452_833, 58_897, 18_217),
        ("dev", 2_222, 34_599, 4_640, 1_416),
        ("test", 2_720, 41_477, 6_305, 1_847),
    ],
)
def test_real_fce(split: str, sentences: int, tokens: int, errors: int, with_error: int) -> None:
    st = corpus_stats(read_ged(_data("fce", f"fce-public.{split}.original.tsv")))
    assert (st["sentences"], st["tokens"], st["error_tokens"], st["sentences_with_error"]) == (
        sentences,
        tokens,
        errors,
        with_error,
    )
    if split == "train":
        assert round(100 * st["error_rate"], 2) == 13.01


@pytest.mark.parametrize(
    ("name", "errors", "rate", "with_error"),
    [("official-2014.0.m2", 2_992, 9.93, 947), ("official-2014.1.m2", 4_199, 13.93, 1_130)],
)
def test_real_conll14(name: str, errors: int, rate: float, with_error: int) -> None:
    st = corpus_stats(read_ged(_data("conll2014", name), annotator=0))
    assert (st["sentences"], st["tokens"], st["error_tokens"], st["sentences_with_error"]) == (
        1_312,
        30_144,
        errors,
        with_error,
    )
    assert round(100 * st["error_rate"], 2) == rate


def test_real_conll14_combined_annotator0_matches_own_file() -> None:
    combined = read_m2(_data("conll2014", "official-2014.combined.m2"), annotator=0)
    own = read_m2(_data("conll2014", "official-2014.0.m2"), annotator=0)
    assert [s.tokens for s in combined] == [s.tokens for s in own]
    assert labels_of(combined) == labels_of(own)


@pytest.mark.parametrize(("split", "sentences", "tokens"), [("dev", 754, 14_010), ("test", 747, 14_096)])
def test_real_jfleg(split: str, sentences: int, tokens: int) -> None:
    sents = read_ged(_data("jfleg", split))
    st = corpus_stats(sents)
    assert (st["sentences"], st["tokens"]) == (sentences, tokens)
    assert 0.2 < st["error_rate"] < 0.5  # fluency rewrites: far more edits than FCE


def test_real_jfleg_test_tokens_match_creators_m2() -> None:
    sents = read_jfleg_split(_data("jfleg", "test"))
    m2_sents = read_m2(_data("jfleg", "m2_unofficial", "test.ref.m2"), annotator=None)
    assert [s.tokens for s in m2_sents] == [s.tokens for s in sents]


def test_real_jfleg_unofficial_dev_m2_has_out_of_range_spans() -> None:
    p = _data("jfleg", "m2_unofficial", "dev.ref.m2")
    with pytest.raises(DataFormatError, match="out of range"):
        read_m2(p, annotator=None)


def test_make_transfer_asap_cuts_essays_into_kept_sentences(tmp_path, capsys):
    """training/make_transfer_asap.py: sentences end after ., ! or ? (a closing quote stays
    with its sentence); those with an @ name, too short or too long, and repeats are left out;
    the rest are shuffled by the seed and cut to --max-sentences."""
    from bench_scripts import load_script

    make = load_script("training/make_transfer_asap.py")
    assert make.essay_sentences('He said "stop." Then I went home!! Why ? ok') == [
        ["He", "said", '"', "stop", "."], ['"', "Then", "I", "went", "home", "!!"],
        ["Why", "?"], ["ok"]]
    assert make.essay_sentences("It is “ fine .” No") == [["It", "is", "“", "fine", ".", "”"],
                                                          ["No"]]
    essays = ["I like my school very much . I like my school very much . Short one .",
              "@CAPS1 went to the park with me . We all had a good time there !",
              "They was going to the shop yesterday ? It rained all the day long ."]
    rows = ["essay_id\tessay_set\tessay\trater1_domain1\trater2_domain1\tdomain1_score"]
    rows += [f"{i}\t1\t{text}\t2\t2\t4" for i, text in enumerate(essays, 1)]
    (tmp_path / "asap.tsv").write_text("\r\n".join(rows) + "\r\n")
    out = tmp_path / "t.txt"
    assert make.main([str(tmp_path / "asap.tsv"), "--out", str(out), "--min-words", "4"]) == 0
    lines = out.read_text().splitlines()
    assert sorted(lines) == sorted([
        "I like my school very much .", "We all had a good time there !",
        "They was going to the shop yesterday ?", "It rained all the day long ."])
    assert "4 kept" in capsys.readouterr().err
    make.main([str(tmp_path / "asap.tsv"), "--out", str(out), "--min-words", "4",
               "--max-sentences", "2", "--seed", "1"])
    again = out.read_text().splitlines()
    assert len(again) == 2 and set(again) <= set(lines)
    make.main([str(tmp_path / "asap.tsv"), "--out", str(tmp_path / "u.txt"), "--min-words", "4",
               "--max-sentences", "2", "--seed", "1"])
    assert (tmp_path / "u.txt").read_text().splitlines() == again  # the seed fixes the draw
    from mhmla_fast.ged.data import read_unlabelled

    assert [" ".join(t) for t in read_unlabelled(out)] == again
