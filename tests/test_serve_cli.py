"""``mhmla-serve tag`` end to end on a tiny random tagger: plain text and JSONL in, one JSONL record
per line out in input order, malformed lines as error records (exit 1) while the good ones are
tagged exactly as the engine tags them, exact Unicode offsets, the ``--pretty`` view, ``--resume``
after a real ``kill -9``, and the refusals (existing output, missing model) with exit 2; ``http``
and ``export`` are wired to the app and the exporters."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import types
from pathlib import Path

import pytest

from mhmla_fast.commands.serve import main

from kill9 import kill_after_lines


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def tag(tmp_path: Path, model: Path, data: bytes, *extra: str) -> tuple[int, list[dict]]:
    """Run ``tag`` in-process on ``data`` (the bytes of one input file) into a fresh output, on
    the CPU in float32 with torch like ``tiny_engine`` (the reference: backend auto's ONNX
    Runtime would move probabilities in the 6th decimal), also on a machine with a GPU
    (``extra`` may override)."""
    src, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_bytes(data)
    if out.exists():
        out.unlink()
    rc = main(["tag", str(src), "--output", str(out), "--model", str(model), "--no-progress",
               "--threads", "1", "--device", "cpu", "--dtype", "float32", "--backend", "torch",
               *extra])
    return rc, read_jsonl(out) if out.exists() else []


UNICODE_TEXTS = [
    "She don't like 👨\u200d👩\u200d👧 trips 👍🏽 to 🇯🇵 !",  # ZWJ family, skin tone, flag
    "The cafe\u0301 was na\u0131\u0308ve , wasn't it ?",  # combining marks
    "我喜欢猫 and 猫喜欢我 .",  # CJK: one token per ideograph
    "مرحبا بالعالم - he say שלום עולם .",  # Arabic and Hebrew (right to left)
    "Tabs\tand\u00a0no-break\u3000ideographic\u200bzero-width spaces",
    "e\u0301e\u0301e\u0301 \U0001d54f\U0001d552 𝓜𝓪𝓽𝓱 ﬁne",  # astral letters, ligature
]


def check_offsets(text: str, rec: dict) -> None:
    assert len(rec["offsets"]) == len(rec["tokens"]) == len(rec["labels"]) == len(rec["probs"])
    for tok, (a, b) in zip(rec["tokens"], rec["offsets"]):
        assert text[a:b] == tok, (text, tok, a, b)
    for span in rec["spans"]:
        assert text[span["start"]:span["end"]] == span["text"]


# ------------------------------------------------------------------------------------ input


def test_plain_and_jsonl_with_every_malformed_kind(tmp_path, tiny_tagger_dir, tiny_engine):
    lines: list[tuple[bytes, str | None]] = [  # (line, expected error reason or None)
        (b"He go to school every day .", None),
        (json.dumps({"text": "They goes home .", "id": "a1"}).encode(), None),
        (json.dumps({"tokens": ["She", "see", "the", "dog", "."], "id": 7}).encode(), None),
        (b"caf\xe9 latin-1 bytes", "invalid UTF-8"),
        (b"", "empty line"),
        (b" \t ", "empty line"),
        (b'{"text": "unterminated', "invalid JSON"),
        (b'{"id": "no-text"}', 'missing field "text"'),
        (b'{"text": 42}', 'field "text" must be a string'),
        (b'{"text": "   "}', 'field "text" is empty'),
        (b'{"text": "a", "tokens": ["a"]}', "not both"),
        (b'{"tokens": []}', 'field "tokens" is empty'),
        (b'{"tokens": "a b"}', 'field "tokens" must be an array'),
        (b'{"tokens": ["a", 1]}', "item 1 must be a string"),
        (b'{"tokens": ["a", " "]}', "item 1 is empty"),
        (b'{"text": "lone \\ud83d half"}', "lone surrogate"),
        (b'{"text": "ok", "id": [1]}', 'field "id" must be a string or an integer'),
        ("Ünïcödé plain text with ✓ and a very long tail ".encode() * 12, None),  # > 1 window
        (b'{"text": "We was late \\u2014 again .", "id": 0}', None),
    ]
    data = b"\n".join(line for line, _ in lines) + b"\r\n"
    rc, out = tag(tmp_path, tiny_tagger_dir, data)
    assert rc == 1
    assert [r["index"] for r in out] == list(range(1, len(lines) + 1))
    src = str(tmp_path / "in.txt")
    good = []
    for n, ((line, reason), rec) in enumerate(zip(lines, out), 1):
        if reason is None:
            assert "error" not in rec, rec
            good.append((line, rec))
            continue
        assert set(rec) == {"index", "id", "error"}
        assert rec["error"].startswith(f"{src}: line {n}: ") and reason in rec["error"], rec
    assert [r["id"] for _, r in good] == [1, "a1", 7, 18, 0]

    # the good lines equal the engine's own results (raw texts in one call, tokens in another)
    texts = [json.loads(x)["text"] if x.startswith(b"{") else x.decode() for x, _ in good
             if b'"tokens"' not in x]
    want_texts = [r.to_dict() for r in tiny_engine.tag_texts(texts)]
    want_tokens = tiny_engine.tag_tokens([["She", "see", "the", "dog", "."]])[0].to_dict()
    got = [{k: v for k, v in r.items() if k not in ("index", "id")} for _, r in good]
    assert got == [want_texts[0], want_texts[1], want_tokens, want_texts[2], want_texts[3]]
    assert "offsets" not in got[2]
    assert len(got[3]["tokens"]) > 62, "the long line needed several encoder windows"
    for text, rec in zip(texts, [got[0], got[1], got[3], got[4]]):
        check_offsets(text, rec)


def test_unicode_offsets_are_exact_code_point_offsets(tmp_path, tiny_tagger_dir, tiny_engine):
    data = "\n".join(UNICODE_TEXTS[:3]).encode() + b"\n" + b"\n".join(
        json.dumps({"text": t}).encode() for t in UNICODE_TEXTS[3:])  # JSON escapes too
    rc, out = tag(tmp_path, tiny_tagger_dir, data)
    assert rc == 0
    want = [r.to_dict() for r in tiny_engine.tag_texts(UNICODE_TEXTS)]
    assert [{k: v for k, v in r.items() if k not in ("index", "id")} for r in out] == want
    for text, rec in zip(UNICODE_TEXTS, out):
        check_offsets(text, rec)
    toks = {t for r in out for t in r["tokens"]}
    assert {"👨\u200d👩\u200d👧", "👍🏽", "🇯🇵", "cafe\u0301", "我", "猫", "مرحبا", "שלום",
            "na\u0131\u0308ve", "was", "n't"} <= toks
    assert any(r["spans"] for r in out), "the tiny tagger flags something to check spans on"


def test_pretty_view_marks_errors(tmp_path, tiny_tagger_dir, tiny_engine, capsys, monkeypatch):
    src = tmp_path / "in.txt"
    tokens_line = '{"tokens": ["a", "b", "c"], "id": "t"}'
    src.write_text("\n".join([*UNICODE_TEXTS[:3], "", tokens_line]) + "\n", encoding="utf-8")
    args = ["tag", str(src), "--pretty", "--model", str(tiny_tagger_dir), "--threads", "1"]
    assert main(args) == 1
    plain = capsys.readouterr().out.splitlines()
    results = tiny_engine.tag_texts(UNICODE_TEXTS[:3])
    for k, (text, res) in enumerate(zip(UNICODE_TEXTS[:3], results), 1):
        expected, pos = f"{k}\t", 0
        for s in res.spans:
            expected += text[pos:s["start"]] + "[[" + s["text"] + "]]"
            pos = s["end"]
        assert plain[k - 1] == expected + text[pos:]
    assert plain[3].startswith("4\t!! ERROR: ") and "line 4: empty line" in plain[3]
    tok = tiny_engine.tag_tokens([["a", "b", "c"]])[0]
    marked = " ".join(f"[[{w}]]" if lab == "i" else w for w, lab in zip(tok.tokens, tok.labels))
    assert plain[4] == "5 [t]\t" + marked.replace("]] [[", " ")

    class Terminal:  # a text stream that says it is a terminal
        def __init__(self) -> None:
            self.parts: list[str] = []

        def write(self, s: str) -> int:
            self.parts.append(s)
            return len(s)

        def flush(self) -> None:
            pass

        def isatty(self) -> bool:
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stdout", term)
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert main(args) == 1
    coloured = "".join(term.parts).splitlines()
    assert "[[" not in "".join(coloured) and "\x1b[1;4;31m" in "".join(coloured)
    assert [_strip_ansi(x) for x in coloured[:3]] == [f"{k}\t{t}" for k, t in
                                                     enumerate(UNICODE_TEXTS[:3], 1)]
    assert "\x1b[33m" in coloured[3]


def _strip_ansi(s: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", s)


def test_stdin_and_stdout(tmp_path, tiny_tagger_dir, tiny_engine, monkeypatch, capsysbinary):
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(
        buffer=__import__("io").BytesIO("He go .\n{\"text\": \"x y\", \"id\": \"q\"}\n".encode())))
    assert main(["tag", "--model", str(tiny_tagger_dir), "--no-progress", "--threads", "1"]) == 0
    out = [json.loads(x) for x in capsysbinary.readouterr().out.decode().splitlines()]
    assert [(r["index"], r["id"]) for r in out] == [(1, 1), (2, "q")]
    assert out[0]["tokens"] == ["He", "go", "."]


# --------------------------------------------------------------------------------- refusals


def test_existing_output_is_never_overwritten_without_resume(tmp_path, tiny_tagger_dir, capsys):
    src, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_text("a b c\n")
    precious = '{"some": "other"}\n{"jsonl": "file"}\n'
    out.write_text(precious)
    base = ["tag", str(src), "--output", str(out), "--model", str(tiny_tagger_dir), "--no-progress"]
    assert main(base) == 2
    assert "exists; pass --resume" in capsys.readouterr().err
    assert out.read_text() == precious
    assert main(base + ["--resume"]) == 2  # not an output of ours: refused, left alone
    assert "not a resumable output" in capsys.readouterr().err
    assert out.read_text() == precious
    assert main(["tag", str(src), "--resume", "--model", str(tiny_tagger_dir)]) == 2
    assert "--resume needs --output" in capsys.readouterr().err
    assert main(["tag", str(src), "--pretty", "--output", str(out)]) == 2
    assert main(["tag", str(tmp_path / "missing.txt"), "--model", str(tiny_tagger_dir)]) == 2
    assert "no such input file" in capsys.readouterr().err
    assert main(["tag", "--batch-size", "0"]) == 2  # argparse


@pytest.mark.parametrize("extra, message", [
    (["--threshold", "nan"], "expected a probability from 0 to 1, got nan"),
    (["--threshold", "1.5"], "expected a probability from 0 to 1, got 1.5"),
    (["--over-long", "cap"], "--over-long cap goes with --max-chars N"),
])
def test_options_out_of_range_or_without_their_partner_exit_2(tmp_path, tiny_tagger_dir, capsys,
                                                               extra, message):
    rc, out = tag(tmp_path, tiny_tagger_dir, b"a b c\n", *extra)
    assert rc == 2 and out == []
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_http_wait_and_timeout_must_be_finite(capsys, value):
    for option in ("--max-wait-ms", "--request-timeout"):
        assert main(["http", option, value]) == 2
        assert f"expected a finite number >= 0, got {value}" in capsys.readouterr().err


def test_input_file_name_that_is_not_utf8(tmp_path, tiny_tagger_dir):
    """A file name with a Latin-1 byte: its error records are written (the name escaped) and
    the run ends with exit 1 for the malformed line, not a stop that --resume cannot pass."""
    src = tmp_path / os.fsdecode(b"caf\xe9.txt")
    src.write_bytes(b"good line\n\nanother\n")
    out = tmp_path / "out.jsonl"
    rc = main(["tag", str(src), "--output", str(out), "--model", str(tiny_tagger_dir),
               "--no-progress", "--threads", "1", "--device", "cpu", "--backend", "torch"])
    recs = read_jsonl(out)
    assert rc == 1 and len(recs) == 3
    assert recs[1]["error"] == f"{src}: line 2: empty line"


def test_missing_model_exits_2_with_a_clear_message(tmp_path, capsys, monkeypatch):
    src = tmp_path / "in.txt"
    src.write_text("a b c\n")
    assert main(["tag", str(src), "--model", str(tmp_path / "nope")]) == 2
    assert f"--model {tmp_path / 'nope'}: no such directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["tag", str(src), "--model", str(tmp_path / "empty")]) == 2
    assert "not a tagger or export directory" in capsys.readouterr().err

    from mhmla_fast.ged import predict

    monkeypatch.setattr(predict, "default_model_path", lambda: tmp_path / "shipped")
    for cmd in (["tag", str(src)], ["http"], ["export", "--onnx", str(tmp_path / "x")]):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert "the shipped GED model is not installed" in err and "--model DIR" in err
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "x").exists()


def test_an_engine_crash_stops_with_exit_3_and_keeps_the_output(tmp_path, tiny_tagger_dir,
                                                                 monkeypatch, capsys):
    from mhmla_fast.serve.engine import Engine

    calls = []
    real = Engine.tag_texts

    def crash_on_second_batch(self, texts):
        calls.append(len(texts))
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return real(self, texts)

    monkeypatch.setattr(Engine, "tag_texts", crash_on_second_batch)
    rc, out = tag(tmp_path, tiny_tagger_dir, b"one two\n" * 10, "--batch-size", "4")
    assert rc == 3
    err = capsys.readouterr().err
    assert "tagging stopped: RuntimeError: device lost" in err and "--resume" in err
    assert [r["index"] for r in out] == [1, 2, 3, 4]  # the first batch is kept, synced


# ----------------------------------------------------------------------------------- resume


def test_resume_after_kill_9_equals_an_uninterrupted_run(tmp_path, tiny_tagger_dir):
    n = 3000
    lines = []
    for i in range(1, n + 1):
        if i % 401 == 0:
            lines.append('{"text": oops}')
        elif i % 3 == 0:
            text = f"Record {i} : they goes 🚲 to shcool"
            lines.append(json.dumps({"text": text, "id": f"r{i}"}))
        else:
            lines.append(f"Sentence number {i} , he have ünïcödé {'words ' * (i % 7)}.")
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out, full = tmp_path / "out.jsonl", tmp_path / "full.jsonl"
    opts = ["--model", str(tiny_tagger_dir), "--no-progress", "--threads", "1",
            "--batch-size", "16"]

    kill_after_lines(["tag", str(src), "--output", str(out), *opts], out, n)

    assert main(["tag", str(src), "--output", str(out), "--resume", *opts]) == 1
    assert main(["tag", str(src), "--output", str(full), *opts[:-1], "64"]) == 1
    resumed, uninterrupted = read_jsonl(out), read_jsonl(full)
    assert [r["index"] for r in resumed] == list(range(1, n + 1))
    assert len(resumed) == len(uninterrupted) == n
    for a, b in zip(resumed, uninterrupted):  # batches differ: probabilities within float noise
        assert {k: v for k, v in a.items() if k != "probs"} == {
            k: v for k, v in b.items() if k != "probs"}
        assert a.get("probs", []) == pytest.approx(b.get("probs", []), abs=1e-5)
    assert sum("error" in r for r in resumed) == n // 401
    # resuming a complete output does nothing more and still reports the bad lines
    assert main(["tag", str(src), "--output", str(out), "--resume", *opts]) == 1
    assert out.read_bytes().count(b"\n") == n


# --------------------------------------------------------------------------- http / export


def test_http_serves_the_app_on_localhost(tiny_tagger_dir, monkeypatch):
    uvicorn = pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    assert main(["http", "--model", str(tiny_tagger_dir), "--max-queue", "300", "--threads", "1",
                 "--max-texts-per-request", "3"]) == 0
    assert (seen["host"], seen["port"]) == ("127.0.0.1", 8000)
    assert seen["app"].state.batcher.max_queue == 300
    assert not seen["app"].state.batcher.alive, "the worker starts with the server, not before"
    assert main(["http", "--model", str(tiny_tagger_dir), "--max-queue", "2"]) == 2  # < 256 texts


def test_http_limit_conflicts_are_refused_before_any_model_loads(tiny_tagger_dir,
                                                                 tiny_scorer_dir, monkeypatch,
                                                                 capsys):
    """Limits that conflict (a queue smaller than one request, with a scorer than one request's
    essays; a body buffer smaller than one body) stopped the server only after the tagger and
    the scorer had loaded; now before either, in one process and with --workers."""
    pytest.importorskip("fastapi")
    from mhmla_fast.commands import serve as cli
    from mhmla_fast.serve import engine, http_workers, score

    loaded = []
    monkeypatch.setattr(engine.Engine, "load", classmethod(
        lambda cls, *a, **kw: loaded.append("tagger") or pytest.fail("the tagger loaded")))
    monkeypatch.setattr(score, "load_scorer",
                        lambda *a, **kw: loaded.append("scorer") or pytest.fail("scorer loaded"))
    monkeypatch.setattr(http_workers, "serve_workers",
                        lambda *a, **kw: loaded.append("workers") or True)
    base = ["http", "--model", str(tiny_tagger_dir), "--threads", "1"]
    cases = [
        (["--no-scorer", "--max-queue", "2"], "max_queue (2) must be >= max_texts_per_request"),
        (["--scorer", str(tiny_scorer_dir), "--max-queue", "300", "--max-texts-per-request",
          "3", "--max-essays-per-request", "400"],
         "max_queue (300) must be >= max_essays_per_request (400)"),
        (["--no-scorer", "--max-request-bytes", "5000", "--max-buffered-bytes", "4000"],
         "max_buffered_bytes (4000) must be >= max_request_bytes (5000)"),
    ]
    for extra, message in cases:
        for workers in ([], ["--workers", "2"]):
            assert main([*base, *extra, *workers]) == 2, (extra, workers)
            assert message in capsys.readouterr().err, (extra, workers)
    assert loaded == []
    # the essays' limit binds only where essays are scored
    args = cli.build_parser().parse_args([*base, *cases[1][0][2:], "--no-scorer"])
    assert cli.check_http_limits(args, scoring=False)["max_essays_per_request"] == 400


def test_export_delegates_to_the_exporters(tmp_path, tiny_tagger_dir, monkeypatch, capsys):
    from mhmla_fast.serve import onnx_export

    calls = []

    def fake_export(model_dir, out_dir, *, int8=False, **kw):
        calls.append(("onnx", Path(model_dir), Path(out_dir), int8))
        return Path(out_dir) / "model.onnx"

    monkeypatch.setattr(onnx_export, "export_onnx", fake_export)
    assert main(["export", "--onnx", str(tmp_path / "e"), "--int8", "--model",
                 str(tiny_tagger_dir)]) == 0
    assert calls == [("onnx", tiny_tagger_dir, tmp_path / "e", True)]

    from mhmla_fast.serve import tensorrt_engine

    if importlib.util.find_spec("tensorrt") is None:  # refused before any export (an ONNX
        capsys.readouterr()                           # export of 94 MB was left there before)
        assert main(["export", "--tensorrt", str(tmp_path / "t"), "--model",
                     str(tiny_tagger_dir)]) == 2
        assert "TensorRT" in capsys.readouterr().err and not (tmp_path / "t").exists()
        assert len(calls) == 1
    monkeypatch.setattr(tensorrt_engine, "import_tensorrt", lambda: None)
    monkeypatch.setattr(tensorrt_engine, "build_engine_dir", lambda d, **kw: calls.append(
        ("trt", Path(d), kw)) or Path(d) / "model.plan")
    assert main(["export", "--tensorrt", str(tmp_path / "t"), "--model", str(tiny_tagger_dir),
                 "--precision", "fp16"]) == 0
    assert calls[1:] == [("onnx", tiny_tagger_dir, tmp_path / "t", False),
                         ("trt", tmp_path / "t", {"layer_attention_plugin": False,
                                                  "fp16": True, "bf16": False})]
    export_dir = tmp_path / "export"  # an ONNX export is built in place, never re-exported
    export_dir.mkdir()
    (export_dir / "config.json").write_text('{"format": "mhmla-ged-tagger/1"}')
    (export_dir / "model.onnx").write_text("{}")
    assert main(["export", "--tensorrt", str(export_dir), "--model", str(export_dir)]) == 0
    assert calls[3][:2] == ("trt", export_dir)
    assert main(["export", "--tensorrt", str(tmp_path / "other"), "--model", str(export_dir)]) == 2
    assert "build its engine in place" in capsys.readouterr().err
    assert main(["export", "--tensorrt", str(tmp_path / "t"), "--int8"]) == 2
    assert main(["export", "--onnx", str(tmp_path / "t"), "--precision", "bf16",
                 "--model", str(tiny_tagger_dir)]) == 2
    assert main(["export"]) == 2
    # not a tagger, or an export to export again: usage errors (exit 1, "export failed", before)
    capsys.readouterr()
    scorer = tmp_path / "scorer"
    scorer.mkdir()
    (scorer / "config.json").write_text('{"format": "mhmla-aes-scorer/1"}')
    assert main(["export", "--onnx", str(tmp_path / "s"), "--model", str(scorer)]) == 2
    assert "not an mhmla GED tagger" in capsys.readouterr().err
    assert main(["export", "--onnx", str(tmp_path / "s"), "--model", str(export_dir)]) == 2
    assert "no model.safetensors" in capsys.readouterr().err
    assert len(calls) == 4


# ------------------------------------------------------------------- a review's findings


def test_input_from_a_pipe_or_fifo_gives_every_record(tmp_path, tiny_tagger_dir, tiny_engine):
    """A pipe given by name (`<(cmd)`, /dev/stdin) is read once: no peek may take its first
    buffer (it lost the first 4 KiB, or all, with exit 0), and a FIFO must not be opened twice
    (the second open waited for ever); the records equal the same bytes as a regular file's.
    A UTF-16 mark at a pipe's start is exit 2, as for a file."""
    import threading

    data = "".join(f"Sentence number {i} are here .\n" for i in range(1, 400)).encode()
    assert len(data) > 2 * 4096
    rc, want = tag(tmp_path, tiny_tagger_dir, data)
    assert rc == 0 and len(want) == 399
    common = ["--model", str(tiny_tagger_dir), "--no-progress", "--threads", "1", "--device",
              "cpu", "--dtype", "float32", "--backend", "torch"]

    def unblock(path):  # a run that opens the FIFO again waits for a writer: give it one
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader waiting
            pass

    def run_on(path, out, payload):
        writer = threading.Thread(target=lambda: Path(path).write_bytes(payload))
        writer.start()
        rescue = threading.Timer(60, unblock, (path,))  # (so a regression fails, not hangs)
        rescue.start()
        try:
            return main(["tag", path, "--output", str(out), *common])
        finally:
            rescue.cancel()
            writer.join(timeout=30)

    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    assert run_on(str(fifo), tmp_path / "fifo.jsonl", data) == 0
    assert read_jsonl(tmp_path / "fifo.jsonl") == want
    r, w = os.pipe()
    os.write(w, data[:8192])  # (a pipe holds 64 KiB: written ahead, as `<(cat f)` would)
    os.write(w, data[8192:])
    os.close(w)
    try:
        assert main(["tag", f"/dev/fd/{r}", "--output", str(tmp_path / "pipe.jsonl"),
                     *common]) == 0
    finally:
        os.close(r)
    assert read_jsonl(tmp_path / "pipe.jsonl") == want
    os.unlink(fifo)
    os.mkfifo(fifo)
    assert run_on(str(fifo), tmp_path / "wide.jsonl", "He go .\n".encode("utf-16")) == 2


