"""Cost-based, fair micro-batching of tagging and scoring requests over one engine: the scheduler
behind the HTTP server (:mod:`mhmla_fast.serve.http`).

Admission
---------
A request is admitted whole or not at all (:meth:`MicroBatcher.submit`), by count and by cost:
its inputs must fit ``max_queue`` inputs waiting, and its estimated word pieces
(:func:`estimate_pieces`) must fit ``max_queue_pieces`` pieces admitted and not yet answered;
else :class:`QueueFull` (503, retry later). A request that alone costs more than
``max_queue_pieces`` could never be admitted: :class:`TooCostly` (413), as is one whose own
work alone, at the measured speed, comes to more than ``max_request_seconds`` (the HTTP
server's request deadline: it would be answered 504 after the whole deadline). With
``max_queue_seconds``, a request is also refused (:class:`QueueFull`) while other work is
admitted and it would not be answered within that many seconds at the speed measured on the
batches so far (estimated pieces per second, a moving average per family, from its second
batch on: the first pays the runtime's warm-up; :meth:`MicroBatcher.warm_up`, which the HTTP
server runs before it accepts connections, runs and measures such batches of a fixed sample
first, so that a burst reaching a cold server is admitted by time too). Round-robin batches
share the worker as processor sharing does, so a request of ``x`` seconds of work is answered
after ``x`` plus, of each unfinished request's ``w``, ``min(w, x)``. Under sustained overload
some requests are then refused at once instead of every one being admitted and timing out
part-done, while a short request beside a long text still gets in (the HTTP server passes half
its request deadline).

Work items and windows
----------------------
A text or sentence estimated at more than ``split_pieces`` word pieces is not tagged in one
engine call: it is tokenised, word-pieced and cut into the engine's own windows
(``Engine.plan_steps``; the engine's ``long_window`` pieces, overlapping by a quarter), each
window one work item; when all its windows are done they are merged (``Engine.finish_plan``)
into exactly what ``tag_texts`` gives for the whole text. Planning runs on the worker thread in
steps of a few thousand characters, one step between two batches (so it neither holds the worker
nor fights it for the GIL), with a short sleep after each step that hands the GIL to the event
loop. An essay estimated above ``split_pieces`` is likewise cut into the scorer's windows
(``EssayScorer.plan_essay``, one planning step), each window one work item, its score combined
from all of them (``finish_essay``) equal to ``predict_scores``' for the whole essay. Other
inputs are one work item each; engines and scorers without those methods (stand-ins) get every
input whole.

Batches
-------
One worker thread owns the engine. A batch is filled round-robin over the requests that have
work waiting, one item per request per round, while the items' estimated pieces stay within
``max_batch_tokens`` (the first item is always taken), waiting for more at most until
``max_wait_ms`` after the first item was queued; requests served in a batch move behind those
that were not. So a long text holds the worker for one batch at a time, not for all its
windows, and short requests that arrive meanwhile share the next batch with its next windows.
A batch is either tagging or scoring, never both, and takes from no request behind one of the
other family (which then starts the next batch). Its items go to the engine in request order:
one ``tag_texts`` call for whole texts, one ``tag_tokens`` call for whole sentences, one
``tag_windows`` call for windows; a scoring batch is one ``predict_scores`` call for whole essays
and one ``score_windows`` call for windows. When the engine
raises, the batch is retried request by request, so only the requests whose own inputs fail get
:class:`EngineFailure`.

Dropping
--------
:meth:`MicroBatcher.drop` (a client gone, a deadline passed) removes a request's waiting items
at once: they never run, and its inputs are not counted as tagged. Items already inside the
running batch finish and are discarded.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .engine import gc_paused
from .score import score_essays, scorer_token_budget

__all__ = ["MicroBatcher", "QueueFull", "TooCostly", "Unavailable", "EngineFailure",
           "estimate_pieces", "batch_token_budget", "KINDS"]

log = logging.getLogger(__name__)

KINDS = ("texts", "sentences", "essays")  # input kinds; "essays" are scored, the others tagged
WARM_UP_SENTENCE = ("The students who lives in the city goes to school by bus every morning , "
                    "and they says that the journey are too long for them .")
WARM_UP_PIECES = 1024  # estimated word pieces of a warm-up tagging batch (capped by the budget)
WARM_UP_ESSAY_SENTENCES = 12  # a warm-up essay: this many sentences (about 300 words)
DEFAULT_BATCH_TOKENS = 8192  # estimated pieces per batch for an engine without a token budget
PLAN_PAUSE_S = 0.002  # the worker sleeps this long after each planning step, so that the event
# loop (parsing, answering) gets the GIL at once rather than after Python's switch interval


class QueueFull(Exception):
    """The queue cannot take the request's inputs now (answer 503 with Retry-After)."""


