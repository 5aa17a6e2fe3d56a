"""Essay scoring in the serving layer, on a tiny random scorer (``tiny_scorer_dir`` in conftest).

``mhmla-serve score``: one JSONL record per input line in input order, scores on each prompt's
scale and equal to ``predict_scores`` on the same essays, one scorer call per ``--batch-essays``
chunk (prompts mixed), malformed lines as error records (exit 1), ``--resume`` after a real
``kill -9``, the refusals (exit 2) and a scorer crash (exit 3). ``POST /v1/score``: concurrent
requests micro-batched into shared scorer calls with the offline scores, 422/413/503/500/404,
/metrics and /healthz; ``mhmla-serve http --scorer/--no-scorer`` wiring.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

from mhmla_fast.aes.data import SCORE_RANGES
from mhmla_fast.commands.serve import main
from mhmla_fast.serve.score import NO_PIECES

from essay_pieces import NO_PIECES_TEXTS, UNK_TEXTS
from kill9 import kill_after_lines

WORDS = ("the a cat dog house school every day he she they we go goes went see sees because "
         "computers people library books café naïve don't 3.14 !? …").split()


def essay(rng: random.Random, long: bool = False) -> str:
    """A random essay; ``long`` ones need several 62-piece windows of the tiny scorer."""
    n = rng.randint(150, 260) if long else rng.choice([3, 12, 30, 55])
    return " ".join(rng.choice(WORDS) for _ in range(n)) + " ."


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def score_cli(tmp_path: Path, model: Path, data: bytes, *extra: str) -> tuple[int, list[dict]]:
    """Run ``score`` in-process on ``data`` (the bytes of one input file) into a fresh output."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(data)
    if out.exists():
        out.unlink()
    rc = main(["score", str(src), "--output", str(out), "--model", str(model), "--no-progress",
               "--threads", "1", *extra])
    return rc, read_jsonl(out) if out.exists() else []


def in_range(prompt: int, score: int) -> bool:
    lo, hi = SCORE_RANGES[prompt]
    return isinstance(score, int) and lo <= score <= hi


class RecordingScorer:
    """Wraps a scorer: records the (texts, prompts, token_budget) of every predict_scores call;
    raises on an essay containing "BOOM"; waits for ``gate`` after setting ``entered``."""

    def __init__(self, scorer) -> None:
        self.scorer, self.config = scorer, scorer.config
        self.calls: list[tuple[list[str], list[int], int]] = []
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()

    def predict_scores(self, texts, prompts, token_budget=8192):
        self.calls.append((list(texts), list(prompts), token_budget))
        self.entered.set()
        assert self.gate.wait(30), "test gate never opened"
        if any("BOOM" in t for t in texts):
            raise RuntimeError("the scorer exploded")
        return self.scorer.predict_scores(texts, prompts, token_budget=token_budget)


class StubScorer:
    """A scorer stand-in for the HTTP limits: score = the prompt's lowest score."""

    config = types.SimpleNamespace(prompts=(1, 2, 3, 4, 5, 6, 7, 8))

    def predict_scores(self, texts, prompts, token_budget=8192):
        return np.array([SCORE_RANGES[p][0] for p in prompts])


class StubEngine:
    """A tagger stand-in (the app needs one): echoes whitespace tokens."""

    def tag_texts(self, texts):
        return [types.SimpleNamespace(to_dict=lambda t=t: {"tokens": t.split()}) for t in texts]

    def tag_tokens(self, sentences):
        return self.tag_texts([" ".join(s) for s in sentences])


# -------------------------------------------------------------------------------------- CLI


