"""Durable writes: ``os.fsync`` of a written file and of the directory entry naming it, so that
a rename that publishes a file survives a power loss along with the file's bytes;
:func:`atomic_write_text` puts the two together for a small text file."""

from __future__ import annotations

import os
import tempfile

__all__ = ["atomic_write_bytes", "atomic_write_text", "current_umask", "fsync_dir", "fsync_file",
           "fsync_parent", "replace_durably"]


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data`` all at once: written to a temporary file of its own
    beside it (``.<name>.<random>.tmp``, so concurrent writers never share one), fsynced,
    renamed over ``path``, and the rename made durable (:func:`replace_durably`). Readers see
    the old file or the new one, never a part; a failure leaves no temporary file behind."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes it 0600; a results file is shared
        replace_durably(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def replace_durably(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Publish the written file ``tmp`` as ``path``: fsync its bytes, rename it over ``path``,
    fsync the directory entry."""
    fsync_file(tmp)
    os.replace(tmp, path)
    fsync_parent(path)


def current_umask() -> int:
    """The process's umask: from ``/proc/self/status`` where there is one (Linux), else read by
    setting it and putting it back (which another thread creating a file in between would see)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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
