"""The HTTP API on a real uvicorn server: 64 concurrent clients get exactly the offline engine's
results while requests are micro-batched together; size limits answer 413, a full queue 503 with
Retry-After, an engine failure 500 for its own request only; /metrics counts it all; shutdown
drains what is in flight and refuses what comes after."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

import uvicorn  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from mhmla_fast.serve.http import (  # noqa: E402
    MAX_LISTED_ERRORS, BodyLimit, EngineFailure, MicroBatcher, Unavailable, create_app,
)

WORDS = ("the a cat dog house school every day he she they we go goes went see sees because "
         "although happily café naïve résumé don't John's well-known 3.14 !? …").split()
UNICODE = ["👍🏽", "👨\u200d👩\u200d👧", "🇯🇵", "e\u0301te\u0301", "我喜欢猫", "مرحبا بالعالم",
           "שלום עולם", "Ünïcödé", "ﬁne", "\u200bzero\u200bwidth"]


def random_text(rng: random.Random) -> str:
    """A short sentence, now and then with Unicode, rarely long enough to need several windows."""
    n = rng.choice([rng.randint(1, 12)] * 9 + [rng.randint(40, 90)])
    words = [rng.choice(UNICODE) if rng.random() < 0.1 else rng.choice(WORDS) for _ in range(n)]
    return rng.choice([" ", "  ", " \u3000"]).join(words) + rng.choice(["", ".", " ?", "\u00a0!"])


# ----------------------------------------------------------------------------------- helpers


@contextmanager
def serving(app, **config) -> Iterator[tuple[str, uvicorn.Server]]:
    """Run ``app`` on uvicorn on a free loopback port in a background thread; yield its base URL
    and server once /healthz answers 200; stop it (graceful shutdown) on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                           loop="asyncio", http="h11", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        assert thread.is_alive(), "the server thread died while starting"
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if server.started and httpx.get(url + "/healthz", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.02)
    try:
        yield url, server
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of a Prometheus text exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


class _Result:
    def __init__(self, text: str) -> None:
        self.text = text

    def to_dict(self) -> dict:
        return {"tokens": self.text.split(), "labels": [], "probs": [], "spans": []}


class StubEngine:
    """Engine stand-in: echoes whitespace tokens; records every call; each call waits for
    ``gate`` (set by default) after setting ``entered``; raises on a text containing "BOOM"."""

    def __init__(self) -> None:
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()
        self.calls: list[list[str]] = []

    def tag_texts(self, texts: list[str]) -> list[_Result]:
        self.calls.append(list(texts))
        self.entered.set()
        assert self.gate.wait(30), "test gate never opened"
        if any("BOOM" in t for t in texts):
            raise RuntimeError("the stub engine exploded")
        return [_Result(t) for t in texts]

    def tag_tokens(self, sentences: list[list[str]]) -> list[_Result]:
        return self.tag_texts([" ".join(s) for s in sentences])


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


# ------------------------------------------------------------------------------------- tests