def test_scores_in_input_order_with_every_malformed_kind(tmp_path, tiny_scorer_dir, tiny_scorer):
    rng = random.Random(3)
    lines: list[tuple[bytes, str | None]] = [  # (line, expected error reason or None)
        (json.dumps({"text": essay(rng), "prompt": 1, "id": "a1"}).encode(), None),
        (json.dumps({"text": essay(rng, long=True), "prompt": 7}).encode(), None),
        (b"a plain-text essay", "plain-text line"),
        (json.dumps({"text": essay(rng), "prompt": 3, "id": 0, "extra": [1]}).encode(), None),
        (b"", "empty line"),
        (b'{"text": "unterminated', "invalid JSON"),
        (b'{"prompt": 2}', 'missing field "text"'),
        (b'{"text": "an essay"}', 'missing field "prompt"'),
        (b'{"text": "", "prompt": 2}', 'field "text" is empty'),
        (b'{"text": " \\n\\t ", "prompt": 2}', 'field "text" is empty'),
        (b'{"text": 42, "prompt": 2}', 'field "text" must be a string'),
        (b'{"text": "\\u200b\\u00ad \\u0001", "prompt": 2}', "gives no word pieces"),
        (b'{"text": "x", "prompt": 9}', "must be an integer from 1 to 8, got 9"),
        (b'{"text": "x", "prompt": "3"}', "must be an integer from 1 to 8, got string"),
        (b'{"text": "x", "prompt": 3.0}', "must be an integer from 1 to 8, got number"),
        (b'{"text": "x", "prompt": true}', "must be an integer from 1 to 8, got boolean"),
        (b'{"text": "x", "prompt": 8, "id": "p8"}', "no output layer for prompt 8"),
        (b'{"text": "x", "prompt": 2, "id": [1]}', 'field "id" must be a string or an integer'),
        (b'{"text": "lone \\ud83d half", "prompt": 2}', "lone surrogate"),
        ('{"text": "caf\xe9", "prompt": 2}'.encode("latin-1"), "invalid UTF-8"),
        # the scorer's tokenizer decides: no pieces (U+FFFD, combining, zero-width, private-use
        # characters: refused) or some (unassigned code points give [UNK]: scored)
        (json.dumps({"text": NO_PIECES_TEXTS[0], "prompt": 2}).encode(), "gives no word pieces"),
        (json.dumps({"text": NO_PIECES_TEXTS[1], "prompt": 3}).encode(), "gives no word pieces"),
        (json.dumps({"text": UNK_TEXTS[0], "prompt": 4}).encode(), None),
        (json.dumps({"text": UNK_TEXTS[1], "prompt": 5}).encode(), None),
        *[(json.dumps({"text": essay(rng, long=k % 4 == 0), "prompt": 1 + k % 7}).encode(), None)
          for k in range(13)],
    ]
    data = b"\n".join(line for line, _ in lines) + b"\n"
    rc, out = score_cli(tmp_path, tiny_scorer_dir, data, "--batch-essays", "1000")
    assert rc == 1
    assert [r["index"] for r in out] == list(range(1, len(lines) + 1))
    src = str(tmp_path / "in.jsonl")
    good = []
    for n, ((line, reason), rec) in enumerate(zip(lines, out), 1):
        if reason is None:
            assert set(rec) == {"index", "id", "prompt", "score"}, rec
            good.append((json.loads(line), rec))
            continue
        assert set(rec) == {"index", "id", "error"}, rec
        assert rec["error"].startswith(f"{src}: line {n}: ") and reason in rec["error"], rec
    assert out[16]["id"] == "p8" and "(it scores prompts 1, 2, 3, 4, 5, 6, 7)" in out[16]["error"]
    assert [r["id"] for _, r in good[:3]] == ["a1", 2, 0]
    assert [r["prompt"] for _, r in good] == [x["prompt"] for x, _ in good]
    assert all(in_range(r["prompt"], r["score"]) for _, r in good)

    # equal to the scorer's own scores for the same essays in one call (one chunk here)
    want = tiny_scorer.predict_scores([x["text"] for x, _ in good], [x["prompt"] for x, _ in good])
    assert [r["score"] for _, r in good] == want.tolist()
    assert len({r["score"] for _, r in good}) > 2, "the tiny scorer gives different scores"


