"""The batching driver of ``tag`` / ``score``: input records in, results out in input order.

Reads the records lazily and fingerprints each one. On resume it first reads the ``m`` input
records the sidecar vouches for and compares their fingerprint with the sidecar's (fewer records,
or another fingerprint: :class:`ResumeMismatchError`, nothing written), then carries on after
record ``writer.done``. It hands the valid records in batches of ``batch_size`` to
``process_batch`` and writes ``{"index", "id", **result}`` for them and ``{"index", "id",
"error"}`` for malformed records, strictly in input order. A batch is also processed early when
``8 * batch_size`` records (mostly errors) wait, which bounds memory. A tqdm bar with records/s
(essays/s for ``score``) goes to stderr; with ``count_pieces`` it also shows the word pieces
encoded so far, which move within one long record.
The returned :class:`RunSummary` counts the whole output file, the resumed part included; a record
counts as an error when its output line has an ``"error"`` key.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..progress import progress_bar
from .inputs import InputRecord
from .outputs import InputFingerprint, ResumableJsonlWriter, ResumeMismatchError, meta_path

__all__ = ["RunSummary", "run_records"]


@dataclass(frozen=True)
class RunSummary:
    """Counts over the whole output: ``n_ok`` + ``n_errors`` records, ``n_resumed`` of which were
    already in it before this run."""

    n_ok: int
    n_errors: int
    n_resumed: int

    @property
    def n_total(self) -> int:
        return self.n_ok + self.n_errors


ProcessBatch = Callable[..., list[dict[str, Any]]]


def _verify_resumed_input(it: Iterator[InputRecord], writer: Any, fp: InputFingerprint
                          ) -> list[InputRecord]:
    """Read the input records the writer's sidecar vouches for into ``fp`` and compare; return
    those past ``writer.done`` (to be processed). ResumeMismatchError on any difference."""
    vouched, done = getattr(writer, "vouched", 0), writer.done
    ahead: list[InputRecord] = []
    for rec in itertools.islice(it, vouched):
        fp.update(rec)
        if fp.count > done:
            ahead.append(rec)
    if fp.count < vouched:
        raise ResumeMismatchError(
            f"{writer.path} was made from {vouched} input records but the input has only "
            f"{fp.count}; is this the same input? Refusing to mix outputs")
    if vouched and fp.hexdigest() != writer.vouched_sha256:
        raise ResumeMismatchError(
            f"{writer.path} was made from other input: the first {vouched} input records differ "
            "from the ones it was made from (by their fingerprint, see "
            f"{os.path.basename(meta_path(writer.path))}); refusing to mix outputs. Resume with "
            "the same input, or write to another output")
    if fp.count < done:  # only with a writer that vouches for nothing (tests, PrettyWriter)
        for rec in itertools.islice(it, done - fp.count):
            fp.update(rec)
        if fp.count < done:
            raise ResumeMismatchError(
                f"{writer.path} already holds {done} records but the input has only {fp.count}; "
                "is this the same input?")
    return ahead


class _PieceCounter:
    """The ``report(n)`` handed to ``process_batch`` with ``count_pieces``: counts word pieces
    and calls ``show()`` (which puts ``text()`` in the bar's postfix) at most twice a second."""

    def __init__(self, show: Callable[[], None]) -> None:
        self.show, self.total, self.t0, self.shown = show, 0, time.monotonic(), 0.0

    def __call__(self, n: int) -> None:
        self.total += int(n)
        now = time.monotonic()
        if now - self.shown >= 0.5:
            self.shown = now
            self.show()

    def text(self) -> str:
        rate = self.total / max(time.monotonic() - self.t0, 1e-9)
        return f"{self.total:,} pieces, {rate:,.0f} pieces/s"


def run_records(
    records: Iterable[InputRecord],
    process_batch: ProcessBatch,
    writer: ResumableJsonlWriter,
    batch_size: int,
    progress: bool = True,
    *,
    total: int | None = None,
    desc: str | None = None,
    unit: str = "rec",
    count_pieces: bool = False,
    first_batch: int | None = None,
) -> RunSummary:
    """Process ``records`` into ``writer`` in input order, resuming after ``writer.done``.

    ``process_batch`` gets a list of 1..``batch_size`` valid records and must return one dict per
    record, in the same order; ``"index"`` and ``"id"`` in a result are replaced by the record's.
    With ``count_pieces`` it is called as ``process_batch(batch, report)`` and calls ``report(n)``
    as it encodes ``n`` more word pieces (the bar shows them). Exceptions from ``process_batch``
    propagate (what was written stays; resume continues from it). On resume the input is first
    checked against the writer's sidecar (:class:`ResumeMismatchError`). Before records past what
    the sidecar vouches for are written, ``writer.vouch`` records the fingerprint of all input
    records read so far. ``total`` (the number of input records, if known) only sets the progress
    bar's length; ``desc`` and ``unit`` (what a record is, e.g. ``"essay"``: the bar shows
    ``<unit>s/s``) label it. ``first_batch``: the first batch holds at most this many valid
    records and each next one twice the last, up to ``batch_size``, so that the first results
    are written soon after start (None: every batch ``batch_size``). The writer is synced, not
    closed, at the end.
    """
    from .engine import gc_paused

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if first_batch is not None and first_batch < 1:
        raise ValueError(f"first_batch must be >= 1, got {first_batch}")
    max_pending = 8 * batch_size
    limit = batch_size if first_batch is None else min(first_batch, batch_size)
    fp = InputFingerprint()
    source = iter(records)
    n_resumed = writer.done
    ahead = _verify_resumed_input(source, writer, fp)

    def fingerprinted() -> Iterator[InputRecord]:
        for rec in source:
            fp.update(rec)
            yield rec

    vouch = getattr(writer, "vouch", None)
    n_errors = writer.done_errors
    n_ok = n_resumed - n_errors
    pending: list[InputRecord] = []  # records waiting to be written, in input order
    batch: list[InputRecord] = []  # the valid ones among them
    bar = progress_bar(total=total, initial=n_resumed, desc=desc, unit=unit, unit_scale=True,
                       disable=not progress)

    def show(refresh: bool = True) -> None:
        """The bar's postfix: word pieces so far (with ``count_pieces``) and malformed records."""
        parts = [report.text()] if report is not None and report.total else []
        if n_errors:
            parts.append(f"errors={n_errors}")
        if parts:
            bar.set_postfix_str(", ".join(parts), refresh=refresh)

    report = _PieceCounter(show) if count_pieces else None

    def emit(out: dict[str, Any]) -> None:
        nonlocal n_ok, n_errors
        writer.write(out)
        if "error" in out:
            n_errors += 1
        else:
            n_ok += 1

    def flush() -> None:
        """Process the pending records and write them, the garbage collector paused until the
        batch's results are written and freed: they hold no cycles, so once they are gone the
        collector has little to walk when it resumes (paused inside the engine alone, it walked
        every result at the end of each call)."""
        with gc_paused():
            write_pending()

    def write_pending() -> None:
        nonlocal limit
        if not pending:
            return
        limit = min(2 * limit, batch_size)
        if batch:
            results = process_batch(list(batch), report) if count_pieces else process_batch(list(batch))
        else:
            results = []
        if not isinstance(results, list) or len(results) != len(batch):
            got = len(results) if isinstance(results, list) else type(results).__name__
            raise RuntimeError(f"process_batch returned {got} results for {len(batch)} records")
        if vouch is not None and pending[-1].index > getattr(writer, "vouched", 0):
            vouch(fp.count, fp.hexdigest())  # before any line it does not cover is written
        res_iter = iter(results)
        for rec in pending:
            if rec.error is not None:
                emit({"index": rec.index, "id": rec.id, "error": rec.error})
                continue
            res = next(res_iter)
            if not isinstance(res, dict):
                raise RuntimeError(
                    f"process_batch returned a {type(res).__name__}, not a dict, for record {rec.index}"
                )
            out: dict[str, Any] = {"index": rec.index, "id": rec.id}
            out.update(res)  # (keys keep their places: "index" and "id" stay first)
            out["index"], out["id"] = rec.index, rec.id
            emit(out)
        show(refresh=False)
        bar.update(len(pending))
        pending.clear()
        batch.clear()

    try:
        for rec in itertools.chain(ahead, fingerprinted()):
            pending.append(rec)
            if rec.error is None:
                batch.append(rec)
            if len(batch) >= limit or len(pending) >= max_pending:
                flush()
        flush()
        writer.sync()
    finally:
        show(refresh=False)  # the final counts, whatever the throttle last showed
        bar.close()
    return RunSummary(n_ok=n_ok, n_errors=n_errors, n_resumed=n_resumed)
