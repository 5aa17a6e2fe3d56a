"""Where the research data lives.

The licensed data sets (FCE, CoNLL-2014, JFLEG, ASAP) are never part of this package:
they are read from ``$MHMLA_SHARED_DATA`` or, in a repository checkout, from
``../shared/data`` beside it, or from a path the user gives on the command line. An
installed wheel has no such folder: a command that needs the data then says what it looked
for and how to give it (:func:`missing_data`).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ENV_VAR", "shared_data_dir", "checkout_data_dir", "missing_data", "shared_data_file"]

ENV_VAR = "MHMLA_SHARED_DATA"
_HOLDS = "fce/, conll2014/, jfleg/ and asap_aes/"


def checkout_data_dir() -> Path:
    """Return ``../shared/data`` beside the repository checkout this package runs from (a
    folder that is not there when the package is installed from a wheel)."""
    return Path(__file__).resolve().parents[2] / "shared" / "data"


def shared_data_dir() -> Path:
    """Return the research-data folder: ``$MHMLA_SHARED_DATA`` when set, else the
    checkout's ``../shared/data`` (:func:`checkout_data_dir`). It may not exist (an installed
    wheel, a checkout without the data): callers check, and raise :func:`missing_data`."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    return checkout_data_dir()


def missing_data(path: str | os.PathLike, option: str) -> FileNotFoundError:
    """Return the error for research data that is not at ``path`` (a file or folder, under
    :func:`shared_data_dir` or given by the user): it names ``path`` and says to give the
    data with ``option`` (the command's flag, e.g. ``"--train"``) or to set
    ``$MHMLA_SHARED_DATA``. When that is unset and no checkout's ``../shared/data`` exists
    (an installed wheel), it names the path under the data folder and says there is none."""
    path = Path(path)
    root = shared_data_dir()
    if not os.environ.get(ENV_VAR) and not root.is_dir() and path.is_relative_to(root):
        rel = path.relative_to(root)
        why = (f"({ENV_VAR} is not set, and the package does not run from a checkout with "
               "../shared/data beside it)")
        where = (f"no research data folder {why}" if rel == Path(".") else
                 f"{rel.as_posix()}: no research data folder to read it from {why}")
    else:
        where = f"{path}: not found"
    return FileNotFoundError(f"{where}; give the data with {option}, or set {ENV_VAR} to the "
                             f"folder holding {_HOLDS}")


def shared_data_file(rel: str, option: str) -> Path:
    """Return ``shared_data_dir() / rel``; :func:`missing_data` (FileNotFoundError, naming it
    and ``option``) when it is not there."""
    path = shared_data_dir() / rel
    if not path.exists():
        raise missing_data(path, option)
    return path