def test_the_empty_essay_rule_is_the_scorers_own_tokenizer(tiny_scorer):
    """An essay is refused exactly when the scorer's tokenizer gives it no word pieces; texts
    with an ASCII letter or digit are never tokenized for it (each one alone gives a piece,
    also beside characters that give none, with the tiny and the shipped scorer's tokenizer)."""
    import string

    from mhmla_fast.aes.model import load_tokenizer
    from mhmla_fast.serve.score import default_scorer_path, essay_pieces_check, piece_encoder

    tokenizers = [tiny_scorer.tokenizer]
    if (default_scorer_path() / "tokenizer.json").is_file():
        tokenizers.append(load_tokenizer(str(default_scorer_path())))
    alnum = list(string.ascii_letters + string.digits)
    for tok in tokenizers:
        pieces = lambda texts: tok(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
        assert all(pieces(alnum)) and all(pieces([NO_PIECES_TEXTS[1] + c for c in alnum]))
        assert [bool(ids) for ids in pieces(NO_PIECES_TEXTS + UNK_TEXTS)] == [0, 0, 1, 1]
    assert [len(x) for x in piece_encoder(tiny_scorer)(["Dear , \u200b", "\u200b"])] == [2, 0]

    check = essay_pieces_check(tiny_scorer)
    assert check([*NO_PIECES_TEXTS, *UNK_TEXTS, "a\u200b", "\u200b7", "\ufffd\u65e5"]) == [
        NO_PIECES, NO_PIECES, None, None, None, None, None]
    chars = [chr(c) for c in range(0x3000)]  # single characters: the rule is the tokenizer's
    want = [None if ids else NO_PIECES for ids in tiny_scorer.tokenizer(
        chars, add_special_tokens=False)["input_ids"]]
    assert check(chars) == want and 0 < want.count(NO_PIECES) < 2000

    class Spy:  # an ONNX scorer's encode; looked up once, asked only about non-ASCII texts
        lookups, calls = 0, []

        def __getattribute__(self, name):
            if name == "encode":
                Spy.lookups += 1
            return object.__getattribute__(self, name)

        def encode(self, texts):
            Spy.calls.append(list(texts))
            return [[] if t == "\u200b" else [7] for t in texts]

    check = essay_pieces_check(Spy())
    assert check(["x", "Essay 1 \u200b"]) == [None, None] and Spy.lookups == 0
    assert check(["ok", "\u200b", "\u65e5"]) == [None, NO_PIECES, None]
    assert check(["\u200b"]) == [NO_PIECES]
    assert Spy.calls == [["\u200b", "\u65e5"], ["\u200b"]] and Spy.lookups == 1
    assert essay_pieces_check(StubScorer())(["\u200b"]) == [None]  # no tokenizer: no rule


def patch_predict_scores(monkeypatch, wrap) -> None:
    """``predict_scores`` of both scorers (torch's, and the ONNX runner of backend auto)
    replaced by ``wrap(real)``."""
    from mhmla_fast.aes.model import EssayScorer
    from mhmla_fast.serve.score_onnx import OnnxScorer

    for cls in (EssayScorer, OnnxScorer):
        monkeypatch.setattr(cls, "predict_scores", wrap(cls.predict_scores))


def test_each_chunk_is_one_scorer_call_over_mixed_prompts(tmp_path, tiny_scorer_dir, monkeypatch):
    calls = []

    def recording(real):
        def predict_scores(self, texts, prompt, **kw):
            calls.append((list(prompt), kw.get("token_budget")))
            return real(self, texts, prompt, **kw)
        return predict_scores

    patch_predict_scores(monkeypatch, recording)
    rng = random.Random(5)
    records = [{"text": essay(rng, long=k == 3), "prompt": 1 + k % 7, "id": f"e{k}"}
               for k in range(10)]
    data = "\n".join(json.dumps(r) for r in records[:6]) + '\n{"bad": 1}\n' + "\n".join(
        json.dumps(r) for r in records[6:])
    rc, out = score_cli(tmp_path, tiny_scorer_dir, data.encode(), "--batch-essays", "4",
                        "--token-budget", "512")
    assert rc == 1
    assert [p for p, _ in calls] == [[1, 2, 3, 4], [5, 6, 7, 1], [2, 3]]
    assert {b for _, b in calls} == {512}
    assert [r["id"] for r in out] == [*(f"e{k}" for k in range(6)), 7,
                                      *(f"e{k}" for k in range(6, 10))]


def test_stdin_stdout_and_the_input_option(tmp_path, tiny_scorer_dir, tiny_scorer, monkeypatch,
                                           capsysbinary):
    lines = [{"text": "Dear editor , computers help people .", "prompt": 1},
             {"text": "The cyclist was tired .", "prompt": 3, "id": "q"}]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(buffer=__import__("io").BytesIO(data)))
    assert main(["score", "--model", str(tiny_scorer_dir), "--no-progress", "--threads", "1"]) == 0
    out = [json.loads(x) for x in capsysbinary.readouterr().out.decode().splitlines()]
    want = tiny_scorer.predict_scores([x["text"] for x in lines], [1, 3]).tolist()
    assert out == [{"index": 1, "id": 1, "prompt": 1, "score": want[0]},
                   {"index": 2, "id": "q", "prompt": 3, "score": want[1]}]

    src = tmp_path / "essays.jsonl"
    src.write_bytes(data)
    assert main(["score", "--input", str(src), "--output", "-", "--model", str(tiny_scorer_dir),
                 "--no-progress", "--threads", "1"]) == 0
    assert [json.loads(x) for x in capsysbinary.readouterr().out.decode().splitlines()] == out


