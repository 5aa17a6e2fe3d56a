"""Durable writes: ``os.fsync`` of a written file and of the directory entry naming it, so that
a rename that publishes a file survives a power loss along with the file's bytes."""

from __future__ import annotations

import os

__all__ = ["fsync_dir", "fsync_file", "fsync_parent"]


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a written file's bytes to the disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make the entries of ``directory`` (new, renamed or removed names) durable; best effort,
    as not every platform can open a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_parent(path: str | os.PathLike) -> None:
    """:func:`fsync_dir` of the directory holding ``path``."""
    fsync_dir(os.path.dirname(os.path.abspath(path)))