class TooCostly(Exception):
    """The request alone costs more than the queue admits at once (answer 413)."""


class Unavailable(Exception):
    """The batcher is shutting down or its worker has stopped."""


class EngineFailure(Exception):
    """The engine raised on this request's inputs; ``args[0]`` is a message for the client."""


def estimate_pieces(kind: str, value: Any) -> float:
    """Rough word-piece count of one text (``kind="texts"``), token list (``"sentences"``) or
    ``(text, prompt)`` essay (``"essays"``):

        max(1, 1.3 x words, characters / 4 + (UTF-8 bytes - characters) / 2)

    words split on whitespace for a text. The last term keeps text without spaces from looking
    cheap: about 1.25 per CJK character (each is a word piece of its own), 0.75 per Cyrillic or
    Greek one, and ASCII text's 1/4 per character unchanged; it errs high for Indic scripts."""
    if kind == "essays":
        value = value[0]
        kind = "texts"
    if kind == "texts":
        words, chars, size = len(value.split()), len(value), len(value.encode("utf-8", "replace"))
    else:
        words = len(value)
        chars = sum(len(w) for w in value)
        size = sum(len(w.encode("utf-8", "replace")) for w in value)
    return max(1.0, 1.3 * words, chars / 4 + (size - chars) / 2)


def _family(kind: str) -> str:
    """"score" for essays, "tag" for texts and sentences: what a batch may mix."""
    return "score" if kind == "essays" else "tag"


@dataclass(eq=False)
class _Planned:
    """A windowed input: its plan and the probabilities of the windows done so far."""

    plan: Any  # engine.WindowPlan
    probs: list[Any]
    left: int


