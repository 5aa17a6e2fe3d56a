"""Shared by the tests of the scripts under bench/ and training/ (not packages): import one by
file name."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def load_script(path: str) -> ModuleType:
    """The script at ``path`` (relative to the repository root) imported as a module named
    after its file (registered in ``sys.modules`` first: dataclasses look their module up while
    the file runs)."""
    name = Path(path).stem
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_bench_script(name: str) -> ModuleType:
    """``bench/<name>.py`` (:func:`load_script`)."""
    return load_script(f"bench/{name}.py")
