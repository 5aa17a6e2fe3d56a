"""The tagger over HTTP: a FastAPI app that micro-batches concurrent requests into engine calls.

Endpoints (:func:`create_app`)
------------------------------

``POST /v1/tag``
    Body ``{"texts": [str, ...]}`` (raw texts, tokenised by the engine) or
    ``{"sentences": [[str, ...], ...]}`` (pre-tokenised, non-empty lists of non-blank words), not
    both. Answer ``{"results": [TagResult.to_dict(), ...]}`` in request order: ``tokens``,
    ``labels`` ("c"/"i"), ``probs`` (6 decimals), ``spans``, and ``offsets`` ([start, end)
    code-point offsets) for raw texts. An empty list gives ``{"results": []}``.

    Statuses: 200; 422 malformed JSON or a body that breaks the schema (strings holding lone
    surrogates included; the error list does not echo the input back); 413 a body larger than
    ``max_request_bytes`` (by ``Content-Length`` and by the bytes actually received, so a chunked
    or lying client is caught) or more than ``max_texts_per_request`` texts/sentences; 503 with
    ``Retry-After`` when the queue is full or the server is shutting down; 500 when the engine
    failed on this request's inputs. Every error body is ``{"detail": ...}``.

``GET /healthz``
    200 ``{"status": "ok", "model", "queue_depth"}``; 503 (``"status": "shutting down"`` or
    ``"worker stopped"``) once shutdown has begun or if the engine's worker thread died.

``GET /metrics``
    Prometheus text exposition from the app's own registry (``app.state.registry``):
    ``mhmla_http_requests_total{path,status}``, ``mhmla_request_seconds`` (``/v1/tag`` latency),
    ``mhmla_texts_tagged_total``, ``mhmla_batch_texts`` / ``mhmla_batch_requests`` (histograms
    of the engine batches), ``mhmla_batch_seconds``, ``mhmla_engine_failures_total``,
    ``mhmla_queue_depth``.

``GET /docs``, ``GET /openapi.json``: the OpenAPI description, from the pydantic models.

Micro-batching (:class:`MicroBatcher`)
--------------------------------------

One worker thread owns the engine. A request is admitted whole or not at all: its texts become
*items* on one FIFO queue bounded at ``max_queue`` items (texts), else 503. The worker takes the
oldest item and keeps taking items (of any request, whole requests or parts of them) while their
estimated size stays within ``max_batch_tokens`` word pieces, waiting for more at most until
``max_wait_ms`` after the first item was queued; when it was busy, the queue has usually filled
meanwhile and it takes what is there at once. The estimate of an item is
``max(1.3 x whitespace-split words, characters / 4)`` (the second term keeps text without spaces,
e.g. Chinese, from looking free). The batch goes to ONE engine call per input kind present
(``tag_texts`` for texts, ``tag_tokens`` for sentences), which sorts by length and packs padded
sub-batches by its own ``token_budget``. Each request's future is resolved on its event loop
(``call_soon_threadsafe``) once all its items are done. When the engine raises, the requests of
the batch are retried one by one, so only the requests whose own inputs fail get 500. Items of a
request whose client has gone are skipped.

Shutdown: the lifespan's exit closes the queue (new requests get 503), lets the worker finish every
queued and in-flight item, and joins it. (Uvicorn stops listening and waits for open requests
before it runs the lifespan exit, so in-flight requests complete.)
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest,
)
from pydantic import (
    BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator,
)

__all__ = ["create_app", "MicroBatcher", "QueueFull", "Unavailable", "TagRequest", "TagResponse"]

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

TAG_PATH = "/v1/tag"
RETRY_AFTER_S = 1


# ------------------------------------------------------------------------------------ schema


def _no_surrogates(s: str, where: str) -> None:
    for ch in s:
        if "\ud800" <= ch <= "\udfff":
            raise ValueError(f"{where} contains a lone surrogate U+{ord(ch):04X}")


Word = Annotated[str, StringConstraints(min_length=1, pattern=r"\S")]


class TagRequest(BaseModel):
    """What to tag: raw ``texts`` or pre-tokenised ``sentences`` (exactly one of the two)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"texts": ["He go to school every day.", "She sees the dog."]},
        {"sentences": [["He", "go", "to", "school", "."]]},
    ]})

    texts: list[str] | None = Field(
        None, description="Raw texts; the engine tokenises them and returns code-point offsets.")
    sentences: list[Annotated[list[Word], Field(min_length=1)]] | None = Field(
        None, description="Pre-tokenised sentences: non-empty lists of non-blank words.")

    @field_validator("texts")
    @classmethod
    def _texts_are_unicode(cls, texts: list[str] | None) -> list[str] | None:
        for i, t in enumerate(texts or ()):
            _no_surrogates(t, f"texts[{i}]")
        return texts

    @field_validator("sentences")
    @classmethod
    def _words_are_unicode(cls, sentences: list[list[str]] | None) -> list[list[str]] | None:
        for i, s in enumerate(sentences or ()):
            for j, w in enumerate(s):
                _no_surrogates(w, f"sentences[{i}][{j}]")
        return sentences

    @model_validator(mode="after")
    def _exactly_one(self) -> TagRequest:
        if (self.texts is None) == (self.sentences is None):
            raise ValueError('give exactly one of "texts" and "sentences"')
        return self


