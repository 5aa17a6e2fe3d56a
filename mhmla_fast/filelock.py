"""Exclusive advisory file locks (``flock``), shared by everything that must not be done by two
processes at once: a training run's folder (:func:`mhmla_fast.checkpoint.run_lock`), a
``mhmla-serve`` output file (:mod:`mhmla_fast.serve.outputs`) and an ONNX export being cached
(:mod:`mhmla_fast.serve.export_cache`).

A ``flock`` belongs to the open file, so it goes when the process does: a killed run leaves
nothing held. Where ``fcntl`` does not exist (Windows) nothing is locked and :data:`SUPPORTED`
is false; each caller documents what decides there instead. On a file system that has no locks
(some network and parallel file systems answer ENOLCK, ENOSYS or EOPNOTSUPP) nothing is locked
either, with a :class:`LocksUnavailableWarning` naming the file system's answer.
"""

from __future__ import annotations

import errno
import os
import warnings

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ["SUPPORTED", "try_lock", "lock", "unlock", "LocksUnavailableWarning", "process_alive"]

SUPPORTED = fcntl is not None
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", -1)}


class LocksUnavailableWarning(RuntimeWarning):
    """The file system holding a file to lock has no locks: it is used unlocked."""


def _unavailable(err: OSError) -> bool:
    """Whether ``err`` says the file system has no locks (then warn and go on unlocked)."""
    if err.errno not in _NO_LOCKS:
        return False
    warnings.warn(f"this file system has no file locks ({err.strerror}): going on without one, "
                  "so nothing stops a second process on the same output", LocksUnavailableWarning,
                  stacklevel=3)
    return True


def try_lock(fd: int) -> bool:
    """Take an exclusive lock on the open file ``fd`` without waiting.

    Returns False when another open file (another process) holds it, True when this one now
    holds it, and True without locking where locks are not supported (module docstring).
    Other errors (a closed descriptor, for one) are raised.
    """
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as err:
        if not _unavailable(err):
            raise
    return True


def lock(fd: int) -> None:
    """Take an exclusive lock on the open file ``fd``, waiting for another holder to let go."""
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:
            if not _unavailable(err):
                raise


def unlock(fd: int) -> None:
    """Let go of this open file's lock on ``fd`` (closing the file does too)."""
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as err:
            if err.errno not in _NO_LOCKS:
                raise


def process_alive(pid: int | str) -> bool:
    """Whether process ``pid`` (an int, or a file name that is one) is running, for what a
    process leaves by its id (a worker's files, an export's staging folder) and no lock
    covers; True when that cannot be told (another user's process, a name that is no pid)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, OverflowError):
        pass
    return True


def process_temp_dir(prefix: str, dir: str | os.PathLike | None = None):
    """A new temporary folder ``<prefix><pid>-<random>`` in ``dir`` (default: the system's)
    for this process; the folders of that form whose process is gone (killed before it
    removed its own) are removed first. Returns its Path."""
    import shutil
    import tempfile
    from pathlib import Path

    parent = Path(tempfile.gettempdir() if dir is None else dir)
    for old in parent.glob(f"{prefix}*-*"):
        pid = old.name[len(prefix):].split("-")[0]
        if pid.isdigit() and not process_alive(pid):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=dir))