def test_refusals_exit_2_with_clear_messages(tmp_path, tiny_scorer_dir, tiny_tagger_dir, capsys,
                                             monkeypatch):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"text": "a b c", "prompt": 1}\n')
    precious = '{"some": "other"}\n'
    out.write_text(precious)
    base = ["score", str(src), "--output", str(out), "--model", str(tiny_scorer_dir),
            "--no-progress"]
    assert main(base) == 2
    assert "exists; pass --resume" in capsys.readouterr().err
    assert main(base + ["--resume"]) == 2
    assert "not a resumable output" in capsys.readouterr().err
    assert out.read_text() == precious
    assert main(["score", str(src), "--resume", "--model", str(tiny_scorer_dir)]) == 2
    assert "--resume needs --output" in capsys.readouterr().err
    assert main(["score", str(src), "--input", str(src), "--model", str(tiny_scorer_dir)]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["score", str(tmp_path / "missing.jsonl"), "--model", str(tiny_scorer_dir)]) == 2
    assert "no such input file" in capsys.readouterr().err
    assert main(["score", "--batch-essays", "0"]) == 2  # argparse

    fresh = tmp_path / "fresh.jsonl"
    assert main(["score", str(src), "-o", str(fresh), "--model", str(tmp_path / "nope")]) == 2
    assert f"--model {tmp_path / 'nope'}: no such directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["score", str(src), "-o", str(fresh), "--model", str(tmp_path / "empty")]) == 2
    assert "not an essay-scorer directory" in capsys.readouterr().err
    assert main(["score", str(src), "-o", str(fresh), "--model", str(tiny_tagger_dir)]) == 2
    assert "cannot load the essay scorer" in capsys.readouterr().err  # a GED tagger
    from mhmla_fast.aes import scoring

    monkeypatch.setattr(scoring, "default_model_path", lambda: tmp_path / "shipped")
    assert main(["score", str(src), "-o", str(fresh)]) == 2
    err = capsys.readouterr().err
    assert "the shipped essay scorer is not installed" in err and "--model DIR" in err
    assert not fresh.exists(), "a bad model leaves no output file"


def test_a_scorer_crash_stops_with_exit_3_and_keeps_the_output(tmp_path, tiny_scorer_dir,
                                                               monkeypatch, capsys):
    calls = []

    def crash_on_second_chunk(real):
        def predict_scores(self, texts, prompt, **kw):
            calls.append(len(texts))
            if len(calls) == 2:
                raise RuntimeError("device lost")
            return real(self, texts, prompt, **kw)
        return predict_scores

    patch_predict_scores(monkeypatch, crash_on_second_chunk)
    data = b'{"text": "one two", "prompt": 2}\n' * 10
    rc, out = score_cli(tmp_path, tiny_scorer_dir, data, "--batch-essays", "4")
    assert rc == 3
    err = capsys.readouterr().err
    assert "scoring stopped: RuntimeError: device lost" in err and "--resume" in err
    assert [r["index"] for r in out] == [1, 2, 3, 4]  # the first chunk is kept, synced


def test_resume_after_kill_9_equals_an_uninterrupted_run(tmp_path, tiny_scorer_dir):
    n = 2500
    rng = random.Random(11)
    lines = []
    for i in range(1, n + 1):
        if i % 401 == 0:
            lines.append('{"text": oops}')
        elif i % 3 == 0:
            lines.append(json.dumps({"text": essay(rng, long=i % 100 == 0), "prompt": 1 + i % 7}))
        else:
            lines.append(json.dumps({"id": f"r{i}", "prompt": 1 + i % 7,
                                     "text": f"Essay {i} ünïcödé 🚲 " + essay(rng)}))
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out, full = tmp_path / "out.jsonl", tmp_path / "full.jsonl"
    # --token-budget 1: every window is encoded alone, so scores cannot depend on the chunking
    opts = ["--model", str(tiny_scorer_dir), "--no-progress", "--threads", "1",
            "--token-budget", "1", "--batch-essays", "16"]

    kill_after_lines(["score", str(src), "--output", str(out), *opts], out, n)

    assert main(["score", str(src), "--output", str(out), "--resume", *opts]) == 1
    assert main(["score", str(src), "--output", str(full), *opts[:-1], "64"]) == 1
    resumed, uninterrupted = read_jsonl(out), read_jsonl(full)
    assert [r["index"] for r in resumed] == list(range(1, n + 1))
    assert resumed == uninterrupted
    assert sum("error" in r for r in resumed) == n // 401
    assert all(in_range(r["prompt"], r["score"]) for r in resumed if "error" not in r)
    # resuming a complete output does nothing more and still reports the bad lines
    assert main(["score", str(src), "--output", str(out), "--resume", *opts]) == 1
    assert out.read_bytes().count(b"\n") == n


