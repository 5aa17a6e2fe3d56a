"""The tagger and the essay scorer over HTTP: a FastAPI app that micro-batches concurrent requests
into engine calls.

Endpoints (:func:`create_app`)
------------------------------

``POST /v1/tag``
    Body ``{"texts": [str, ...]}`` (raw texts, not empty or blank, tokenised by the engine) or
    ``{"sentences": [[str, ...], ...]}`` (pre-tokenised, non-empty lists of non-blank words), not
    both. Answer ``{"results": [TagResult.to_dict(), ...]}`` in request order: ``tokens``,
    ``labels`` ("c"/"i"), ``probs`` (6 decimals), ``spans``, and ``offsets`` ([start, end)
    code-point offsets) for raw texts. An empty list gives ``{"results": []}``.

    Statuses: 200; 415 a ``Content-Type`` other than ``application/json`` (or ``*/*+json``;
    a ``charset`` other than UTF-8 too; a missing one too); 422 malformed JSON, a body that is
    not UTF-8 (:class:`RequireUtf8`), JSON nested too deeply to parse (``"type":
    "json_invalid"``), or a body that breaks the schema (strings holding lone surrogates
    included, named with their index; a text that is empty or blank by ``str.strip``, which
    ``mhmla-serve tag`` answers with an error record; the error list does not echo the input
    back); 413 a body larger than ``max_request_bytes`` (by ``Content-Length`` and by the bytes
    actually received, so a chunked or lying client is caught), more than
    ``max_texts_per_request`` texts/sentences, a text (or sentence: its words and one space
    between each two) longer than ``max_text_chars`` characters (the message names the input
    and the limit), or a request whose estimated word pieces alone exceed
    ``max_queue_pieces``; 503 with ``Retry-After`` when the queue is full
    (inputs, pieces, or more than half ``request_timeout_s`` of work at the measured speed),
    the request bodies held reach ``max_buffered_bytes``, or the server is shutting down; 504
    when the answer is not ready ``request_timeout_s`` after admission (the request's waiting
    work is dropped); 500 when the engine failed on this request's inputs.
    A request whose client disconnects is dropped before its waiting work runs (recorded as
    status 499 and in ``mhmla_dropped_requests_total``). Every error body is ``{"detail": ...}``.

``POST /v1/score``
    Body ``{"essays": [{"text": str, "prompt": int, "id": str|int (optional)}, ...]}``; answer
    ``{"results": [{"id", "prompt", "score"}, ...]}`` in request order, ``score`` an integer on
    the prompt's scale (``mhmla_fast.aes.data.SCORE_RANGES``) and ``id`` the essay's own, else its
    1-based position in the request; ``"advisories"`` besides where the essay lies far outside
    the essays the scorer was fitted on (``mhmla_fast.serve.score.with_advisories``). An empty
    list gives ``{"results": []}``.

    Statuses: 200; 415 and 422 for the body as for ``/v1/tag``; 422 a body that breaks the
    schema (``"text"`` missing, not a string or blank; ``"text"`` or ``"id"`` holding a lone
    surrogate, ``loc`` naming the essay's field;
    ``"prompt"`` not an integer 1..8 (no strings, floats or booleans); ``"id"`` not a string or
    integer; unknown fields), a text that gives no word pieces with the scorer's tokenizer (it
    would be scored as an empty essay; ``loc`` points at the essay's ``text``,
    :func:`~mhmla_fast.serve.score.essay_pieces_check`) or a prompt the scorer has no output
    layer for (``loc`` points at the essay's ``prompt``); 413 a body over
    ``max_request_bytes``, more than ``max_essays_per_request`` essays or an essay over
    ``max_text_chars``; 504 and dropping as for ``/v1/tag``; 503 with ``Retry-After`` when the
    queue is full or the server is shutting down; 500 when the scorer failed on this request's
    essays; 404 when the app has no scorer (``{"detail": "essay scoring is not enabled
    ..."}``).

``GET /healthz`` (and ``HEAD /healthz``: the same status and headers, no body)
    200 ``{"status": "ok", "model", "queue_depth"}`` (plus ``"scorer"``, its name, when the app
    scores essays; plus ``"pid"``, ``"workers"`` and ``"workers_ready"`` in a worker of
    ``mhmla-serve http --workers N``, :mod:`.http_workers`); 503 (``"status": "shutting
    down"`` or ``"worker stopped"``) once shutdown has begun or if the engine's worker thread
    died.

``GET /metrics``
    Prometheus text exposition from the app's own registry (``app.state.registry``):
    ``mhmla_http_requests_total{path,status}``, ``mhmla_request_seconds`` (``/v1/tag`` latency),
    ``mhmla_texts_tagged_total``, ``mhmla_batch_texts`` / ``mhmla_batch_requests`` (histograms
    of the tagging batches), ``mhmla_batch_seconds``, ``mhmla_engine_failures_total`` (tagging
    and scoring), ``mhmla_queue_depth`` (texts and essays); for scoring
    ``mhmla_score_request_seconds`` (``/v1/score`` latency), ``mhmla_essays_scored_total``,
    ``mhmla_score_batch_essays``, ``mhmla_score_batch_requests`` and ``mhmla_score_batch_seconds``;
    ``mhmla_dropped_requests_total{reason}`` (``disconnected``, ``deadline``, ``shutdown``: past
    the graceful shutdown time, answered 503). The seconds histograms' buckets run from 1 ms to
    120 s, past the default request deadline (60 s). In a worker of
    ``--workers N``: the sums over all workers (``mhmla_queue_depth``: the live ones).

``GET /openapi.json``: the OpenAPI description, from the pydantic models; it needs nothing else.
``GET /docs``: Swagger UI on it. Swagger UI's script and style come from cdn.jsdelivr.net (this
server sends no other assets), so the page says, above the viewer, that offline the description
is at ``/openapi.json``. (No ``/redoc``: one CDN page is enough.)

Micro-batching (:class:`~mhmla_fast.serve.scheduler.MicroBatcher`)
-----------------------------------------------------------------

Admission is by count and by cost, batching by cost and round-robin over requests, and long
texts are tagged in windows interleaved with other requests: see :mod:`.scheduler`. The handler
waits for its request's future, its client's disconnection and its deadline, whichever comes
first. Memory: uvicorn buffers little per connection (it pauses reading at 64 kB), the app holds
at most ``max_buffered_bytes`` of request bodies in all, and ``mhmla-serve http`` passes
``--limit-concurrency`` to uvicorn (503 beyond it). A result of more than 65,536 tokens is
encoded to JSON off the event loop.

Shutdown: the lifespan's exit closes the queue (new requests get 503), lets the worker finish every
queued and in-flight item, and joins it. (Uvicorn stops listening and waits for open requests
before it runs the lifespan exit, so in-flight requests complete.)
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import (
    CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector
from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Field, StrictInt, StrictStr, StringConstraints, ValidationInfo,
    field_validator, model_validator,
)

from .scheduler import (
    EngineFailure, MicroBatcher, QueueFull, TooCostly, Unavailable, estimate_pieces,
)
from .http_workers import WorkerGroup
from .outputs import encode_json
from .score import essay_pieces_check, unsupported_prompt, with_advisories

__all__ = ["create_app", "check_limits", "MicroBatcher", "QueueFull", "TooCostly",
           "Unavailable", "EngineFailure", "estimate_pieces", "BodyLimit", "TagFastPath",
           "TagRequest", "TagResponse", "ScoreRequest", "ScoreResponse"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

TAG_PATH = "/v1/tag"
SCORE_PATH = "/v1/score"
RETRY_AFTER_S = 1
CLIENT_CLOSED = 499  # the status recorded (nginx's) for a request whose client went away
BIG_RESPONSE = 1 << 16  # result items (tokens) above which the JSON is encoded off the loop
# the measured seconds of work admitted at once, as a share of the request deadline: round-robin
# batches serve every admitted request in step, so a queue of more than the deadline's work
# would time out nearly every request part-done (MicroBatcher's max_queue_seconds)
QUEUE_SHARE_OF_TIMEOUT = 0.5
MAX_LISTED_ERRORS = 20  # validation errors a 422 names; more are counted in one more entry
_FASTAPI_PARSE_ERROR = "There was an error parsing the body"  # FastAPI's 400 for what json.loads
# raised other than a JSONDecodeError (RecursionError for deep nesting): answered 422 here
NO_SCORER = ("essay scoring is not enabled on this server (it was started without an essay "
             "scorer: `mhmla-serve http --scorer DIR`)")


# ------------------------------------------------------------------------------------ schema


def _no_surrogates(s: str, where: str) -> None:
    for ch in s:
        if "\ud800" <= ch <= "\udfff":
            raise ValueError(f"{where} contains a lone surrogate U+{ord(ch):04X}")


def _non_blank(word: str) -> str:
    """A word of a pre-tokenised sentence must not be blank by ``str.strip``, the rule of the
    offline readers (``records``): JSON Schema's ``\\S`` differs on U+001C-U+001F."""
    if not word.strip():
        raise ValueError("a word must not be empty or blank")
    return word