class Span(BaseModel):
    """A flagged error: a run of consecutive "i" words. ``start``/``end`` (exclusive) are
    code-point offsets with the covered ``text`` for raw texts, token indices for sentences."""

    start: int
    end: int
    text: str | None = None


class TagResultModel(BaseModel):
    """One input's tags (``TagResult.to_dict()``); ``offsets`` only for raw texts."""

    tokens: list[str]
    labels: list[str] = Field(description='"c" (correct) or "i" (error) per token')
    probs: list[float] = Field(description="error probability per token, 6 decimals")
    spans: list[Span]
    offsets: list[tuple[int, int]] | None = Field(
        None, description="[start, end) code-point offsets of the tokens in the text")


class TagResponse(BaseModel):
    """Results in request order."""

    results: list[TagResultModel]


class ErrorResponse(BaseModel):
    """An error: a message (or, for 422, a list of ``{"loc", "msg", "type"}``)."""

    detail: Any


# ------------------------------------------------------------------------------------ batcher


class QueueFull(Exception):
    """The queue cannot take the request's texts now (answer 503 with Retry-After)."""


class Unavailable(Exception):
    """The batcher is shutting down or its worker has stopped."""


class EngineFailure(Exception):
    """The engine raised on this request's inputs; ``args[0]`` is a message for the client."""