# ------------------------------------------------------------------------------------- HTTP

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")


def run_app(app, body) -> None:
    """Run ``body(http)`` (an async function of an httpx client) against ``app`` in-process,
    inside the app's lifespan (so its batching worker runs)."""
    async def go() -> None:
        transport = httpx.ASGITransport(app=app)
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=transport, base_url="http://test", timeout=60) as http:
            await body(http)

    asyncio.run(go())


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_concurrent_requests_get_the_offline_scores_in_shared_scorer_calls(tiny_scorer):
    from mhmla_fast.serve.http import create_app

    rng = random.Random(21)
    requests = []
    for r in range(48):
        essays = [{"text": essay(rng, long=rng.random() < 0.15), "prompt": rng.randint(1, 7)}
                  for _ in range(rng.randint(1, 5))]
        for k, e in enumerate(essays):
            if rng.random() < 0.5:
                e["id"] = rng.choice([f"req{r}-{k}", r * 10 + k])
        requests.append(essays)
    every = [e for req in requests for e in req]
    want = tiny_scorer.predict_scores([e["text"] for e in every], [e["prompt"] for e in every],
                                      token_budget=1).tolist()
    scorer = RecordingScorer(tiny_scorer)
    # token budget 1: each window is encoded alone, so batching cannot change a score
    app = create_app(StubEngine(), scorer=scorer, scorer_name="tiny-scorer", max_wait_ms=20,
                     score_token_budget=1, max_batch_tokens=100_000)
    got: list = [None] * len(requests)

    async def body(http) -> None:
        async def client(c: int) -> None:
            for k in range(c, len(requests), 8):
                r = await http.post("/v1/score", json={"essays": requests[k]})
                got[k] = (r.status_code, r.json())

        await asyncio.gather(*(client(c) for c in range(8)))
        health = (await http.get("/healthz")).json()
        assert health == {"status": "ok", "model": "StubEngine", "scorer": "tiny-scorer",
                          "queue_depth": 0}
        tagged = await http.post("/v1/tag", json={"texts": ["still tags"]})
        assert tagged.json() == {"results": [{"tokens": ["still", "tags"]}]}
        m = metric_samples((await http.get("/metrics")).text)
        assert m[("mhmla_http_requests_total", (("path", "/v1/score"), ("status", "200")))] == 48
        assert m[("mhmla_essays_scored_total", ())] == len(every)
        assert m[("mhmla_score_request_seconds_count", ())] == 48
        assert m[("mhmla_texts_tagged_total", ())] == 1
        assert m[("mhmla_score_batch_essays_sum", ())] == len(every)
        docs = (await http.get("/openapi.json")).json()
        assert "/v1/score" in docs["paths"] and "ScoreRequest" in json.dumps(docs)

    run_app(app, body)
    flat = iter(want)
    for essays, (status, resp) in zip(requests, got):
        assert status == 200, resp
        assert [r["prompt"] for r in resp["results"]] == [e["prompt"] for e in essays]
        assert [r["id"] for r in resp["results"]] == [e.get("id", k)
                                                      for k, e in enumerate(essays, 1)]
        assert [r["score"] for r in resp["results"]] == [next(flat) for _ in essays]
    assert len(scorer.calls) < len(requests), "requests were scored together"
    assert any(len(set(p)) > 1 for _, p, _ in scorer.calls), "prompts mixed in one call"
    assert {b for *_, b in scorer.calls} == {1}