def test_output_that_is_empty_or_the_input_is_refused(tmp_path, tiny_tagger_dir, capsys,
                                                       monkeypatch):
    """`-o ""` (an unset variable) is not standard output, and an output that is the input
    file is named as such (the message used to say to remove it); a closed standard output
    or input is exit 2 with a message, not a traceback."""
    src = tmp_path / "in.txt"
    src.write_text("He go .\n")
    base = ["--model", str(tiny_tagger_dir), "--no-progress"]
    assert main(["tag", str(src), "-o", "", *base]) == 2
    assert "--output: empty file name" in capsys.readouterr().err
    link = tmp_path / "link.txt"
    link.symlink_to(src)
    for cmd in ("tag", "score"):
        assert main([cmd, str(src), "-o", str(link), *base]) == 2
        assert f"is the input file {src}; write the results to another file" in \
            capsys.readouterr().err
    assert src.read_text() == "He go .\n"
    monkeypatch.setattr(sys, "stdout", None)
    assert main(["tag", str(src), *base, "--backend", "torch"]) == 2
    monkeypatch.undo()
    assert "standard output is closed; give an output file with -o" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", None)
    assert main(["tag", *base]) == 2
    assert "standard input is closed" in capsys.readouterr().err


def test_check_margin_is_recorded_so_a_resume_cannot_mix_it(tmp_path, tiny_tagger_dir):
    """--check-margin 0 is bf16 alone: an output begun with it records it, and a resume
    without it (or with another margin) is refused; without the option nothing is recorded,
    as in the sidecars of before."""
    import argparse

    from mhmla_fast.commands.serve import made_from

    args = argparse.Namespace(backend="auto", format="auto", encoding="utf-8", max_chars=None,
                              check_margin=0.0)
    assert made_from("tag", tiny_tagger_dir, args)["check_margin"] == 0.0
    args.check_margin = None
    assert "check_margin" not in made_from("tag", tiny_tagger_dir, args)


