"""Tests of the serving I/O layer (mhmla_fast.serve.inputs, .outputs, .records): tolerant input records, the resumable
JSONL writer, the batching driver, and a real ``kill -9`` + resume run in a subprocess.

All inputs are hand-made and written into ``tmp_path``.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mhmla_fast.serve.inputs import InputRecord, iter_input_records, line_format
from mhmla_fast.serve.outputs import (
    InputFingerprint,
    OutputCorruptError,
    OutputExistsError,
    ResumableJsonlWriter,
    ResumeMismatchError,
)
from mhmla_fast.serve.records import run_records

from kill9 import kill_command_after_lines


def write(path: Path, data: str | bytes) -> str:
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return str(path)


def read_jsonl(path: Path | str) -> list[dict]:
    data = Path(path).read_bytes()
    assert data == b"" or data.endswith(b"\n")
    return [json.loads(line) for line in data.splitlines()]


def errors_of(records: list[InputRecord]) -> list[tuple[int, str | None]]:
    return [(r.line, r.error) for r in records]


HINT = " (--format text reads such lines as plain text)"  # after "invalid JSON" in format "auto"
NAME_HINT = (" (a file named *.jsonl or *.ndjson is read as JSON lines; --format text reads "
             "its lines as plain text)")  # after "invalid JSON" in "auto" on such a file


def ours(path: Path, data: str | bytes, records: int | None = None, src: str | None = None,
         made_from: dict | None = None) -> None:
    """Make ``path`` an output of ours holding ``data`` (as a crash leaves it): its sidecar
    vouches for ``records`` input records (default: one per line of ``data``), fingerprinted
    from ``src`` when given."""
    data = data if isinstance(data, bytes) else data.encode("utf-8")
    n = data.count(b"\n") + (not data.endswith(b"\n")) if records is None else records
    fp = InputFingerprint()
    for rec in itertools.islice(iter_input_records([src]), n) if src else ():
        fp.update(rec)
    path.unlink(missing_ok=True)
    with ResumableJsonlWriter(str(path), made_from=made_from) as w:
        w.vouch(n, fp.hexdigest())
    path.write_bytes(data)


# ---------------------------------------------------------------------------------------------------
# input


def test_plain_text_and_jsonl_mixed(tmp_path):
    src = write(
        tmp_path / "in.txt",
        "I has a apple .\r\n"
        '{"text": "She go home.", "id": "essay-7"}\n'
        '   {"tokens": ["do", "n\'t"], "id": 42, "extra": [1]}\r\n'
        "[not json, plain text]\n"
        '{"text": "  keeps its spaces "}',  # no final newline
    )
    assert list(iter_input_records([src], kind="tag")) == [
        InputRecord(1, src, 1, 1, text="I has a apple ."),
        InputRecord(2, src, 2, "essay-7", text="She go home."),
        InputRecord(3, src, 3, 42, tokens=("do", "n't")),
        InputRecord(4, src, 4, 4, text="[not json, plain text]"),
        InputRecord(5, src, 5, 5, text="  keeps its spaces "),
    ]


@pytest.mark.parametrize("name", ["in.jsonl", "IN.NDJSON", "in.ndjson"])
def test_auto_reads_a_file_named_jsonl_as_json_lines(tmp_path, name):
    """A ``tag`` input named *.jsonl / *.ndjson is JSON lines in "auto": a line that is not a
    JSON object is an error record (a damaged JSONL line is not tagged as text); "text" still
    reads it as text, other names and standard input keep auto's per-line rule, and "score"
    input (JSON objects either way) keeps its message for a plain-text line."""
    data = b'{"text": "ok", "id": "a"}\nnot json\n[1, 2]\n'
    src = write(tmp_path / name, data)
    a, b, c = iter_input_records([src], kind="tag")
    assert (a.text, a.id, a.error) == ("ok", "a", None)
    assert b.error == f"{src}: line 2: invalid JSON: Expecting value at column 1{NAME_HINT}"
    assert c.error == f"{src}: line 3: JSON value must be an object, got array"
    assert [r.text for r in iter_input_records([src], kind="tag", format="text")] == [
        '{"text": "ok", "id": "a"}', "not json", "[1, 2]"]
    for other in (write(tmp_path / "in.txt", data), "-"):
        recs = list(iter_input_records([other], kind="tag", stdin=io.BytesIO(data)))
        assert [r.text for r in recs] == ["ok", "not json", "[1, 2]"]
    (score,) = [r for r in iter_input_records([src], kind="score") if r.line == 2]
    assert score.error.endswith('plain-text line, but "score" input must be JSON objects with '
                                '"text" and "prompt"')
    assert line_format("s3://bucket/part-0.JSONL", "auto") == "jsonl"
    assert line_format("in.jsonl", "text") == "text"
    assert line_format("in.jsonl.gz", "auto") == "auto"


def test_every_malformed_tag_line_becomes_an_error_record(tmp_path):
    lines = [
        b'{"text": "ok"}',
        b"",
        b"  \t ",
        b'{"text": "a" "b"}',
        b"{text: 1}",
        b'{"text": "caf\xe9"}',
        b'{"id": 7}',
        b'{"text": 5}',
        b'{"text": null}',
        b'{"text": "  "}',
        b'{"tokens": []}',
        b'{"tokens": ["a", ""]}',
        b'{"tokens": ["a", 3]}',
        b'{"tokens": "a b"}',
        b'{"text": "x", "tokens": ["x"]}',
        b'{"text": "x", "id": [1]}',
        b'{"text": "x", "id": true}',
        b'{"text": "\\ud800"}',
        b'{"text": "a"} trailing',
        b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"text": "last", "id": "e1"}',
    ]
    src = write(tmp_path / "bad.jsonl", b"\n".join(lines) + b"\n")
    records = list(iter_input_records([src], kind="tag", format="jsonl"))
    # "auto" reads a file named *.jsonl as JSON lines: the same, with a hint naming the rule
    assert list(iter_input_records([src], kind="tag")) == [
        dataclasses.replace(r, error=r.error + NAME_HINT) if "invalid JSON: E" in (r.error or "")
        else r for r in records]
    txt = write(tmp_path / "bad.txt", Path(src).read_bytes())  # "auto" on another name: the
    assert [dataclasses.replace(r, source=src, error=r.error and r.error.replace(txt, src))
            for r in iter_input_records([txt], kind="tag")] == [  # same, with auto's hint
        dataclasses.replace(r, error=r.error + HINT) if "invalid JSON: E" in (r.error or "") else r
        for r in records]
    at = f"{src}: line"
    assert errors_of(records) == [
        (1, None),
        (2, f"{at} 2: empty line"),
        (3, f"{at} 3: empty line"),
        (4, f"{at} 4: invalid JSON: Expecting ',' delimiter at column 14"),
        (5, f"{at} 5: invalid JSON: Expecting property name enclosed in double quotes at column 2"),
        (6, f"{at} 6: invalid UTF-8: byte(s) b'\\xe9' at byte 14 of the line (invalid continuation byte)"),
        (7, f'{at} 7: missing field "text" (or "tokens")'),
        (8, f'{at} 8: field "text" must be a string, got number'),
        (9, f'{at} 9: field "text" must be a string, got null'),
        (10, f'{at} 10: field "text" is empty'),
        (11, f'{at} 11: field "tokens" is empty'),
        (12, f'{at} 12: field "tokens": item 1 is empty'),
        (13, f'{at} 13: field "tokens": item 1 must be a string, got number'),
        (14, f'{at} 14: field "tokens" must be an array of strings, got string'),
        (15, f'{at} 15: give either "text" or "tokens", not both'),
        (16, f'{at} 16: field "id" must be a string or an integer, got array'),
        (17, f'{at} 17: field "id" must be a string or an integer, got boolean'),
        (18, f'{at} 18: field "text" contains a lone surrogate U+D800'),
        (19, f"{at} 19: invalid JSON: Extra data at column 15"),
        (20, f"{at} 20: invalid JSON: nested too deeply"),
        (21, None),
    ]
    # error records keep a valid JSON id, else default to the index; they carry no payload
    assert records[6] == InputRecord(7, src, 7, 7, error=f'{at} 7: missing field "text" (or "tokens")')
    bad_text_with_id = write(tmp_path / "b2.jsonl", '{"text": "", "id": "doc-3"}\n')
    (rec,) = iter_input_records([bad_text_with_id])
    assert (rec.id, rec.text, rec.tokens, rec.prompt, rec.ok) == ("doc-3", None, None, None, False)
    assert records[15].id == 16 and records[20].id == "e1" and records[20].ok


def test_score_records_and_their_errors(tmp_path):
    src = write(
        tmp_path / "essays.jsonl",
        '{"text": "Dear Sir, ...", "prompt": 3, "id": "e1"}\n'
        "a plain-text essay\n"
        '{"text": "x"}\n'
        '{"prompt": 2}\n'
        '{"text": "x", "prompt": 9}\n'
        '{"text": "x", "prompt": 0}\n'
        '{"text": "x", "prompt": "3"}\n'
        '{"text": "x", "prompt": 3.0}\n'
        '{"text": "x", "prompt": true}\n'
        '{"text": "x", "prompt": 8, "tokens": ["ignored"]}\n',
    )
    records = list(iter_input_records([src], kind="score"))
    assert records[0] == InputRecord(1, src, 1, "e1", text="Dear Sir, ...", prompt=3)
    assert records[9] == InputRecord(10, src, 10, 10, text="x", prompt=8)
    at = f"{src}: line"
    assert [r.error for r in records[1:9]] == [
        f'{at} 2: plain-text line, but "score" input must be JSON objects with "text" and "prompt"',
        f'{at} 3: missing field "prompt"',
        f'{at} 4: missing field "text"',
        f'{at} 5: field "prompt" must be an integer from 1 to 8, got 9',
        f'{at} 6: field "prompt" must be an integer from 1 to 8, got 0',
        f'{at} 7: field "prompt" must be an integer from 1 to 8, got string',
        f'{at} 8: field "prompt" must be an integer from 1 to 8, got number',
        f'{at} 9: field "prompt" must be an integer from 1 to 8, got boolean',
    ]


def test_multiple_files_and_stdin_share_one_global_index(tmp_path):
    a = write(tmp_path / "a.txt", "\ufeffalpha\nbeta\n")  # a BOM is skipped
    empty = write(tmp_path / "empty.txt", "")
    b = write(tmp_path / "b.jsonl", '\ufeff{"text": "delta"}\r\n\n')
    stdin = io.BytesIO("\ufeffgamma\r\n".encode("utf-8") + b"\xff\n")
    records = list(iter_input_records([a, "-", empty, b], kind="tag", stdin=stdin))
    assert [(r.index, r.source, r.line, r.id, r.text, r.error) for r in records] == [
        (1, a, 1, 1, "alpha", None),
        (2, a, 2, 2, "beta", None),
        (3, "<stdin>", 1, 3, "gamma", None),
        (4, "<stdin>", 2, 4, None,
         "<stdin>: line 2: invalid UTF-8: byte(s) b'\\xff' at byte 1 of the line (invalid start byte)"),
        (5, b, 1, 5, "delta", None),
        (6, b, 2, 6, None, f"{b}: line 2: empty line"),
    ]  # fmt: skip


def test_stdin_is_the_default_and_is_read_lazily(monkeypatch):
    pulled: list[bytes] = []

    class Stream:  # a binary stream that notes which lines were read from it
        def __iter__(self):
            for line in (b"one\n", b"two\n", b"three\n"):
                pulled.append(line)
                yield line

    records = iter_input_records(stdin=Stream())  # type: ignore[arg-type]
    assert pulled == []
    assert next(records).text == "one"
    assert pulled == [b"one\n"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"x\n")))
    assert [(r.source, r.text) for r in iter_input_records([])] == [("<stdin>", "x")]


def test_bad_arguments_raise_before_reading(tmp_path):
    ok = write(tmp_path / "ok.txt", "x\n")
    with pytest.raises(FileNotFoundError, match="missing.txt: no such input file"):
        iter_input_records([ok, str(tmp_path / "missing.txt")])
    with pytest.raises(IsADirectoryError):
        iter_input_records([str(tmp_path)])
    with pytest.raises(ValueError, match="only once"):
        iter_input_records(["-", ok, "-"])
    with pytest.raises(ValueError, match="kind"):
        iter_input_records([ok], kind="grade")


def test_wide_unicode_nul_and_inner_byte_order_marks(tmp_path):
    """UTF-16/32 with a byte-order mark is refused as a whole before any record (PowerShell's
    ``>`` writes UTF-16); a NUL character makes a line an error record (UTF-16 without a mark);
    a UTF-8 byte-order mark that starts a later line (files joined by cat) is skipped, so a
    JSON line behind it stays JSON."""
    for enc, name in (("utf-16", "UTF-16"), ("utf-32", "UTF-32")):
        wide = write(tmp_path / f"{enc}.txt", "She go .\nok\n".encode(enc))
        with pytest.raises(ValueError, match=f"starts with a {name} byte-order mark.*iconv -f {enc}"):
            iter_input_records([wide])
        with pytest.raises(ValueError, match=f"<stdin>: starts with a {name} byte-order mark"):
            list(iter_input_records(["-"], stdin=io.BytesIO(Path(wide).read_bytes())))
    bare = write(tmp_path / "bare.txt", "She go .\nok\n".encode("utf-16-le"))
    recs = list(iter_input_records([bare]))
    # "\n" is b"\n\x00" there: a third line of one NUL; every line is an error record
    assert len(recs) == 3 and all("contains a NUL character" in r.error for r in recs)
    joined = write(tmp_path / "joined.txt", b'plain\n\xef\xbb\xbf{"id": "b", "text": "x y"}\n'
                                               b"\xef\xbb\xbfword\n")
    a, b, c = iter_input_records([joined])
    assert (a.text, b.id, b.text, c.text) == ("plain", "b", "x y", "word")


def test_unreadable_input_is_refused_before_reading(tmp_path, monkeypatch):
    ok = write(tmp_path / "ok.txt", "x\n")
    locked = write(tmp_path / "locked.txt", "y\n")
    real_open = open

    def refusing_open(path, *a, **kw):  # root reads a mode-000 file: refuse like a real denial
        if str(path) == locked:
            raise PermissionError(13, "Permission denied", locked)
        return real_open(path, *a, **kw)

    monkeypatch.setattr("builtins.open", refusing_open)
    with pytest.raises(PermissionError, match="Permission denied"):
        iter_input_records([ok, locked])


# ---------------------------------------------------------------------------------------------------
# writer


def test_writer_refuses_what_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="fifo: not a regular file.*leave out -o"):
        ResumableJsonlWriter(str(fifo), resume=False)


def test_writer_escapes_a_lone_surrogate_of_a_file_name(tmp_path):
    """An input path that is not UTF-8 decodes to lone surrogates, which reach error messages;
    the writer escapes them (\\udcXX), so the line stays UTF-8 JSON and the name round-trips."""
    name = os.fsdecode(b"caf\xe9.txt")
    with ResumableJsonlWriter(str(tmp_path / "o.jsonl"), resume=False) as w:
        w.write({"index": 1, "error": f"{name}: line 2: empty line"})
    raw = (tmp_path / "o.jsonl").read_bytes()
    raw.decode("utf-8")  # strict
    assert b"caf\\udce9.txt" in raw
    assert read_jsonl(tmp_path / "o.jsonl")[0]["error"].startswith(name)


def test_writer_refuses_to_overwrite_without_resume(tmp_path):
    out = tmp_path / "out.jsonl"
    write(out, '{"index": 1}\n')
    with pytest.raises(OutputExistsError, match=r"out\.jsonl exists; pass --resume to continue or remove it"):
        ResumableJsonlWriter(str(out), resume=False)
    assert out.read_text() == '{"index": 1}\n'
    write(out, "")  # an empty file may be overwritten
    with ResumableJsonlWriter(str(out), resume=False) as w:
        assert w.done == 0
        w.write({"index": 1, "x": "ü"})
    assert out.read_text(encoding="utf-8") == '{"index":1,"x":"ü"}\n'  # compact, UTF-8


@pytest.fixture(params=["orjson", "json"])
def line_encoder(request, monkeypatch):
    """encode_line with orjson (where installed) and with Python's json alone (an install made
    with --no-deps)."""
    from mhmla_fast.serve import outputs

    if request.param == "orjson":
        pytest.importorskip("orjson")
    else:
        monkeypatch.setattr(outputs, "_orjson", lambda: None)
    return outputs.encode_line


def test_encode_line_gives_the_same_values_with_either_encoder(line_encoder):
    """One compact UTF-8 line per record with the values as given; the numbers' spelling is the
    encoder's own. NaN, Infinity, a null, a lone surrogate, a 70-bit integer and an int key
    take Python's json under orjson too: NaN refused, the surrogate escaped."""
    record = {"index": 3, "id": "doc-ü", "tokens": ["He", "go", "\u2028"], "labels": ["c", "i"],
              "probs": [1e-06, 1.5e-05, 0.5, 0.999999], "offsets": [[0, 2], [3, 5]],
              "spans": [{"start": 3, "end": 5, "text": "go"}]}
    line = line_encoder(record)
    assert line.endswith(b"\n") and line.count(b"\n") == 1 and b", " not in line
    assert json.loads(line) == record
    assert line_encoder({"index": 1, "id": None}) == b'{"index":1,"id":null}\n'
    assert json.loads(line_encoder({"index": 1, "big": 2**70, 5: "x"})) == {
        "index": 1, "big": 2**70, "5": "x"}
    assert line_encoder({"index": 1, "error": "bad \udcff.txt"}) == \
        b'{"index":1,"error":"bad \\udcff.txt"}\n'
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError):
            line_encoder({"index": 1, "probs": [0.5, bad]})


