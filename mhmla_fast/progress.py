"""Progress bars: one tqdm setting for every long loop (training epochs, tagging, scoring, Ray).

On a terminal the bar redraws as tqdm does by default (every 0.1 s at most). Into a file or a
pipe (``nohup``, a job's log) each redraw is appended rather than drawn over, so there it
redraws at most every :data:`LOG_INTERVAL_S` seconds: a 10-minute epoch writes about 20 lines
instead of thousands.
"""

from __future__ import annotations

import sys

__all__ = ["LOG_INTERVAL_S", "progress_bar"]

LOG_INTERVAL_S = 30.0


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def progress_bar(*, file=None, **kw):
    """``tqdm.auto.tqdm(file=file or sys.stderr, dynamic_ncols=True, **kw)``, with ``mininterval``
    :data:`LOG_INTERVAL_S` when ``file`` is not a terminal (unless given)."""
    from tqdm.auto import tqdm

    file = sys.stderr if file is None else file
    if not _is_terminal(file):
        kw.setdefault("mininterval", LOG_INTERVAL_S)
    kw.setdefault("dynamic_ncols", True)
    return tqdm(file=file, **kw)