def test_pretty_view_cannot_be_driven_by_an_id(tmp_path, tiny_tagger_dir, tiny_engine):
    from mhmla_fast.serve.pipeline import format_pretty

    line = format_pretty({"index": 1, "id": "\x1b[2J\x1b[31mX", "error": "bad \x1b]0;t\x07"},
                         None, colour=False)
    assert "\x1b" not in line and "\x07" not in line and "[2J" in line


def test_ctrl_c_before_the_records_is_exit_130_and_not_a_fallback(tmp_path, monkeypatch, capsys):
    """Ctrl-C while a C extension initialises surfaces as `ImportError: initialization
    failed`: backend auto re-raises the interrupt instead of running torch; and an interrupt
    during start-up is the one-line exit 130, not a traceback."""
    from mhmla_fast.serve import export_cache

    def interrupted():
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as err:
            raise ImportError("initialization failed") from err

    with pytest.raises(KeyboardInterrupt):
        try:
            interrupted()
        except ImportError as err:
            export_cache._raise_interrupt(err)
    export_cache._raise_interrupt(ImportError("no module named onnxruntime"))  # a real one

    import mhmla_fast.commands.serve as serve

    def load(*a, **kw):
        raise KeyboardInterrupt

    src = tmp_path / "in.txt"
    src.write_text("He go .\n")
    monkeypatch.setattr(serve, "load_engine", load)
    assert main(["tag", str(src), "--no-progress"]) == 130
    assert capsys.readouterr().err.strip() == "mhmla-serve: interrupted"