def test_64_concurrent_clients_get_the_offline_results(tiny_engine):
    rng = random.Random(7)
    n_clients, per_client = 64, 48  # 3072 requests
    plans = []
    for _ in range(n_clients * per_client):
        kind = "sentences" if rng.random() < 0.15 else "texts"
        texts = [random_text(rng) for _ in range(rng.randint(1, 8))]
        plans.append((kind, texts if kind == "texts" else [t.split() for t in texts]))
    # offline reference: one engine call per kind over every distinct input
    uniq_texts = sorted({t for k, xs in plans if k == "texts" for t in xs})
    uniq_sents = sorted({tuple(s) for k, xs in plans if k == "sentences" for s in xs})
    ref = {("texts", t): r.to_dict() for t, r in zip(uniq_texts, tiny_engine.tag_texts(uniq_texts))}
    ref.update({("sentences", s): r.to_dict()
                for s, r in zip(uniq_sents, tiny_engine.tag_tokens([list(s) for s in uniq_sents]))})
    assert any("i" in r["labels"] for r in ref.values()) and any(
        "c" in r["labels"] for r in ref.values()), "the tiny tagger should give both labels"

    app = create_app(tiny_engine, max_batch_tokens=4096, max_wait_ms=5, max_queue=4096,
                     max_request_bytes=1_000_000, max_texts_per_request=256, model_name="tiny")
    responses: list[tuple[int, dict] | None] = [None] * len(plans)

    async def client(url: str, c: int) -> None:
        # one client (one keep-alive connection) each; verify=False: no CA bundle load per client
        async with httpx.AsyncClient(base_url=url, timeout=120, verify=False) as http:
            for k in range(c, len(plans), n_clients):
                kind, inputs = plans[k]
                r = await http.post("/v1/tag", json={kind: inputs})
                responses[k] = (r.status_code, r.json())

    async def load(url: str) -> None:
        await asyncio.gather(*(client(url, c) for c in range(n_clients)))

    with serving(app) as (url, _):
        t0 = time.perf_counter()
        asyncio.run(load(url))
        elapsed = time.perf_counter() - t0
        health = httpx.get(url + "/healthz").json()
        metrics = httpx.get(url + "/metrics")
        docs = httpx.get(url + "/openapi.json").json()

    # batches differ from the offline run's (they depend on timing), which moves probabilities
    # by float rounding; the random tiny tagger puts many near its threshold, so a label is
    # compared only where its probability is clear of the threshold by more than that
    threshold, near = float(tiny_engine.threshold), 1e-5
    n_texts = n_words = n_near = 0
    for (kind, inputs), resp in zip(plans, responses):
        assert resp is not None
        status, body = resp
        assert status == 200, body
        assert len(body["results"]) == len(inputs)
        for x, got in zip(inputs, body["results"]):
            want = ref[(kind, x if kind == "texts" else tuple(x))]
            assert got["tokens"] == want["tokens"]
            assert got.get("offsets") == want.get("offsets")
            assert got["probs"] == pytest.approx(want["probs"], abs=near)
            clear = [abs(q - threshold) > near for q in want["probs"]]
            assert [a for a, c in zip(got["labels"], clear) if c] == [
                b for b, c in zip(want["labels"], clear) if c]
            if all(clear):
                assert got["spans"] == want["spans"]
            n_texts += 1
            n_words += len(clear)
            n_near += clear.count(False)
    assert n_near <= n_words // 1000  # the exemption stays rare
    assert health == {"status": "ok", "model": "tiny", "queue_depth": 0}

    assert metrics.status_code == 200
    m = metric_samples(metrics.text)
    assert m[("mhmla_http_requests_total", (("path", "/v1/tag"), ("status", "200")))] == len(plans)
    assert m[("mhmla_texts_tagged_total", ())] == n_texts
    assert m[("mhmla_request_seconds_count", ())] == len(plans)
    batches = m[("mhmla_batch_texts_count", ())]
    assert m[("mhmla_batch_texts_sum", ())] == n_texts
    per_batch = m[("mhmla_batch_requests_sum", ())] / batches
    multi = batches - m[("mhmla_batch_requests_bucket", (("le", "1.0"),))]
    assert batches < len(plans) and multi > 0, "requests were batched together"
    assert m[("mhmla_queue_depth", ())] == 0
    assert "/v1/tag" in docs["paths"] and "TagRequest" in json.dumps(docs)
    print(f"\n{len(plans)} requests, {n_texts} texts in {elapsed:.1f} s "
          f"({len(plans) / elapsed:.0f} req/s); {batches:.0f} engine batches, "
          f"{per_batch:.1f} requests and {n_texts / batches:.1f} texts per batch, "
          f"{multi:.0f} batches of several requests")