def test_writer_enforces_index_order_and_strict_json(tmp_path):
    with ResumableJsonlWriter(str(tmp_path / "o.jsonl"), resume=False) as w:
        w.write({"index": 1})
        with pytest.raises(ValueError, match='expected a record with "index": 2, got 3'):
            w.write({"index": 3})
        with pytest.raises(ValueError, match="got None"):
            w.write({"id": 2})
        with pytest.raises(ValueError):
            w.write({"index": 2, "score": float("nan")})
        w.write({"index": 2})
    assert read_jsonl(tmp_path / "o.jsonl") == [{"index": 1}, {"index": 2}]


def test_writer_syncs_every_n_records(tmp_path, monkeypatch):
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    out = tmp_path / "o.jsonl"
    w = ResumableJsonlWriter(str(out), resume=False, sync_every=3)
    n_create = len(synced)  # the directory entry of the new file
    for i in range(1, 8):
        w.write({"index": i})
    assert len(synced) - n_create == 2  # after records 3 and 6
    assert len(read_jsonl(out)) == 6  # what is synced is on disk
    w.close()
    assert len(synced) - n_create == 3 and len(read_jsonl(out)) == 7
    w.close()  # twice is fine


@pytest.mark.parametrize(
    "tail",
    [b'{"index": 4, "id"', b'{"index": 4}', b'{"inde\n', b"\x00\x00\x00"],
    ids=["torn-json", "no-newline", "invalid-json-line", "garbage"],
)
def test_resume_drops_a_torn_last_line(tmp_path, tail):
    out = tmp_path / "o.jsonl"
    good = "".join(json.dumps({"index": i, "id": i, "v": "é" * i}) + "\n" for i in range(1, 4)).encode()
    ours(out, good + tail, records=4)
    with ResumableJsonlWriter(str(out), resume=True) as w:
        assert (w.done, w.last_id, w.next_index) == (3, 3, 4)
        assert out.read_bytes() == good  # truncated at once
        w.write({"index": 4, "id": 4})
    assert [r["index"] for r in read_jsonl(out)] == [1, 2, 3, 4]


