"""Where the research data lives.

The licensed data sets (FCE, CoNLL-2014, JFLEG, ASAP) are never part of this package:
they are read from ``$MHMLA_SHARED_DATA`` or, by default, ``../shared/data`` beside the
repository checkout, or from a path the user gives on the command line.
"""

from __future__ import annotations

import os
from pathlib import Path


def shared_data_dir() -> Path:
    """Return the research-data folder (it may not exist: callers check and say so)."""
    env = os.environ.get("MHMLA_SHARED_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "shared" / "data"
