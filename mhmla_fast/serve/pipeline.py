"""The batch pipeline of ``mhmla-serve tag``, shared by the command line, Ray jobs and the views:
input records to result dicts (:func:`tag_records`), and the human-readable view of results
(:func:`format_pretty`, :class:`PrettyWriter`). No torch at import."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import IO, Any

__all__ = ["tag_records", "format_pretty", "PrettyWriter", "RED", "YELLOW", "RESET"]

RED, YELLOW, RESET = "\x1b[1;4;31m", "\x1b[33m", "\x1b[0m"


def tag_records(engine: Any, records: Sequence[Any], report: Any = None) -> list[dict]:
    """Result dicts (``TagResult.to_dict()``, a call's all at once: :func:`.engine.result_dicts`)
    of valid input records, in order: the raw texts in one ``engine.tag_texts`` call, the token
    lists in one ``engine.tag_tokens`` call (an :class:`~.engine.Engine`, or any engine whose
    calls return :class:`~.engine.TagResult` objects). ``report`` is called with the word pieces
    of each forward pass, for the progress bar. A record cut by ``--max-chars``/``--over-long
    cap`` gets ``"capped_from"``: its original length."""
    from .engine import gc_paused, result_dicts

    out: list[Any] = [None] * len(records)
    texts = [k for k, r in enumerate(records) if r.text is not None]
    tokens = [k for k, r in enumerate(records) if r.text is None]
    kw = {"on_pieces": report} if report is not None else {}
    if texts:
        results = engine.tag_texts([records[k].text for k in texts], **kw)
        with gc_paused():  # many small containers, no cycles (see gc_paused)
            for k, res in zip(texts, result_dicts(results)):
                out[k] = res
    if tokens:
        results = engine.tag_tokens([list(records[k].tokens) for k in tokens], **kw)
        with gc_paused():
            for k, res in zip(tokens, result_dicts(results)):
                out[k] = res
    for rec, res in zip(records, out):
        if rec.capped_from is not None:
            res["capped_from"] = rec.capped_from
    return out


_CONTROLS = {c: "\ufffd" for c in [*range(0x20), *range(0x7F, 0xA0)] if c != 0x09}


def format_pretty(record: dict, text: str | None, colour: bool) -> str:
    """One readable line for an output ``record``: ``<index> [id] <text>`` with each error span
    marked (ANSI red with ``colour``, else ``[[...]]``), or ``<index> [id] ERROR: <message>``.
    ``text`` is the record's raw text (None for token input, shown as the tokens joined by
    spaces). Control characters are shown as U+FFFD so the text cannot drive the terminal."""
    head = str(record["index"])
    if record["id"] != record["index"]:
        head += f" [{str(record['id']).translate(_CONTROLS)}]"  # (an id is input too)
    if "error" in record:
        msg = f"ERROR: {str(record['error']).translate(_CONTROLS)}"
        return f"{head}\t{YELLOW}{msg}{RESET}" if colour else f"{head}\t!! {msg}"
    if text is None:
        starts = [0, *accumulate(len(t) + 1 for t in record["tokens"])]  # of the joined text
        text = " ".join(record["tokens"])
        cut = [(starts[s["start"]], starts[s["end"]] - 1) for s in record["spans"]]
    else:
        cut = [(s["start"], s["end"]) for s in record["spans"]]
    text = text.translate(_CONTROLS)
    opening, closing = (RED, RESET) if colour else ("[[", "]]")
    parts, pos = [], 0
    for a, b in cut:
        parts += [text[pos:a], opening, text[a:b], closing]
        pos = b
    parts.append(text[pos:])
    return f"{head}\t{''.join(parts)}"


class PrettyWriter:
    """Stands in for :class:`~mhmla_fast.serve.outputs.ResumableJsonlWriter` in ``run_records``
    (``done``, ``done_errors``, ``last_id``, ``path``, ``write``, ``sync``): prints each record
    with :func:`format_pretty`. A result's private ``"_text"`` (the raw input) is used for display
    and not printed."""

    done, done_errors, last_id, path = 0, 0, None, "<stdout>"

    def __init__(self, stream: IO[str], colour: bool) -> None:
        self.stream, self.colour = stream, colour

    def write(self, record: dict) -> None:
        text = record.pop("_text", None)
        self.stream.write(format_pretty(record, text, self.colour) + "\n")

    def sync(self) -> None:
        self.stream.flush()

    def close(self) -> None:
        self.sync()