def test_resume_of_missing_or_empty_output_starts_at_one(tmp_path):
    for out in (tmp_path / "missing.jsonl", Path(write(tmp_path / "empty.jsonl", ""))):
        with ResumableJsonlWriter(str(out), resume=True) as w:
            assert w.done == 0
            w.write({"index": 1})
        assert read_jsonl(out) == [{"index": 1}]


def test_resume_rejects_damaged_or_foreign_output(tmp_path):
    out = tmp_path / "o.jsonl"
    ours(out, '{"index": 1}\n{"index": 2\n{"index": 3}\n')
    with pytest.raises(OutputCorruptError, match="line 2: not a complete JSON record, and more lines follow"):
        ResumableJsonlWriter(str(out), resume=True)
    ours(out, '{"index": 1}\n{"index": 3}\n')
    with pytest.raises(OutputCorruptError, match='line 2: expected a record with "index": 2, found 3'):
        ResumableJsonlWriter(str(out), resume=True)
    ours(out, '{"index": 1}\n[2]\n{"index": 3}\n')
    with pytest.raises(OutputCorruptError, match="line 2: .*found None"):
        ResumableJsonlWriter(str(out), resume=True)
    assert out.read_text() == '{"index": 1}\n[2]\n{"index": 3}\n'  # untouched
    ours(out, '{"index": 1}\n{"index": 2}\n', records=1)  # more records than the sidecar covers
    with pytest.raises(OutputCorruptError, match="holds 2 records but .*vouches for 1 input records"):
        ResumableJsonlWriter(str(out), resume=True)


