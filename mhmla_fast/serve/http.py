"""The tagger and the essay scorer over HTTP: a FastAPI app that micro-batches concurrent requests
into engine calls.

Endpoints (:func:`create_app`)
------------------------------

``POST /v1/tag``
    Body ``{"texts": [str, ...]}`` (raw texts, tokenised by the engine) or
    ``{"sentences": [[str, ...], ...]}`` (pre-tokenised, non-empty lists of non-blank words), not
    both. Answer ``{"results": [TagResult.to_dict(), ...]}`` in request order: ``tokens``,
    ``labels`` ("c"/"i"), ``probs`` (6 decimals), ``spans``, and ``offsets`` ([start, end)
    code-point offsets) for raw texts. An empty list gives ``{"results": []}``.

    Statuses: 200; 415 a ``Content-Type`` other than ``application/json`` (or ``*/*+json``;
    a ``charset`` other than UTF-8 too; a missing one too); 422 malformed JSON, JSON nested too
    deeply to parse (``"type": "json_invalid"``), or a body that breaks the schema (strings holding
    lone surrogates included; the error list does not echo the input back); 413 a body larger than
    ``max_request_bytes`` (by ``Content-Length`` and by the bytes actually received, so a chunked
    or lying client is caught) or more than ``max_texts_per_request`` texts/sentences; 503 with
    ``Retry-After`` when the queue is full or the server is shutting down; 500 when the engine
    failed on this request's inputs. Every error body is ``{"detail": ...}``.

``POST /v1/score``
    Body ``{"essays": [{"text": str, "prompt": int, "id": str|int (optional)}, ...]}``; answer
    ``{"results": [{"id", "prompt", "score"}, ...]}`` in request order, ``score`` an integer on
    the prompt's scale (``mhmla_fast.aes.data.SCORE_RANGES``) and ``id`` the essay's own, else its
    1-based position in the request. An empty list gives ``{"results": []}``.

    Statuses: 200; 415 and 422 for the body as for ``/v1/tag``; 422 a body that breaks the
    schema (``"text"`` missing, not a string or blank;
    ``"prompt"`` not an integer 1..8 (no strings, floats or booleans); ``"id"`` not a string or
    integer; unknown fields), or a prompt the scorer has no output layer for (``loc`` points at
    the essay's ``prompt``); 413 a body over ``max_request_bytes`` or more than
    ``max_essays_per_request`` essays; 503 with ``Retry-After`` when the queue is full or the
    server is shutting down; 500 when the scorer failed on this request's essays; 404 when the
    app has no scorer (``{"detail": "essay scoring is not enabled ..."}``).

``GET /healthz``
    200 ``{"status": "ok", "model", "queue_depth"}`` (plus ``"scorer"``, its name, when the app
    scores essays); 503 (``"status": "shutting down"`` or ``"worker stopped"``) once shutdown has
    begun or if the engine's worker thread died.

``GET /metrics``
    Prometheus text exposition from the app's own registry (``app.state.registry``):
    ``mhmla_http_requests_total{path,status}``, ``mhmla_request_seconds`` (``/v1/tag`` latency),
    ``mhmla_texts_tagged_total``, ``mhmla_batch_texts`` / ``mhmla_batch_requests`` (histograms
    of the tagging batches), ``mhmla_batch_seconds``, ``mhmla_engine_failures_total`` (tagging
    and scoring), ``mhmla_queue_depth`` (texts and essays); for scoring
    ``mhmla_score_request_seconds`` (``/v1/score`` latency), ``mhmla_essays_scored_total``,
    ``mhmla_score_batch_essays``, ``mhmla_score_batch_requests`` and ``mhmla_score_batch_seconds``.

``GET /openapi.json``: the OpenAPI description, from the pydantic models; it needs nothing else.
``GET /docs``: Swagger UI on it. Swagger UI's script and style come from cdn.jsdelivr.net (this
server sends no other assets), so the page says, above the viewer, that offline the description
is at ``/openapi.json``. (No ``/redoc``: one CDN page is enough.)

Micro-batching (:class:`MicroBatcher`)
--------------------------------------

One worker thread owns the engine. A request is admitted whole or not at all: its texts become
*items* on one FIFO queue bounded at ``max_queue`` items (texts), else 503. The worker takes the
oldest item and keeps taking items (of any request, whole requests or parts of them) while their
estimated size stays within ``max_batch_tokens`` word pieces, waiting for more at most until
``max_wait_ms`` after the first item was queued; when it was busy, the queue has usually filled
meanwhile and it takes what is there at once. The estimate of an item is
``max(1.3 x whitespace-split words, characters / 4)`` (the second term keeps text without spaces,
e.g. Chinese, from looking free). A batch is either tagging or scoring, never both (the worker
stops taking items at the first one of the other family). A tagging batch goes to ONE engine
call per input kind present (``tag_texts`` for texts, ``tag_tokens`` for sentences), which sorts
by length and packs padded sub-batches by its own ``token_budget``; a scoring batch (kind
``"essays"``, estimated like texts) goes to ONE ``scorer.predict_scores(texts, prompts,
token_budget=score_token_budget)`` call, so all windows of all its essays, of every request and
prompt, are encoded together. Each request's future is resolved on its event loop
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
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import (
    CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest,
)
from pydantic import (
    BaseModel, ConfigDict, Field, StrictInt, StrictStr, StringConstraints, ValidationInfo,
    field_validator, model_validator,
)

from .score import score_essays, unsupported_prompt

__all__ = ["create_app", "MicroBatcher", "QueueFull", "Unavailable", "TagRequest", "TagResponse",
           "ScoreRequest", "ScoreResponse"]

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

TAG_PATH = "/v1/tag"
SCORE_PATH = "/v1/score"
RETRY_AFTER_S = 1
KINDS = ("texts", "sentences", "essays")  # input kinds; "essays" are scored, the others tagged
_FASTAPI_PARSE_ERROR = "There was an error parsing the body"  # FastAPI's 400 for what json.loads
# raised other than a JSONDecodeError (RecursionError for deep nesting): answered 422 here
NO_SCORER = ("essay scoring is not enabled on this server (it was started without an essay "
             "scorer: `mhmla-serve http --scorer DIR`)")


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


class EssayIn(BaseModel):
    """One essay to score: its ``text``, ASAP ``prompt`` (1..8) and optional ``id``."""

    model_config = ConfigDict(extra="forbid")

    text: Annotated[str, StringConstraints(min_length=1, pattern=r"\S")] = Field(
        description="The essay; not empty or blank. Long essays are scored in windows.")
    prompt: StrictInt = Field(ge=1, le=8, description="ASAP prompt 1-8: picks the scale")
    id: StrictInt | StrictStr | None = Field(
        None, description="Echoed back; default: the essay's 1-based position in the request")

    @field_validator("text", "id")
    @classmethod
    def _is_unicode(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str):
            _no_surrogates(value, info.field_name)
        return value


class ScoreRequest(BaseModel):
    """Essays to score, in order."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"essays": [{"id": "e1", "prompt": 1, "text": "Dear local newspaper, computers ..."},
                    {"prompt": 3, "text": "The features of the setting affect the cyclist ..."}]},
    ]})

    essays: list[EssayIn]


