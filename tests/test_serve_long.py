"""Long texts on the CLI (issue 14): a generated 1 MB text is tagged exactly as its windows are
(quarter-window overlap, each word from the window where it sits farthest from an edge), with a
bounded memory peak, progress in word pieces, no false "indexing errors" warning, and
``--max-chars`` skipping or capping over-long records."""

from __future__ import annotations

import functools
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from mhmla_fast.commands.serve import main
from mhmla_fast.serve.engine import (iter_word_tokenize, load_tokenizer, plan_windows,
                                     word_tokenize_chunked)
from mhmla_fast.serve.tokenize import word_tokenize

WORDS = ("the a cat dog house school every day he she they we go goes went see sees because "
         "although happily café naïve résumé don't John's well-known 3.14 !? … unbelievably "
         "internationalisation photosynthesis , . ; :").split()
UNICODE = [*WORDS, "我喜欢猫", "👍🏽", "e\u0301te\u0301"]


def long_text(n_chars: int, seed: int = 0, words: list[str] = WORDS) -> str:
    rng = random.Random(seed)
    out, size = [], 0
    while size < n_chars:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars].rstrip()


@pytest.fixture(scope="module")
def megabyte(tmp_path_factory) -> tuple[str, Path]:
    text = long_text(1_000_000)
    path = tmp_path_factory.mktemp("long") / "big.txt"
    path.write_text(text + "\n", encoding="utf-8")
    return text, path