@dataclass(eq=False)
class _Job:
    """One request: ``inputs`` of one ``kind`` ("texts" | "sentences"), the result dicts so far,
    and the future its handler awaits (resolved on ``loop``)."""

    kind: str
    inputs: Sequence[Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    results: list[Any] = field(default_factory=list)
    remaining: int = 0
    failed: bool = False


@dataclass(eq=False, slots=True)
class _Item:
    job: _Job
    pos: int
    cost: float
    queued_at: float


def estimate_pieces(kind: str, value: Any) -> float:
    """Rough word-piece count of one text (``kind="texts"``) or token list (``"sentences"``):
    ``max(1, 1.3 x words, characters / 4)``, words split on whitespace for a text."""
    if kind == "texts":
        words, chars = len(value.split()), len(value)
    else:
        words, chars = len(value), sum(len(w) for w in value)
    return max(1.0, 1.3 * words, chars / 4)


def _resolve(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _reject(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


class MicroBatcher:
    """Dynamic micro-batching of tagging requests over one engine (design: module docstring).

    Args:
        engine: has ``tag_texts(list[str])`` and ``tag_tokens(list[list[str]])`` returning objects
            with ``to_dict()``; used only from the worker thread.
        max_batch_tokens: estimated word pieces per batch (the first item is always taken).
        max_wait_ms: how long a batch may wait for more items after its first one was queued.
        max_queue: queued texts at most (admission is per request, all or nothing).
        on_batch: called from the worker after each engine batch with (texts, requests, seconds).
        on_failure: called from the worker once per request failed by the engine.
    """

    def __init__(self, engine: Any, *, max_batch_tokens: int = 8192, max_wait_ms: float = 5.0,
                 max_queue: int = 1024,
                 on_batch: Callable[[int, int, float], None] | None = None,
                 on_failure: Callable[[], None] | None = None) -> None:
        if max_batch_tokens < 1 or max_queue < 1 or max_wait_ms < 0:
            raise ValueError("max_batch_tokens and max_queue must be >= 1 and max_wait_ms >= 0")
        self.engine = engine
        self.max_batch_tokens = float(max_batch_tokens)
        self.max_wait = max_wait_ms / 1000.0
        self.max_queue = int(max_queue)
        self._on_batch = on_batch
        self._on_failure = on_failure
        self._queue: deque[_Item] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what killed the worker, if anything

    # ------------------------------------------------------------------ control

    @property
    def depth(self) -> int:
        """Texts waiting in the queue (not counting the batch being tagged)."""
        return len(self._queue)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        """True while new requests are admitted (started, not closed, worker alive)."""
        return not self._closed and self.alive

    def start(self) -> None:
        """Start the worker thread (once)."""
        if self._thread is not None:
            raise RuntimeError("the batcher was already started")
        self._thread = threading.Thread(target=self._run, name="mhmla-batcher", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop admitting requests; the worker still finishes everything queued, then exits."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the worker to finish (after :meth:`close`)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, kind: str, inputs: Sequence[Any]) -> asyncio.Future:
        """Queue a request's inputs from the event loop; the returned future gets the list of
        result dicts in input order, or :class:`EngineFailure`. Raises :class:`QueueFull` or
        :class:`Unavailable` when the request cannot be admitted."""
        if kind not in ("texts", "sentences"):
            raise ValueError(f"kind: expected 'texts' or 'sentences', got {kind!r}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not inputs:
            fut.set_result([])
            return fut
        job = _Job(kind, inputs, loop, fut, [None] * len(inputs), len(inputs))
        now = time.monotonic()
        items = [_Item(job, k, estimate_pieces(kind, x), now) for k, x in enumerate(inputs)]
        with self._cond:
            if self._closed:
                raise Unavailable("shutting down")
            if not self.alive:
                raise Unavailable("the tagging worker is not running")
            if len(self._queue) + len(items) > self.max_queue:
                raise QueueFull(f"the queue is full ({len(self._queue)} of {self.max_queue} "
                                f"texts waiting); retry later")
            self._queue.extend(items)
            self._cond.notify()
        return fut

    # ------------------------------------------------------------------- worker

    def _next_batch(self) -> list[_Item] | None:
        """Block for the next batch; None once closed and drained."""
        with self._cond:
            while not self._queue:
                if self._closed:
                    return None
                self._cond.wait()
            first = self._queue.popleft()
            batch, size = [first], first.cost
            deadline = first.queued_at + self.max_wait
            while True:
                if self._queue:
                    if size + self._queue[0].cost > self.max_batch_tokens:
                        break
                    item = self._queue.popleft()
                    batch.append(item)
                    size += item.cost
                    continue
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    break
                self._cond.wait(left)
            return batch

    def _tag(self, items: Sequence[_Item]) -> list[dict]:
        """Result dicts of ``items`` in order: one engine call per input kind present."""
        out: list[Any] = [None] * len(items)
        for kind, fn in (("texts", self.engine.tag_texts), ("sentences", self.engine.tag_tokens)):
            idx = [k for k, it in enumerate(items) if it.job.kind == kind]
            if not idx:
                continue
            results = fn([items[k].job.inputs[items[k].pos] for k in idx])
            if len(results) != len(idx):
                raise RuntimeError(f"engine returned {len(results)} results for {len(idx)} inputs")
            for k, res in zip(idx, results):
                out[k] = res.to_dict()
        return out

    def _deliver(self, items: Sequence[_Item], results: Sequence[dict]) -> None:
        for it, res in zip(items, results):
            job = it.job
            job.results[it.pos] = res
            job.remaining -= 1
            if job.remaining == 0:
                self._call(job, _resolve, job.results)

    def _fail(self, job: _Job, err: BaseException) -> None:
        job.failed = True
        if self._on_failure is not None:
            self._on_failure()
        self._call(job, _reject, EngineFailure(f"tagging failed: {type(err).__name__}: {err}"))

    @staticmethod
    def _call(job: _Job, fn: Callable[[asyncio.Future, Any], None], arg: Any) -> None:
        try:
            job.loop.call_soon_threadsafe(fn, job.future, arg)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _process(self, batch: list[_Item]) -> None:
        items = [it for it in batch if not it.job.failed and not it.job.future.done()]
        if not items:
            return
        t0 = time.perf_counter()
        try:
            results = self._tag(items)
        except Exception as err:  # isolate: retry request by request
            log.warning("engine failed on a batch of %d texts (%s: %s); retrying per request",
                        len(items), type(err).__name__, err)
            jobs: dict[_Job, list[_Item]] = {}
            for it in items:
                jobs.setdefault(it.job, []).append(it)
            if len(jobs) == 1:
                self._fail(items[0].job, err)
                return
            for job, its in jobs.items():
                t0 = time.perf_counter()
                try:
                    results = self._tag(its)
                except Exception as one:
                    log.exception("engine failed on a request of %d texts", len(its))
                    self._fail(job, one)
                    continue
                if self._on_batch is not None:
                    self._on_batch(len(its), 1, time.perf_counter() - t0)
                self._deliver(its, results)
            return
        if self._on_batch is not None:
            self._on_batch(len(items), len({id(it.job) for it in items}), time.perf_counter() - t0)
        self._deliver(items, results)

    def _run(self) -> None:
        batch: list[_Item] = []
        try:
            while True:
                batch = self._next_batch() or []
                if not batch:
                    return
                self._process(batch)
        except BaseException as err:  # a bug in the batcher itself: fail everyone, go dark
            # (logged, not re-raised: /healthz reports it as 503 "worker stopped")
            log.exception("the tagging worker stopped")
            self.error = err
            with self._cond:
                self._closed = True
                left = [*batch, *self._queue]
                self._queue.clear()
            for job in {id(it.job): it.job for it in left}.values():
                if not job.failed and not job.future.done():
                    self._fail(job, err)


# ----------------------------------------------------------------------------- middleware


async def _send_json(send: Send, status: int, body: dict,
                     headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    data = JSONResponse(body).body
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()), *headers]})
    await send({"type": "http.response.body", "body": data})


class BodyLimit:
    """ASGI middleware: refuse HTTP request bodies over ``limit`` bytes with 413, first by the
    ``Content-Length`` header, then by counting what actually arrives (chunked or lying clients).
    An accepted body is read whole and replayed to the app."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, int(limit)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_big = {"detail": f"request body larger than {self.limit} bytes"}
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _send_json(send, 400, {"detail": "invalid Content-Length"})
                    return
                if declared > self.limit:
                    await _send_json(send, 413, too_big, [(b"connection", b"close")])
                    return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.limit:
                await _send_json(send, 413, too_big, [(b"connection", b"close")])
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class Instrument:
    """ASGI middleware: count HTTP requests by path and status, and time ``/v1/tag``."""

    def __init__(self, app: ASGIApp, requests: Counter, latency: Histogram,
                 paths: Sequence[str]) -> None:
        self.app, self.requests, self.latency, self.paths = app, requests, latency, set(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope["path"] if scope["path"] in self.paths else "other"
            self.requests.labels(path=path, status=str(status)).inc()
            if path == TAG_PATH:
                self.latency.observe(time.perf_counter() - t0)


# ------------------------------------------------------------------------------------ app


@dataclass
class _Metrics:
    registry: CollectorRegistry
    requests: Counter
    latency: Histogram
    texts: Counter
    batch_texts: Histogram
    batch_requests: Histogram
    batch_seconds: Histogram
    failures: Counter
    queue: Gauge

    @classmethod
    def create(cls) -> _Metrics:
        reg = CollectorRegistry()
        sizes = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
        times = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
        return cls(
            registry=reg,
            requests=Counter("mhmla_http_requests", "HTTP requests by path and status",
                             ["path", "status"], registry=reg),
            latency=Histogram("mhmla_request_seconds", "Latency of POST /v1/tag",
                              buckets=times, registry=reg),
            texts=Counter("mhmla_texts_tagged", "Texts and sentences tagged", registry=reg),
            batch_texts=Histogram("mhmla_batch_texts", "Texts per engine batch",
                                  buckets=sizes, registry=reg),
            batch_requests=Histogram("mhmla_batch_requests", "Requests per engine batch",
                                     buckets=sizes, registry=reg),
            batch_seconds=Histogram("mhmla_batch_seconds", "Engine time per batch",
                                    buckets=times, registry=reg),
            failures=Counter("mhmla_engine_failures", "Requests failed by the engine",
                             registry=reg),
            queue=Gauge("mhmla_queue_depth", "Texts waiting in the batching queue", registry=reg),
        )

    def on_batch(self, texts: int, requests: int, seconds: float) -> None:
        self.texts.inc(texts)
        self.batch_texts.observe(texts)
        self.batch_requests.observe(requests)
        self.batch_seconds.observe(seconds)


def _unavailable(detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=503,
                        headers={"Retry-After": str(RETRY_AFTER_S)})


def create_app(engine: Any, *, max_batch_tokens: int = 8192, max_wait_ms: float = 5.0,
               max_queue: int = 1024, max_request_bytes: int = 1_000_000,
               max_texts_per_request: int = 256, model_name: str | None = None) -> FastAPI:
    """The tagging app over ``engine`` (endpoints, limits and batching: module docstring).

    The batching worker starts with the app's lifespan and stops, after draining, at its end;
    ``app.state.batcher`` is the :class:`MicroBatcher`, ``app.state.registry`` the Prometheus
    registry. ``max_queue`` must be at least ``max_texts_per_request`` (else a request of the
    largest allowed size could never be admitted).
    """
    if max_texts_per_request < 1 or max_request_bytes < 1:
        raise ValueError("max_texts_per_request and max_request_bytes must be >= 1")
    if max_queue < max_texts_per_request:
        raise ValueError(f"max_queue ({max_queue}) must be >= max_texts_per_request "
                         f"({max_texts_per_request})")
    name = model_name or getattr(engine, "name", None) or type(engine).__name__
    metrics = _Metrics.create()
    batcher = MicroBatcher(engine, max_batch_tokens=max_batch_tokens, max_wait_ms=max_wait_ms,
                           max_queue=max_queue, on_batch=metrics.on_batch,
                           on_failure=metrics.failures.inc)
    metrics.queue.set_function(lambda: batcher.depth)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher.start()
        try:
            yield
        finally:
            batcher.close()
            await asyncio.to_thread(batcher.join)

    app = FastAPI(title="mhmla-fast GED tagger",
                  description="Grammatical error detection: per-token error labels and "
                              "probabilities for texts or pre-tokenised sentences.",
                  lifespan=lifespan)
    app.state.batcher = batcher
    app.state.registry = metrics.registry

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{k: e[k] for k in ("loc", "msg", "type") if k in e} for e in exc.errors()]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.post(TAG_PATH, response_model=TagResponse, responses={
        413: {"model": ErrorResponse, "description": "body or text count over the limit"},
        500: {"model": ErrorResponse, "description": "the engine failed on these inputs"},
        503: {"model": ErrorResponse,
              "description": "queue full or shutting down; see Retry-After"},
    })
    async def tag(body: TagRequest) -> Response:
        """Tag raw texts or pre-tokenised sentences; results come back in request order."""
        kind = "texts" if body.texts is not None else "sentences"
        inputs = body.texts if body.texts is not None else body.sentences
        if len(inputs) > max_texts_per_request:
            raise HTTPException(413, f"{len(inputs)} {kind} in one request; at most "
                                     f"{max_texts_per_request} are allowed")
        try:
            fut = batcher.submit(kind, inputs)
        except (QueueFull, Unavailable) as err:
            return _unavailable(str(err))
        try:
            results = await fut
        except EngineFailure as err:
            return JSONResponse({"detail": err.args[0]}, status_code=500)
        return JSONResponse({"results": results})

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        """200 with the model name and queue depth while serving; 503 otherwise."""
        if batcher.accepting:
            return JSONResponse({"status": "ok", "model": name, "queue_depth": batcher.depth})
        status = "worker stopped" if batcher.error is not None else "shutting down"
        return JSONResponse({"status": status, "model": name, "queue_depth": batcher.depth},
                            status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        """Prometheus text exposition of the app's metrics."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(BodyLimit, limit=max_request_bytes)
    app.add_middleware(Instrument, requests=metrics.requests, latency=metrics.latency,
                       paths=(TAG_PATH, "/healthz", "/metrics"))
    return app