class ScoreResult(BaseModel):
    """One essay's score: ``score`` is an integer on ``prompt``'s scale."""

    id: int | str
    prompt: int
    score: int


class ScoreResponse(BaseModel):
    """Results in request order."""

    results: list[ScoreResult]


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
    """One request: ``inputs`` of one ``kind`` ("texts" | "sentences" | "essays"), the result
    dicts so far, and the future its handler awaits (resolved on ``loop``)."""

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


def _family(kind: str) -> str:
    """"score" for essays, "tag" for texts and sentences: what a batch may mix."""
    return "score" if kind == "essays" else "tag"


def estimate_pieces(kind: str, value: Any) -> float:
    """Rough word-piece count of one text (``kind="texts"``), token list (``"sentences"``) or
    ``(text, prompt)`` essay (``"essays"``): ``max(1, 1.3 x words, characters / 4)``, words split
    on whitespace for a text."""
    if kind == "essays":
        value = value[0]
        kind = "texts"
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
    """Dynamic micro-batching of tagging and scoring requests over one engine and an optional
    essay scorer (design: module docstring).

    Args:
        engine: has ``tag_texts(list[str])`` and ``tag_tokens(list[list[str]])`` returning objects
            with ``to_dict()``; used only from the worker thread.
        scorer: None, or has ``predict_scores(texts, prompts, token_budget=...)`` returning one
            integer score per essay (an :class:`~mhmla_fast.aes.model.EssayScorer`); used only
            from the worker thread. Needed for ``submit("essays", ...)``.
        score_token_budget: the scorer's padded word pieces per forward pass.
        max_batch_tokens: estimated word pieces per batch (the first item is always taken).
        max_wait_ms: how long a batch may wait for more items after its first one was queued.
        max_queue: queued texts and essays at most (admission is per request, all or nothing).
        on_batch: called from the worker after each tagging batch with (texts, requests, seconds).
        on_score_batch: likewise after each scoring batch with (essays, requests, seconds).
        on_failure: called from the worker once per request failed by the engine or scorer.
    """

    def __init__(self, engine: Any, *, scorer: Any = None, score_token_budget: int = 8192,
                 max_batch_tokens: int = 8192, max_wait_ms: float = 5.0,
                 max_queue: int = 1024,
                 on_batch: Callable[[int, int, float], None] | None = None,
                 on_score_batch: Callable[[int, int, float], None] | None = None,
                 on_failure: Callable[[], None] | None = None) -> None:
        if max_batch_tokens < 1 or max_queue < 1 or max_wait_ms < 0 or score_token_budget < 1:
            raise ValueError("max_batch_tokens, max_queue and score_token_budget must be >= 1 "
                             "and max_wait_ms >= 0")
        self.engine = engine
        self.scorer = scorer
        self.score_token_budget = int(score_token_budget)
        self._on_score_batch = on_score_batch
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
        """Texts and essays waiting in the queue (not counting the batch being processed)."""
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
        result dicts in input order (``TagResult.to_dict()``, or ``{"prompt", "score"}`` for
        essays), or :class:`EngineFailure`. ``kind`` is "texts" (strings), "sentences" (token
        lists) or "essays" (``(text, prompt)`` pairs; needs a scorer). Raises :class:`QueueFull`
        or :class:`Unavailable` when the request cannot be admitted."""
        if kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
        if kind == "essays" and self.scorer is None:
            raise ValueError("this batcher has no essay scorer")
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
                                f"texts and essays waiting); retry later")
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
            family = _family(first.job.kind)
            deadline = first.queued_at + self.max_wait
            while True:
                if self._queue:
                    head = self._queue[0]
                    if (size + head.cost > self.max_batch_tokens
                            or _family(head.job.kind) != family):
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

    def _compute(self, items: Sequence[_Item]) -> list[dict]:
        """Result dicts of ``items`` (all of one family) in order: one scorer call for essays,
        else one engine call per input kind present."""
        if _family(items[0].job.kind) == "score":
            essays = [it.job.inputs[it.pos] for it in items]
            return score_essays(self.scorer, [t for t, _ in essays], [p for _, p in essays],
                                self.score_token_budget)
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
        what = "scoring" if _family(job.kind) == "score" else "tagging"
        self._call(job, _reject, EngineFailure(f"{what} failed: {type(err).__name__}: {err}"))

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
        on_batch = (self._on_score_batch if _family(items[0].job.kind) == "score"
                    else self._on_batch)
        t0 = time.perf_counter()
        try:
            results = self._compute(items)
        except Exception as err:  # isolate: retry request by request
            log.warning("engine failed on a batch of %d inputs (%s: %s); retrying per request",
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
                    results = self._compute(its)
                except Exception as one:
                    log.exception("engine failed on a request of %d inputs", len(its))
                    self._fail(job, one)
                    continue
                if on_batch is not None:
                    on_batch(len(its), 1, time.perf_counter() - t0)
                self._deliver(its, results)
            return
        if on_batch is not None:
            on_batch(len(items), len({id(it.job) for it in items}), time.perf_counter() - t0)
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


def _is_json(content_type: bytes) -> bool:
    """``application/json`` or ``*/*+json``, with no charset or a UTF-8 one."""
    mime, _, params = content_type.decode("latin-1").partition(";")
    mime = mime.strip().lower()
    if mime != "application/json" and not (mime.startswith("application/") and mime.endswith("+json")):
        return False
    for param in params.split(";"):
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            return False
    return True


class RequireJson:
    """ASGI middleware: a POST to one of ``paths`` must say ``Content-Type: application/json``
    (see :func:`_is_json`), else 415 before its body is read."""

    def __init__(self, app: ASGIApp, paths: Sequence[str]) -> None:
        self.app, self.paths = app, frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.paths:
            ctype = next((v for k, v in scope.get("headers", ()) if k == b"content-type"), b"")
            if not _is_json(ctype):
                got = repr(ctype.decode("latin-1")) if ctype else "none"
                await _send_json(send, 415, {"detail": "the body must be JSON sent with "
                                             f"Content-Type: application/json (got {got})"})
                return
        await self.app(scope, receive, send)


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
    """ASGI middleware: count HTTP requests by path and status (paths outside ``paths`` count
    as "other"), and time the requests of each path in ``latency`` (path -> histogram)."""

    def __init__(self, app: ASGIApp, requests: Counter, latency: dict[str, Histogram],
                 paths: Sequence[str]) -> None:
        self.app, self.requests, self.latency = app, requests, dict(latency)
        self.paths = set(paths) | set(self.latency)

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
            if path in self.latency:
                self.latency[path].observe(time.perf_counter() - t0)


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
    score_latency: Histogram
    essays: Counter
    score_batch_essays: Histogram
    score_batch_requests: Histogram
    score_batch_seconds: Histogram

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
            queue=Gauge("mhmla_queue_depth", "Texts and essays waiting in the batching queue",
                        registry=reg),
            score_latency=Histogram("mhmla_score_request_seconds", "Latency of POST /v1/score",
                                    buckets=times, registry=reg),
            essays=Counter("mhmla_essays_scored", "Essays scored", registry=reg),
            score_batch_essays=Histogram("mhmla_score_batch_essays", "Essays per scorer batch",
                                         buckets=sizes, registry=reg),
            score_batch_requests=Histogram("mhmla_score_batch_requests",
                                           "Requests per scorer batch", buckets=sizes,
                                           registry=reg),
            score_batch_seconds=Histogram("mhmla_score_batch_seconds", "Scorer time per batch",
                                          buckets=times, registry=reg),
        )

    def on_batch(self, texts: int, requests: int, seconds: float) -> None:
        self.texts.inc(texts)
        self.batch_texts.observe(texts)
        self.batch_requests.observe(requests)
        self.batch_seconds.observe(seconds)

    def on_score_batch(self, essays: int, requests: int, seconds: float) -> None:
        self.essays.inc(essays)
        self.score_batch_essays.observe(essays)
        self.score_batch_requests.observe(requests)
        self.score_batch_seconds.observe(seconds)


def _unavailable(detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=503,
                        headers={"Retry-After": str(RETRY_AFTER_S)})


def _unsupported_prompts(essays: Sequence[EssayIn], prompts: Sequence[int]) -> list[dict]:
    """422 error entries (``loc``, ``msg``, ``type``) for the essays whose prompt the scorer has
    no output layer for; empty when all can be scored."""
    errors = []
    for k, essay in enumerate(essays):
        reason = unsupported_prompt(essay.prompt, prompts)
        if reason is not None:
            errors.append({"loc": ["body", "essays", k, "prompt"], "msg": reason,
                           "type": "value_error"})
    return errors


def _with_ids(essays: Sequence[EssayIn], results: Sequence[dict]) -> list[dict]:
    """``{"id", "prompt", "score"}`` per essay: its own id, else its 1-based position."""
    return [{"id": e.id if e.id is not None else k, "prompt": r["prompt"], "score": r["score"]}
            for k, (e, r) in enumerate(zip(essays, results), 1)]


async def _await_results(batcher: MicroBatcher, kind: str, inputs: Sequence[Any]
                         ) -> list[dict] | JSONResponse:
    """Submit a request's inputs and wait: the result dicts, or the 503/500 response."""
    try:
        fut = batcher.submit(kind, inputs)
    except (QueueFull, Unavailable) as err:
        return _unavailable(str(err))
    try:
        return await fut
    except EngineFailure as err:
        return JSONResponse({"detail": err.args[0]}, status_code=500)


_ERRORS = {
    500: {"model": ErrorResponse, "description": "the model failed on these inputs"},
    503: {"model": ErrorResponse, "description": "queue full or shutting down; see Retry-After"},
}


def _add_score_route(app: FastAPI, batcher: MicroBatcher, scorer: Any,
                     max_essays_per_request: int) -> None:
    """``POST /v1/score`` on ``app``: scores through ``batcher``, or 404 without a scorer."""
    if scorer is None:
        @app.post(SCORE_PATH, include_in_schema=False)
        async def score_disabled() -> JSONResponse:
            return JSONResponse({"detail": NO_SCORER}, status_code=404)
        return

    prompts = tuple(int(p) for p in scorer.config.prompts)

    @app.post(SCORE_PATH, response_model=ScoreResponse, responses={
        413: {"model": ErrorResponse, "description": "body or essay count over the limit"},
        **_ERRORS,
    })
    async def score(body: ScoreRequest) -> Response:
        """Score essays on their prompts' scales; results come back in request order."""
        essays = body.essays
        if len(essays) > max_essays_per_request:
            raise HTTPException(413, f"{len(essays)} essays in one request; at most "
                                     f"{max_essays_per_request} are allowed")
        errors = _unsupported_prompts(essays, prompts)
        if errors:
            return JSONResponse({"detail": errors}, status_code=422)
        results = await _await_results(batcher, "essays", [(e.text, e.prompt) for e in essays])
        if isinstance(results, Response):
            return results
        return JSONResponse({"results": _with_ids(essays, results)})


def create_app(engine: Any, *, max_batch_tokens: int = 8192, max_wait_ms: float = 5.0,
               max_queue: int = 1024, max_request_bytes: int = 1_000_000,
               max_texts_per_request: int = 256, model_name: str | None = None,
               scorer: Any = None, scorer_name: str | None = None,
               max_essays_per_request: int = 64, score_token_budget: int = 8192) -> FastAPI:
    """The tagging (and, with ``scorer``, essay-scoring) app over ``engine`` (endpoints, limits
    and batching: module docstring).

    ``scorer`` is an :class:`~mhmla_fast.aes.model.EssayScorer` (or anything with
    ``predict_scores(texts, prompts, token_budget=...)`` and ``config.prompts``) or None, which
    makes ``POST /v1/score`` answer 404. The batching worker starts with the app's lifespan and
    stops, after draining, at its end; ``app.state.batcher`` is the :class:`MicroBatcher`,
    ``app.state.registry`` the Prometheus registry. ``max_queue`` must be at least
    ``max_texts_per_request`` and, with a scorer, ``max_essays_per_request`` (else a request of
    the largest allowed size could never be admitted).
    """
    if min(max_texts_per_request, max_request_bytes, max_essays_per_request) < 1:
        raise ValueError("max_texts_per_request, max_essays_per_request and max_request_bytes "
                         "must be >= 1")
    if max_queue < max_texts_per_request:
        raise ValueError(f"max_queue ({max_queue}) must be >= max_texts_per_request "
                         f"({max_texts_per_request})")
    if scorer is not None and max_queue < max_essays_per_request:
        raise ValueError(f"max_queue ({max_queue}) must be >= max_essays_per_request "
                         f"({max_essays_per_request})")
    name = model_name or getattr(engine, "name", None) or type(engine).__name__
    scorer_name = (scorer_name or type(scorer).__name__) if scorer is not None else None
    metrics = _Metrics.create()
    batcher = MicroBatcher(engine, scorer=scorer, score_token_budget=score_token_budget,
                           max_batch_tokens=max_batch_tokens, max_wait_ms=max_wait_ms,
                           max_queue=max_queue, on_batch=metrics.on_batch,
                           on_score_batch=metrics.on_score_batch,
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

    if scorer is None:
        title, description = "mhmla-fast GED tagger", (
            "Grammatical error detection: per-token error labels and probabilities for texts "
            "or pre-tokenised sentences.")
    else:
        title, description = "mhmla-fast GED tagger and essay scorer", (
            "Grammatical error detection: per-token error labels and probabilities for texts "
            "or pre-tokenised sentences. Automated essay scoring: an integer score per essay "
            "on its ASAP prompt's scale.")
    app = FastAPI(title=title, description=description, lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    app.state.batcher = batcher
    app.state.registry = metrics.registry

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{k: e[k] for k in ("loc", "msg", "type") if k in e} for e in exc.errors()]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 400 and exc.detail == _FASTAPI_PARSE_ERROR:  # e.g. RecursionError
            return JSONResponse({"detail": [{"loc": ["body"], "type": "json_invalid",
                                             "msg": "invalid JSON: nested too deeply or not "
                                                    "decodable"}]}, status_code=422)
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        """Swagger UI, with where to find the OpenAPI description when its CDN is out of reach."""
        openapi = request.scope.get("root_path", "") + app.openapi_url
        page = get_swagger_ui_html(openapi_url=openapi, title=f"{title} - Swagger UI")
        note = (f'<p style="font-family:sans-serif;margin:1em">Swagger UI below is loaded from '
                f'cdn.jsdelivr.net. Offline (or if nothing appears below), the OpenAPI '
                f'description of this API is at <a href="{openapi}">{openapi}</a>.</p>')
        html = page.body.decode("utf-8").replace("<body>", "<body>\n" + note, 1)
        return HTMLResponse(html)

    @app.post(TAG_PATH, response_model=TagResponse, responses={
        413: {"model": ErrorResponse, "description": "body or text count over the limit"},
        **_ERRORS,
    })
    async def tag(body: TagRequest) -> Response:
        """Tag raw texts or pre-tokenised sentences; results come back in request order."""
        kind = "texts" if body.texts is not None else "sentences"
        inputs = body.texts if body.texts is not None else body.sentences
        if len(inputs) > max_texts_per_request:
            raise HTTPException(413, f"{len(inputs)} {kind} in one request; at most "
                                     f"{max_texts_per_request} are allowed")
        results = await _await_results(batcher, kind, inputs)
        if isinstance(results, Response):
            return results
        return JSONResponse({"results": results})

    _add_score_route(app, batcher, scorer, max_essays_per_request)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        """200 with the model name(s) and queue depth while serving; 503 otherwise."""
        body: dict[str, Any] = {"status": "ok", "model": name}
        if scorer_name is not None:
            body["scorer"] = scorer_name
        body["queue_depth"] = batcher.depth
        if batcher.accepting:
            return JSONResponse(body)
        body["status"] = "worker stopped" if batcher.error is not None else "shutting down"
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        """Prometheus text exposition of the app's metrics."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(BodyLimit, limit=max_request_bytes)
    app.add_middleware(RequireJson, paths=(TAG_PATH, SCORE_PATH))
    app.add_middleware(Instrument, requests=metrics.requests,
                       latency={TAG_PATH: metrics.latency, SCORE_PATH: metrics.score_latency},
                       paths=(TAG_PATH, SCORE_PATH, "/healthz", "/metrics"))
    return app