def test_stdout_output(capsysbinary):
    with pytest.raises(ValueError, match="cannot resume when writing to standard output"):
        ResumableJsonlWriter("-", resume=True)
    with ResumableJsonlWriter("-", resume=False, sync_every=1) as w:
        w.write({"index": 1, "t": "ß"})
    assert capsysbinary.readouterr().out == '{"index":1,"t":"ß"}\n'.encode("utf-8")


# ---------------------------------------------------------------------------------------------------
# driver


def upper_batch(seen: list[list[int]]):
    """A ``process_batch`` that records the indices of each batch and upper-cases the texts."""

    def process(batch: list[InputRecord]) -> list[dict]:
        assert all(r.ok for r in batch)
        seen.append([r.index for r in batch])
        return [{"index": -1, "upper": (r.text or " ".join(r.tokens or ())).upper()} for r in batch]

    return process


def make_input(tmp_path: Path, n: int = 23) -> str:
    """``n`` lines; every 5th is invalid JSON, every 7th has an explicit id."""
    lines = []
    for i in range(1, n + 1):
        if i % 5 == 0:
            lines.append("{broken")
        elif i % 7 == 0:
            lines.append(json.dumps({"text": f"line {i}", "id": f"doc{i}"}))
        else:
            lines.append(f"line {i}")
    return write(tmp_path / "in.txt", "\n".join(lines) + "\n")