def test_an_output_name_too_long_for_its_sidecar_is_refused_before_it_is_made(
        tmp_path, tiny_tagger_dir, capsys):
    src = tmp_path / "in.txt"
    src.write_text("He go .\n")
    out = tmp_path / ("o" * 248)  # the output fits NAME_MAX (255); its sidecar's names do not
    assert main(["tag", str(src), "-o", str(out), "--model", str(tiny_tagger_dir),
                 "--no-progress"]) == 2
    assert "the name is too long for its sidecar" in capsys.readouterr().err
    assert not out.exists()


def test_a_resume_is_refused_when_the_encoder_files_the_model_reads_changed(
        tmp_path, tiny_tagger_dir, capsys):
    """A model that reads files from its encoder's folder (the shipped ones: word embeddings
    and tokenizer from the encoder package) records their fingerprint: after those files
    change (a package upgrade) a resume is refused, not mixed. An output made before the
    fingerprint was recorded still resumes (its sidecar lacks the key)."""
    import shutil

    from mhmla_fast.serve.outputs import meta_path

    from safetensors.torch import load_file, save_file

    config = json.loads((tiny_tagger_dir / "config.json").read_text())
    encoder = shutil.copytree(config["encoder_spec"]["name_or_path"], tmp_path / "encoder")
    model = shutil.copytree(tiny_tagger_dir, tmp_path / "model")
    key = "encoder.embeddings.word_embeddings.weight"  # read from the encoder's folder
    state = load_file(model / "model.safetensors")
    del state[key]
    save_file(state, model / "model.safetensors")
    (model / "config.json").write_text(json.dumps(
        {**config, "encoder_spec": {**config["encoder_spec"], "name_or_path": str(encoder)},
         "base_tensors": {key: key[len("encoder."):]}}))
    src, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_text("".join(f"sentence number {k} is here .\n" for k in range(40)))
    base = ["tag", str(src), "--output", str(out), "--model", str(model), "--no-progress",
            "--backend", "torch"]
    assert main(base) == 0
    sidecar = json.loads(Path(meta_path(str(out))).read_text())
    assert len(sidecar["made_from"]["encoder_sha256"]) == 64
    done = out.read_text().splitlines()
    out.write_text("\n".join(done[:10]) + "\n")  # as if stopped after 10 records
    (encoder / "config.json").write_text(json.dumps(
        {**json.loads((encoder / "config.json").read_text()), "upgraded": 1}))
    capsys.readouterr()
    assert main(base + ["--resume"]) == 2
    assert "encoder_sha256" in capsys.readouterr().err
    assert len(out.read_text().splitlines()) == 10  # untouched
    # a sidecar from before the key: resumed (and the key recorded from then on)
    del sidecar["made_from"]["encoder_sha256"]
    Path(meta_path(str(out))).write_text(json.dumps(sidecar))
    assert main(base + ["--resume"]) == 0
    assert len(out.read_text().splitlines()) == 40
    assert "encoder_sha256" in json.loads(Path(meta_path(str(out))).read_text())["made_from"]


