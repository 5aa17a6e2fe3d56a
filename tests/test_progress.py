"""progress_bar: tqdm's redraws into a log file are rate-limited; on a terminal they are not."""

from __future__ import annotations

import io
import time

from mhmla_fast.progress import LOG_INTERVAL_S, progress_bar


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _draws(stream, n=200):
    """The bar's draws into ``stream`` over about 0.5 s of updates."""
    bar = progress_bar(total=n, file=stream, desc="work")
    for _ in range(n):
        time.sleep(0.0025)
        bar.update()
    bar.close()
    return stream.getvalue().count("work:")


def test_into_a_file_the_bar_redraws_rarely_on_a_terminal_often():
    assert progress_bar(total=1, file=io.StringIO()).mininterval == LOG_INTERVAL_S
    assert progress_bar(total=1, file=FakeTerminal()).mininterval == 0.1
    assert progress_bar(total=1, file=io.StringIO(), mininterval=1.0).mininterval == 1.0  # kept
    log = io.StringIO()
    assert _draws(log) == 2  # the first draw and the last: 0.5 s is within one interval
    assert "200/200" in log.getvalue()  # the final state is written
    assert _draws(FakeTerminal()) >= 4  # every 0.1 s
