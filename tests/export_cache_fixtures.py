"""What the export-cache tests of tagging and scoring share: a log that keeps the cache's
lines, and a fresh cache per test. Imported by those test modules (the fixture is theirs only,
not the session's, so pytest's own ``cache`` fixture stays as it is elsewhere)."""

from __future__ import annotations

from pathlib import Path

import pytest


class Lines:
    """A ``log`` that keeps what the cache prints (parts joined into lines, as on stderr)."""

    def __init__(self):
        self.text = ""

    def __call__(self, *parts, end="\n"):
        self.text += " ".join(parts) + end

    @property
    def lines(self) -> list[str]:
        return self.text.splitlines()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh cache for one test (``$MHMLA_CACHE_DIR``)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("MHMLA_CACHE_DIR", str(root))
    monkeypatch.delenv("MHMLA_NO_CACHE", raising=False)
    return root