Word = Annotated[str, StringConstraints(min_length=1), AfterValidator(_non_blank)]


class TagRequest(BaseModel):
    """What to tag: raw ``texts`` or pre-tokenised ``sentences`` (exactly one of the two)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"texts": ["He go to school every day.", "She sees the dog."]},
        {"sentences": [["He", "go", "to", "school", "."]]},
    ]})

    texts: list[str] | None = Field(
        None, description="Raw texts, not empty or blank; the engine tokenises them and returns "
                          "code-point offsets.")
    sentences: list[Annotated[list[Word], Field(min_length=1)]] | None = Field(
        None, description="Pre-tokenised sentences: non-empty lists of non-blank words.")

    @field_validator("texts")
    @classmethod
    def _texts_are_unicode(cls, texts: list[str] | None) -> list[str] | None:
        """Each text Unicode and not blank by ``str.strip`` (``mhmla-serve tag``'s rule: its
        error record 'field "text" is empty'; a blank text has no words to tag)."""
        for i, t in enumerate(texts or ()):
            _no_surrogates(t, f"texts[{i}]")
            if not t.strip():
                raise ValueError(f"texts[{i}] is empty or blank: there is nothing to tag")
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

    @field_validator("text", "id", mode="before")
    @classmethod
    def _is_unicode(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse a ``text`` or ``id`` holding a lone surrogate, naming the field, before the
        type's checks: the ``text`` pattern (``\\S``) cannot read one and answered only
        "unable to parse raw data as a unicode string"."""
        if isinstance(value, str):
            _no_surrogates(value, f'field "{info.field_name}"')
        return value


