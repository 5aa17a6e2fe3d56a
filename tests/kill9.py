"""Shared by the kill -9 tests (``mhmla-serve tag`` and ``score``, and the records writer): run a
command in a child process, SIGKILL it once its output has ``lines`` complete lines, and leave
the output as a crash leaves it (with a torn last line)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mhmla_fast import serve


def kill_command_after_lines(cmd: list[str], out: Path, total: int, lines: int = 100,
                             timeout: float = 120) -> bytes:
    """Run ``cmd`` (the package importable from this checkout) and SIGKILL it after ``lines``
    output lines of ``total`` expected. Returns the output as the kill left it; a torn record is
    then appended to ``out`` when the kill fell between lines."""
    env = {**os.environ, "PYTHONPATH": str(Path(serve.__file__).resolve().parents[2])}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    try:
        while not (out.exists() and out.read_bytes().count(b"\n") >= lines):
            assert proc.poll() is None, proc.communicate()[1].decode()
            assert time.monotonic() < deadline, "the first run wrote nothing"
            time.sleep(0.003)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    written = out.read_bytes()
    complete = written.count(b"\n")
    assert lines <= complete < total, "killed in the middle"
    if written.endswith(b"\n"):  # the kill fell between two lines: add the torn line it can leave
        out.write_bytes(written + b'{"index": %d, "id": "r' % (complete + 1))
    return written


def kill_after_lines(args: list[str], out: Path, total: int, lines: int = 100,
                     timeout: float = 120) -> None:
    """:func:`kill_command_after_lines` of ``python -m mhmla_fast.commands.serve *args``."""
    kill_command_after_lines([sys.executable, "-m", "mhmla_fast.commands.serve", *args], out,
                             total, lines, timeout)