BROKEN = "invalid JSON: Expecting property name enclosed in double quotes at column 2" + HINT  # "{broken"


def expected_output(src: str, n: int = 23) -> list[dict]:
    out = []
    for i in range(1, n + 1):
        if i % 5 == 0:
            out.append({"index": i, "id": i, "error": f"{src}: line {i}: {BROKEN}"})
        else:
            out.append({"index": i, "id": f"doc{i}" if i % 7 == 0 else i, "upper": f"LINE {i}"})
    return out


def test_run_records_in_order_with_errors_and_batches(tmp_path, capsys):
    src = make_input(tmp_path)
    seen: list[list[int]] = []
    out = tmp_path / "out.jsonl"
    with ResumableJsonlWriter(str(out), resume=False) as w:
        summary = run_records(iter_input_records([src]), upper_batch(seen), w, batch_size=4, progress=True)
    assert read_jsonl(out) == expected_output(src)
    assert (summary.n_ok, summary.n_errors, summary.n_resumed, summary.n_total) == (19, 4, 0, 23)
    valid = [i for i in range(1, 24) if i % 5]
    assert seen == [valid[k : k + 4] for k in range(0, len(valid), 4)]
    assert "rec/s" in capsys.readouterr().err  # the progress bar


def test_run_records_bar_ends_with_every_piece_and_error_counted(tmp_path, capsys):
    """The pieces postfix is throttled to twice a second while running; the bar's last state
    shows the whole count, beside the malformed records' count (one did not hide the other)."""
    src = make_input(tmp_path)

    def batch_with_pieces(batch, report):
        report(7 * len(batch))
        return [{"upper": r.text.upper()} for r in batch]

    with ResumableJsonlWriter(str(tmp_path / "out.jsonl"), resume=False) as w:
        run_records(iter_input_records([src]), batch_with_pieces, w, batch_size=4,
                    progress=True, count_pieces=True)
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "133 pieces" in last and "errors=4" in last, last  # 19 valid records x 7


