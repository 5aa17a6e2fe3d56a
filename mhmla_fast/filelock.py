"""Exclusive advisory file locks (``flock``), shared by everything that must not be done by two
processes at once: a training run's folder (:func:`mhmla_fast.checkpoint.run_lock`), a
``mhmla-serve`` output file (:mod:`mhmla_fast.serve.records`) and an ONNX export being cached
(:mod:`mhmla_fast.serve.export_cache`).

A ``flock`` belongs to the open file, so it goes when the process does: a killed run leaves
nothing held. Where ``fcntl`` does not exist (Windows) nothing is locked and :data:`SUPPORTED`
is false; each caller documents what decides there instead.
"""

from __future__ import annotations

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ["SUPPORTED", "try_lock", "lock", "unlock"]

SUPPORTED = fcntl is not None


def try_lock(fd: int) -> bool:
    """Take an exclusive lock on the open file ``fd`` without waiting.

    Returns False when another open file (another process) holds it, True when this one now
    holds it, and True without locking where locks are not supported. Errors other than "held
    by another" (a file system without locks, for one) are raised.
    """
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def lock(fd: int) -> None:
    """Take an exclusive lock on the open file ``fd``, waiting for another holder to let go."""
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX)


def unlock(fd: int) -> None:
    """Let go of this open file's lock on ``fd`` (closing the file does too)."""
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