def reference_probs(engine, tokenizer, words: list[str]) -> np.ndarray:
    """P(error) per word from tagging each window of ``words`` on its own (windows of
    ``engine.long_window`` pieces overlapping by a quarter): each word's from the window whose
    edge its first piece is farthest from (the earliest window on a tie). ``tokenizer``: the
    model's Hugging Face tokenizer, independent of the engine's own word-piecing."""
    enc = tokenizer(words, is_split_into_words=True, add_special_tokens=False)
    ids, wids = np.asarray(enc["input_ids"]), enc.word_ids()
    first = np.array([w if w is not None and (q == 0 or wids[q - 1] != w) else -1
                      for q, w in enumerate(wids)])
    spans = plan_windows(len(ids), engine.long_window, engine.long_window // 4)
    probs, margin = np.zeros(len(words)), np.full(len(words), -1)
    by_len: dict[int, list[tuple[int, int]]] = {}
    for a, b in spans:  # windows of one length batch without padding: as tagged one by one
        by_len.setdefault(b - a, []).append((a, b))
    for n, group in by_len.items():
        for k in range(0, len(group), 256):
            part = group[k:k + 256]
            x = np.array([[engine.cls_id, *ids[a:b], engine.sep_id] for a, b in part])
            out = engine.runner(x, np.ones_like(x))
            for row, (a, b) in zip(out, part):
                for q in range(a, b):
                    w = first[q]
                    edge = min(q - a, b - 1 - q)
                    if w >= 0 and edge > margin[w]:
                        margin[w], probs[w] = edge, row[q - a + 1]
    return probs


def test_a_megabyte_text_equals_tagging_its_windows(megabyte, tiny_engine, tiny_tagger_dir):
    text, _ = megabyte
    text = long_text(20_000, seed=5, words=UNICODE) + " " + text  # with CJK, emoji, marks
    (res,) = tiny_engine.tag_texts([text])
    assert len(res.tokens) > 150_000
    assert res.tokens == [t.text for t in word_tokenize(text)]  # chunked tokenising is exact
    assert all(text[a:b] == t for t, (a, b) in zip(res.tokens[::997], res.offsets[::997]))
    want = reference_probs(tiny_engine, load_tokenizer(tiny_tagger_dir), res.tokens)
    np.testing.assert_allclose(res.probs, want, atol=2e-5, rtol=0)
    assert res.labels == ["i" if p >= tiny_engine.threshold else "c" for p in res.probs]


def test_word_tokenize_chunked_is_word_tokenize():
    rng = random.Random(3)
    seps = [" ", "  ", "\n", "\u3000", "\u200b", "\t", " \u00a0"]
    text = "".join(rng.choice(UNICODE) + rng.choice(seps) for _ in range(3000))
    text += "x" * 500 + " tail"  # a piece with no separator grows to the next one
    for chunk in (7, 50, 333, 1 << 16):
        assert word_tokenize_chunked(text, chunk) == word_tokenize(text)


def test_a_text_without_spaces_is_tokenized_in_pieces():
    """Chinese, a URL or base64 with no separator at all: pieces stay near the chunk size (so a
    server interleaves other work), and the tokens are word_tokenize's."""
    rng = random.Random(4)
    han = "".join(rng.choice("我喜欢猫狗学校每天去。，！") for _ in range(5000))
    blob = "".join(rng.choice("abcXYZ0189+/=") for _ in range(5000))
    for text in (han, blob, han[:2000] + blob[:2000] + "、" + han[2000:]):
        parts = list(iter_word_tokenize(text, 64))
        assert [t for part in parts for t in part] == word_tokenize(text)
        assert len(parts) >= len(text) // 64  # no piece grew to the end of the text


_PEAK = textwrap.dedent("""
    import json, sys
    from mhmla_fast.commands.serve import main

    def status_mb(key):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith(key + ":")) / 1024

    model, small, big, out1, out2 = sys.argv[1:6]
    opts = ["--model", model, "--no-progress", "--threads", "1", "--device", "cpu",
            "--backend", "torch"]
    assert main(["tag", small, "--output", out1, *opts]) == 0  # warm: imports, one model load
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM): ru_maxrss would
        f.write("5")  # carry the forking parent's size over the exec
    base = status_mb("VmRSS")
    rc = main(["tag", big, "--output", out2, *opts])
    print(json.dumps({"rc": rc, "peak_delta_mb": status_mb("VmHWM") - base}))
""")

PEAK_CEILING_MB = 170  # measured 115-130 MB on 2 CPU cores; 190+ MB before issue 14


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
def test_the_command_tags_a_megabyte_line_under_a_memory_ceiling(tmp_path, megabyte,
                                                                  tiny_tagger_dir, tiny_engine):
    """Peak RSS over the process's resident size before the run (imports and model already
    loaded): the windows go through the encoder in token-budget batches, the text is
    word-tokenised and word-pieced in chunks, so what grows with the text is the result."""
    text, big = megabyte
    small = tmp_path / "small.txt"
    small.write_text("a short one .\n")
    script = tmp_path / "peak.py"
    script.write_text(_PEAK)
    out = tmp_path / "big.jsonl"
    run = subprocess.run([sys.executable, str(script), str(tiny_tagger_dir), str(small), str(big),
                          str(tmp_path / "small.jsonl"), str(out)],
                         capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["rc"] == 0
    assert report["peak_delta_mb"] < PEAK_CEILING_MB, report
    assert "indexing errors" not in run.stderr  # transformers' false warning is gone
    (rec,) = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    (want,) = tiny_engine.tag_texts([text])
    assert rec["tokens"] == want.tokens and rec["labels"] == want.labels
    assert rec["probs"] == pytest.approx(want.probs, abs=1e-5)


def test_progress_counts_pieces_within_a_long_record(tmp_path, tiny_tagger_dir, capsys):
    src, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_text(long_text(60_000) + "\n")
    assert main(["tag", str(src), "--output", str(out), "--model", str(tiny_tagger_dir),
                 "--threads", "1", "--token-budget", "512"]) == 0
    err = capsys.readouterr().err
    assert " pieces, " in err and "pieces/s" in err, err


def test_max_chars_skips_or_caps_over_long_records(tmp_path, tiny_tagger_dir, tiny_engine):
    src = tmp_path / "in.txt"
    src.write_text("short one .\n" + "word " * 100 + "end\n"
                   + json.dumps({"tokens": ["a"] * 40, "id": "t"}) + "\n")
    base = ["tag", str(src), "--model", str(tiny_tagger_dir), "--no-progress", "--threads", "1",
            "--max-chars", "50", "--backend", "torch"]  # exactly tiny_engine's probabilities
    out = tmp_path / "skip.jsonl"
    assert main([*base, "--output", str(out)]) == 1
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert "error" not in recs[0]
    assert recs[1] == {"index": 2, "id": 2,
                       "error": f"{src}: line 2: 503 characters, over --max-chars 50; skipped"}
    assert recs[2]["id"] == "t" and "79 characters, over --max-chars 50" in recs[2]["error"]

    out = tmp_path / "cap.jsonl"
    assert main([*base, "--over-long", "cap", "--output", str(out)]) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert "capped_from" not in recs[0]
    want = tiny_engine.tag_texts([("word " * 100)[:50]])[0].to_dict()
    assert {k: v for k, v in recs[1].items() if k not in ("index", "id")} == {
        **want, "capped_from": 503}
    assert recs[2]["tokens"] == ["a"] * 25 and recs[2]["capped_from"] == 79


def test_max_chars_bounds_the_reading_of_a_line(tmp_path, monkeypatch):
    """With --max-chars N a line of more than 16 N bytes + 64 MiB (here, the slack shrunk to
    1 KiB) is read in pieces and becomes an error record, whatever --over-long says; the lines
    around it, line numbers, CRLF and a first-line BOM are read as before."""
    import tracemalloc

    from mhmla_fast.serve import inputs

    monkeypatch.setattr(inputs, "READ_BOUND_SLACK", 1024)
    assert inputs.read_bound(10) == 1184 and inputs.read_bound(None) is None
    src = tmp_path / "in.txt"
    huge = 8 << 20  # 8 MiB without a line break, then a short line, then 8 MiB more
    with open(src, "wb") as f:
        f.write(b"\xef\xbb\xbfa b\r\n" + b"x" * 1184 + b"\n" + b"y" * huge + b"\nc d\n")
        f.write(b"z" * huge)
    tracemalloc.start()
    got = list(inputs.iter_input_records([str(src)], "tag", max_chars=10))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 << 20, peak  # a line read whole would hold 8 MiB at least
    assert [(r.index, r.line, r.text) for r in got] == [
        (1, 1, "a b"), (2, 2, "x" * 1184), (3, 3, None), (4, 4, "c d"), (5, 5, None)]
    assert got[2].id == 3 and got[2].error == (
        f"{src}: line 3: {huge} bytes, over the 1184 read for --max-chars 10; skipped")
    assert got[4].error.startswith(f"{src}: line 5: {huge} bytes, over the 1184")
    # without --max-chars every line is read whole, as before
    assert [r.text for r in inputs.iter_input_records([str(src)], "tag")][2] == "y" * huge
    # standard input reads the same way
    with open(src, "rb") as stdin:
        piped = list(inputs.iter_input_records(["-"], "tag", stdin=stdin, max_chars=10))
    assert [(r.text, r.error and r.error.replace("<stdin>", str(src))) for r in piped] == [
        (r.text, r.error) for r in got]
    with pytest.raises(ValueError, match="max_chars: expected a positive integer"):
        inputs.iter_input_records([str(src)], "tag", max_chars=0)


def test_an_unbounded_line_on_the_cli_and_on_ray_shards(tmp_path, monkeypatch, tiny_tagger_dir):
    """The CLI writes the over-long line's error record (exit 1: a record failed) and tags the
    rest; Ray's shards, read back by byte range from a path or a URI, are the CLI's records."""
    from mhmla_fast.serve import ray as serve_ray
    from mhmla_fast.serve import inputs

    monkeypatch.setattr(inputs, "READ_BOUND_SLACK", 1024)
    src, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_bytes(b"a b\n" + b"w " * 4096 + b"\nc d\n" + b'{"id": "j", "text": "e f"}\n')
    assert main(["tag", str(src), "--model", str(tiny_tagger_dir), "--no-progress",
                 "--threads", "1", "--max-chars", "10", "--over-long", "cap", "--backend",
                 "torch", "--output", str(out)]) == 1
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r.get("error") for r in recs] == [
        None, f"{src}: line 2: 8192 bytes, over the 1184 read for --max-chars 10; skipped",
        None, None]
    assert recs[3]["id"] == "j" and recs[0]["tokens"] == ["a", "b"]
    want = list(inputs.limit_length(inputs.iter_input_records(
        [str(src)], "tag", max_chars=10), 10, "cap"))
    job = serve_ray.RayJob("tag", "unused", max_chars=10, over_long="cap")
    for path in (str(src), src.as_uri()):
        plan = serve_ray.plan_shards(job, [path], 3)
        got = [r for s in plan.shards for r in serve_ray.read_shard(job, s)]
        assert [(r.index, r.line, r.id, r.text, r.error and r.error.replace(path, "SRC"))
                for r in got] == [
            (r.index, r.line, r.id, r.text, r.error and r.error.replace(str(src), "SRC"))
            for r in want]


def test_the_read_bound_leaves_out_a_last_lines_lone_carriage_return(tmp_path, monkeypatch):
    """A line's break is not counted against the bound, by the rule that strips it: ``\\n``,
    ``\\r\\n``, or the ``\\r`` ending a last line."""
    from mhmla_fast.serve import inputs

    monkeypatch.setattr(inputs, "READ_BOUND_SLACK", 1024)  # read_bound(10) == 1184
    src = tmp_path / "in.txt"
    src.write_bytes(b"v" * 1184 + b"\r\n" + b"w" * 1184 + b"\r")
    got = list(inputs.iter_input_records([str(src)], "tag", max_chars=10))
    assert [(r.text, r.error) for r in got] == [("v" * 1184, None), ("w" * 1184, None)]
    src.write_bytes(b"w" * 1185 + b"\r")
    (over,) = inputs.iter_input_records([str(src)], "tag", max_chars=10)
    assert over.text is None and "1185 bytes, over the 1184" in over.error
    # a "\r\n" split between two pieces of an over-long line is still a two-byte break
    monkeypatch.setattr(inputs, "bounded_lines", functools.partial(inputs.bounded_lines, piece=1))
    src.write_bytes(b"u" * 2000 + b"\r\n" + b"ok\n")
    over, ok = inputs.iter_input_records([str(src)], "tag", max_chars=10)
    assert "line 1: 2000 bytes, over the 1184" in over.error and ok.text == "ok"
