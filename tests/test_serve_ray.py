"""``mhmla-serve tag --ray`` / ``score --ray`` (issue 12) on a local Ray with 2 CPU workers, one
Ray start for the module: records equal to the single-process CLI's (malformed lines included,
input order, the same sidecar), and exactly once when an actor dies mid-job or the job is killed
after some shards were committed and run again with ``--resume``. Refusals need no Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from mhmla_fast.commands.serve import main  # noqa: E402
from mhmla_fast.serve import ray as serve_ray  # noqa: E402
from mhmla_fast.serve.outputs import meta_path  # noqa: E402
from essay_pieces import NO_PIECES_TEXTS, UNK_TEXTS  # noqa: E402

BASE = ["--no-progress", "--threads", "1", "--device", "cpu", "--dtype", "float32"]
MALFORMED = [b'{"text": oops}', b"", b"caf\xe9 latin-1", b'{"tokens": []}', b'{"text": 42}']


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module: 2 CPUs, so 2 single-thread actors."""
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def assert_same_records(got: list[dict], want: list[dict]) -> None:
    """Equal records; probabilities within float noise (batches are cut at other places)."""
    assert [r["index"] for r in got] == list(range(1, len(want) + 1))
    for a, b in zip(got, want):
        assert {k: v for k, v in a.items() if k != "probs"} == {
            k: v for k, v in b.items() if k != "probs"}
        assert a.get("probs", []) == pytest.approx(b.get("probs", []), abs=1e-5)