def test_run_records_pauses_the_collector_until_a_batch_is_written(tmp_path):
    """The garbage collector is off while a batch is processed and its records are written (so
    that it does not walk results about to be freed), and on again after, as it was."""
    import gc

    src = make_input(tmp_path)
    seen: list[bool] = []

    def batch_seeing_gc(batch):
        seen.append(gc.isenabled())
        return [{"upper": r.text.upper()} for r in batch]

    class Writer(ResumableJsonlWriter):
        def write(self, record):
            seen.append(gc.isenabled())
            super().write(record)

    assert gc.isenabled()
    with Writer(str(tmp_path / "out.jsonl"), resume=False) as w:
        run_records(iter_input_records([src]), batch_seeing_gc, w, batch_size=4, progress=False)
    assert gc.isenabled() and len(seen) == 5 + 23 and not any(seen)  # 5 batches, 23 records


def test_run_records_first_batch_ramps_up_to_batch_size(tmp_path):
    """first_batch: batches of 1, 2, 4, 4, ... valid records, the same output in order."""
    src = make_input(tmp_path)
    seen: list[list[int]] = []
    out = tmp_path / "out.jsonl"
    with ResumableJsonlWriter(str(out), resume=False) as w:
        run_records(iter_input_records([src]), upper_batch(seen), w, batch_size=4,
                    progress=False, first_batch=1)
    assert read_jsonl(out) == expected_output(src)
    valid = [i for i in range(1, 24) if i % 5]
    assert [len(b) for b in seen] == [1, 2, 4, 4, 4, 4]
    assert [i for b in seen for i in b] == valid
    with pytest.raises(ValueError, match="first_batch"):
        with ResumableJsonlWriter(str(tmp_path / "x.jsonl"), resume=False) as w:
            run_records(iter_input_records([src]), upper_batch([]), w, batch_size=4,
                        progress=False, first_batch=0)