@dataclass(eq=False)
class _Job:
    """One request: ``inputs`` of one ``kind``, the result dicts so far, its waiting items, and
    the future its handler awaits (resolved on ``loop``)."""

    kind: str
    inputs: Sequence[Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    seq: int
    cost: float  # estimated pieces, held against max_queue_pieces until the job ends
    results: list[Any] = field(default_factory=list)
    remaining: int = 0  # inputs without a result
    waiting: int = 0  # inputs not yet (wholly) taken into a batch
    pending: deque = field(default_factory=deque)  # its queued _Items, in order
    planned: dict[int, _Planned] = field(default_factory=dict)
    queued: bool = False  # in the batcher's round-robin list
    ended: bool = False  # resolved, failed or dropped


@dataclass(eq=False, slots=True)
class _Item:
    job: _Job
    pos: int
    cost: float
    queued_at: float
    window: int = -1  # -1: the whole input; else the window's index in its plan
    last: bool = True  # taking it takes the last of its input


def _resolve(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _reject(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def batch_token_budget(engine: Any, max_batch_tokens: int | None = None) -> int:
    """``max_batch_tokens``, else the engine's ``token_budget`` (an
    :class:`~mhmla_fast.serve.engine.Engine`'s padded word pieces per forward pass:
    ``options.default_token_budget``, 1024 on the CPU and 8192 on a GPU, or ``--token-budget``),
    else :data:`DEFAULT_BATCH_TOKENS` for an engine without one.

    One pass per batch: a batch holds the worker for one forward pass, so a short request that
    arrives while a long text is tagged waits about one pass, not several. On a 2-core CPU
    (the HTTP server, a 500,000-character text): one-sentence requests beside it answered in
    0.22 s at the median against 2.49 s with 8192, the long text 1.09x slower (27.9 against
    25.5 s), and one-sentence requests from 64 clients alone at 1.10x the requests/s, within
    run-to-run noise (``bench/results/http_fairness_cpu_2026-12-07.json``,
    ``http_batch_tokens_cpu_2026-12-07/``). On a GPU the pass budget is the old default,
    8192."""
    if max_batch_tokens is not None:
        return int(max_batch_tokens)
    return int(getattr(engine, "token_budget", None) or DEFAULT_BATCH_TOKENS)


class MicroBatcher:
    """Cost-based, fair micro-batching of tagging and scoring requests over one engine and an
    optional essay scorer (design: module docstring).

    Args:
        engine: has ``tag_texts(list[str])`` and ``tag_tokens(list[list[str]])`` returning objects
            with ``to_dict()``, and optionally ``plan_text``/``plan_tokens``/``tag_windows``/
            ``finish_plan`` (:class:`~mhmla_fast.serve.engine.Engine`) to tag long inputs window
            by window; used only from the batcher's threads.
        scorer: None, or has ``predict_scores(texts, prompts, token_budget=...)`` returning one
            integer score per essay, and optionally ``plan_essay``/``score_windows``/
            ``finish_essay`` (an :class:`~mhmla_fast.aes.model.EssayScorer`) to score long essays
            window by window; used only from the worker thread. Needed for ``submit("essays", ...)``.
        score_token_budget: the scorer's padded word pieces per forward pass (default:
            ``score.scorer_token_budget``, 1024 on the CPU, 8192 on a GPU).
        max_batch_tokens: estimated word pieces per batch (the first item is always taken;
            default: :func:`batch_token_budget`, one forward pass of the engine).
        max_wait_ms: how long a batch may wait for more items after its first one was queued.
        max_queue: inputs (texts, sentences, essays) waiting at most.
        max_queue_pieces: estimated word pieces admitted and not yet answered, at most.
        max_queue_seconds: the measured seconds of work admitted and not yet answered, at most
            (None: no such bound; see the module docstring).
        max_request_seconds: the measured seconds of one request's own work, at most (None: no
            such bound): above it, :class:`TooCostly` at once.
        split_pieces: inputs estimated above it are tagged (essays: scored) window by window
            (default: a quarter of ``max_batch_tokens``).
        on_batch: called from the worker after each tagging batch with (texts, requests,
            seconds); ``texts`` counts the inputs whose last piece of work ran in it.
        on_score_batch: likewise after each scoring batch with (essays, requests, seconds).
        on_failure: called once per request failed by the engine or scorer.
    """

    def __init__(self, engine: Any, *, scorer: Any = None, score_token_budget: int | None = None,
                 max_batch_tokens: int | None = None, max_wait_ms: float = 5.0,
                 max_queue: int = 1024, max_queue_pieces: int = 1_000_000,
                 max_queue_seconds: float | None = None,
                 max_request_seconds: float | None = None, split_pieces: int | None = None,
                 on_batch: Callable[[int, int, float], None] | None = None,
                 on_score_batch: Callable[[int, int, float], None] | None = None,
                 on_failure: Callable[[], None] | None = None) -> None:
        max_batch_tokens = batch_token_budget(engine, max_batch_tokens)
        split_pieces = max(1, max_batch_tokens // 4) if split_pieces is None else split_pieces
        score_token_budget = scorer_token_budget(scorer, score_token_budget)
        if min(max_batch_tokens, max_queue, score_token_budget, max_queue_pieces,
               split_pieces) < 1 or not 0 <= max_wait_ms < float("inf"):
            raise ValueError("max_batch_tokens, max_queue, max_queue_pieces, split_pieces and "
                             "score_token_budget must be >= 1 and max_wait_ms finite and >= 0")
        if max_queue_seconds is not None and not 0 < max_queue_seconds < float("inf"):
            raise ValueError(f"max_queue_seconds: expected > 0 or None, got {max_queue_seconds}")
        self.max_queue_seconds = max_queue_seconds
        if max_request_seconds is not None and not 0 < max_request_seconds < float("inf"):
            raise ValueError(f"max_request_seconds: expected > 0 or None, got "
                             f"{max_request_seconds}")
        self.max_request_seconds = max_request_seconds
        self.engine = engine
        self.scorer = scorer
        self.score_token_budget = int(score_token_budget)
        self.max_batch_tokens = float(max_batch_tokens)
        self.max_wait = max_wait_ms / 1000.0
        self.max_queue = int(max_queue)
        self.max_queue_pieces = float(max_queue_pieces)
        self.split_pieces = float(split_pieces)
        self.windowed = all(hasattr(engine, a) for a in ("plan_steps", "tag_windows",
                                                         "finish_plan"))
        self.score_windowed = scorer is not None and all(
            hasattr(scorer, a) for a in ("plan_essay", "score_windows", "finish_essay"))
        self._on_batch = on_batch
        self._on_score_batch = on_score_batch
        self._on_failure = on_failure
        self._cond = threading.Condition()
        self._active: deque[_Job] = deque()  # jobs with queued items, in round-robin order
        self._jobs: dict[asyncio.Future, _Job] = {}  # unfinished jobs by future
        self._plans: deque[tuple[_Job, int, Any]] = deque()  # inputs being planned, in order
        self._waiting = 0  # inputs admitted and not yet wholly taken into a batch
        self._cost = 0.0  # estimated pieces of unfinished jobs
        self._rates: dict[str, float] = {}  # family -> estimated pieces per second, measured
        self._warm: set[str] = set()  # families whose first (warm-up) batch has run
        self._seq = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what killed the worker, if anything

    # ------------------------------------------------------------------ control

    @property
    def depth(self) -> int:
        """Inputs (texts, sentences, essays) admitted and not yet wholly taken into a batch; a
        long text counts until its last window is taken."""
        return self._waiting

    @property
    def pieces(self) -> float:
        """Estimated word pieces of the requests admitted and not yet answered."""
        return self._cost

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
        """Stop admitting requests; the worker still finishes everything admitted, then
        exits."""
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
        lists) or "essays" (``(text, prompt)`` pairs; needs a scorer). Raises :class:`QueueFull`,
        :class:`TooCostly` or :class:`Unavailable` when the request cannot be admitted."""
        if kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
        if kind == "essays" and self.scorer is None:
            raise ValueError("this batcher has no essay scorer")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not inputs:
            fut.set_result([])
            return fut
        costs = [estimate_pieces(kind, x) for x in inputs]
        total = sum(costs)
        if total > self.max_queue_pieces:
            raise TooCostly(f"the request comes to about {total:.0f} word pieces; at most "
                            f"{self.max_queue_pieces:.0f} are admitted at once (max_queue_pieces)")
        split = self.score_windowed if kind == "essays" else self.windowed
        now = time.monotonic()
        with self._cond:
            if self._closed:
                raise Unavailable("shutting down")
            if not self.alive:
                raise Unavailable("the tagging worker is not running")
            if self._waiting + len(inputs) > self.max_queue:
                raise QueueFull(f"the queue is full ({self._waiting} of {self.max_queue} texts "
                                f"and essays waiting); retry later")
            if self._cost + total > self.max_queue_pieces:
                raise QueueFull(f"the queue is full ({self._cost:.0f} of "
                                f"{self.max_queue_pieces:.0f} word pieces admitted); retry later")
            rate = self._rates.get(_family(kind))
            if self.max_request_seconds is not None and rate and (
                    total / rate > self.max_request_seconds):
                raise TooCostly(f"the request alone would take about {total / rate:.0f} s at "
                                f"the measured speed ({total:.0f} word pieces at "
                                f"{rate:.0f} a second), over its {self.max_request_seconds:g} s "
                                "deadline; send it in smaller requests")
            seconds = self._queued_seconds(_family(kind), total) if self._jobs else None
            if seconds is not None and seconds > self.max_queue_seconds:
                raise QueueFull(f"the queue is full (this request would be answered in about "
                                f"{seconds:.1f} s at the measured speed, over "
                                f"{self.max_queue_seconds:g} s); retry later")
            self._seq += 1
            job = _Job(kind, inputs, loop, fut, self._seq, total, [None] * len(inputs),
                       len(inputs), len(inputs))
            for k, cost in enumerate(costs):
                if split and cost > self.split_pieces:
                    if kind == "essays":
                        steps = self._essay_steps(*inputs[k])
                    elif kind == "texts":
                        steps = self.engine.plan_steps(text=inputs[k])
                    else:
                        steps = self.engine.plan_steps(words=inputs[k])
                    self._plans.append((job, k, steps))
                else:
                    job.pending.append(_Item(job, k, cost, now))
            self._jobs[fut] = job
            self._waiting += len(inputs)
            self._cost += total
            if job.pending:
                job.queued = True
                self._active.append(job)
            self._cond.notify_all()
        return fut

    def _queued_seconds(self, family: str, extra: float) -> float | None:
        """(Under the lock.) When a request of ``extra`` estimated pieces of ``family`` would
        be answered, in seconds from now, at the measured speeds: round-robin batches share
        the worker like processor sharing, so it finishes after its own work ``x`` and, of
        each unfinished request's work ``w``, ``min(w, x)``: ``x + sum min(w, x)`` (in
        seconds; a request's whole estimate stands for what is left of it). None without
        ``max_queue_seconds`` or before a batch of the family was measured."""
        rate = self._rates.get(family)
        if self.max_queue_seconds is None or rate is None:
            return None
        own = extra / rate
        ahead = 0.0
        for job in self._jobs.values():
            job_rate = self._rates.get(_family(job.kind))
            if job_rate:
                ahead += min(job.cost / job_rate, own)
        return own + ahead

    def _measured(self, family: str, pieces: float, seconds: float) -> None:
        """Fold a batch's speed into the family's moving average (weight 0.3 on the new). The
        family's first batch is not counted: it pays the runtime's warm-up (a CUDA context,
        kernels compiled or graphs captured, a session's first run), which would make the
        first estimate far too slow and refuse requests the device could answer."""
        if seconds <= 0 or pieces <= 0:
            return
        speed = pieces / seconds
        with self._cond:
            if family not in self._warm:
                self._warm.add(family)
                return
            old = self._rates.get(family)
            self._rates[family] = speed if old is None else 0.7 * old + 0.3 * speed

    def warm_up(self) -> dict[str, float]:
        """Run each family's warm-up before serving: two tagging batches of
        :data:`WARM_UP_SENTENCE` (``WARM_UP_PIECES`` estimated pieces, at most
        ``max_batch_tokens``) and, with a scorer, two scoring calls on an essay of
        ``WARM_UP_ESSAY_SENTENCES`` such sentences on its first prompt. The first call of each
        pays the runtime's warm-up and is not timed; the second seeds the family's speed, so that
        admission by time (``max_queue_seconds``) holds from the first request on, a burst on a
        cold server included. Returns the measured pieces per second by family. Call it before
        :meth:`start` (from any one thread); what the engine or scorer raises propagates: a
        model that cannot tag a plain sentence should not start serving."""
        if self._thread is not None:
            raise RuntimeError("warm_up runs before start(), while no worker uses the engine")
        pieces = estimate_pieces("texts", WARM_UP_SENTENCE)
        n = max(1, int(min(WARM_UP_PIECES, self.max_batch_tokens) // pieces))
        texts = [WARM_UP_SENTENCE] * n
        runs: list[tuple[str, float, Callable[[], Any]]] = [
            ("tag", n * pieces, lambda: self.engine.tag_texts(texts))]
        prompts = getattr(getattr(self.scorer, "config", None), "prompts", None)
        if self.scorer is not None and prompts:
            essay = " ".join([WARM_UP_SENTENCE] * WARM_UP_ESSAY_SENTENCES)
            runs.append(("score", estimate_pieces("texts", essay), lambda: score_essays(
                self.scorer, [essay], [int(prompts[0])], self.score_token_budget,
                advisories=False)))
        speeds = {}
        for family, cost, run in runs:
            run()  # the runtime's warm-up: not timed
            t0 = time.perf_counter()
            run()
            seconds = time.perf_counter() - t0
            with self._cond:
                self._warm.add(family)
            self._measured(family, cost, seconds)
            if family in self._rates:
                speeds[family] = self._rates[family]
        return speeds

    def _essay_steps(self, text: str, prompt: int):
        """Planning an essay: one step (tokenizing it whole), like ``Engine.plan_steps``."""
        yield self.scorer.plan_essay(text, prompt)

    def drop(self, fut: asyncio.Future) -> bool:
        """Forget the request of ``fut`` (its client has gone or its deadline passed): its
        waiting items never run. False when it had already ended."""
        with self._cond:
            job = self._jobs.get(fut)
            if job is None or job.ended:
                return False
            self._end(job)
            return True

    def _end(self, job: _Job) -> None:
        """(Under the lock.) The job leaves: release what it holds, drop its waiting items."""
        job.ended = True
        self._jobs.pop(job.future, None)
        self._waiting -= job.waiting
        self._cost = self._cost - job.cost if self._jobs else 0.0  # no float drift when idle
        job.waiting, job.cost = 0, 0.0
        job.pending.clear()
        job.planned.clear()
        # its inputs waiting to be planned hold their whole texts: let them go now, not when
        # they reach the head (which may be mid-step outside the lock: _plan_step drops it)
        if any(entry[0] is job for entry in itertools.islice(self._plans, 1, None)):
            self._plans = deque(entry for k, entry in enumerate(self._plans)
                                if k == 0 or entry[0] is not job)
        if job.queued:
            job.queued = False
            self._active.remove(job)
        self._cond.notify_all()

    # ------------------------------------------------------------------- worker

    def _next_batch(self) -> list[_Item] | None:
        """Block for the next batch: [] when there is none but an input to plan, None once
        closed and drained."""
        with self._cond:
            while not self._active:
                if self._plans:
                    return []
                if self._closed:
                    return None
                self._cond.wait()
            head = self._active[0]
            family = _family(head.kind)
            deadline = head.pending[0].queued_at + self.max_wait
            batch: list[_Item] = []
            size = 0.0
            while True:
                size, full = self._fill(batch, family, size)
                left = deadline - time.monotonic()
                if full or left <= 0 or self._closed or self._plans:
                    break
                self._cond.wait(left)
            batch.sort(key=lambda it: (it.job.seq, it.pos, it.window))
            return batch

    def _fill(self, batch: list[_Item], family: str, size: float) -> tuple[float, bool]:
        """(Under the lock.) Add items to ``batch`` round-robin, one per job per round, from
        the jobs of ``family`` ahead of the first job of the other family (none jumps a job of
        the other family), while they fit the budget; served jobs move to the back of the
        round-robin order. Returns the new size and whether some item no longer fits."""
        candidates = []
        for job in self._active:
            if _family(job.kind) != family:
                break
            candidates.append(job)
        served: dict[int, _Job] = {}
        full = False
        while candidates:
            again = []
            for job in candidates:
                item = job.pending[0]
                if batch and size + item.cost > self.max_batch_tokens:
                    full = True
                    continue
                job.pending.popleft()
                batch.append(item)
                size += item.cost
                if item.last:
                    job.waiting -= 1
                    self._waiting -= 1
                served[id(job)] = job
                if job.pending:
                    again.append(job)
            candidates = again
        if served:
            rest = [j for j in self._active if id(j) not in served]
            back = [j for j in served.values() if j.pending]
            for job in served.values():
                job.queued = bool(job.pending)
            self._active = deque(rest + back)
        return size, full

    def _compute(self, items: Sequence[_Item]) -> list[Any]:
        """Results of ``items`` (all of one family) in order: result dicts for whole inputs,
        window outputs for windows. One scorer call for whole essays and one for windows, else
        one engine call per input kind present."""
        out: list[Any] = [None] * len(items)
        scoring = _family(items[0].job.kind) == "score"
        if scoring:
            idx = [k for k, it in enumerate(items) if it.window < 0]
            essays = [items[k].job.inputs[items[k].pos] for k in idx]
            # (the route adds advisories to every essay's result, windowed ones included)
            for k, res in zip(idx, score_essays(self.scorer, [t for t, _ in essays],
                                                [p for _, p in essays], self.score_token_budget,
                                                advisories=False)):
                out[k] = res
        for kind, fn in () if scoring else (("texts", self.engine.tag_texts),
                                            ("sentences", self.engine.tag_tokens)):
            idx = [k for k, it in enumerate(items) if it.job.kind == kind and it.window < 0]
            if not idx:
                continue
            results = fn([items[k].job.inputs[items[k].pos] for k in idx])
            if len(results) != len(idx):
                raise RuntimeError(f"engine returned {len(results)} results for {len(idx)} inputs")
            with gc_paused():  # many small containers, no cycles (see engine.gc_paused)
                for k, res in zip(idx, results):
                    out[k] = res.to_dict()
        idx = [k for k, it in enumerate(items) if it.window >= 0]
        if idx:
            with self._cond:  # a dropped job's plans are gone: skip its windows
                pairs = [(k, items[k].job.planned.get(items[k].pos)) for k in idx]
            pairs = [(k, p) for k, p in pairs if p is not None]
            windows = [(p.plan, items[k].window) for k, p in pairs]
            probs = (self.scorer.score_windows(windows, token_budget=self.score_token_budget)
                     if scoring else self.engine.tag_windows(windows))
            for (k, _), pr in zip(pairs, probs):
                out[k] = pr
        return out

    def _deliver(self, items: Sequence[_Item], results: Sequence[Any]) -> tuple[int, list[_Job]]:
        """Store results, merging the windows of inputs whose last window is done. Returns how
        many inputs had their last piece of work here, and the jobs now complete (to resolve
        with :meth:`_complete` once the batch is accounted for)."""
        done, complete, merge = 0, [], []
        with self._cond:
            for it, res in zip(items, results):
                job = it.job
                if job.ended:
                    continue
                if it.window < 0:
                    done += 1
                    if self._store(job, it.pos, res):
                        complete.append(job)
                    continue
                planned = job.planned.get(it.pos)
                if planned is None or res is None:
                    continue
                planned.probs[it.window] = res
                planned.left -= 1
                if planned.left == 0:
                    done += 1
                    merge.append((job, it.pos, planned))
        for job, pos, planned in merge:
            res = self._finish(job, planned.plan, planned.probs)
            with self._cond:
                if not job.ended:
                    job.planned.pop(pos, None)
                    if self._store(job, pos, res):
                        complete.append(job)
        return done, complete

    def _finish(self, job: _Job, plan: Any, outputs: Sequence[Any]) -> dict:
        """The result dict of a windowed input from all its windows' outputs."""
        if job.kind == "essays":
            return {"prompt": plan.prompt, "score": self.scorer.finish_essay(plan, outputs)}
        return self.engine.finish_plan(plan, outputs).to_dict()

    @staticmethod
    def _store(job: _Job, pos: int, result: Any) -> bool:
        """(Under the lock.) One input's result; True when it was the job's last."""
        job.results[pos] = result
        job.remaining -= 1
        return job.remaining == 0

    def _complete(self, jobs: Sequence[_Job]) -> None:
        """Resolve complete jobs (those not dropped meanwhile) with their results."""
        with self._cond:
            for job in jobs:
                if not job.ended:
                    self._end(job)
                    self._call(job, _resolve, job.results)

    def _fail(self, job: _Job, err: BaseException) -> None:
        with self._cond:
            if job.ended:
                return
            self._end(job)
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
        items = [it for it in batch if not it.job.ended]
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
            jobs: dict[int, list[_Item]] = {}
            for it in items:
                jobs.setdefault(id(it.job), []).append(it)
            if len(jobs) == 1:
                self._fail(items[0].job, err)
                return
            for its in jobs.values():
                t0 = time.perf_counter()
                try:
                    results = self._compute(its)
                except Exception as one:
                    log.exception("engine failed on a request of %d inputs", len(its))
                    self._fail(its[0].job, one)
                    continue
                done, complete = self._deliver(its, results)
                if on_batch is not None:
                    on_batch(done, 1, time.perf_counter() - t0)
                self._complete(complete)
            return
        done, complete = self._deliver(items, results)
        seconds = time.perf_counter() - t0
        self._measured(_family(items[0].job.kind), sum(it.cost for it in items), seconds)
        if on_batch is not None:
            on_batch(done, len({id(it.job) for it in items}), seconds)
        self._complete(complete)

    def _run(self) -> None:
        batch: list[_Item] = []
        try:
            while True:
                batch = self._next_batch()
                if batch is None:
                    return
                if batch:
                    self._process(batch)
                self._plan_step()
        except BaseException as err:  # a bug in the batcher itself: fail everyone, go dark
            # (logged, not re-raised: /healthz reports it as 503 "worker stopped")
            log.exception("the tagging worker stopped")
            self.error = err
            with self._cond:
                self._closed = True
                left = list(self._jobs.values())
                self._plans.clear()
            for job in left:
                self._fail(job, err)

    # ----------------------------------------------------------------- planning

    def _plan_step(self) -> None:
        """One step of planning the oldest input being planned; a planned input's windows join
        its request's queued items (merged at once when it has none)."""
        with self._cond:
            if not self._plans:
                return
            job, pos, steps = self._plans[0]
            if job.ended:
                self._plans.popleft()
                return
        try:
            plan = next(steps)
            time.sleep(PLAN_PAUSE_S)
        except Exception as err:
            log.exception("planning the windows of a long input failed")
            with self._cond:
                self._plans.popleft()
            self._fail(job, err)
            return
        if plan is None:
            return
        now = time.monotonic()
        n = len(plan.windows)
        items = [_Item(job, pos, float(end - start + 2), now, w, w == n - 1)
                 for w, (start, end) in enumerate(plan.windows)]
        planned = _Planned(plan, [None] * n, n)
        with self._cond:
            self._plans.popleft()
            if job.ended:
                return
            job.planned[pos] = planned
            if items:
                job.pending.extend(items)
                if not job.queued:
                    job.queued = True
                    self._active.append(job)
                return
            job.waiting -= 1  # nothing to encode (no words): merge at once
            self._waiting -= 1
        res = self._finish(job, plan, [])
        on_batch = self._on_score_batch if _family(job.kind) == "score" else self._on_batch
        if on_batch is not None and not job.ended:  # counted as if it went through a batch
            on_batch(1, 1, 0.0)
        with self._cond:
            if not job.ended and self._store(job, pos, res):
                self._complete([job])
