"""Input formats (issue 14): ``--format auto|text|jsonl`` and ``--encoding``. In ``auto`` a line
starting with ``{`` is JSON (its error says ``--format text`` is the way out), ``text`` reads every
line as plain text, ``jsonl`` requires every line to be a JSON object; non-UTF-8 input is decoded
per line with ``--encoding``."""

from __future__ import annotations

import json

import pytest

from mhmla_fast.commands.serve import main
from mhmla_fast.serve.inputs import InputRecord, check_encoding, iter_input_records

LINES = ['{"text": "a json text", "id": "j"}', "{braces} open this plain line", "[1, 2, 3]",
         '"string"', "plain text"]


def test_the_three_formats(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("\n".join(LINES) + "\n")
    p = str(src)
    auto = list(iter_input_records([p]))
    assert auto[0] == InputRecord(1, p, 1, "j", text="a json text")
    assert auto[1].error == (f"{p}: line 2: invalid JSON: Expecting property name enclosed in "
                             "double quotes at column 2 (--format text reads such lines as plain "
                             "text)")
    assert [r.text for r in auto[2:]] == ["[1, 2, 3]", '"string"', "plain text"]

    text = list(iter_input_records([p], format="text"))
    assert [(r.id, r.text) for r in text] == [(k, line) for k, line in enumerate(LINES, 1)]

    jsonl = list(iter_input_records([p], format="jsonl"))
    assert jsonl[0] == auto[0]
    assert [r.error for r in jsonl[1:]] == [
        f"{p}: line 2: invalid JSON: Expecting property name enclosed in double quotes at column 2",
        f"{p}: line 3: JSON value must be an object, got array",
        f"{p}: line 4: JSON value must be an object, got string",
        f"{p}: line 5: invalid JSON: Expecting value at column 1",
    ]
    score = list(iter_input_records([p], kind="score", format="jsonl"))
    assert "JSON value must be an object, got array" in score[2].error
    with pytest.raises(ValueError, match='"text" is for tag only'):
        iter_input_records([p], kind="score", format="text")
    with pytest.raises(ValueError, match="format: expected one of"):
        iter_input_records([p], format="csv")


def test_encodings(tmp_path):
    src = tmp_path / "latin1.txt"
    src.write_bytes("café naïve\n{\"text\": \"résumé\"}\n".encode("latin-1") + b"\x81\n")
    recs = list(iter_input_records([str(src)], encoding="latin-1"))
    assert [r.text for r in recs] == ["café naïve", "résumé", "\x81"]
    utf8 = list(iter_input_records([str(src)]))
    assert "invalid UTF-8: byte(s) b'\\xe9'" in utf8[0].error
    cp = list(iter_input_records([str(src)], encoding="cp1252"))  # 0x81 is undefined in cp1252
    assert [r.text for r in cp[:2]] == ["café naïve", "résumé"]
    assert "invalid cp1252: byte(s) b'\\x81' at byte 1" in cp[2].error
    sjis = tmp_path / "sjis.txt"
    sjis.write_bytes("彼は学校に行く\n".encode("shift_jis"))
    assert next(iter_input_records([str(sjis)], encoding="shift_jis")).text == "彼は学校に行く"
    assert check_encoding("Latin-1") == "iso8859-1"
    with pytest.raises(ValueError, match="not ASCII-compatible.*iconv -f utf-16"):
        iter_input_records([str(src)], encoding="utf-16")
    with pytest.raises(ValueError, match="unknown encoding 'klingon'"):
        iter_input_records([str(src)], encoding="klingon")


def test_the_command_takes_format_and_encoding(tmp_path, tiny_tagger_dir, tiny_engine, capsys):
    src, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    text = ["{Braces} start this sentence .", "Ça va très bien ."]
    src.write_bytes("\n".join(text).encode("latin-1") + b"\n")
    base = ["tag", str(src), "--model", str(tiny_tagger_dir), "--no-progress", "--threads", "1"]
    assert main([*base, "--output", str(out), "--format", "text", "--encoding", "latin-1"]) == 0
    got = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    want = [r.to_dict() for r in tiny_engine.tag_texts(text)]
    assert [{k: v for k, v in r.items() if k not in ("index", "id")} for r in got] == want
    assert main([*base, "--encoding", "utf-16"]) == 2
    assert "--encoding: 'utf-16' is not ASCII-compatible" in capsys.readouterr().err
    assert main([*base, "--format", "jsonl"]) == 1  # neither line is a JSON object
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert all("error" in r for r in lines)
    assert main(["score", str(src), "--format", "text"]) == 2  # argparse: not a score format