def test_run_records_resume_that_is_complete_reruns_nothing(tmp_path, capsys):
    src = make_input(tmp_path)
    out = tmp_path / "out.jsonl"
    with ResumableJsonlWriter(str(out), resume=False) as w:
        run_records(iter_input_records([src]), upper_batch([]), w, batch_size=3, progress=False)
    before = out.read_bytes()
    seen: list[list[int]] = []
    with ResumableJsonlWriter(str(out), resume=True) as w:
        summary = run_records(iter_input_records([src]), upper_batch(seen), w, batch_size=3, progress=False)
    assert seen == [] and out.read_bytes() == before
    assert (summary.n_ok, summary.n_errors, summary.n_resumed) == (19, 4, 23)
    assert capsys.readouterr().err == ""  # progress=False


def test_run_records_resume_after_a_torn_last_line(tmp_path):
    src = make_input(tmp_path)
    expected = expected_output(src)
    out = tmp_path / "out.jsonl"
    head = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in expected[:9])
    ours(out, head + json.dumps(expected[9])[:17], records=12, src=src)  # 1-9 complete, 10 torn
    seen: list[list[int]] = []
    with ResumableJsonlWriter(str(out), resume=True) as w:
        assert w.done == 9
        summary = run_records(iter_input_records([src]), upper_batch(seen), w, batch_size=5, progress=False)
    assert read_jsonl(out) == expected
    assert min(i for b in seen for i in b) == 11  # 10 is an error record, 1-9 were not re-run
    assert (summary.n_ok, summary.n_errors, summary.n_resumed) == (19, 4, 9)