def test_validation_and_size_limits_of_v1_score(tiny_scorer):
    from mhmla_fast.serve.http import create_app

    app = create_app(StubEngine(), scorer=RecordingScorer(tiny_scorer), max_request_bytes=20_000,
                     max_essays_per_request=3, max_queue=300)

    async def body(http) -> None:
        ok = await http.post("/v1/score", json={"essays": [{"text": "a b", "prompt": 7}]})
        assert ok.status_code == 200 and ok.json()["results"][0]["id"] == 1
        assert in_range(7, ok.json()["results"][0]["score"])
        assert (await http.post("/v1/score", json={"essays": []})).json() == {"results": []}
        bad_bodies = [
            {}, {"essays": "x"}, {"essays": [{"prompt": 1}]}, {"essays": [{"text": "a"}]},
            {"essays": [{"text": "", "prompt": 1}]}, {"essays": [{"text": " \n ", "prompt": 1}]},
            # no word pieces with the scorer's tokenizer: it used to get a plausible score
            {"essays": [{"text": "\u00ad\u200b\ufeff", "prompt": 1}]},
            {"essays": [{"text": "\u0001", "prompt": 1}]},
            {"essays": [{"text": " \u0301 ", "prompt": 1}]},
            *({"essays": [{"text": t, "prompt": 1}]} for t in NO_PIECES_TEXTS),
            {"essays": [{"text": 5, "prompt": 1}]}, {"essays": [{"text": "a", "prompt": "1"}]},
            {"essays": [{"text": "a", "prompt": 1.0}]}, {"essays": [{"text": "a", "prompt": True}]},
            {"essays": [{"text": "a", "prompt": 0}]}, {"essays": [{"text": "a", "prompt": 9}]},
            {"essays": [{"text": "a", "prompt": 1, "id": [1]}]},
            {"essays": [{"text": "a", "prompt": 1, "id": 1.5}]},
            {"essays": [{"text": "a", "prompt": 1, "score": 3}]},
            {"essays": [], "texts": []},
        ]
        for bad in bad_bodies:
            r = await http.post("/v1/score", json=bad)
            assert r.status_code == 422, (bad, r.text)
            assert isinstance(r.json()["detail"], list)
        r = await http.post("/v1/score", json={"essays": [{"text": "a", "prompt": 1},
                                                          {"text": "b", "prompt": 8}]})
        assert r.status_code == 422, r.text
        (detail,) = r.json()["detail"]
        assert detail["loc"] == ["body", "essays", 1, "prompt"]
        assert "no output layer for prompt 8" in detail["msg"]
        r = await http.post("/v1/score", json={"essays": [
            {"text": "a", "prompt": 1}, {"text": NO_PIECES_TEXTS[0], "prompt": 8},
            {"text": NO_PIECES_TEXTS[1], "prompt": 2}]})
        assert r.status_code == 422, r.text
        assert [(d["loc"], d["msg"][:40]) for d in r.json()["detail"]] == [
            (["body", "essays", 1, "text"], 'field "text" gives no word pieces: the s'),
            (["body", "essays", 1, "prompt"], 'field "prompt": this scorer has no outpu'),
            (["body", "essays", 2, "text"], 'field "text" gives no word pieces: the s')]
        assert r.json()["detail"][0]["msg"] == NO_PIECES
        # characters the old rule refused that the tokenizer keeps (as [UNK]) are scored
        r = await http.post("/v1/score", json={"essays": [{"text": t, "prompt": 2}
                                                          for t in UNK_TEXTS]})
        assert r.status_code == 200, r.text
        assert all(in_range(2, x["score"]) for x in r.json()["results"])
        for raw in (b'{"essays": [{"text": "\\ud800 lone", "prompt": 1}]}', b'{"essays": ['):
            r = await http.post("/v1/score", content=raw,
                                headers={"content-type": "application/json"})
            assert r.status_code == 422, (raw, r.text)
            assert all("input" not in e for e in r.json()["detail"]), "input not echoed back"

        r = await http.post("/v1/score", json={"essays": [{"text": "x", "prompt": 1}] * 4})
        assert r.status_code == 413 and "at most 3" in r.json()["detail"]
        r = await http.post("/v1/score", json={"essays": [{"text": "word " * 5_000, "prompt": 1}]})
        assert r.status_code == 413, r.text
        m = metric_samples((await http.get("/metrics")).text)
        assert m[("mhmla_http_requests_total", (("path", "/v1/score"), ("status", "422")))] == 25
        assert m[("mhmla_http_requests_total", (("path", "/v1/score"), ("status", "413")))] == 2

    run_app(app, body)


def test_a_lone_surrogate_in_an_essay_is_named_as_in_a_tag_request():
    """A lone surrogate in an essay's text got pydantic's "unable to parse raw data as a unicode
    string" (the text's pattern cannot read it); now the 422 names the essay's field and the
    code point, as /v1/tag names the text (and `mhmla-serve score` its line's field)."""
    from mhmla_fast.serve.http import create_app

    app = create_app(StubEngine(), scorer=StubScorer())

    async def body(http) -> None:
        for raw, loc, msg in [
            (b'{"essays": [{"text": "ok", "prompt": 1}, {"text": "a \\ud800 b", "prompt": 2}]}',
             ["body", "essays", 1, "text"], 'field "text" contains a lone surrogate U+D800'),
            (b'{"essays": [{"text": "\\udfff", "prompt": 2}]}',
             ["body", "essays", 0, "text"], 'field "text" contains a lone surrogate U+DFFF'),
            (b'{"essays": [{"text": "ok", "prompt": 1, "id": "x\\udc80"}]}',
             ["body", "essays", 0, "id"], 'field "id" contains a lone surrogate U+DC80'),
        ]:
            r = await http.post("/v1/score", content=raw,
                                headers={"content-type": "application/json"})
            assert r.status_code == 422, (raw, r.text)
            (error,) = r.json()["detail"]
            assert error["loc"] == loc and msg in error["msg"], error
            assert "input" not in error
        ok = await http.post("/v1/score", json={"essays": [{"text": "caf\u00e9 \U0001F600",
                                                             "prompt": 1}]})
        assert ok.status_code == 200, ok.text

    run_app(app, body)