def test_sigterm_stops_tag_as_ctrl_c_does(tmp_path, tiny_tagger_dir):
    """A plain kill (SIGTERM) of `tag` stops it as Ctrl-C does (Python's default ended the
    process without its cleanup, leaving host workers running): exit 130, the --resume hint;
    the handler before the command is back after it. In a fresh process, as a user's command
    runs: in the test process, after the rest of the suite, the signal itself crashed it
    (SIGSEGV on delivery, seen on a CPU with avx512_bf16; some earlier test's library had left
    the process's signal state broken), whatever the command did."""
    import subprocess

    src, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_bytes(b"He go to school .\n")
    script = f"""
import os, signal, sys
from mhmla_fast.commands.serve import main
from mhmla_fast.serve.engine import Engine

def terminated(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    raise AssertionError("SIGTERM did not interrupt the call")

Engine.tag_texts = terminated
before = signal.getsignal(signal.SIGTERM)
rc = main(["tag", {str(src)!r}, "--output", {str(out)!r}, "--model", {str(tiny_tagger_dir)!r},
           "--no-progress", "--threads", "1", "--device", "cpu", "--dtype", "float32",
           "--backend", "torch"])
print("handler restored:", signal.getsignal(signal.SIGTERM) == before)
sys.exit(rc)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 130, run.stderr[-2000:]
    assert "interrupted; rerun with --resume" in run.stderr
    assert "handler restored: True" in run.stdout
    assert not out.exists() or read_jsonl(out) == []


def test_sigterm_handling_survives_ray_init_and_respects_an_ignored_sigterm(monkeypatch):
    """ray.init installs a SIGTERM handler that exits at once: _init_ray puts the command's
    back. A SIGTERM a parent set to be ignored stays ignored."""
    import signal

    ray = pytest.importorskip("ray")
    from mhmla_fast.commands import serve as cli
    from mhmla_fast.serve import ray as ray_jobs

    def rays_own(signum, frame):
        raise SystemExit(signum)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: signal.signal(signal.SIGTERM, rays_own))
    before = signal.getsignal(signal.SIGTERM)
    mine = cli._terminate_as_interrupt()
    try:
        ours = signal.getsignal(signal.SIGTERM)
        assert ray_jobs._init_ray(None, 1) is True
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, mine)
    assert signal.getsignal(signal.SIGTERM) == before
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        assert cli._terminate_as_interrupt() is None
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)


def test_score_offers_only_the_backends_it_runs(capsys):
    """``score --help`` listed onnx, openvino and tensorrt and said in the same breath that the
    scorer has none of them; argparse now offers auto and torch only."""
    assert main(["score", "--backend", "onnx", "x.jsonl"]) == 2
    assert "invalid choice: 'onnx' (choose from 'auto', 'torch')" in capsys.readouterr().err