def test_run_records_resume_against_other_input_fails(tmp_path):
    src = make_input(tmp_path)
    out = tmp_path / "out.jsonl"
    written = "".join(json.dumps(r) + "\n" for r in expected_output(src)[:7])
    ours(out, written, records=8, src=src)
    # same ids, one other text: the old id check could not see it
    other = write(tmp_path / "other.txt", Path(src).read_text().replace("line 8\n", "LINE 8\n"))
    with ResumableJsonlWriter(str(out), resume=True) as w:
        with pytest.raises(ResumeMismatchError, match="was made from other input: the first 8 "):
            run_records(iter_input_records([other]), upper_batch([]), w, batch_size=2, progress=False)
    short = write(tmp_path / "short.txt", "a\nb\n")
    with ResumableJsonlWriter(str(out), resume=True) as w:
        with pytest.raises(ResumeMismatchError, match="made from 8 input records but the input has only 2"):
            run_records(iter_input_records([short]), upper_batch([]), w, batch_size=2, progress=False)
    assert out.read_text() == written  # refused: nothing written
    moved = write(tmp_path / "moved.txt", Path(src).read_bytes())  # same lines, another name
    with ResumableJsonlWriter(str(out), resume=True) as w:
        run_records(iter_input_records([moved]), upper_batch([]), w, batch_size=2, progress=False)
    assert [r["index"] for r in read_jsonl(out)] == list(range(1, 24))


def test_run_records_bounds_the_records_waiting_behind_a_batch(tmp_path):
    src = write(tmp_path / "in.txt", "first\n" + "{bad\n" * 40 + "last\n")
    seen: list[list[int]] = []
    out = tmp_path / "out.jsonl"
    with ResumableJsonlWriter(str(out), resume=False) as w:
        summary = run_records(iter_input_records([src]), upper_batch(seen), w, batch_size=2, progress=False)
    assert seen == [[1], [42]]  # processed early: 16 records were waiting behind record 1
    assert [r["index"] for r in read_jsonl(out)] == list(range(1, 43))
    assert (summary.n_ok, summary.n_errors) == (2, 40)


def test_run_records_checks_process_batch_results(tmp_path):
    src = write(tmp_path / "in.txt", "a\nb\n")
    with ResumableJsonlWriter(str(tmp_path / "o.jsonl"), resume=False) as w:
        with pytest.raises(RuntimeError, match="returned 1 results for 2 records"):
            run_records(iter_input_records([src]), lambda b: [{}], w, batch_size=2, progress=False)
    with ResumableJsonlWriter(str(tmp_path / "o2.jsonl"), resume=False) as w:
        with pytest.raises(ValueError, match="batch_size"):
            run_records(iter_input_records([src]), lambda b: [], w, batch_size=0, progress=False)


# ---------------------------------------------------------------------------------------------------
# a real kill -9

_KILL_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from mhmla_fast.serve.inputs import iter_input_records
    from mhmla_fast.serve.outputs import ResumableJsonlWriter
    from mhmla_fast.serve.records import run_records

    def process_batch(batch):
        time.sleep(0.001)
        return [{"upper": r.text.upper(), "n_chars": len(r.text)} for r in batch]

    src, out, resume = sys.argv[1], sys.argv[2], sys.argv[3] == "resume"
    with ResumableJsonlWriter(out, resume=resume, sync_every=500) as w:
        s = run_records(iter_input_records([src]), process_batch, w, batch_size=20, progress=False)
    print(json.dumps({"n_ok": s.n_ok, "n_errors": s.n_errors, "n_resumed": s.n_resumed}))
    """
)


def test_kill_9_then_resume_writes_every_record_once(tmp_path):
    n = 20_000
    lines = [("{oops" if i % 997 == 0 else f"sentence {i} ünïcödé ✓") for i in range(1, n + 1)]
    src = write(tmp_path / "in.txt", "\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    script = write(tmp_path / "run.py", _KILL_SCRIPT)
    cmd = [sys.executable, script, src, str(out)]

    after_kill = kill_command_after_lines(cmd + ["fresh"], out, n, lines=2000, timeout=60)
    complete = after_kill.count(b"\n")

    done = subprocess.run(cmd + ["resume"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    n_errors = n // 997
    assert json.loads(done.stdout) == {"n_ok": n - n_errors, "n_errors": n_errors, "n_resumed": complete}

    records = read_jsonl(out)
    assert [r["index"] for r in records] == list(range(1, n + 1))
    for i, (line, rec) in enumerate(zip(lines, records), 1):
        if i % 997 == 0:
            assert rec == {"index": i, "id": i, "error": f"{src}: line {i}: {BROKEN}"}
        else:
            assert rec == {"index": i, "id": i, "upper": line.upper(), "n_chars": len(line)}
    assert out.read_bytes().startswith(after_kill[: after_kill.rfind(b"\n") + 1])  # kept, not rewritten