class ScoreRequest(BaseModel):
    """Essays to score, in order."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"essays": [{"id": "e1", "prompt": 1, "text": "Dear local newspaper, computers ..."},
                    {"prompt": 3, "text": "The features of the setting affect the cyclist ..."}]},
    ]})

    essays: list[EssayIn]


class Advisory(BaseModel):
    """A surface feature of the essay far outside the essays the scorer was fitted on."""

    feature: str
    value: float
    range: list[float]


class ScoreResult(BaseModel):
    """One essay's score: ``score`` is an integer on ``prompt``'s scale; ``advisories``, where
    present, say that the essay lies far outside the essays the scorer was fitted on (one word
    repeated, say), so its score is an extrapolation."""

    id: int | str
    prompt: int
    score: int
    advisories: list[Advisory] | None = None


class ScoreResponse(BaseModel):
    """Results in request order."""

    results: list[ScoreResult]


class ErrorResponse(BaseModel):
    """An error: a message (or, for 422, a list of ``{"loc", "msg", "type"}``)."""

    detail: Any


# ----------------------------------------------------------------------------- middleware


async def _send_json(send: Send, status: int, body: dict,
                     headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    data = JSONResponse(body).body
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()), *headers]})
    await send({"type": "http.response.body", "body": data})


def _replaying(first: Message, receive: Receive) -> Receive:
    """``receive`` that gives ``first`` (a message already read) once, then the connection's."""
    pending = [first]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


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


class RequireUtf8:
    """ASGI middleware (inside :class:`BodyLimit`, which hands it whole bodies): the body of a
    POST to one of ``paths`` must be UTF-8, as JSON between systems is (RFC 8259), else 422
    ``json_invalid`` saying so and naming the first byte that is not. (``json.loads`` took
    such a body for UTF-16 or UTF-32 by its first bytes and failed with "JSON decode error" at
    0, or with FastAPI's bare 400, answered "nested too deeply or not decodable".) An ASCII
    body, the usual one, is passed on after one C scan."""

    def __init__(self, app: ASGIApp, paths: Sequence[str]) -> None:
        self.app, self.paths = app, frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        message = await receive()
        body = message.get("body", b"") if message["type"] == "http.request" else b""
        if not body.isascii():
            try:
                body.decode("utf-8")
            except UnicodeDecodeError as err:
                await _send_json(send, 422, {"detail": [{
                    "loc": ["body"], "type": "json_invalid",
                    "msg": f"the body must be UTF-8 JSON: byte 0x{body[err.start]:02x} at offset "
                           f"{err.start} is not UTF-8 ({err.reason})"}]})
                return
        await self.app(scope, _replaying(message, receive), send)


