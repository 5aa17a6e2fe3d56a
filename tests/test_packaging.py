"""What a wheel carries: every package folder and every shipped model file is listed in
pyproject.toml (a non-editable ``pip install`` would otherwise leave it out, and the tests,
run from the checkout, would not notice)."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def _package_dir(name: str, package_dir: dict[str, str]) -> Path:
    for prefix in sorted(package_dir, key=len, reverse=True):
        if name == prefix or name.startswith(prefix + "."):
            rest = name[len(prefix):].lstrip(".")
            return ROOT / package_dir[prefix] / rest.replace(".", "/")
    return ROOT / name.replace(".", "/")


def test_every_python_package_folder_is_listed():
    cfg = _setuptools()
    listed = {_package_dir(n, cfg.get("package-dir", {})) for n in cfg["packages"]}
    folders = {p.parent for top in ("mhmla_fast", "kernels")
               for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts}
    assert folders <= listed, sorted(map(str, folders - listed))


def test_every_shipped_model_file_goes_into_the_wheel():
    cfg = _setuptools()
    patterns = cfg["package-data"]["mhmla_fast.models"]
    models = ROOT / "mhmla_fast" / "models"
    files = [p.relative_to(models).as_posix() for p in models.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts]
    assert any(f.endswith("model.safetensors") for f in files)
    missed = [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)]
    assert not missed, f"shipped model files left out of the wheel: {missed}"
    assert "embedded_encoder_checksums.json" in cfg["package-data"]["mhmla_fast"]
    assert (ROOT / "mhmla_fast" / "embedded_encoder_checksums.json").is_file()