def test_full_queue_503_and_a_scorer_failure_500_for_its_own_request_only(tiny_scorer):
    from mhmla_fast.serve.http import create_app

    scorer = RecordingScorer(tiny_scorer)
    scorer.gate.clear()
    app = create_app(StubEngine(), scorer=scorer, max_queue=3, max_texts_per_request=2,
                     max_essays_per_request=2, max_wait_ms=0, warm_up=False)

    async def body(http) -> None:
        post = lambda *texts: http.post("/v1/score", json={  # noqa: E731
            "essays": [{"text": t, "prompt": 2} for t in texts]})
        first = asyncio.create_task(post("first"))
        while not scorer.entered.is_set():  # the worker holds "first" inside the scorer
            await asyncio.sleep(0.005)
        queued = [asyncio.create_task(post("fine", "BOOM here")), asyncio.create_task(post("ok"))]
        while app.state.batcher.depth < 3:
            await asyncio.sleep(0.005)
        r = await post("one too many")
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        scorer.gate.set()
        assert (await first).status_code == 200
        boom, ok = await asyncio.gather(*queued)
        assert boom.status_code == 500 and "scoring failed" in boom.json()["detail"]
        assert "exploded" in boom.json()["detail"]
        assert ok.status_code == 200 and ok.json()["results"][0]["prompt"] == 2
        m = metric_samples((await http.get("/metrics")).text)
        assert m[("mhmla_engine_failures_total", ())] == 1
        assert m[("mhmla_http_requests_total", (("path", "/v1/score"), ("status", "503")))] == 1

    run_app(app, body)
    # the two queued requests went to the scorer together, then one by one after the failure
    assert [c[0] for c in scorer.calls] == [["first"], ["fine", "BOOM here", "ok"],
                                            ["fine", "BOOM here"], ["ok"]]


def test_tagging_and_scoring_items_are_never_mixed_in_one_batch():
    from mhmla_fast.serve.http import MicroBatcher

    calls: list[str] = []

    class Engine(StubEngine):
        def tag_texts(self, texts):
            calls.append("tag")
            return super().tag_texts(texts)

    class Scorer(StubScorer):
        def predict_scores(self, texts, prompts, token_budget=8192):
            calls.append("score")
            return super().predict_scores(texts, prompts, token_budget)

    batcher = MicroBatcher(Engine(), scorer=Scorer(), max_wait_ms=200)

    async def run() -> list:
        batcher.start()
        futs = [batcher.submit("texts", ["a b"]), batcher.submit("essays", [("x", 3), ("y", 8)]),
                batcher.submit("texts", ["c"])]
        return await asyncio.gather(*futs)

    tagged, scored, tagged2 = asyncio.run(run())
    batcher.close()
    batcher.join(10)
    assert scored == [{"prompt": 3, "score": 0}, {"prompt": 8, "score": 0}]
    assert tagged == [{"tokens": ["a", "b"]}] and tagged2 == [{"tokens": ["c"]}]
    assert calls == ["tag", "score", "tag"]
    with pytest.raises(ValueError, match="no essay scorer"):
        MicroBatcher(StubEngine()).submit("essays", [("x", 1)])


def test_without_a_scorer_v1_score_answers_404():
    from mhmla_fast.serve.http import create_app

    app = create_app(StubEngine())

    async def body(http) -> None:
        r = await http.post("/v1/score", json={"essays": [{"text": "a", "prompt": 1}]})
        assert r.status_code == 404 and "essay scoring is not enabled" in r.json()["detail"]
        assert (await http.get("/healthz")).json() == {"status": "ok", "model": "StubEngine",
                                                       "queue_depth": 0}
        assert "/v1/score" not in (await http.get("/openapi.json")).json()["paths"]

    run_app(app, body)