@pytest.mark.parametrize("big", [False, True])
def test_a_tag_response_is_the_bytes_the_tag_command_would_write(tiny_engine, monkeypatch, big):
    """One request alone is one engine call, as offline: the body is {"results": ...} encoded as
    the tag command encodes its lines (outputs.encode_json), on the event loop and, for a
    body past BIG_RESPONSE tokens, in a thread."""
    from mhmla_fast.serve import http as http_module
    from mhmla_fast.serve.engine import result_dicts
    from mhmla_fast.serve.outputs import encode_json

    if big:
        monkeypatch.setattr(http_module, "BIG_RESPONSE", 1)
    texts = [random_text(random.Random(k)) for k in range(5)]
    want = encode_json({"results": result_dicts(tiny_engine.tag_texts(texts))})
    app = create_app(tiny_engine, max_batch_tokens=4096, max_wait_ms=5, model_name="tiny")
    with serving(app) as (url, _):
        r = httpx.post(url + "/v1/tag", json={"texts": texts})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.content == want


def test_validation_and_size_limits():
    app = create_app(StubEngine(), max_request_bytes=20_000, max_texts_per_request=4,
                     max_queue=64)
    with serving(app) as (url, _):
        post = lambda **kw: httpx.post(url + "/v1/tag", timeout=30, **kw)  # noqa: E731
        assert post(json={"texts": ["a b", "c"]}).json()["results"][1]["tokens"] == ["c"]
        assert post(json={"texts": []}).json() == {"results": []}
        for bad in ({}, {"texts": "a string"}, {"texts": ["a"], "sentences": [["a"]]},
                    {"sentences": [[]]}, {"sentences": [["a", " "]]}, {"texts": [1]},
                    {"texts": ["a"], "other": 1},
                    # blank by str.strip, the offline readers' rule, not only by \S
                    {"sentences": [["a", "\x1c"]]}, {"sentences": [["a", "\u3000\x1f"]]}):
            r = post(json=bad)
            assert r.status_code == 422, (bad, r.text)
            assert isinstance(r.json()["detail"], list)
        for raw in (b'{"texts": ["\\ud800 lone"]}', b'{"texts": [', b'\xff\xfe'):
            r = post(content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 422, (raw, r.text)
            assert all("input" not in e for e in r.json()["detail"]), "input not echoed back"

        r = post(json={"texts": ["x"] * 5})
        assert r.status_code == 413 and "at most 4" in r.json()["detail"]
        big = {"texts": ["word " * 5_000]}
        r = post(json=big)  # honest Content-Length over the limit
        assert r.status_code == 413, r.text
        chunks = [b'{"texts": ["' + b"w " * 4_000 + b'"', *[b', "' + b"w " * 4_000 + b'"'] * 3,
                  b"]}"]
        r = post(content=iter(chunks),  # a generator body is sent chunked, without Content-Length
                 headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        m = metric_samples(httpx.get(url + "/metrics").text)
        assert m[("mhmla_http_requests_total", (("path", "/v1/tag"), ("status", "413")))] == 3
        assert m[("mhmla_http_requests_total", (("path", "/v1/tag"), ("status", "422")))] == 12

        # too many items is the 413 before any item is validated (FastAPI validated all of
        # them first: a 1 MB body of bad items came back as a 41 MB 422), and a 422 names
        # at most MAX_LISTED_ERRORS errors
        for key in ("texts", "sentences"):
            r = post(content=b'{"%s": [' % key.encode() + b",".join([b"1"] * 5000) + b"]}",
                     headers={"content-type": "application/json"})
            assert r.status_code == 413 and r.json()["detail"] == \
                f"5000 {key} in one request; at most 4 are allowed", r.text
        r = post(json={"sentences": [[1] * 30, [2] * 30]})  # 60 bad words in 2 sentences
        assert r.status_code == 422
        detail = r.json()["detail"]
        assert len(detail) == MAX_LISTED_ERRORS + 1
        assert detail[-1]["msg"] == f"and {60 - MAX_LISTED_ERRORS} more errors"


def test_wrong_content_type_415_deep_nesting_422_and_offline_docs():
    app = create_app(StubEngine(), max_request_bytes=1_000_000)
    with serving(app) as (url, _):
        post = lambda path="/v1/tag", **kw: httpx.post(url + path, timeout=30, **kw)  # noqa: E731
        body = b'{"texts": ["a b"]}'
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                      "application/json; charset=latin-1", None):
            headers = {"content-type": ctype} if ctype else {}
            r = post(content=body, headers=headers)
            assert r.status_code == 415, (ctype, r.text)
            assert "Content-Type: application/json" in r.json()["detail"]
            assert post("/v1/score", content=body, headers=headers).status_code == 415
        for ctype in ("application/json", "application/json; charset=UTF-8",
                      "application/vnd.api+json", "Application/JSON"):
            r = post(content=body, headers={"content-type": ctype})
            assert r.status_code == 200, (ctype, r.text)
        deep = b'{"texts": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # beats the parser's stack
        r = post(content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["type"] == "json_invalid"
        assert "nested too deeply" in r.json()["detail"][0]["msg"]

        page = httpx.get(url + "/docs", timeout=30)
        assert page.status_code == 200
        assert 'the OpenAPI description of this API is at <a href="/openapi.json">' in page.text
        spec = httpx.get(url + "/openapi.json", timeout=30).json()  # self-contained, offline
        assert "/v1/tag" in spec["paths"]
        assert httpx.get(url + "/redoc", timeout=30).status_code == 404


def test_a_lying_content_length_is_caught_by_counting_the_body():
    sent: list[dict] = []

    async def app(scope, receive, send):  # must never be reached
        raise AssertionError("the oversized body reached the app")

    async def run() -> None:
        chunks = [b"x" * 600, b"x" * 600, b""]

        async def receive():
            body = chunks.pop(0)
            return {"type": "http.request", "body": body, "more_body": bool(chunks)}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/tag",
                 "headers": [(b"content-length", b"10")]}
        await BodyLimit(app, limit=1000)(scope, receive, send)

    asyncio.run(run())
    assert sent[0]["status"] == 413


def test_full_queue_answers_503_with_retry_after():
    engine = StubEngine()
    engine.gate.clear()
    app = create_app(engine, max_queue=2, max_texts_per_request=2, max_wait_ms=0,
                     warm_up=False)  # (a gated stand-in: no warm-up)
    with serving(app) as (url, _):
        with httpx.Client(base_url=url, timeout=30) as http:
            results: dict[str, httpx.Response] = {}

            def send(name: str) -> threading.Thread:
                t = threading.Thread(target=lambda: results.__setitem__(
                    name, httpx.post(url + "/v1/tag", json={"texts": [name]}, timeout=30)))
                t.start()
                return t

            threads = [send("first")]
            assert engine.entered.wait(10)  # the worker holds "first" inside the engine
            threads += [send("second"), send("third")]
            wait_for(lambda: app.state.batcher.depth == 2)  # the queue is full
            r = http.post("/v1/tag", json={"texts": ["one too many"]})
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert http.get("/healthz").json()["queue_depth"] == 2
            engine.gate.set()
            for t in threads:
                t.join(30)
            assert {k: v.status_code for k, v in results.items()} == dict.fromkeys(
                ["first", "second", "third"], 200)
            assert http.post("/v1/tag", json={"texts": ["again"]}).status_code == 200
            m = metric_samples(http.get("/metrics").text)
            assert m[("mhmla_http_requests_total", (("path", "/v1/tag"), ("status", "503")))] == 1


def test_an_engine_failure_fails_only_its_own_request():
    engine = StubEngine()
    app = create_app(engine, max_wait_ms=1500)  # a long wait: all requests land in one batch

    async def run(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            texts = [["fine one"], ["BOOM here", "and fine"], ["fine two", "fine three"]]
            return await asyncio.gather(*(http.post("/v1/tag", json={"texts": t}) for t in texts))

    with serving(app) as (url, _):
        engine.calls.clear()
        ok1, boom, ok2 = asyncio.run(run(url))
        m = metric_samples(httpx.get(url + "/metrics").text)
    assert ok1.status_code == 200 and ok1.json()["results"][0]["tokens"] == ["fine", "one"]
    assert ok2.status_code == 200 and len(ok2.json()["results"]) == 2
    assert boom.status_code == 500 and "exploded" in boom.json()["detail"]
    assert len(engine.calls[0]) == 5, "the three requests were tagged in one engine call"
    assert m[("mhmla_engine_failures_total", ())] == 1


def test_graceful_shutdown_finishes_in_flight_requests():
    engine = StubEngine()
    engine.gate.clear()
    app = create_app(engine, max_wait_ms=0, warm_up=False)
    results: list[httpx.Response] = []
    with serving(app) as (url, server):
        def send(k: int) -> None:
            results.append(httpx.post(url + "/v1/tag", json={"texts": [f"text {k}"]}, timeout=30))

        threads = [threading.Thread(target=send, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        assert engine.entered.wait(10)
        wait_for(lambda: app.state.batcher.depth + sum(map(len, engine.calls)) == 8)
        server.should_exit = True  # shutdown begins with 8 requests in flight
        time.sleep(0.3)
        engine.gate.set()
        for t in threads:
            t.join(30)
    assert all(r.status_code == 200 for r in results)
    assert sorted(r.json()["results"][0]["tokens"][1] for r in results) == list("01234567")
    assert not app.state.batcher.alive


def test_a_request_past_the_graceful_shutdown_time_gets_a_503():
    """uvicorn cancels what is still running when --graceful-timeout runs out; the
    cancellation reached it and it answered a plain-text 500 ("Exception in ASGI
    application"). The request gets the 503 with Retry-After of a refused one, counted as
    dropped for shutdown."""
    engine = StubEngine()
    engine.gate.clear()
    app = create_app(engine, max_wait_ms=0, warm_up=False)
    got: list[httpx.Response] = []
    try:
        with serving(app, timeout_graceful_shutdown=1) as (url, server):
            sender = threading.Thread(target=lambda: got.append(
                httpx.post(url + "/v1/tag", json={"texts": ["slow"]}, timeout=30)))
            sender.start()
            assert engine.entered.wait(10)
            server.should_exit = True  # the engine call never ends within the 1 s
            sender.join(30)
            engine.gate.set()  # (then the worker drains, and the server stops)
    finally:
        engine.gate.set()
    (r,) = got
    assert r.status_code == 503 and r.headers["retry-after"], (r.status_code, r.text)
    assert "shutting down" in r.json()["detail"]
    from prometheus_client import generate_latest

    samples = metric_samples(generate_latest(app.state.registry).decode())
    assert samples[("mhmla_dropped_requests_total", (("reason", "shutdown"),))] == 1


def test_after_shutdown_begins_new_requests_get_503_while_queued_ones_finish():
    engine = StubEngine()
    engine.gate.clear()
    app = create_app(engine, max_wait_ms=0, warm_up=False)

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=transport, base_url="http://test", timeout=30) as http:
            inflight = [asyncio.create_task(http.post("/v1/tag", json={"texts": [f"q {k}"]}))
                        for k in range(3)]
            # all three texts admitted: queued, or inside the (gated) engine call. Count texts,
            # not calls: the worker may take several queued requests into one batch.
            deadline = time.monotonic() + 10
            while app.state.batcher.depth + sum(map(len, engine.calls)) < 3:
                assert time.monotonic() < deadline, "the three requests were never admitted"
                await asyncio.sleep(0.005)
            app.state.batcher.close()  # what the lifespan exit does first
            r = await http.post("/v1/tag", json={"texts": ["late"]})
            assert r.status_code == 503 and "shutting down" in r.json()["detail"]
            assert (await http.get("/healthz")).status_code == 503
            engine.gate.set()
            done = await asyncio.gather(*inflight)
            assert [d.status_code for d in done] == [200, 200, 200]
        assert not app.state.batcher.alive

    asyncio.run(run())


@pytest.mark.parametrize("wait", [float("inf"), float("nan"), -1.0])
def test_the_batch_wait_must_be_finite(wait):
    with pytest.raises(ValueError, match="max_wait_ms finite and >= 0"):
        MicroBatcher(StubEngine(), max_wait_ms=wait)


def test_a_dead_worker_fails_its_requests_and_reports_unhealthy():
    def broken_metrics(*args) -> None:
        raise RuntimeError("bug in a callback")

    batcher = MicroBatcher(StubEngine(), max_wait_ms=0, on_batch=broken_metrics)

    async def run() -> None:
        batcher.start()
        with pytest.raises(EngineFailure, match="bug in a callback"):
            await asyncio.wait_for(batcher.submit("texts", ["a b"]), 10)
        batcher.join(10)
        assert not batcher.alive and not batcher.accepting
        assert isinstance(batcher.error, RuntimeError)
        with pytest.raises(Unavailable):
            batcher.submit("texts", ["c"])

    asyncio.run(run())


def test_valid_tag_requests_take_the_fast_path_and_answer_as_the_route_does(monkeypatch):
    """TagFastPath answers every POST /v1/tag whose body parses and validates (413s included)
    and hands everything else to FastAPI; with the fast path switched off, the app answers every
    request of the set with the same status and the same JSON."""
    from mhmla_fast.serve import http as http_mod

    handled = []
    init = http_mod.TagFastPath.__init__

    def spying_init(self, app, handle):
        async def spy(body, request):
            handled.append(body)
            return await handle(body, request)
        init(self, app, spy)

    monkeypatch.setattr(http_mod.TagFastPath, "__init__", spying_init)
    bodies = [{"texts": ["a b", "c"]}, {"sentences": [["He", "go"], ["x"]]}, {"texts": []},
              {"texts": ["x"] * 5},  # over max_texts_per_request: 413 before (ItemLimit)
              {}, {"texts": [1]}, {"texts": ["a"], "other": 1}, {"sentences": [["a", " "]]}]
    raws = [b'{"texts": ["\\ud800 lone"]}', b'{"texts": [', b"[" * 100_000]

    def answers() -> list[tuple[int, object]]:
        app = create_app(StubEngine(), max_texts_per_request=4, max_queue=64)
        with serving(app) as (url, _):
            out = [httpx.post(url + "/v1/tag", json=b, timeout=30) for b in bodies]
            out += [httpx.post(url + "/v1/tag", content=r, timeout=30,
                               headers={"content-type": "application/json"}) for r in raws]
            return [(r.status_code, r.json()) for r in out]

    fast = answers()
    assert len(handled) == 3  # the three valid bodies in the limits; none of the others
    assert [s for s, _ in fast] == [200, 200, 200, 413] + [422] * 7

    async def passthrough(self, scope, receive, send):
        await self.app(scope, receive, send)

    monkeypatch.setattr(http_mod.TagFastPath, "__call__", passthrough)
    handled.clear()
    assert answers() == fast and handled == []


def test_the_heap_loaded_before_serving_is_frozen_while_it_serves():
    """At the app's start what is loaded moves to the collector's permanent generation (a full
    collection then skips it: on 2 CPU cores the slowest request of a 10 s load went from
    0.27 to 0.04 s), and it is unfrozen at shutdown."""
    import gc

    gc.unfreeze()
    app = create_app(StubEngine())
    with serving(app) as (url, _):
        assert gc.get_freeze_count() > 0
        assert httpx.post(url + "/v1/tag", json={"texts": ["a b"]}, timeout=30).status_code == 200
    assert gc.get_freeze_count() == 0


def test_blank_texts_are_refused_as_the_tag_command_refuses_them():
    """A text empty or blank by str.strip answered 200 with an empty tagging, where `mhmla-serve
    tag` answers its line with the error 'field "text" is empty' (and /v1/score refuses a blank
    essay): now 422 naming the text."""
    app = create_app(StubEngine())
    with serving(app) as (url, _):
        post = lambda body: httpx.post(url + "/v1/tag", json=body, timeout=30)  # noqa: E731
        for texts, first in ((["a", ""], 1), (["   "], 0), (["a b", "\u3000\t\n", ""], 1)):
            r = post({"texts": texts})
            assert r.status_code == 422, (texts, r.text)
            (error,) = r.json()["detail"]
            assert error["loc"] == ["body", "texts"]
            assert f"texts[{first}] is empty or blank" in error["msg"]
        assert post({"texts": ["a", " b "]}).json()["results"][1]["tokens"] == ["b"]


def test_a_body_that_is_not_utf8_gets_422_saying_so():
    """A body with bytes that are not UTF-8 got "JSON decode error" at offset 0 (json.loads took
    it for UTF-16 by its first bytes) or "nested too deeply or not decodable": now 422 saying
    that the body must be UTF-8 JSON, on both endpoints."""
    app = create_app(StubEngine())
    with serving(app) as (url, _):
        for path in ("/v1/tag", "/v1/score"):
            for raw, at in ((b'\xff\xfe', 0), (b'{"texts": ["caf\xe9"]}', 15),
                            ('{"texts": ["a"]}'.encode("utf-16"), 0)):
                r = httpx.post(url + path, content=raw, timeout=30,
                               headers={"content-type": "application/json"})
                assert r.status_code == 422, (path, raw, r.text)
                (error,) = r.json()["detail"]
                assert error["type"] == "json_invalid" and error["loc"] == ["body"]
                assert error["msg"].startswith(f"the body must be UTF-8 JSON: byte 0x{raw[at]:02x} "
                                               f"at offset {at} is not UTF-8"), error
        r = httpx.post(url + "/v1/tag", content='{"texts": ["café"]}'.encode(), timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json()["results"][0]["tokens"] == ["café"]


def test_head_healthz_answers_as_get_does_without_a_body():
    """A probe's HEAD /healthz got 405; it answers GET's status and headers, with no body."""
    app = create_app(StubEngine())
    with serving(app) as (url, _):
        got, head = httpx.get(url + "/healthz"), httpx.head(url + "/healthz")
        assert (head.status_code, got.status_code) == (200, 200)
        assert head.content == b"" and head.headers["content-type"] == "application/json"
        assert head.headers["content-length"] == got.headers["content-length"]
        assert "head" not in app.openapi()["paths"]["/healthz"]  # GET's alone is described


def test_latency_buckets_reach_past_the_request_deadline():
    """The request and batch seconds histograms stopped at 10 s, while a request may run up to
    its deadline (60 s by default): longer ones were counted in +Inf alone. The buckets now run
    to 120 s, and the exposition stays valid Prometheus text."""
    app = create_app(StubEngine())
    with serving(app) as (url, _):
        assert httpx.post(url + "/v1/tag", json={"texts": ["a b"]}).status_code == 200
        text = httpx.get(url + "/metrics").text
    bounds: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):  # (the parser checks the format)
        for s in family.samples:
            if s.name.endswith("_seconds_bucket"):
                bounds.setdefault(s.name, []).append(float(s.labels["le"]))
    assert set(bounds) == {"mhmla_request_seconds_bucket", "mhmla_batch_seconds_bucket",
                           "mhmla_score_request_seconds_bucket",
                           "mhmla_score_batch_seconds_bucket"}
    for name, les in bounds.items():
        assert les == sorted(les) and les[-1] == float("inf"), name
        assert {10.0, 30.0, 60.0, 120.0} <= set(les), name
    m = metric_samples(text)
    assert m[("mhmla_request_seconds_bucket", (("le", "60.0"),))] == 1