class BodyLimit:
    """ASGI middleware: refuse HTTP request bodies over ``limit`` bytes with 413, first by the
    ``Content-Length`` header, then by counting what actually arrives (chunked or lying clients).
    An accepted body is read whole and replayed to the app.

    ``max_buffered``: the bytes of request bodies held at once by all requests in flight (from
    their first byte until their response is sent), at most; a request that would pass it gets
    503 with ``Retry-After`` (by ``Content-Length`` before anything is read, else as it
    arrives). ``held`` is the current total."""

    def __init__(self, app: ASGIApp, limit: int, max_buffered: int | None = None) -> None:
        self.app, self.limit = app, int(limit)
        self.max_buffered = None if max_buffered is None else int(max_buffered)
        self.held = 0  # one event loop: no lock needed

    def _room(self, n: int) -> bool:
        return self.max_buffered is None or self.held + n <= self.max_buffered

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_big = {"detail": f"request body larger than {self.limit} bytes"}
        busy = {"detail": f"the server is holding its maximum of request bodies in memory "
                          f"({self.max_buffered} bytes); retry later"}
        close = [(b"connection", b"close")]
        retry = [*close, (b"retry-after", str(RETRY_AFTER_S).encode())]
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _send_json(send, 400, {"detail": "invalid Content-Length"})
                    return
                if declared > self.limit:
                    await _send_json(send, 413, too_big, close)
                    return
                if not self._room(declared):
                    await _send_json(send, 503, busy, retry)
                    return
        chunks, size = [], 0
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body = message.get("body", b"")
                if size + len(body) > self.limit:
                    await _send_json(send, 413, too_big, close)
                    return
                if not self._room(len(body)):
                    await _send_json(send, 503, busy, retry)
                    return
                size += len(body)
                self.held += len(body)
                chunks.append(body)
                if not message.get("more_body", False):
                    break
            data = b"".join(chunks)
            chunks.clear()
            await self.app(scope, _replaying({"type": "http.request", "body": data,
                                              "more_body": False}, receive), send)
        finally:
            self.held -= size


class Instrument:
    """ASGI middleware: count HTTP requests by path and status (paths outside ``paths`` count
    as "other"), and time the requests of each path in ``latency`` (path -> histogram). A
    request that ends with no response and no error (the client went away before its body
    was read) counts as status 499, nginx's "client closed request", not as a server error."""

    def __init__(self, app: ASGIApp, requests: Counter, latency: dict[str, Histogram],
                 paths: Sequence[str]) -> None:
        self.app, self.requests, self.latency = app, requests, dict(latency)
        self.paths = set(paths) | set(self.latency)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = CLIENT_CLOSED  # no response: the client closed the request

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except BaseException:
            if status == CLIENT_CLOSED:
                status = 500  # an error before any response
            raise
        finally:
            path = scope["path"] if scope["path"] in self.paths else "other"
            self.requests.labels(path=path, status=str(status)).inc()
            if path in self.latency:
                self.latency[path].observe(time.perf_counter() - t0)


class ItemLimit:
    """ASGI middleware (inside :class:`BodyLimit`, which hands it whole bodies): a POST to one
    of ``limits``' paths whose JSON body holds a list field with more items than allowed
    (``limits``: path -> (fields, most items)) is answered 413 before any item is validated.
    FastAPI validates every item first: a 1 MB body of 450,000 bad items took seconds of the
    event loop and came back as a 41 MB 422. A body that cannot hold more items than allowed
    is passed on unparsed (the usual one: it is parsed once, by the app): such a list needs
    ``most`` commas at least (commas inside strings only add to the count)."""

    def __init__(self, app: ASGIApp, limits: dict[str, tuple[tuple[str, ...], int]]) -> None:
        self.app, self.limits = app, dict(limits)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.limits.get(scope["path"]) if scope["type"] == "http" else None
        if limit is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        fields, most = limit
        message = await receive()
        replay = _replaying(message, receive)
        body = message.get("body", b"") if message["type"] == "http.request" else b""
        if body.count(b",") >= most:  # (a C scan; json.loads twice on every body was not)
            try:
                data = json.loads(body)
            except (ValueError, RecursionError):  # the app says why (422)
                data = None
            for name in fields if isinstance(data, dict) else ():
                items = data.get(name)
                if isinstance(items, list) and len(items) > most:
                    await _send_json(send, 413, {"detail": f"{len(items)} {name} in one "
                                                 f"request; at most {most} are allowed"})
                    return
        await self.app(scope, replay, send)


class TagFastPath:
    """ASGI middleware, the innermost of the app's: a ``POST /v1/tag`` whose body (read whole by
    :class:`BodyLimit`) parses as JSON and validates as a :class:`TagRequest` goes straight to
    ``handle(body, request) -> Response``, past FastAPI's routing, dependency resolution and
    request parsing (about half of a one-sentence request's Python time). Any other request,
    and a tag request whose body does not parse or validate, goes to the app, so every error
    answer (422 and the rest) is FastAPI's own. The JSON is parsed and validated as FastAPI
    does (``json.loads``, then the model in Python mode): the two paths accept the same
    bodies."""

    def __init__(self, app: ASGIApp, handle: Callable[[TagRequest, Request], Awaitable[Response]]
                 ) -> None:
        self.app, self.handle = app, handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != TAG_PATH or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        message = await receive()
        replay = _replaying(message, receive)  # the message read here, then the connection's
        body = None
        if message["type"] == "http.request" and not message.get("more_body", False):
            try:
                body = TagRequest.model_validate(json.loads(message.get("body", b"")))
            except (ValueError, RecursionError):  # (ValidationError is a ValueError)
                body = None
        if body is None:
            await self.app(scope, replay, send)
            return
        response = await self.handle(body, Request(scope, replay))
        await response(scope, replay, send)


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
    dropped: Counter

    @classmethod
    def create(cls, *, multiprocess: bool = False) -> _Metrics:
        """The app's metrics in a registry of its own; ``multiprocess``: one of several worker
        processes (:mod:`.http_workers`), where the queue-depth gauge sums the live workers."""
        reg = CollectorRegistry()
        sizes = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
        # up to past the default request deadline (60 s; --request-timeout): a request may run
        # that long, and one past 10 s was counted only in +Inf
        times = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
                 120)
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
                        registry=reg, multiprocess_mode="livesum" if multiprocess else "all"),
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
            dropped=Counter("mhmla_dropped_requests", "Admitted requests dropped before they "
                            "finished, by reason (disconnected, deadline, shutdown)", ["reason"],
                            registry=reg),
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


