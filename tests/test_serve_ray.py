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
from mhmla_fast.serve.records import meta_path  # noqa: E402

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
    assert sum("error" in r for r in expected) == 8
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

    args = argparse.Namespace(backend="torch", format="auto", encoding="utf-8", max_chars=None,
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
    from mhmla_fast.serve.records import iter_input_records

    src = tmp_path / "in.txt"
    src.write_bytes(b"\xef\xbb\xbf" + sentences(300).replace(b"\n", b"\r\n", 7) + b"last\r")
    job = serve_ray.RayJob("tag", "unused")
    want = list(iter_input_records([str(src)], "tag"))
    assert list(serve_ray._uri_lines(src.as_uri(), chunk=7)) == list(open(src, "rb"))
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


def test_importing_the_package_does_not_import_ray():
    import subprocess
    import sys

    code = ("import sys, mhmla_fast, mhmla_fast.commands.serve, mhmla_fast.serve.ray; "
            "print('ray' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
