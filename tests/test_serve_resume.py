"""Resume never mixes outputs (issue 14): the sidecar ``OUT.meta.json`` records what an output was
made from (input fingerprint, model, options) and ``--resume`` refuses any difference with exit 2;
a file that is not ours is never truncated; a second writer is stopped by the lock. The writer is
tested directly, then ``mhmla-serve tag`` / ``score`` end to end on the tiny models."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest

from mhmla_fast.commands.serve import main
from mhmla_fast.serve.inputs import iter_input_records
from mhmla_fast.serve.outputs import (
    OutputCorruptError,
    OutputLockedError,
    ResumableJsonlWriter,
    ResumeMismatchError,
    meta_path,
)
from mhmla_fast.serve.records import run_records

# ------------------------------------------------------------------------------------ writer


def test_the_sidecar_is_written_first_and_replaced_atomically(tmp_path):
    out = tmp_path / "o.jsonl"
    with ResumableJsonlWriter(str(out), made_from={"threshold": 0.5}) as w:
        meta = json.loads(Path(meta_path(str(out))).read_text())
        assert meta["format"] == "mhmla-serve-output/1"
        assert meta["made_from"] == {"threshold": 0.5} and meta["input"]["records"] == 0
        w.vouch(3, "abc")
        w.write({"index": 1})
    assert json.loads(Path(meta_path(str(out))).read_text())["input"] == {"records": 3,
                                                                          "sha256": "abc"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl", "o.jsonl.meta.json"]
    with pytest.raises(ValueError, match="made_from must be JSON data"):
        ResumableJsonlWriter(str(tmp_path / "x.jsonl"), made_from={"f": object()})


@pytest.mark.parametrize("foreign", [b"hello, not json at all\n", b"hello", b'{"index": 1}\n'],
                         ids=["text-line", "no-newline", "looks-like-ours"])
def test_a_file_that_is_not_ours_is_never_truncated(tmp_path, foreign):
    out = tmp_path / "o.jsonl"
    out.write_bytes(foreign)
    with pytest.raises(OutputCorruptError, match=r"not a resumable output of this version of mhmla-serve: it has no o\.jsonl\.meta\.json"):
        ResumableJsonlWriter(str(out), resume=True)
    assert out.read_bytes() == foreign and not Path(meta_path(str(out))).exists()
    Path(meta_path(str(out))).write_text('{"format": "something else"}')
    with pytest.raises(OutputCorruptError, match="not a mhmla-serve-output/1 sidecar"):
        ResumableJsonlWriter(str(out), resume=True)
    assert out.read_bytes() == foreign


def test_other_settings_are_refused_by_name_and_nothing_is_touched(tmp_path):
    out = tmp_path / "o.jsonl"
    with ResumableJsonlWriter(str(out), made_from={"model_sha256": "m1", "threshold": 0.5}) as w:
        w.vouch(2, "h")
        w.write({"index": 1})
        w.write({"index": 2})
    before = out.read_bytes() + b'{"index": 3, "to'  # a torn line too: still untouched
    out.write_bytes(before)
    with pytest.raises(ResumeMismatchError, match=r"other settings \(threshold: 0\.5 then, 0\.7 "
                       r"now\); refusing to mix outputs"):
        ResumableJsonlWriter(str(out), resume=True,
                             made_from={"model_sha256": "m1", "threshold": 0.7})
    with pytest.raises(ResumeMismatchError, match="model_sha256: 'm1' then, 'm2' now"):
        ResumableJsonlWriter(str(out), resume=True, made_from={"model_sha256": "m2",
                                                              "threshold": 0.5})
    assert out.read_bytes() == before
    with ResumableJsonlWriter(str(out), resume=True,
                              made_from={"threshold": 0.5, "model_sha256": "m1"}) as w:
        assert (w.done, w.vouched) == (2, 2)
    assert out.read_bytes() == before[: before.rindex(b"\n") + 1]


def test_a_second_writer_is_stopped_by_the_lock(tmp_path):
    out = tmp_path / "o.jsonl"
    first = ResumableJsonlWriter(str(out))
    first.vouch(2, "h")
    first.write({"index": 1})
    first.sync()
    for resume in (True, False):
        with pytest.raises(OutputLockedError, match="being written by another process"):
            ResumableJsonlWriter(str(out), resume=resume)
    first.write({"index": 2})
    first.close()
    assert out.read_text() == '{"index":1}\n{"index":2}\n'
    with ResumableJsonlWriter(str(out), resume=True) as w:  # the lock goes with the writer
        assert w.done == 2
    fresh = tmp_path / "fresh.jsonl"  # two fresh runs on a path that did not exist
    with ResumableJsonlWriter(str(fresh)):
        with pytest.raises(OutputLockedError):
            ResumableJsonlWriter(str(fresh))


def test_resume_with_more_input_lines_continues(tmp_path):
    """The fingerprint covers the records seen so far: input that grew at its end is the same
    input, and resuming it adds the new records."""
    src = tmp_path / "in.txt"
    src.write_text("a\nb\nc\n")
    out = tmp_path / "o.jsonl"

    def process(batch):
        return [{"t": r.text} for r in batch]

    with ResumableJsonlWriter(str(out)) as w:
        run_records(iter_input_records([str(src)]), process, w, batch_size=2, progress=False)
    src.write_text("a\nb\nc\nd\n")
    with ResumableJsonlWriter(str(out), resume=True) as w:
        s = run_records(iter_input_records([str(src)]), process, w, batch_size=2, progress=False)
    assert (s.n_resumed, s.n_total) == (3, 4)
    assert [json.loads(x)["t"] for x in out.read_text().splitlines()] == ["a", "b", "c", "d"]


# ------------------------------------------------------------------------------- the command


def _tag(src: Path, out: Path, model: Path, *extra: str) -> int:
    return main(["tag", str(src), "--output", str(out), "--model", str(model), "--no-progress",
                 "--threads", "1", "--device", "cpu", "--dtype", "float32", *extra])


def _interrupted(tmp_path: Path, model: Path, monkeypatch, src: Path, out: Path,
                 *extra: str) -> bytes:
    """Tag ``src`` into ``out`` until the engine's second batch crashes (exit 3), as an
    interrupted run leaves it; returns the output."""
    from mhmla_fast.serve.engine import Engine

    real, calls = Engine.tag_texts, []

    def crash_on_second_batch(self, texts, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("interrupted")
        return real(self, texts, **kw)

    with monkeypatch.context() as m:
        m.setattr(Engine, "tag_texts", crash_on_second_batch)
        assert _tag(src, out, model, "--batch-size", "4", *extra) == 3
    data = out.read_bytes()
    assert data.count(b"\n") == 4
    return data


def test_resume_with_another_input_or_threshold_is_refused(tmp_path, tiny_tagger_dir,
                                                           monkeypatch, capsys):
    a, b, out = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "out.jsonl"
    a.write_text("".join(f"sentence {i} from file a .\n" for i in range(20)))
    b.write_text("".join(f"sentence {i} from file b .\n" for i in range(20)))
    jsonl = tmp_path / "b.jsonl"  # JSONL without ids: the ids are the indices, as in a.txt
    jsonl.write_text("".join(json.dumps({"text": f"other {i} ."}) + "\n" for i in range(20)))
    done = _interrupted(tmp_path, tiny_tagger_dir, monkeypatch, a, out)
    capsys.readouterr()
    for other in (b, jsonl):
        assert _tag(other, out, tiny_tagger_dir, "--resume") == 2
        err = capsys.readouterr().err
        assert "was made from other input" in err and "refusing to mix outputs" in err, err
    assert _tag(a, out, tiny_tagger_dir, "--resume", "--threshold", "0.7") == 2
    assert "threshold: 0.5 then, 0.7 now" in capsys.readouterr().err
    assert _tag(a, out, tiny_tagger_dir, "--resume", "--format", "text") == 2
    assert "format: 'auto' then, 'text' now" in capsys.readouterr().err
    assert _tag(a, out, tiny_tagger_dir, "--resume", "--max-chars", "10") == 2
    assert "max_chars: None then, 10 now" in capsys.readouterr().err
    assert out.read_bytes() == done  # every refusal left it alone

    assert _tag(a, out, tiny_tagger_dir, "--resume") == 0  # the same run finishes it
    full = tmp_path / "full.jsonl"
    assert _tag(a, full, tiny_tagger_dir) == 0
    assert out.read_text() == full.read_text()


def test_resume_with_another_model_is_refused(tmp_path, tiny_tagger_dir, monkeypatch, capsys):
    import shutil

    src, out = tmp_path / "a.txt", tmp_path / "out.jsonl"
    src.write_text("".join(f"line {i} .\n" for i in range(20)))
    _interrupted(tmp_path, tiny_tagger_dir, monkeypatch, src, out)
    other = tmp_path / "other-model"
    shutil.copytree(tiny_tagger_dir, other)
    assert _tag(src, out, other, "--resume") == 0  # a copy is the same model
    out.unlink()
    _interrupted(tmp_path, tiny_tagger_dir, monkeypatch, src, out)
    config = json.loads((other / "config.json").read_text())
    config["threshold"] = 0.25  # another model (here: its tuned threshold)
    (other / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert _tag(src, out, other, "--resume") == 2
    assert "model_sha256:" in capsys.readouterr().err


def test_the_command_never_truncates_a_foreign_file_and_respects_the_lock(tmp_path,
                                                                          tiny_tagger_dir,
                                                                          capsys):
    src, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_text("a b c\n")
    out.write_text("my notes, not JSON\n")
    assert _tag(src, out, tiny_tagger_dir, "--resume") == 2
    assert "not a resumable output of this version of mhmla-serve" in capsys.readouterr().err
    assert out.read_text() == "my notes, not JSON\n"

    out.unlink()
    assert _tag(src, out, tiny_tagger_dir) == 0
    before = out.read_bytes()
    fd = os.open(out, os.O_RDWR)  # another process writing it holds the lock
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert _tag(src, out, tiny_tagger_dir, "--resume") == 2
        assert "being written by another process" in capsys.readouterr().err
    finally:
        os.close(fd)
    assert out.read_bytes() == before


def test_score_resume_with_another_input_is_refused(tmp_path, tiny_scorer_dir, capsys):
    a, b, out = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "out.jsonl"
    a.write_text("".join(json.dumps({"text": f"essay {i} text .", "prompt": 1}) + "\n"
                         for i in range(6)))
    b.write_text("".join(json.dumps({"text": f"other {i} text .", "prompt": 1}) + "\n"
                         for i in range(6)))
    base = ["--output", str(out), "--model", str(tiny_scorer_dir), "--no-progress",
            "--threads", "1", "--device", "cpu"]
    assert main(["score", str(a), *base]) == 0
    before = out.read_bytes()
    assert main(["score", str(b), *base, "--resume"]) == 2
    assert "was made from other input" in capsys.readouterr().err
    assert main(["score", str(a), *base, "--resume", "--dtype", "bfloat16"]) == 2
    assert "dtype: 'float32' then, 'bfloat16' now" in capsys.readouterr().err
    assert main(["score", str(a), *base, "--resume"]) == 0
    assert out.read_bytes() == before