GAUGE_REFRESH_S = 0.5


async def _refresh_gauge(gauge: Gauge, value: Callable[[], float]) -> None:
    """Set ``gauge`` to ``value()`` every ``GAUGE_REFRESH_S`` seconds until cancelled (a
    worker group's gauges are files that other workers read)."""
    while True:
        gauge.set(value())
        await asyncio.sleep(GAUGE_REFRESH_S)


def _unavailable(detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=503,
                        headers={"Retry-After": str(RETRY_AFTER_S)})


def _unscorable(essays: Sequence[EssayIn], prompts: Sequence[int],
                check: Callable[[Sequence[str]], list[str | None]]) -> list[dict]:
    """422 error entries (``loc``, ``msg``, ``type``) for the essays whose text gives no word
    pieces with the scorer's tokenizer (``check``, :func:`~.score.essay_pieces_check`) and
    those whose prompt the scorer has no output layer for; empty when all can be scored."""
    errors = []
    for k, (essay, no_pieces) in enumerate(zip(essays, check([e.text for e in essays]))):
        if no_pieces is not None:
            errors.append({"loc": ["body", "essays", k, "text"], "msg": no_pieces,
                           "type": "value_error"})
        reason = unsupported_prompt(essay.prompt, prompts)
        if reason is not None:
            errors.append({"loc": ["body", "essays", k, "prompt"], "msg": reason,
                           "type": "value_error"})
    return errors


def _with_ids(essays: Sequence[EssayIn], results: Sequence[dict], scorer: Any = None) -> list[dict]:
    """``{"id", "prompt", "score"}`` per essay: its own id, else its 1-based position; and
    ``"advisories"`` where ``scorer``'s :func:`~.score.with_advisories` finds some."""
    out = [{"id": e.id if e.id is not None else k, "prompt": r["prompt"], "score": r["score"]}
           for k, (e, r) in enumerate(zip(essays, results), 1)]
    return with_advisories(scorer, [e.text for e in essays], [e.prompt for e in essays], out)