def sentences(n: int, seed: int = 0) -> bytes:
    """``n`` short lines: plain text, JSON with ids and tokens, a long text (several encoder
    windows) now and then, and a malformed line every 97."""
    lines = []
    for i in range(1, n + 1):
        if i % 97 == 0:
            lines.append(MALFORMED[(i // 97) % len(MALFORMED)])
        elif i % 5 == 0:
            lines.append(json.dumps({"text": f"Record {i + seed} : they goes 🚲 to shcool",
                                     "id": f"r{i}"}).encode())
        elif i % 7 == 0:
            lines.append(json.dumps({"tokens": ["She", "see", str(i), "."]}).encode())
        elif i % 331 == 0:
            lines.append(("a very long ünïcödé sentence " * 20).encode())
        else:
            lines.append(f"Sentence {i + seed} , he have {'words ' * (i % 6)}.".encode())
    return b"\n".join(lines) + b"\n"


def tag_args(tiny_tagger_dir: Path, *files: Path) -> list[str]:
    return ["tag", *map(str, files), "--model", str(tiny_tagger_dir), *BASE]


# ------------------------------------------------------------------------- equal to the CLI


def test_tag_on_ray_equals_the_single_process_cli(tmp_path, tiny_tagger_dir, local_ray):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(b"\xef\xbb\xbf" + sentences(1700))  # a BOM, and shards that span two files
    b.write_bytes(sentences(1300, seed=5000).rstrip(b"\n") + b"\r")  # no final newline
    want, got = tmp_path / "cli.jsonl", tmp_path / "ray.jsonl"
    args = tag_args(tiny_tagger_dir, a, b)
    assert main([*args, "--output", str(want)]) == 1
    assert main([*args, "--output", str(got), "--ray", "--ray-workers", "2",
                 "--shard-size", "700"]) == 1
    expected = read_jsonl(want)
    assert len(expected) == 3000 and sum("error" in r for r in expected) == 30
    assert_same_records(read_jsonl(got), expected)
    assert [r["error"] for r in read_jsonl(got) if "error" in r] == [
        r["error"] for r in expected if "error" in r]  # file names and line numbers too
    assert json.loads(Path(meta_path(str(got))).read_text()) == {
        **json.loads(Path(meta_path(str(want))).read_text()), "output": "ray.jsonl"}
    assert not serve_ray.shards_dir(str(got)).exists()
    # a finished Ray output is a finished mhmla-serve output: the CLI resumes it to no effect
    before = got.read_bytes()
    assert main([*args, "--output", str(got), "--resume"]) == 1
    assert got.read_bytes() == before


def test_score_on_ray_equals_the_single_process_cli(tmp_path, tiny_scorer_dir, local_ray):
    lines = []
    for i in range(1, 301):
        if i % 37 == 0:
            lines.append(["plain text is not an essay record", '{"text": "x", "prompt": 9}',
                          '{"text": "no head for it", "prompt": 8}', '{"prompt": 1}'][i // 37 % 4])
        elif i % 41 == 0:  # no word pieces: an error record made on the worker, as the CLI's
            lines.append(json.dumps({"text": NO_PIECES_TEXTS[i // 41 % 2], "prompt": 2}))
        elif i % 43 == 0:  # only [UNK] pieces: scored
            lines.append(json.dumps({"text": UNK_TEXTS[i // 43 % 2], "prompt": 3}))
        else:
            text = f"Essay {i} . " + "I think that computers is good for peoples . " * (i % 9 + 1)
            lines.append(json.dumps({"text": text, "prompt": i % 7 + 1, "id": f"e{i}"}))
    src = tmp_path / "essays.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    want, got = tmp_path / "cli.jsonl", tmp_path / "ray.jsonl"
    args = ["score", str(src), "--model", str(tiny_scorer_dir), *BASE]
    assert main([*args, "--output", str(want)]) == 1
    assert main([*args, "--output", str(got), "--ray", "--shard-size", "64"]) == 1
    expected = read_jsonl(want)
    assert sum("error" in r for r in expected) == 8 + 7
    assert sum("gives no word pieces" in r.get("error", "") for r in expected) == 7
    assert read_jsonl(got) == expected
    assert json.loads(Path(meta_path(str(got))).read_text())["input"] == json.loads(
        Path(meta_path(str(want))).read_text())["input"]


# --------------------------------------------------------------------------- exactly once


def _job(tiny_tagger_dir: Path, **kw) -> serve_ray.RayJob:
    return serve_ray.RayJob("tag", str(tiny_tagger_dir), device="cpu", dtype="float32",
                            threads=1, threshold=0.5, **kw)


def _made_from(tiny_tagger_dir: Path) -> dict:
    """The ``made_from`` of the CLI's sidecar for :func:`tag_args` (default options)."""
    import argparse

    from mhmla_fast.commands.serve import made_from

    args = argparse.Namespace(backend="auto", format="auto", encoding="utf-8", max_chars=None,
                              over_long="skip")
    return made_from("tag", tiny_tagger_dir, args, dtype="float32", threshold=0.5)


def test_an_actor_that_dies_mid_job_still_yields_each_record_once(tmp_path, tiny_tagger_dir,
                                                                 local_ray):
    src, out, want = tmp_path / "in.txt", tmp_path / "out.jsonl", tmp_path / "cli.jsonl"
    src.write_bytes(sentences(1200))
    marker = tmp_path / "crashed"
    job = _job(tiny_tagger_dir, crash_once=(str(marker), 650))  # in the third of four shards
    commits: list[int] = []
    summary = serve_ray.run_job(job, [str(src)], str(out), made_from={"test": 1}, workers=2,
                                shard_size=300, progress=False, on_commit=commits.append)
    assert marker.exists(), "the actor did not die"
    assert sorted(commits) == [0, 1, 2, 3]  # each shard committed once
    assert (summary.n_total, summary.n_errors) == (1200, 12)
    assert main([*tag_args(tiny_tagger_dir, src), "--output", str(want)]) == 1
    assert_same_records(read_jsonl(out), read_jsonl(want))


def test_a_job_killed_after_some_shards_resumes_exactly_once(tmp_path, tiny_tagger_dir,
                                                             local_ray, capsys):
    src, out, want = tmp_path / "in.txt", tmp_path / "out.jsonl", tmp_path / "cli.jsonl"
    src.write_bytes(sentences(1000))
    args = [*tag_args(tiny_tagger_dir, src), "--output", str(out)]
    job = _job(tiny_tagger_dir)
    made = _made_from(tiny_tagger_dir)

    def die_after_two(k: int) -> None:
        if len(list(serve_ray.shards_dir(str(out)).glob("*.jsonl"))) >= 2:
            raise KeyboardInterrupt  # the driver killed between two commits

    with pytest.raises(KeyboardInterrupt):
        serve_ray.run_job(job, [str(src)], str(out), made_from=made, workers=2, shard_size=200,
                          progress=False, on_commit=die_after_two)
    folder = serve_ray.shards_dir(str(out))
    first = {p.name: p.stat().st_mtime_ns for p in folder.glob("*.jsonl")}
    assert len(first) >= 2 and out.read_bytes() == b""
    (folder / ".00000004-0000.jsonl.tmp").write_bytes(b'{"index": 801, "id"')  # torn shard

    assert main([*args, "--ray"]) == 2  # never without --resume
    assert "pass --resume" in capsys.readouterr().err
    assert main([*args, "--ray", "--resume", "--threshold", "0.7"]) == 2  # nor other settings
    assert "threshold: 0.5 then, 0.7 now" in capsys.readouterr().err

    commits: list[int] = []
    serve_ray.run_job(job, [str(src)], str(out), made_from=made, resume=True, workers=2,
                      progress=False, on_commit=commits.append)
    assert sorted(commits) == sorted(set(range(5)) - {int(n[:8]) for n in first})
    assert not folder.exists()
    assert main([*tag_args(tiny_tagger_dir, src), "--output", str(want)]) == 1
    assert_same_records(read_jsonl(out), read_jsonl(want))
    assert main([*args, "--resume", "--ray"]) == 1  # finished: nothing more to do
    assert out.read_bytes().count(b"\n") == 1000


def test_ray_resumes_an_interrupted_single_process_output(tmp_path, tiny_tagger_dir, local_ray,
                                                         monkeypatch, capsys):
    """A ``mhmla-serve tag`` run that stopped part-way is finished by ``--ray --resume`` (the
    sidecar rules are the CLI's); another input is refused, the output untouched."""
    from mhmla_fast.serve.engine import Engine

    src, other = tmp_path / "in.txt", tmp_path / "other.txt"
    src.write_bytes(sentences(400))
    other.write_bytes(sentences(400, seed=1))
    out, want = tmp_path / "out.jsonl", tmp_path / "cli.jsonl"
    real, calls = Engine.tag_texts, []

    def crash_on_third_batch(self, texts, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("interrupted")
        return real(self, texts, **kw)

    with monkeypatch.context() as m:
        m.setattr(Engine, "tag_texts", crash_on_third_batch)
        assert main([*tag_args(tiny_tagger_dir, src), "--output", str(out),
                     "--batch-size", "50"]) == 3
    done = out.read_bytes()
    assert 0 < done.count(b"\n") < 400
    ray_args = ["--output", str(out), "--resume", "--ray", "--shard-size", "128"]
    assert main([*tag_args(tiny_tagger_dir, other), *ray_args]) == 2
    assert "was made from other input" in capsys.readouterr().err
    assert out.read_bytes() == done and not serve_ray.shards_dir(str(out)).exists()
    assert main([*tag_args(tiny_tagger_dir, src), *ray_args]) == 1
    assert main([*tag_args(tiny_tagger_dir, src), "--output", str(want)]) == 1
    assert out.read_bytes().startswith(done)
    assert_same_records(read_jsonl(out), read_jsonl(want))


def test_shards_read_back_the_records_of_the_cli_parser_also_from_a_uri(tmp_path):
    """No Ray: the plan's shards, read back by byte range from the local path or from a
    ``file://`` URI (pyarrow's filesystems), are the CLI parser's records (BOM, CRLF, no final
    newline, malformed lines)."""
    from mhmla_fast.serve.inputs import iter_input_records

    src = tmp_path / "in.txt"
    src.write_bytes(b"\xef\xbb\xbf" + sentences(300).replace(b"\n", b"\r\n", 7) + b"last\r")
    job = serve_ray.RayJob("tag", "unused")
    want = list(iter_input_records([str(src)], "tag"))
    lines = list(open(src, "rb"))
    for path in (str(src), src.as_uri()):
        assert [raw for _, _, raw in serve_ray._range_lines(job, path)] == lines
        assert [raw for _, _, raw in serve_ray._range_lines(job, path, len(lines[0]),
                                                             len(lines[0]) + len(lines[1]))
                ] == lines[1:2]
    for path in (str(src), src.as_uri()):
        plan = serve_ray.plan_shards(job, [path], 64)
        assert plan.records == 301 and [s.count for s in plan.shards] == [64] * 4 + [45]
        got = [r for s in plan.shards for r in serve_ray.read_shard(job, s)]
        assert [r.source for r in got] == [path] * 301
        assert [r.error.replace(path, "SRC") if r.error else None for r in got] == [
            r.error.replace(str(src), "SRC") if r.error else None for r in want]
        assert [(r.index, r.line, r.id, r.text, r.tokens) for r in got] == [
            (r.index, r.line, r.id, r.text, r.tokens) for r in want]
    with pytest.raises(FileNotFoundError, match="no such input file"):
        serve_ray.plan_shards(job, [(tmp_path / "missing.txt").as_uri()], 64)


def test_a_utf16_input_is_refused_up_front_also_from_a_uri(tmp_path, tiny_tagger_dir, capsys):
    """No Ray: UTF-16 text (PowerShell's ``>``) is refused before any output, for a local
    path (checked when opened) and a ``file://`` URI alike; it used to give an error record
    per line on Ray when read from a URI."""
    src = tmp_path / "in.txt"
    src.write_bytes("a b\nc d\n".encode("utf-16"))
    job = serve_ray.RayJob("tag", "unused")
    for path in (str(src), src.as_uri()):
        with pytest.raises(ValueError, match="UTF-16 byte-order mark"):
            serve_ray.plan_shards(job, [path], 64)
        assert main(["tag", path, "--model", str(tiny_tagger_dir), "--output",
                     str(tmp_path / "o.jsonl"), "--ray"]) == 2
        assert "UTF-16 byte-order mark" in capsys.readouterr().err
        assert not (tmp_path / "o.jsonl").exists()


# ------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("extra, message", [
    (["--ray-workers", "2"], "--ray-workers goes with --ray"),
    (["--shard-size", "9"], "--shard-size goes with --ray"),
    (["--ray"], "give --output FILE"),
    (["--output", "o.jsonl", "--ray", "notes.txt"], "not a Ray address"),
    (["--output", "o.jsonl", "--pretty", "--ray"], "cannot be combined"),
])
def test_ray_options_that_cannot_be_honoured_are_errors(tmp_path, tiny_tagger_dir, capsys,
                                                       monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.txt").write_text("a b\n")
    assert main([*tag_args(tiny_tagger_dir, tmp_path / "in.txt"), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_stdin_is_refused_on_ray(tiny_tagger_dir, tmp_path, capsys):
    assert main(["tag", "-", "--model", str(tiny_tagger_dir), "--output",
                 str(tmp_path / "o.jsonl"), "--ray"]) == 2
    assert "not standard input" in capsys.readouterr().err


def test_refusals_before_any_file_is_made_on_ray(tmp_path, tiny_tagger_dir, tiny_scorer_dir,
                                                capsys):
    """No Ray needed: a model of the wrong kind, an input that is a pipe, an output that cannot
    be opened, and an input given right after --ray are usage errors (exit 2), nothing made.
    Before, they were a traceback (exit 1), or exit 3 with a --resume hint that could not
    help, or a misleading message."""
    import os

    src = tmp_path / "in.txt"
    src.write_text("a b\n")
    out = tmp_path / "o.jsonl"
    cases = [
        (["tag", str(src), "--model", str(tiny_scorer_dir)], "not an mhmla GED tagger"),
        (["score", str(src), "--model", str(tiny_tagger_dir)], "not an mhmla essay scorer"),
    ]
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    cases.append(([*tag_args(tiny_tagger_dir, fifo)], "not a regular file"))
    for extra, message in cases:
        assert main([*extra, *BASE, "--output", str(out), "--ray"]) == 2, extra
        assert message in capsys.readouterr().err
        assert not out.exists() and not serve_ray.shards_dir(str(out)).exists()
    for bad in (tmp_path / "no-such-folder" / "o.jsonl", tmp_path):
        assert main([*tag_args(tiny_tagger_dir, src), "--output", str(bad), "--ray"]) == 2
        err = capsys.readouterr().err
        assert "stopped" not in err and "--resume" not in err, err
    assert main(["tag", "--ray", str(src), "--output", str(out), "--model",
                 str(tiny_tagger_dir)]) == 2
    assert "give the input files before --ray" in capsys.readouterr().err


def test_a_job_whose_workers_cannot_start_leaves_nothing(tmp_path, tiny_tagger_dir, local_ray,
                                                         capsys):
    """Workers that cannot load the model (here --backend onnx on a model never exported):
    the job stops before its first shard and removes the output, sidecar and shards folder it
    made, saying the same command tries again (before: exit 3 with a --resume hint, and
    three things to delete by hand before anything could run)."""
    src, out = tmp_path / "in.txt", tmp_path / "o.jsonl"
    src.write_bytes(sentences(50))
    assert main([*tag_args(tiny_tagger_dir, src), "--output", str(out), "--ray",
                 "--backend", "onnx"]) == 3
    err = capsys.readouterr().err
    assert "tagging could not start" in err and "nothing was written" in err
    assert "--resume" not in err.splitlines()[-1]
    assert not out.exists() and not Path(meta_path(str(out))).exists()
    assert not serve_ray.shards_dir(str(out)).exists()
    assert main([*tag_args(tiny_tagger_dir, src), "--output", str(out), "--ray"]) == 0


def test_a_single_process_resume_of_a_ray_output_removes_its_shards(tmp_path, tiny_tagger_dir,
                                                                   local_ray):
    src, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_bytes(sentences(600))

    def stop_after_one(k: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        serve_ray.run_job(_job(tiny_tagger_dir), [str(src)], str(out),
                          made_from=_made_from(tiny_tagger_dir), workers=2, shard_size=200,
                          progress=False, on_commit=stop_after_one)
    assert serve_ray.shards_dir(str(out)).is_dir()
    assert main([*tag_args(tiny_tagger_dir, src), "--output", str(out), "--resume"]) == 1
    assert out.read_bytes().count(b"\n") == 600
    assert not serve_ray.shards_dir(str(out)).exists()  # a second copy of the results before


def test_importing_the_package_does_not_import_ray():
    import subprocess
    import sys

    code = ("import sys, mhmla_fast, mhmla_fast.commands.serve, mhmla_fast.serve.ray; "
            "print('ray' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


# --------------------------------------------------------------------------------- Parquet


def parquet_rows(n: int, seed: int = 0) -> list[dict]:
    """``n`` rows for a Parquet file with the columns ``id``, ``text``, ``tokens`` and an
    unused ``note`` (None = null): texts, tokens, ids, and malformed rows now and then (no
    text, empty text, text and tokens both, empty tokens, a null or blank token)."""
    bad = [{}, {"text": "  "}, {"text": "both", "tokens": ["x"]}, {"tokens": []},
           {"tokens": ["a", None]}, {"tokens": ["a", " "]}, {"id": "no-text"}]
    rows = []
    for i in range(1, n + 1):
        if i % 41 == 0:
            row = dict(bad[(i // 41) % len(bad)])
        elif i % 3 == 0:
            row = {"tokens": ["She", "see", str(i + seed), "."], "id": f"t{i}"}
        else:
            row = {"text": f"Row {i + seed} , he have {'words ' * (i % 5)}🚲 ."}
        rows.append({"id": None, "text": None, "tokens": None, "note": i, **row})
    return rows


def write_parquet_and_jsonl(folder: Path, name: str, rows: list[dict], schema=None,
                            row_group_size: int = 64) -> tuple[Path, Path]:
    """``rows`` as ``name.parquet`` (nulls for absent fields) and as ``name.jsonl`` (one JSON
    object line of each row's non-null fields)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows, schema=schema), folder / f"{name}.parquet",
                   row_group_size=row_group_size)
    (folder / f"{name}.jsonl").write_text("".join(
        json.dumps({k: v for k, v in row.items() if v is not None}) + "\n" for row in rows),
        encoding="utf-8")
    return folder / f"{name}.parquet", folder / f"{name}.jsonl"


def malformed_parquet_inputs(folder: Path) -> tuple[list[Path], list[Path]]:
    """Parquet files and the same rows as JSONL files: a few hundred rows with malformed ones,
    and files whose column types are wrong (a number as text, tokens of numbers, tokens as a
    string)."""
    import pyarrow as pa

    files = [write_parquet_and_jsonl(folder, "a", parquet_rows(250))]
    files.append(write_parquet_and_jsonl(folder, "b", [
        {"text": 42, "id": 7}, {"text": None, "id": 8}, {"text": 1, "id": None}]))
    files.append(write_parquet_and_jsonl(folder, "c", [{"tokens": [1, 2]}, {"tokens": None}],
                                         schema=pa.schema([("tokens", pa.list_(pa.int64()))])))
    files.append(write_parquet_and_jsonl(folder, "d", [
        {"tokens": "not a list", "id": "s"}, {"tokens": "x y", "id": None}]))
    return [p for p, _ in files], [j for _, j in files]


def as_parquet_errors(records: list[dict], jsonl: list[Path]) -> list[dict]:
    """``records`` made from ``jsonl`` files with their error messages as the same rows read
    from the ``.parquet`` files give them (``X.parquet: row N`` for ``X.jsonl: line N``)."""
    out = []
    for rec in records:
        if "error" in rec:
            err = rec["error"]
            for j in jsonl:
                err = err.replace(f"{j}: line ", f"{j.with_suffix('.parquet')}: row ")
            rec = {**rec, "error": err}
        out.append(rec)
    return out


def test_parquet_input_equals_the_same_rows_as_jsonl_and_resumes_exactly_once(
        tmp_path, tiny_tagger_dir, local_ray, capsys):
    """Parquet rows are the records of the same JSON objects as lines: the single-process CLI
    on the Parquet files equals it on the JSONL files (errors naming file and row), with the
    same input fingerprint. A Ray job on the Parquet files (shards across row groups and
    files) killed after some shards, refused on changed input, then resumed, equals both."""
    parquet, jsonl = malformed_parquet_inputs(tmp_path)
    want, cli, out = tmp_path / "jsonl.jsonl", tmp_path / "cli.jsonl", tmp_path / "ray.jsonl"
    assert main([*tag_args(tiny_tagger_dir, *jsonl), "--output", str(want)]) == 1
    assert main([*tag_args(tiny_tagger_dir, *parquet), "--output", str(cli)]) == 1
    expected = as_parquet_errors(read_jsonl(want), jsonl)
    errors = [r["error"] for r in expected if "error" in r]
    assert len(expected) == 257 and len(errors) == 13
    assert f'{parquet[1]}: row 1: field "text" must be a string, got number' in errors
    assert f'{parquet[1]}: row 2: missing field "text" (or "tokens")' in errors
    assert f'{parquet[2]}: row 1: field "tokens": item 0 must be a string, got number' in errors
    assert f'{parquet[3]}: row 1: field "tokens" must be an array of strings, got string' in errors
    assert f'{parquet[0]}: row 164: field "tokens": item 1 must be a string, got null' in errors

    job, made = _job(tiny_tagger_dir), _made_from(tiny_tagger_dir)
    paths = [str(p) for p in parquet]

    def die_after_two(k: int) -> None:
        if len(list(serve_ray.shards_dir(str(out)).glob("*.jsonl"))) >= 2:
            raise KeyboardInterrupt  # the driver killed between two commits

    with pytest.raises(KeyboardInterrupt):
        serve_ray.run_job(job, paths, str(out), made_from=made, workers=2, shard_size=60,
                          progress=False, on_commit=die_after_two)
    folder = serve_ray.shards_dir(str(out))
    first = sorted(p.name for p in folder.glob("*.jsonl"))
    assert len(first) >= 2 and out.read_bytes() == b""

    original = parquet[1].read_bytes()  # one changed row: the resume is refused, nothing touched
    write_parquet_and_jsonl(tmp_path, "b", [{"text": 42, "id": 9}, {"text": None, "id": 8},
                                            {"text": 1, "id": None}])
    args = [*tag_args(tiny_tagger_dir, *parquet), "--output", str(out), "--ray", "--resume"]
    assert main(args) == 2
    assert "was made from other input" in capsys.readouterr().err
    assert sorted(p.name for p in folder.glob("*.jsonl")) == first and out.read_bytes() == b""
    parquet[1].write_bytes(original)

    commits: list[int] = []
    serve_ray.run_job(job, paths, str(out), made_from=made, resume=True, workers=2,
                      progress=False, on_commit=commits.append)
    assert sorted(commits) == sorted(set(range(5)) - {int(n[:8]) for n in first})
    assert main(args) == 1  # finished: nothing more to do
    for got in (cli, out):
        records = read_jsonl(got)
        assert_same_records(records, expected)
        assert [r["error"] for r in records if "error" in r] == errors
        assert json.loads(Path(meta_path(str(got))).read_text())["input"] == json.loads(
            Path(meta_path(str(want))).read_text())["input"]


def test_parquet_shards_read_back_the_cli_records_also_from_a_uri(tmp_path):
    """No Ray: the plan's row-range shards of Parquet files (several row groups, between two
    line files), read back from local paths and ``file://`` URIs, are the CLI's records; for
    ``score`` the rows are the records of the same JSON lines."""
    import pyarrow as pa

    from mhmla_fast.serve.inputs import iter_input_records

    pq_file, _ = write_parquet_and_jsonl(tmp_path, "p", parquet_rows(150), row_group_size=32)
    txt = tmp_path / "t.txt"
    txt.write_bytes(sentences(20))
    job = serve_ray.RayJob("tag", "unused")
    want = list(iter_input_records([str(txt), str(pq_file), str(txt)], "tag"))
    assert [r.line for r in want[20:170]] == list(range(1, 151))
    for paths in ([str(txt), str(pq_file), str(txt)], [txt.as_uri(), pq_file.as_uri(), str(txt)]):
        plan = serve_ray.plan_shards(job, paths, 45)
        assert plan.records == 190 and len(plan.shards) == 5
        got = [r for s in plan.shards for r in serve_ray.read_shard(job, s)]
        assert [(r.index, r.line, r.id, r.text, r.tokens) for r in got] == [
            (r.index, r.line, r.id, r.text, r.tokens) for r in want]
        assert [r.error.replace(str(paths[1]), "P") for r in got[20:170] if r.error] == [
            r.error.replace(str(pq_file), "P") for r in want[20:170] if r.error]

    essays = [{"text": "An essay .", "prompt": 3, "id": "e1"}, {"text": "No prompt ."},
              {"text": "Bad prompt .", "prompt": 9}, {"prompt": 2}, {"text": "Ok .", "prompt": 8}]
    e_pq, e_jsonl = write_parquet_and_jsonl(tmp_path, "e", essays)
    s_pq, s_jsonl = write_parquet_and_jsonl(tmp_path, "s", [{"text": "x", "prompt": "3"}])
    got = list(iter_input_records([str(e_pq), str(s_pq)], "score"))
    want = list(iter_input_records([str(e_jsonl), str(s_jsonl)], "score"))
    assert [(r.id, r.text, r.prompt) for r in got] == [(r.id, r.text, r.prompt) for r in want]
    assert [r.error for r in got if r.error] == [
        f'{e_pq}: row 2: missing field "prompt"',
        f'{e_pq}: row 3: field "prompt" must be an integer from 1 to 8, got 9',
        f'{e_pq}: row 4: missing field "text"',
        f'{s_pq}: row 1: field "prompt" must be an integer from 1 to 8, got string']
    assert pa  # the Parquet writer is pyarrow's


def test_parquet_input_that_cannot_be_read_is_refused(tmp_path, tiny_tagger_dir, capsys):
    src, _ = write_parquet_and_jsonl(tmp_path, "in", parquet_rows(5))
    args = tag_args(tiny_tagger_dir, src)
    assert main([*args, "--format", "text"]) == 2
    assert '--format: "text" reads lines as plain text' in capsys.readouterr().err
    (tmp_path / "fake.parquet").write_text('{"text": "a JSON line"}\n')
    for ray_args in ([], ["--output", str(tmp_path / "o.jsonl"), "--ray"]):
        assert main([*tag_args(tiny_tagger_dir, tmp_path / "fake.parquet"), *ray_args]) == 2
        assert "not a readable Parquet file" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_a_clusters_workers_get_the_drivers_cache_settings(monkeypatch):
    """Workers on a running cluster do not inherit the driver's shell: MHMLA_CACHE_DIR and
    MHMLA_NO_CACHE go to them in the job's runtime environment (nothing else of the shell)."""
    import ray

    from mhmla_fast.serve.ray import _init_ray

    seen: list = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.append(kw))
    monkeypatch.setenv("MHMLA_CACHE_DIR", "/shared/mhmla-cache")
    monkeypatch.setenv("MHMLA_NO_CACHE", "1")
    monkeypatch.setenv("SOMETHING_ELSE", "x")
    assert _init_ray("ray://head:10001", 2)
    assert seen[-1] == {"address": "ray://head:10001", "runtime_env": {"env_vars": {
        "MHMLA_CACHE_DIR": "/shared/mhmla-cache", "MHMLA_NO_CACHE": "1"}}}
    monkeypatch.delenv("MHMLA_CACHE_DIR")
    monkeypatch.delenv("MHMLA_NO_CACHE")
    assert _init_ray("auto", 2)
    assert seen[-1] == {"address": "auto"}