def test_http_command_loads_the_scorer(tiny_tagger_dir, tiny_scorer_dir, tmp_path, monkeypatch,
                                       capsys):
    uvicorn = pytest.importorskip("uvicorn")
    from mhmla_fast.aes import scoring as aes_scoring

    seen: dict = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    base = ["http", "--model", str(tiny_tagger_dir), "--threads", "1"]
    assert main([*base, "--scorer", str(tiny_scorer_dir), "--max-essays-per-request", "5",
                 "--token-budget", "1024"]) == 0
    batcher = seen["app"].state.batcher
    assert batcher.scorer is not None and batcher.score_token_budget == 1024
    assert batcher.scorer.config.prompts == (1, 2, 3, 4, 5, 6, 7)
    assert main([*base, "--no-scorer"]) == 0
    assert seen["app"].state.batcher.scorer is None
    monkeypatch.setattr(aes_scoring, "default_model_path", lambda: tmp_path / "shipped")
    assert main(base) == 0  # no shipped scorer: tagging only, with a note
    assert seen["app"].state.batcher.scorer is None
    assert "no essay scorer installed" in capsys.readouterr().err
    monkeypatch.setattr(aes_scoring, "default_model_path", lambda: tiny_scorer_dir)
    assert main(base) == 0  # the shipped scorer when it is installed
    assert seen["app"].state.batcher.scorer is not None
    assert main([*base, "--scorer", str(tmp_path / "nope")]) == 2
    assert "--scorer" in capsys.readouterr().err
    assert main([*base, "--scorer", str(tiny_scorer_dir), "--no-scorer"]) == 2  # argparse
    assert main([*base, "--scorer", str(tiny_scorer_dir), "--max-queue", "300",
                 "--max-texts-per-request", "3", "--max-essays-per-request", "400"]) == 2


def test_a_capped_essay_says_so(tmp_path, tiny_scorer_dir, tiny_scorer):
    """--max-chars N --over-long cap scores the first N characters and marks the record with
    "capped_from", as tag does (it used to give the cut essay's score with no mark)."""
    text = "the cat sat on the mat because it was warm ."
    data = (json.dumps({"text": text, "prompt": 1, "id": "c"}) + "\n"
            + json.dumps({"text": "short", "prompt": 1}) + "\n").encode()
    rc, out = score_cli(tmp_path, tiny_scorer_dir, data, "--max-chars", "20", "--over-long", "cap")
    assert rc == 0
    want = tiny_scorer.predict_scores([text[:20], "short"], 1).tolist()
    assert out == [{"index": 1, "id": "c", "prompt": 1, "score": want[0], "capped_from": len(text)},
                   {"index": 2, "id": 2, "prompt": 1, "score": want[1]}]


def test_advisories_come_with_the_score_over_http_and_from_the_command(tmp_path):
    """The shipped scorer over POST /v1/score and `mhmla-serve score`: an essay of one word
    repeated gets its score and advisories (distinct / words far below the training essays'),
    also when the service scores it window by window; an ordinary essay gets none."""
    from mhmla_fast.serve.http import create_app
    from mhmla_fast.serve.score import default_scorer_path, load_scorer

    scorer = load_scorer(default_scorer_path(), backend="torch", threads=1)
    ordinary = ("Computers are good for people because they help us learn and talk with our "
                "friends. I think the newspaper should say that computers are good.")
    essays = [{"text": "because " * 300, "prompt": 4, "id": "rep"},
              {"text": "because " * 1200, "prompt": 5},  # over split_pieces: window by window
              {"text": ordinary, "prompt": 1}]
    want = scorer.predict_scores([e["text"] for e in essays], [e["prompt"] for e in essays]).tolist()
    app = create_app(StubEngine(), scorer=scorer, scorer_name="shipped", split_pieces=600,
                     warm_up=False)
    got = {}

    async def body(http) -> None:
        got["r"] = (await http.post("/v1/score", json={"essays": essays})).json()

    run_app(app, body)
    results = got["r"]["results"]
    assert [r["score"] for r in results] == want
    for r in results[:2]:
        assert "distinct_ratio" in [a["feature"] for a in r["advisories"]], r
    assert "advisories" not in results[2]

    data = "".join(json.dumps(e) + "\n" for e in essays).encode()
    rc, out = score_cli(tmp_path, str(default_scorer_path()), data, "--backend", "torch")
    assert rc == 0 and [r["score"] for r in out] == want
    assert [r.get("advisories") for r in out] == [r.get("advisories") for r in results]