async def _disconnected(request: Request) -> None:
    """Return once the client of ``request`` (whose body has been read) goes away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _await_results(batcher: MicroBatcher, kind: str, inputs: Sequence[Any],
                         request: Request, timeout: float | None, dropped: Counter
                         ) -> list[dict] | Response:
    """Submit a request's inputs and wait: the result dicts, or the error response (503 not
    admitted, 413 too costly, 500 engine failure, 504 past ``timeout`` seconds, 499 client gone;
    the last two drop the request's waiting work)."""
    try:
        fut = batcher.submit(kind, inputs)
    except (QueueFull, Unavailable) as err:
        return _unavailable(str(err))
    except TooCostly as err:
        return JSONResponse({"detail": str(err)}, status_code=413)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((fut, gone), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        # the server's graceful shutdown ran out (--graceful-timeout) and cancelled the
        # request: answer 503 with Retry-After, as a request refused while shutting down is
        # (the cancellation reached uvicorn, which answered a plain-text 500)
        batcher.drop(fut)
        dropped.labels(reason="shutdown").inc()
        return _unavailable("shutting down: the request was not done within the server's "
                            "graceful shutdown time; retry it")
    except BaseException:  # nobody waits for the results any more
        batcher.drop(fut)
        raise
    finally:
        gone.cancel()
    if not fut.done():
        if batcher.drop(fut):
            reason = "disconnected" if gone.done() and not gone.cancelled() else "deadline"
            dropped.labels(reason=reason).inc()
            if reason == "disconnected":  # nobody reads it; recorded in the metrics
                return JSONResponse({"detail": "the client went away"},
                                    status_code=CLIENT_CLOSED)
            return JSONResponse({"detail": f"deadline exceeded: the request was not done "
                                           f"within {timeout:g} s of being admitted "
                                           f"(request_timeout_s); its remaining work was "
                                           f"cancelled. Send fewer or shorter texts, or retry "
                                           f"later"}, status_code=504)
        await fut  # it ended between the wait and the drop
    try:
        return fut.result()
    except EngineFailure as err:
        return JSONResponse({"detail": err.args[0]}, status_code=500)


async def _results_response(results: list[dict]) -> Response:
    """``{"results": results}`` as JSON, encoded as ``mhmla-serve tag`` writes its lines
    (:func:`.outputs.encode_json`: orjson); a large body is encoded in a thread, so that the
    event loop goes on answering other requests meanwhile."""
    body = {"results": results}
    if sum(len(r.get("tokens", ())) for r in results) < BIG_RESPONSE:
        data = encode_json(body)
    else:
        data = await asyncio.to_thread(encode_json, body)
    return Response(data, media_type="application/json")


def _over_long(kind: str, inputs: Sequence[Any], cap: int | None) -> str | None:
    """The 413 message for the first input longer than ``cap`` characters (a sentence counts
    its words and one space between each two), else None."""
    if cap is None:
        return None
    for k, x in enumerate(inputs):
        n = (len(x) if isinstance(x, str)
             else sum(map(len, x)) + len(x) - 1)
        if n > cap:
            return (f"{kind}[{k}] is {n} characters long; the limit is {cap} characters per "
                    f"text (max_text_chars)")
    return None


_ERRORS = {
    500: {"model": ErrorResponse, "description": "the model failed on these inputs"},
    503: {"model": ErrorResponse, "description": "queue full or shutting down; see Retry-After"},
    504: {"model": ErrorResponse, "description": "not done within the request deadline"},
}


def _add_score_route(app: FastAPI, batcher: MicroBatcher, scorer: Any,
                     max_essays_per_request: int, max_text_chars: int | None,
                     wait: Callable[..., Awaitable[list[dict] | Response]]) -> None:
    """``POST /v1/score`` on ``app``: scores through ``batcher``, or 404 without a scorer."""
    if scorer is None:
        @app.post(SCORE_PATH, include_in_schema=False)
        async def score_disabled() -> JSONResponse:
            return JSONResponse({"detail": NO_SCORER}, status_code=404)
        return

    prompts = tuple(int(p) for p in scorer.config.prompts)
    check = essay_pieces_check(scorer)
    # Look the tokenizer up now, before the batching worker runs: a transformers tokenizer
    # sets its padding and truncation on its first call and never again, so afterwards the
    # route (on the event loop) and the worker (scoring) may encode at the same time.
    check([""])

    @app.post(SCORE_PATH, response_model=ScoreResponse, responses={
        413: {"model": ErrorResponse, "description": "body or essay count over the limit"},
        **_ERRORS,
    })
    async def score(body: ScoreRequest, request: Request) -> Response:
        """Score essays on their prompts' scales; results come back in request order."""
        essays = body.essays
        if len(essays) > max_essays_per_request:
            raise HTTPException(413, f"{len(essays)} essays in one request; at most "
                                     f"{max_essays_per_request} are allowed")
        too_long = _over_long("essays", [e.text for e in essays], max_text_chars)
        if too_long:
            raise HTTPException(413, too_long)
        # off the event loop: the check tokenizes essays without an ASCII letter or digit
        errors = await asyncio.to_thread(_unscorable, essays, prompts, check)
        if errors:
            return JSONResponse({"detail": errors}, status_code=422)
        results = await wait("essays", [(e.text, e.prompt) for e in essays], request)
        if isinstance(results, Response):
            return results
        # off the event loop: the advisories read every essay's surface features
        answer = await asyncio.to_thread(_with_ids, essays, results, scorer)
        return JSONResponse({"results": answer})


def check_limits(*, max_queue: int, max_request_bytes: int, max_texts_per_request: int,
                 max_essays_per_request: int, max_text_chars: int | None,
                 request_timeout_s: float | None, max_buffered_bytes: int | None,
                 scoring: bool) -> None:
    """ValueError naming the first of :func:`create_app`'s request limits that is out of range
    or conflicts with another; ``scoring``: the app has an essay scorer (only then must
    ``max_queue`` hold ``max_essays_per_request``). It needs no model, so ``mhmla-serve http``
    checks the limits before loading any."""
    if min(max_texts_per_request, max_request_bytes, max_essays_per_request) < 1:
        raise ValueError("max_texts_per_request, max_essays_per_request and max_request_bytes "
                         "must be >= 1")
    if max_queue < max_texts_per_request:
        raise ValueError(f"max_queue ({max_queue}) must be >= max_texts_per_request "
                         f"({max_texts_per_request})")
    if scoring and max_queue < max_essays_per_request:
        raise ValueError(f"max_queue ({max_queue}) must be >= max_essays_per_request "
                         f"({max_essays_per_request})")
    if max_text_chars is not None and max_text_chars < 1:
        raise ValueError(f"max_text_chars: expected >= 1 or None, got {max_text_chars}")
    if request_timeout_s is not None and not request_timeout_s > 0:
        raise ValueError(f"request_timeout_s: expected > 0 or None, got {request_timeout_s}")
    if max_buffered_bytes is not None and max_buffered_bytes < max_request_bytes:
        raise ValueError(f"max_buffered_bytes ({max_buffered_bytes}) must be >= "
                         f"max_request_bytes ({max_request_bytes})")


def create_app(engine: Any, *, max_batch_tokens: int | None = None, max_wait_ms: float = 5.0,
               max_queue: int = 1024, max_request_bytes: int = 1_000_000,
               max_texts_per_request: int = 256, model_name: str | None = None,
               scorer: Any = None, scorer_name: str | None = None,
               max_essays_per_request: int = 64, score_token_budget: int | None = None,
               max_text_chars: int | None = 500_000, max_queue_pieces: int = 1_000_000,
               request_timeout_s: float | None = 60.0,
               max_buffered_bytes: int | None = 64_000_000,
               split_pieces: int | None = None, group: WorkerGroup | None = None,
               warm_up: bool = True) -> FastAPI:
    """The tagging (and, with ``scorer``, essay-scoring) app over ``engine`` (endpoints, limits
    and batching: module docstring).

    Batching: ``max_batch_tokens`` estimated word pieces per batch (default: one forward pass
    of the engine, :func:`~mhmla_fast.serve.scheduler.batch_token_budget`).

    Limits: ``max_text_chars`` characters per text, sentence or essay (413; None: no cap);
    ``max_queue_pieces`` estimated word pieces admitted and not yet answered (503, or 413 for a
    request that alone is over it); ``request_timeout_s`` seconds from admission to the answer
    (504; None: no deadline); ``max_buffered_bytes`` request-body bytes held at once by all
    requests (503; None: no cap; at least ``max_request_bytes``); ``split_pieces``: texts,
    sentences and essays estimated above it are tagged (scored) window by window, interleaved
    with other requests (default: a quarter of ``max_batch_tokens``; essays only with a scorer
    that has ``plan_essay``, as :class:`~mhmla_fast.aes.model.EssayScorer` does).

    ``warm_up``: before accepting connections, the lifespan runs
    :meth:`MicroBatcher.warm_up` (a few tagging and scoring batches of a fixed sample; their
    speeds, pieces per second by family, in ``app.state.warm_up_speeds``), so the first
    requests neither pay the runtime's warm-up nor, in a burst, get admitted before any speed
    was measured; an engine that fails on it stops the start-up.

    ``group``: the :class:`~mhmla_fast.serve.http_workers.WorkerGroup` this process is a worker
    of (``mhmla-serve http --workers N``), or None for a server of one process: with a group,
    ``/metrics`` gives the sums over the group's workers, ``/healthz`` adds ``pid``,
    ``workers`` and ``workers_ready``, and the worker marks itself ready once started.

    ``scorer`` is an :class:`~mhmla_fast.aes.model.EssayScorer` (or anything with
    ``predict_scores(texts, prompts, token_budget=...)`` and ``config.prompts``) or None, which
    makes ``POST /v1/score`` answer 404. The batching worker starts with the app's lifespan and
    stops, after draining, at its end; ``app.state.batcher`` is the :class:`MicroBatcher`,
    ``app.state.registry`` the Prometheus registry. ``max_queue`` must be at least
    ``max_texts_per_request`` and, with a scorer, ``max_essays_per_request`` (else a request of
    the largest allowed size could never be admitted).
    """
    check_limits(max_queue=max_queue, max_request_bytes=max_request_bytes,
                 max_texts_per_request=max_texts_per_request,
                 max_essays_per_request=max_essays_per_request, max_text_chars=max_text_chars,
                 request_timeout_s=request_timeout_s, max_buffered_bytes=max_buffered_bytes,
                 scoring=scorer is not None)
    name = model_name or getattr(engine, "name", None) or type(engine).__name__
    scorer_name = (scorer_name or type(scorer).__name__) if scorer is not None else None
    metrics = _Metrics.create(multiprocess=group is not None)
    batcher = MicroBatcher(engine, scorer=scorer, score_token_budget=score_token_budget,
                           max_batch_tokens=max_batch_tokens, max_wait_ms=max_wait_ms,
                           max_queue=max_queue, max_queue_pieces=max_queue_pieces,
                           max_queue_seconds=(None if request_timeout_s is None
                                              else QUEUE_SHARE_OF_TIMEOUT * request_timeout_s),
                           max_request_seconds=request_timeout_s,
                           split_pieces=split_pieces, on_batch=metrics.on_batch,
                           on_score_batch=metrics.on_score_batch,
                           on_failure=metrics.failures.inc)
    if group is None:  # read at each scrape; a group's workers refresh theirs (lifespan)
        metrics.queue.set_function(lambda: batcher.depth)

    async def wait(kind: str, inputs: Sequence[Any], request: Request) -> list[dict] | Response:
        return await _await_results(batcher, kind, inputs, request, request_timeout_s,
                                    metrics.dropped)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # what is loaded by now (torch, the models, the app) into the collector's permanent
        # generation: a full collection while serving then walks only what serving allocated,
        # not the whole heap, and stalls the event loop for less
        if warm_up:  # before connections are accepted: admission by time from the first
            app.state.warm_up_speeds = await asyncio.to_thread(batcher.warm_up)
        gc.collect()
        gc.freeze()
        batcher.start()
        refresh = None
        if group is not None:
            refresh = asyncio.ensure_future(_refresh_gauge(metrics.queue, lambda: batcher.depth))
            group.mark_ready()
        try:
            yield
        finally:
            if group is not None:
                refresh.cancel()
                group.mark_stopped()
            batcher.close()
            await asyncio.to_thread(batcher.join)
            gc.unfreeze()

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
        found = exc.errors()
        errors = [{k: e[k] for k in ("loc", "msg", "type") if k in e}
                  for e in found[:MAX_LISTED_ERRORS]]
        if len(found) > MAX_LISTED_ERRORS:  # (an answer is not made many times its request)
            errors.append({"loc": ["body"], "type": "more_errors",
                           "msg": f"and {len(found) - MAX_LISTED_ERRORS} more errors"})
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
        413: {"model": ErrorResponse, "description": "body, text count, a text's length or "
                                                    "the request's cost over the limit"},
        **_ERRORS,
    })
    async def tag(body: TagRequest, request: Request) -> Response:
        """Tag raw texts or pre-tokenised sentences; results come back in request order."""
        return await answer_tag(body, request)

    async def answer_tag(body: TagRequest, request: Request) -> Response:
        """The answer to a valid tag request (the route's, and :class:`TagFastPath`'s)."""
        kind = "texts" if body.texts is not None else "sentences"
        inputs = body.texts if body.texts is not None else body.sentences
        if len(inputs) > max_texts_per_request:
            return JSONResponse({"detail": f"{len(inputs)} {kind} in one request; at most "
                                           f"{max_texts_per_request} are allowed"}, status_code=413)
        too_long = _over_long(kind, inputs, max_text_chars)
        if too_long:
            return JSONResponse({"detail": too_long}, status_code=413)
        results = await wait(kind, inputs, request)
        if isinstance(results, Response):
            return results
        return await _results_response(results)

    _add_score_route(app, batcher, scorer, max_essays_per_request, max_text_chars, wait)

    @app.head("/healthz", include_in_schema=False)  # a probe's HEAD: GET's status, no body
    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        """200 with the model name(s) and queue depth while serving; 503 otherwise."""
        body: dict[str, Any] = {"status": "ok", "model": name}
        if scorer_name is not None:
            body["scorer"] = scorer_name
        body["queue_depth"] = batcher.depth
        if group is not None:
            body.update(pid=os.getpid(), workers=group.size, workers_ready=group.ready())
        if batcher.accepting:
            return JSONResponse(body)
        body["status"] = "worker stopped" if batcher.error is not None else "shutting down"
        return JSONResponse(body, status_code=503)

    exposed = metrics.registry
    if group is not None:  # every worker's values, from the group's files
        exposed = CollectorRegistry()
        MultiProcessCollector(exposed, path=str(group.metrics_dir))

    @app.get("/metrics")
    async def prometheus() -> Response:
        """Prometheus text exposition of the app's metrics (a worker group's: summed)."""
        if group is not None:
            group.forget_dead()  # (a killed worker's live gauges)
        return Response(generate_latest(exposed), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(TagFastPath, handle=answer_tag)
    app.add_middleware(ItemLimit, limits={
        TAG_PATH: (("texts", "sentences"), max_texts_per_request),
        **({SCORE_PATH: (("essays",), max_essays_per_request)} if scorer is not None else {})})
    app.add_middleware(RequireUtf8, paths=(TAG_PATH, SCORE_PATH))
    app.add_middleware(BodyLimit, limit=max_request_bytes, max_buffered=max_buffered_bytes)
    app.add_middleware(RequireJson, paths=(TAG_PATH, SCORE_PATH))
    app.add_middleware(Instrument, requests=metrics.requests,
                       latency={TAG_PATH: metrics.latency, SCORE_PATH: metrics.score_latency},
                       paths=(TAG_PATH, SCORE_PATH, "/healthz", "/metrics"))
    return app
